// The kernels' C++ interface, on raw pointers (kernels/csrc/bindings.cpp checks the tensors and calls
// these). See each .cpp file for the algorithm and the layout it reads.
#pragma once

#include <cstdint>

namespace tandem {

// ---- quantized matmul (qmatmul.cpp) -------------------------------------------------------------

constexpr int64_t kPanel = 16;   // output columns interleaved in one panel of packed weights

// GGUF's block formats the matmul reads (the codes of kernels.quant.QuantFormat).
enum class QuantFormat : int { kQ8_0 = 0, kQ4_0, kQ4_1, kQ5_0, kQ5_1, kQ4_K, kQ5_K, kQ6_K };
constexpr int kNumFormats = 8;

// The panel layout of each format (kernels/packing.py, qmatmul.cpp): for each panel of 16 columns,
// groups of blocks of 32 inputs (a K-quant's super-block of 8, else 1), each block's codes then its
// scales, then (K-quants) the group's float16 D and -Dmin.
constexpr bool is_k_quant(QuantFormat f) { return f >= QuantFormat::kQ4_K; }
constexpr int high_bits(QuantFormat f) {   // bits of a code above its low nibble
  if (f == QuantFormat::kQ6_K) return 2;
  return f == QuantFormat::kQ5_0 || f == QuantFormat::kQ5_1 || f == QuantFormat::kQ5_K ? 1 : 0;
}
constexpr int64_t value_bytes(QuantFormat f) { return f == QuantFormat::kQ8_0 ? 512 : 256 + 64 * high_bits(f); }
constexpr int64_t scale_bytes(QuantFormat f) {
  return f == QuantFormat::kQ4_0 || f == QuantFormat::kQ4_1 || f == QuantFormat::kQ5_1 ? 64 : 32;
}
constexpr int64_t group_blocks(QuantFormat f) { return is_k_quant(f) ? 8 : 1; }
constexpr int64_t group_bytes(QuantFormat f) {
  return group_blocks(f) * (value_bytes(f) + scale_bytes(f)) + (!is_k_quant(f) ? 0 : f == QuantFormat::kQ6_K ? 32 : 64);
}
// Bytes of one panel over k inputs (k a multiple of 32 * group_blocks).
constexpr int64_t panel_bytes(QuantFormat f, int64_t k) { return k / (32 * group_blocks(f)) * group_bytes(f); }

// A packed weight: row segments, each in its own format, stacked (a fused q/k/v whose parts differ).
// Segment s holds output columns [sum of earlier n, + n) in ceil(n / 16) panels at `data`.
struct PackedSegment {
  const uint8_t* data;
  int64_t n;
  QuantFormat format;
};
struct PackedMatrix {
  const PackedSegment* segments;
  int64_t num_segments, n, k;   // n: every segment's columns
};

// out [m, w.n] = x [m, w.k] times the packed weight^T, float32. Each activation row is first rounded
// to int16 blocks of 32 with one scale each (amax / qmax; qmax 32767, or 127 for llama.cpp's int8
// rounding), then every product is an exact integer dot per block, scaled in float32. One call
// rounds the activations once for every segment and writes each segment's columns.
void qmatmul(const float* x, int64_t m, const PackedMatrix& w, int qmax, float* out);

// ---- paged attention (attention.cpp) --------------------------------------------------------------

// The KV cache [pages, 2, page_size, kv_heads, head_dim], K at 0 and V at 1; strides in elements.
struct PagedKV {
  const void* base;
  bool is_bf16;   // else float32
  int64_t page_stride, kv_stride, token_stride, head_stride, page_size, num_kv_heads, head_dim;
};

// Causal attention of q [rows, q_heads, head_dim] (float32; row r at q + r * q_row_stride, its heads
// contiguous) over the paged cache, for `batch` sequences in FlashInfer's CSR form (int32): sequence
// b owns q rows qo_indptr[b]..qo_indptr[b+1] and pages kv_indices[kv_indptr[b]..kv_indptr[b+1]], the
// last holding last_page_len[b] tokens. The page table must have been checked (bindings.cpp).
// Scores are (q * scale) . k; `window` > 0: a row at position p sees keys p - window + 1 .. p only.
// out: [rows, q_heads, head_dim] float32, contiguous.
void paged_attention(const float* q, int64_t q_row_stride, int64_t num_q_heads, const PagedKV& kv,
                     const int32_t* qo_indptr, const int32_t* kv_indptr, const int32_t* kv_indices,
                     const int32_t* last_page_len, int64_t batch, float scale, int64_t window, float* out);

// ---- elementwise layers (layers.cpp), float32 rows ------------------------------------------------

// out[r] = weight * x[r] / sqrt(mean(x[r]^2) + eps); with `residual` (not null) residual[r] += x[r]
// first, in place, and the sum is normalized.
void rms_norm(const float* x, int64_t rows, int64_t h, const float* weight, float eps, float* residual, float* out);

// rms_norm in place over each of `heads` vectors of `d` floats at x + r * row_stride (+ i * d), for
// `rows` rows (q or k heads inside a fused q/k/v row): each vector gets the bits rms_norm gives it.
void rms_norm_heads(float* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t d, const float* weight,
                    float eps);

// out [rows, width] = silu(gate) * up for gate_up [rows, 2 * width] = [gate | up].
void silu_and_mul(const float* gate_up, int64_t rows, int64_t width, float* out);

// out [rows, width] = gelu_tanh(gate) * up (torch's gelu(approximate="tanh")), as gate * sigmoid(2u)
// with u = sqrt(2 / pi) * (gate + 0.044715 gate^3), which is 0.5 * gate * (1 + tanh(u)).
void gelu_tanh_and_mul(const float* gate_up, int64_t rows, int64_t width, float* out);

// Rotary embedding (rotate-half) of q and k rows in place, then k and v written into the cache.
struct RopeStore {
  float* q;
  float* k;
  const float* v;
  int64_t q_row_stride, k_row_stride, v_row_stride;   // rows may be views of one fused projection
  int64_t num_q_heads, num_kv_heads, head_dim;
  const float* cos;   // [max_pos, head_dim] tables
  const float* sin;
  const int64_t* positions;
  const int64_t* write_pages;   // token t goes to (write_pages[t], write_offsets[t])
  const int64_t* write_offsets;
  void* cache;   // [pages, 2, page_size, kv_heads, head_dim], float32 or bfloat16 (rounded to nearest even)
  bool cache_is_bf16;
  int64_t page_stride, kv_stride, token_stride;
};
void rope_and_store(const RopeStore& a, int64_t tokens);

// ---- one dense decoder layer (decoder.cpp) -------------------------------------------------------

struct PackedLinear {
  PackedMatrix w;       // qmatmul above
  const float* bias;    // [w.n] or null
};

enum class Activation : int { kSilu = 0, kGeluTanh };

// The norms are RMSNorm weights, all of one eps; the optional ones are null where a family has none.
struct DecoderLayerWeights {
  const float* input_norm;      // [hidden], on the stream before attention
  const float* ffn_norm;        // [hidden], on the stream before the MLP (after the attention output is added)
  const float* q_norm;          // [head_dim] per q head before rotary (Qwen3, Gemma 3), or null
  const float* k_norm;          // [head_dim] per k head, or null
  const float* attn_out_norm;   // [hidden] on the attention output before it is added (Gemma 3), or null
  const float* ffn_out_norm;    // [hidden] on the MLP output (Gemma 3), or null
  float eps;
  PackedLinear qkv, o, gate_up, down;   // gate_up: [gate | up] rows
  int64_t num_q_heads, num_kv_heads, head_dim;
  int qmax;
  float scale;      // the softmax scale (1 / sqrt(head_dim) unless the family sets another)
  int64_t window;   // sliding window (paged_attention), 0 for none
  Activation activation;
};

// What one step's layers share: rotary tables and positions, the layer's cache and write slots
// (RopeStore's fields but q, k, v), and the page table (PagedKV and the CSR arrays).
struct DecoderStep {
  RopeStore rope;
  PagedKV kv;
  const int32_t* qo_indptr;
  const int32_t* kv_indptr;
  const int32_t* kv_indices;
  const int32_t* last_page_len;
  int64_t batch;
};

// out [t, hidden] = the layer's feed-forward output for rows x [t, hidden]; `residual` [t, hidden]
// is the residual stream, updated in place (with `is_first`, set to x first). Exactly the kernels the
// Python layer calls (engine/models/layers.py), in the same order: the same bits, without Python between them.
// `step.rope` holds the layer's own rotary tables (a sliding layer's may differ from the others').
void decoder_layer(const DecoderLayerWeights& w, const DecoderStep& step, const float* x, float* residual,
                   bool is_first, int64_t t, float* out);

// ---- batched LoRA over segments of rows (lora.cpp), float32 ---------------------------------------

constexpr int64_t kMaxLoraRank = 64;   // the largest rank lora_expand takes (kernels/lora.py's MAX_RANK)

// Rows starts[s]..starts[s+1] take adapter slot slots[s] (negative: no adapter), s < num_segments;
// starts run from 0 to the call's rows. The bindings check them.
struct LoraSegments {
  const int32_t* starts;
  const int32_t* slots;
  int64_t num_segments;
};

// t [n, rank] = x [n, in] times a[slot]^T, a [slots, rank, in] contiguous; rows of no slot get zeros.
void lora_shrink(const float* x, int64_t n, int64_t in, const float* a, int64_t rank, const LoraSegments& seg,
                 float* t);

// y[row, :out] += scaling[slot] * t[row, :r] times b[slot]^T, b [slots, out, r] contiguous with
// r <= kMaxLoraRank, for the rows of every segment with a slot (others are left alone); t's and y's
// rows are t_stride and y_stride floats apart (the caller offsets t and y to the projection's columns).
void lora_expand(const float* t, int64_t t_stride, int64_t r, const float* b, int64_t out, const LoraSegments& seg,
                 const float* scaling, float* y, int64_t y_stride);

// ---- GGUF blocks -> panels at load (repack.cpp) -----------------------------------------------

// Bytes of one row of GGUF blocks of format f over k inputs (llama.cpp's block sizes).
int64_t gguf_row_bytes(QuantFormat f, int64_t k);
// out [ceil(n / 16) * panel_bytes(f, k)] = the panels of n rows whose GGUF blocks are rows of
// gguf_row_bytes(f, k) bytes at raw: output row i is raw's row order[i] (order null: row i).
void repack_gguf(const uint8_t* raw, QuantFormat f, int64_t n, int64_t k, const int64_t* order, uint8_t* out);

}  // namespace tandem
