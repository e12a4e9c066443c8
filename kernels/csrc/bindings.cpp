// Tensor-level entry points of Tandem's CPU kernels: shapes, dtypes and page tables are checked
// here (TORCH_CHECK raises a Python error), then the pointer-level kernels of kernels.h run.

#include <torch/extension.h>

#include "common.h"
#include "kernels.h"
#include "qamx.h"

namespace {

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), name,
              " must be a contiguous [T, H] float32 tensor");
}

void check_qmax(int64_t qmax) {
  TORCH_CHECK(qmax == 32767 || qmax == 127, "qmax must be 32767 (int16) or 127 (int8)");
}

// A packed weight's segments from its table int64 [S, 3] (format code, columns, byte offset into
// `data`, uint8; kernels/packing.py), checked against `data` and k inputs. The pointers are into `data`.
std::vector<tandem::PackedSegment> packed_segments(const torch::Tensor& data, const torch::Tensor& table, int64_t k) {
  TORCH_CHECK(data.scalar_type() == torch::kUInt8 && data.is_contiguous(), "packed data must be contiguous uint8");
  TORCH_CHECK(table.scalar_type() == torch::kInt64 && table.is_contiguous() && table.dim() == 2 && table.size(1) == 3 &&
                  table.size(0) >= 1,
              "segments must be an int64 [S, 3] table (format, columns, byte offset)");
  std::vector<tandem::PackedSegment> segments;
  const int64_t* row = table.data_ptr<int64_t>();
  for (int64_t i = 0; i < table.size(0); ++i, row += 3) {
    const auto [code, n, offset] = std::tuple{row[0], row[1], row[2]};
    TORCH_CHECK(code >= 0 && code < tandem::kNumFormats, "segment ", i, ": unknown format ", code);
    const auto format = static_cast<tandem::QuantFormat>(code);
    TORCH_CHECK(k % (tandem::kBlock * tandem::group_blocks(format)) == 0, "segment ", i, ": K = ", k,
                " is not a multiple of its blocks");
    const int64_t bytes = (n + tandem::kPanel - 1) / tandem::kPanel * tandem::panel_bytes(format, k);
    TORCH_CHECK(n >= 0 && offset >= 0 && offset + bytes <= data.numel(), "segment ", i, ": ", n,
                " columns do not fit the packed data");
    segments.push_back({data.data_ptr<uint8_t>() + offset, n, format});
  }
  return segments;
}

torch::Tensor qmatmul_segments(const torch::Tensor& x, const std::vector<tandem::PackedSegment>& segments, int64_t qmax) {
  check_qmax(qmax);
  int64_t n = 0;
  for (const auto& segment : segments) n += segment.n;
  auto out = torch::empty({x.size(0), n}, x.options());
  const tandem::PackedMatrix w{segments.data(), static_cast<int64_t>(segments.size()), n, x.size(1)};
  if (x.size(0) > 0 && n > 0) tandem::qmatmul(x.data_ptr<float>(), x.size(0), w, static_cast<int>(qmax), out.data_ptr<float>());
  return out;
}

// x [M, K] float32 times the packed weight (data, segments: kernels/packing.py's PackedWeight) -> [M, N].
torch::Tensor qmatmul(torch::Tensor x, torch::Tensor data, torch::Tensor segments, int64_t qmax) {
  check_rows(x, "x");
  return qmatmul_segments(x, packed_segments(data, segments, x.size(1)), qmax);
}

// The single-format form benchmarks/kernels.py calls: N columns of Q8_0 (bits 8) or Q4_0 / Q4_1
// (bits 4, one layout) panels.
torch::Tensor qmatmul_bits(torch::Tensor x, torch::Tensor packed, int64_t n, int64_t bits, int64_t qmax) {
  check_rows(x, "x");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const auto format = bits == 8 ? tandem::QuantFormat::kQ8_0 : tandem::QuantFormat::kQ4_1;
  const auto table = torch::tensor({static_cast<int64_t>(format), n, int64_t{0}}, torch::kInt64).reshape({1, 3});
  return qmatmul_segments(x, packed_segments(packed.reshape({-1}), table, x.size(1)), qmax);
}

// kv_cache [P, 2, S, Hkv, D] float32 or bfloat16 (any page stride, the rest contiguous), for q heads of head_dim.
tandem::PagedKV paged_kv(const torch::Tensor& kv_cache, int64_t num_q_heads, int64_t head_dim) {
  TORCH_CHECK(kv_cache.dim() == 5, "kv_cache: [P, 2, S, Hkv, D]");
  TORCH_CHECK(kv_cache.stride(4) == 1 && kv_cache.stride(3) == kv_cache.size(4) &&
                  kv_cache.stride(2) == kv_cache.size(3) * kv_cache.size(4),
              "kv_cache: each page's rows contiguous");
  const bool is_bf16 = kv_cache.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(is_bf16 || kv_cache.scalar_type() == torch::kFloat32, "kv_cache must be float32 or bfloat16");
  const int64_t num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == head_dim && num_q_heads % num_kv_heads == 0, "head shapes");
  TORCH_CHECK(num_q_heads / num_kv_heads <= 64, "at most 64 query heads per kv head");
  return {kv_cache.data_ptr(), is_bf16, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
          kv_cache.stride(3), kv_cache.size(2), num_kv_heads, head_dim};
}

// The CSR page table as FlashInfer takes it (int32), checked against `rows` query rows and the cache.
struct PageTable {
  const int32_t *qo, *kvp, *indices, *last;
  int64_t batch;
};

PageTable page_table(const torch::Tensor& qo_indptr, const torch::Tensor& kv_indptr, const torch::Tensor& kv_indices,
                     const torch::Tensor& kv_last_page_len, int64_t rows, const torch::Tensor& kv_cache) {
  for (const auto& t : {qo_indptr, kv_indptr, kv_indices, kv_last_page_len})
    TORCH_CHECK(t.scalar_type() == torch::kInt32 && t.is_contiguous(), "page table tensors must be int32");
  const int64_t batch = qo_indptr.size(0) - 1, page_size = kv_cache.size(2);
  TORCH_CHECK(batch >= 0 && kv_indptr.size(0) == batch + 1 && kv_last_page_len.size(0) == batch, "page table sizes");
  const PageTable table{qo_indptr.data_ptr<int32_t>(), kv_indptr.data_ptr<int32_t>(), kv_indices.data_ptr<int32_t>(),
                        kv_last_page_len.data_ptr<int32_t>(), batch};
  TORCH_CHECK(table.qo[0] == 0 && table.qo[batch] == rows, "qo_indptr must run from 0 to q's rows");
  TORCH_CHECK(table.kvp[0] == 0 && table.kvp[batch] <= kv_indices.size(0), "kv_indptr does not fit kv_indices");
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t num_pages = table.kvp[b + 1] - table.kvp[b];
    TORCH_CHECK(num_pages >= 1 && table.last[b] >= 1 && table.last[b] <= page_size, "sequence ", b, ": bad page count");
    const int64_t seq_len = (num_pages - 1) * page_size + table.last[b];
    TORCH_CHECK(table.qo[b + 1] >= table.qo[b] && table.qo[b + 1] - table.qo[b] <= seq_len, "sequence ", b,
                " has more queries than keys");
    for (int32_t i = table.kvp[b]; i < table.kvp[b + 1]; ++i)
      TORCH_CHECK(table.indices[i] >= 0 && table.indices[i] < kv_cache.size(0), "page id out of range");
  }
  return table;
}

// q [T, Hq, D] float32 (rows may be strided, e.g. views of a fused projection; heads contiguous);
// kv_cache [P, 2, S, Hkv, D] float32 or bfloat16; the CSR page table. Causal: query row i of a
// sequence with q_len rows and seq_len keys sits at position seq_len - q_len + i.
// Scores are (q * scale) . k; `window` > 0: a row at position p sees keys p - window + 1 .. p only.
// Returns [T, Hq, D] float32, contiguous.
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor qo_indptr,
                              torch::Tensor kv_indptr, torch::Tensor kv_indices, torch::Tensor kv_last_page_len,
                              double scale, int64_t window) {
  TORCH_CHECK(window >= 0, "window must be 0 (none) or positive");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q: [T, Hq, D] float32, each row's heads contiguous");
  const tandem::PagedKV kv = paged_kv(kv_cache, q.size(1), q.size(2));
  const PageTable table = page_table(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, q.size(0), kv_cache);
  auto out = torch::empty(q.sizes(), q.options());
  tandem::paged_attention(q.data_ptr<float>(), q.stride(0), q.size(1), kv, table.qo, table.kvp, table.indices,
                          table.last, table.batch, static_cast<float>(scale), window, out.data_ptr<float>());
  return out;
}

// RMSNorm as HF Llama computes it in float32: weight * (x / sqrt(mean(x^2) + eps)), row by row.
// With `residual` (same shape): residual += x first (in place), and the sum is normalized.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, torch::optional<torch::Tensor> residual) {
  check_rows(x, "x");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() && weight.numel() == x.size(1),
              "weight must be [H] float32");
  float* res = nullptr;
  if (residual.has_value()) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual must match x");
    res = residual->data_ptr<float>();
  }
  auto out = torch::empty_like(x);
  tandem::rms_norm(x.data_ptr<float>(), x.size(0), x.size(1), weight.data_ptr<float>(), static_cast<float>(eps), res,
                   out.data_ptr<float>());
  return out;
}

// silu(gate) * up for gate_up [T, 2I] = [gate | up] -> [T, I].
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t width = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), width}, gate_up.options());
  tandem::silu_and_mul(gate_up.data_ptr<float>(), gate_up.size(0), width, out.data_ptr<float>());
  return out;
}

// gelu(gate, approximate="tanh") * up for gate_up [T, 2I] = [gate | up] -> [T, I].
torch::Tensor gelu_tanh_and_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t width = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), width}, gate_up.options());
  tandem::gelu_tanh_and_mul(gate_up.data_ptr<float>(), gate_up.size(0), width, out.data_ptr<float>());
  return out;
}

// The rotary tables and write slots of `tokens` rows, checked against the cache [P, 2, S, Hkv, D]
// (q, k, v are filled in by the caller).
tandem::RopeStore rope_store(const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& positions,
                             const torch::Tensor& kv_cache, const torch::Tensor& write_pages,
                             const torch::Tensor& write_offsets, int64_t tokens, int64_t head_dim) {
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat32 &&
                  sin.scalar_type() == torch::kFloat32 && cos.dim() == 2 && cos.size(1) == head_dim &&
                  sin.sizes() == cos.sizes(),
              "cos/sin tables must be contiguous float32 [max_pos, D]");
  for (const auto& t : {positions, write_pages, write_offsets})
    TORCH_CHECK(t.scalar_type() == torch::kInt64 && t.is_contiguous() && t.numel() == tokens,
                "positions and write slots must be int64, one per token");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.stride(4) == 1 && kv_cache.stride(3) == kv_cache.size(4) &&
                  kv_cache.size(4) == head_dim,
              "cache rows must be contiguous and of head_dim");
  const bool is_bf16 = kv_cache.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(is_bf16 || kv_cache.scalar_type() == torch::kFloat32, "kv_cache must be float32 or bfloat16");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* pages = write_pages.data_ptr<int64_t>();
  const int64_t* offsets = write_offsets.data_ptr<int64_t>();
  for (int64_t r = 0; r < tokens; ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos.size(0) && pages[r] >= 0 && pages[r] < kv_cache.size(0) &&
                    offsets[r] >= 0 && offsets[r] < kv_cache.size(2),
                "position or write slot out of range");
  tandem::RopeStore a{};
  a.head_dim = head_dim;
  a.num_kv_heads = kv_cache.size(3);
  a.cos = cos.data_ptr<float>();
  a.sin = sin.data_ptr<float>();
  a.positions = pos;
  a.write_pages = pages;
  a.write_offsets = offsets;
  a.cache = kv_cache.data_ptr();
  a.cache_is_bf16 = is_bf16;
  a.page_stride = kv_cache.stride(0);
  a.kv_stride = kv_cache.stride(1);
  a.token_stride = kv_cache.stride(2);
  return a;
}

// Rotary embedding (rotate-half) applied to q [T, Hq, D] and k [T, Hkv, D] in place, from tables
// cos/sin [max_pos, D] at `positions` [T]; then k and v [T, Hkv, D] are written into the paged
// cache [P, 2, S, Hkv, D] at (write_pages[t], write_offsets[t]). All float32 but the cache, which may
// be float32 or bfloat16. q, k, v may be strided views of one fused projection (rows contiguous).
void rope_and_store(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                    torch::Tensor positions, torch::Tensor kv_cache, torch::Tensor write_pages,
                    torch::Tensor write_offsets) {
  for (const auto& t : {q, k, v})
    TORCH_CHECK(t.dim() == 3 && t.scalar_type() == torch::kFloat32 && t.stride(2) == 1 && t.stride(1) == t.size(2) &&
                    t.size(0) == q.size(0) && t.size(2) == q.size(2),
                "q, k, v must be [T, H, D] float32 with contiguous rows");
  tandem::RopeStore a = rope_store(cos, sin, positions, kv_cache, write_pages, write_offsets, q.size(0), q.size(2));
  TORCH_CHECK(k.size(1) == a.num_kv_heads && v.size(1) == a.num_kv_heads, "k and v must have the cache's kv heads");
  a.q = q.data_ptr<float>();
  a.k = k.data_ptr<float>();
  a.v = v.data_ptr<float>();
  a.q_row_stride = q.stride(0);
  a.k_row_stride = k.stride(0);
  a.v_row_stride = v.stride(0);
  a.num_q_heads = q.size(1);
  tandem::rope_and_store(a, q.size(0));
}

// A packed projection as the decoder layer keeps it: (data, segments table, bias or None).
using LinearSpec = std::tuple<torch::Tensor, torch::Tensor, torch::optional<torch::Tensor>>;

using OptionalNorm = torch::optional<torch::Tensor>;

// One dense decoder layer's weights, held for the model's life; `forward` runs tandem::decoder_layer.
// Norms: input and ffn [hidden] (ffn: Llama's post_attention_layernorm, Gemma's pre_feedforward_layernorm);
// optional q and k [head_dim], attn_out and ffn_out [hidden] (Gemma's post_attention_layernorm and
// post_feedforward_layernorm); all float32 with one eps. `activation`: "silu" or "gelu_tanh".
class DecoderLayer {
 public:
  DecoderLayer(torch::Tensor input_norm, torch::Tensor ffn_norm, OptionalNorm q_norm, OptionalNorm k_norm,
               OptionalNorm attn_out_norm, OptionalNorm ffn_out_norm, double eps, std::vector<LinearSpec> linears,
               int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t qmax, double scale,
               int64_t window, const std::string& activation)
      : linears_(std::move(linears)) {
    TORCH_CHECK(linears_.size() == 4, "linears: qkv, o, gate_up, down");
    TORCH_CHECK(activation == "silu" || activation == "gelu_tanh", "activation must be silu or gelu_tanh");
    TORCH_CHECK(window >= 0, "window must be 0 (none) or positive");
    check_qmax(qmax);
    const int64_t hidden = input_norm.numel(), q_size = num_q_heads * head_dim;
    // each norm checked and kept; its pointer (null when absent) goes to w_
    auto keep = [&](const OptionalNorm& norm, int64_t size, const char* name) -> const float* {
      if (!norm.has_value()) return nullptr;
      TORCH_CHECK(norm->scalar_type() == torch::kFloat32 && norm->is_contiguous() && norm->numel() == size, name,
                  " norm weight must be [", size, "] float32");
      norms_.push_back(*norm);
      return norm->data_ptr<float>();
    };
    w_.input_norm = keep(input_norm, hidden, "input");
    w_.ffn_norm = keep(ffn_norm, hidden, "ffn");
    w_.q_norm = keep(q_norm, head_dim, "q");
    w_.k_norm = keep(k_norm, head_dim, "k");
    w_.attn_out_norm = keep(attn_out_norm, hidden, "attn_out");
    w_.ffn_out_norm = keep(ffn_out_norm, hidden, "ffn_out");
    const torch::Tensor& gate_up_table = std::get<1>(linears_[2]);
    TORCH_CHECK(gate_up_table.dim() == 2 && gate_up_table.size(1) == 3, "linear 2: segments table");
    const int64_t intermediate = gate_up_table.select(1, 1).sum().item<int64_t>() / 2;
    const int64_t k_in[4] = {hidden, q_size, hidden, intermediate};
    const int64_t n_out[4] = {q_size + 2 * num_kv_heads * head_dim, hidden, 2 * intermediate, hidden};
    tandem::PackedLinear* targets[4] = {&w_.qkv, &w_.o, &w_.gate_up, &w_.down};
    for (int i = 0; i < 4; ++i) {
      const auto& [data, table, bias] = linears_[i];
      segments_[i] = packed_segments(data, table, k_in[i]);
      int64_t n = 0;
      for (const auto& segment : segments_[i]) n += segment.n;
      TORCH_CHECK(n == n_out[i], "linear ", i, ": shape does not fit the layer");
      if (bias.has_value())
        TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == n,
                    "linear ", i, ": bias must be [N] float32");
      *targets[i] = {{segments_[i].data(), static_cast<int64_t>(segments_[i].size()), n, k_in[i]},
                     bias.has_value() ? bias->data_ptr<float>() : nullptr};
    }
    w_.eps = static_cast<float>(eps);
    w_.num_q_heads = num_q_heads;
    w_.num_kv_heads = num_kv_heads;
    w_.head_dim = head_dim;
    w_.qmax = static_cast<int>(qmax);
    w_.scale = static_cast<float>(scale);
    w_.window = window;
    w_.activation = activation == "silu" ? tandem::Activation::kSilu : tandem::Activation::kGeluTanh;
  }

  // x [T, hidden] float32; residual the stream (None: the first layer, x starts it); returns
  // (the feed-forward output, the stream), the stream updated in place when given.
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x, torch::optional<torch::Tensor> residual,
                                                   torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                                                   torch::Tensor kv_cache, torch::Tensor write_pages,
                                                   torch::Tensor write_offsets, torch::Tensor qo_indptr,
                                                   torch::Tensor kv_indptr, torch::Tensor kv_indices,
                                                   torch::Tensor kv_last_page_len) {
    check_rows(x, "x");
    TORCH_CHECK(x.size(1) == w_.o.w.n, "x must be [T, hidden]");
    const bool is_first = !residual.has_value();
    torch::Tensor stream = is_first ? torch::empty_like(x) : *residual;
    if (!is_first) {
      check_rows(stream, "residual");
      TORCH_CHECK(stream.sizes() == x.sizes(), "residual must match x");
    }
    const int64_t t = x.size(0);
    tandem::DecoderStep step{};
    step.rope = rope_store(cos, sin, positions, kv_cache, write_pages, write_offsets, t, w_.head_dim);
    TORCH_CHECK(step.rope.num_kv_heads == w_.num_kv_heads, "the cache's kv heads do not fit the layer");
    step.kv = paged_kv(kv_cache, w_.num_q_heads, w_.head_dim);
    const PageTable table = page_table(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, t, kv_cache);
    step.qo_indptr = table.qo;
    step.kv_indptr = table.kvp;
    step.kv_indices = table.indices;
    step.last_page_len = table.last;
    step.batch = table.batch;
    auto out = torch::empty_like(x);
    tandem::decoder_layer(w_, step, x.data_ptr<float>(), stream.data_ptr<float>(), is_first, t, out.data_ptr<float>());
    return {out, stream};
  }

 private:
  std::vector<torch::Tensor> norms_;   // keep the weights the raw pointers in w_ point into
  std::vector<LinearSpec> linears_;
  std::vector<tandem::PackedSegment> segments_[4];
  tandem::DecoderLayerWeights w_{};
};

// GGUF blocks of one tensor (any C-contiguous buffer of `rows` rows of `cols` inputs, format code
// `format`) -> its packed panels, uint8 (repack.cpp); with `row_order` (int64 [N]) output row i is row_order[i].
torch::Tensor repack_gguf(const py::buffer& raw, int64_t format, int64_t rows, int64_t cols,
                          const std::optional<torch::Tensor>& row_order) {
  TORCH_CHECK(format >= 0 && format < tandem::kNumFormats, "unknown format ", format);
  const auto f = static_cast<tandem::QuantFormat>(format);
  TORCH_CHECK(rows >= 0 && cols > 0 && cols % (tandem::kBlock * tandem::group_blocks(f)) == 0, "cols = ", cols,
              " is not a multiple of the format's blocks");
  const py::buffer_info info = raw.request();
  const int64_t row_bytes = tandem::gguf_row_bytes(f, cols);
  TORCH_CHECK(info.itemsize * info.size == rows * row_bytes, "raw holds ", info.itemsize * info.size,
              " bytes, not ", rows, " rows of ", row_bytes);
  TORCH_CHECK(PyBuffer_IsContiguous(info.view(), 'C'), "raw must be C-contiguous");
  int64_t n = rows;
  const int64_t* order = nullptr;
  if (row_order.has_value()) {
    const auto& o = *row_order;
    TORCH_CHECK(o.scalar_type() == torch::kInt64 && o.dim() == 1 && o.is_contiguous(), "row_order must be int64 [N]");
    n = o.numel();
    order = o.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) TORCH_CHECK(order[i] >= 0 && order[i] < rows, "row_order out of range");
  }
  auto out = torch::empty({(n + tandem::kPanel - 1) / tandem::kPanel * tandem::panel_bytes(f, cols)}, torch::kUInt8);
  {
    py::gil_scoped_release release;
    tandem::repack_gguf(static_cast<const uint8_t*>(info.ptr), f, n, cols, order, out.data_ptr<uint8_t>());
  }
  return out;
}

// The LoRA kernels' tensors are checked with ValueError (TORCH_CHECK_VALUE): kernels/lora.py's
// torch path raises the same for the same mistakes.
void check_lora_operand(const torch::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == dim && t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.device().is_cpu(),
                    name, " must be a contiguous ", dim, "-d float32 CPU tensor");
}

// The segment table: int32 starts [S + 1] from 0 to n rows, never decreasing, and slots [S], each
// -1 (no adapter) or below num_slots.
tandem::LoraSegments lora_segments(const torch::Tensor& starts, const torch::Tensor& slots, int64_t n,
                                   int64_t num_slots) {
  for (const auto& t : {starts, slots})
    TORCH_CHECK_VALUE(t.scalar_type() == torch::kInt32 && t.dim() == 1 && t.is_contiguous() && t.device().is_cpu(),
                      "seg_starts and seg_slots must be 1-d int32 CPU tensors");
  const int64_t num_segments = slots.size(0);
  TORCH_CHECK_VALUE(starts.size(0) == num_segments + 1, "seg_starts must hold one more entry than seg_slots");
  const tandem::LoraSegments seg{starts.data_ptr<int32_t>(), slots.data_ptr<int32_t>(), num_segments};
  TORCH_CHECK_VALUE(seg.starts[0] == 0 && seg.starts[num_segments] == n, "seg_starts must run from 0 to the ", n,
                    " rows");
  for (int64_t s = 0; s < num_segments; ++s) {
    TORCH_CHECK_VALUE(seg.starts[s + 1] >= seg.starts[s], "seg_starts must not decrease");
    TORCH_CHECK_VALUE(seg.slots[s] >= -1 && seg.slots[s] < num_slots, "segment ", s, ": slot ", seg.slots[s],
                      " is neither -1 nor one of the ", num_slots, " slots");
  }
  return seg;
}

// t [n, R] = x [n, in] times a[slot] [R, in]^T per segment (a [slots, R, in]); rows of slot -1 get zeros.
torch::Tensor lora_shrink(torch::Tensor x, torch::Tensor a, torch::Tensor seg_starts, torch::Tensor seg_slots) {
  check_lora_operand(x, 2, "x");
  check_lora_operand(a, 3, "a");
  TORCH_CHECK_VALUE(a.size(2) == x.size(1), "a [slots, R, in] must have x's ", x.size(1), " inputs, not ", a.size(2));
  const tandem::LoraSegments seg = lora_segments(seg_starts, seg_slots, x.size(0), a.size(0));
  auto t = torch::empty({x.size(0), a.size(1)}, x.options());
  tandem::lora_shrink(x.data_ptr<float>(), x.size(0), x.size(1), a.data_ptr<float>(), a.size(1), seg,
                      t.data_ptr<float>());
  return t;
}

// In place: y[rows, out_offset:+out] += scaling[slot] * t[rows, r_offset:+r] times b[slot] [out, r]^T
// per segment (b [slots, out, r], scaling [slots]); rows of slot -1 are left alone.
void lora_expand(torch::Tensor t, torch::Tensor b, torch::Tensor seg_starts, torch::Tensor seg_slots,
                 torch::Tensor scaling, torch::Tensor y, int64_t r_offset, int64_t out_offset) {
  check_lora_operand(t, 2, "t");
  check_lora_operand(b, 3, "b");
  check_lora_operand(scaling, 1, "scaling");
  check_lora_operand(y, 2, "y");
  const int64_t out = b.size(1), r = b.size(2);
  TORCH_CHECK_VALUE(r <= tandem::kMaxLoraRank, "b's rank ", r, " is above the largest, ", tandem::kMaxLoraRank);
  TORCH_CHECK_VALUE(t.size(0) == y.size(0), "t and y must have the same rows");
  TORCH_CHECK_VALUE(scaling.size(0) == b.size(0), "scaling must hold one value per slot of b");
  TORCH_CHECK_VALUE(r_offset >= 0 && r_offset + r <= t.size(1), "t's columns ", r_offset, " + ", r,
                    " (b's rank) do not fit its ", t.size(1));
  TORCH_CHECK_VALUE(out_offset >= 0 && out_offset + out <= y.size(1), "y's columns ", out_offset, " + ", out,
                    " (b's outputs) do not fit its ", y.size(1));
  const tandem::LoraSegments seg = lora_segments(seg_starts, seg_slots, y.size(0), b.size(0));
  tandem::lora_expand(t.data_ptr<float>() + r_offset, t.size(1), r, b.data_ptr<float>(), out, seg,
                      scaling.data_ptr<float>(), y.data_ptr<float>() + out_offset, y.size(1));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every kernel runs without the GIL (the tensors it reads are its arguments, held by the caller):
  // a worker's gRPC threads stream the last step's tokens while the engine thread computes the next.
  using NoGil = py::call_guard<py::gil_scoped_release>;
  m.def("qmatmul", &qmatmul,
        "x [M, K] float32 times packed block-quantized weights (data, segments) [N, K]^T -> [M, N]; activations "
        "rounded to int16 (qmax 32767) or int8 (qmax 127) blocks, exact integer block dots",
        py::arg("x"), py::arg("data"), py::arg("segments"), py::arg("qmax"), NoGil());
  m.def("qmatmul", &qmatmul_bits, "the same over N columns of single-format Q8_0 (bits 8) or Q4_x (bits 4) panels",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bits"), py::arg("qmax"), NoGil());
  m.def("paged_attention", &paged_attention,
        "causal attention over a paged KV cache (CSR page table), over the last `window` positions when > 0",
        py::arg("q"), py::arg("kv_cache"), py::arg("qo_indptr"), py::arg("kv_indptr"), py::arg("kv_indices"),
        py::arg("kv_last_page_len"), py::arg("scale"), py::arg("window") = 0, NoGil());
  m.def("rms_norm", &rms_norm, "RMSNorm of [T, H] float32 rows, optionally after adding them into a residual",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none(), NoGil());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [T, 2I] float32 rows", NoGil());
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "gelu_tanh(gate) * up of [T, 2I] float32 rows", NoGil());
  m.def("rope_and_store", &rope_and_store, "rotary embedding on q, k in place; k, v written to the paged cache",
        NoGil());
  m.def("lora_shrink", &lora_shrink, "t [n, R] = x [n, in] times a[slot]^T per segment of rows (slot -1: zeros)",
        py::arg("x"), py::arg("a"), py::arg("seg_starts"), py::arg("seg_slots"), NoGil());
  m.def("lora_expand", &lora_expand,
        "in place y[rows, out_offset:+out] += scaling[slot] * t[rows, r_offset:+r] times b[slot]^T per segment",
        py::arg("t"), py::arg("b"), py::arg("seg_starts"), py::arg("seg_slots"), py::arg("scaling"), py::arg("y"),
        py::arg("r_offset"), py::arg("out_offset"), NoGil());
  m.def("isa", [] { return std::string(tandem::isa_name()) + (tandem::amx_ready() ? "+amx" : ""); },
        "the instruction set the kernels were compiled for (+amx: the matmul's AMX tiles run here)");
  m.def("repack_gguf", &repack_gguf, "one tensor's GGUF blocks -> its packed panels (uint8), rows in row_order",
        py::arg("raw"), py::arg("format"), py::arg("rows"), py::arg("cols"), py::arg("row_order") = py::none());
  py::class_<DecoderLayer>(m, "DecoderLayer", "one dense decoder layer over packed weights, in one call")
      .def(py::init<torch::Tensor, torch::Tensor, OptionalNorm, OptionalNorm, OptionalNorm, OptionalNorm, double,
                    std::vector<LinearSpec>, int64_t, int64_t, int64_t, int64_t, double, int64_t,
                    const std::string&>(),
           py::arg("input_norm"), py::arg("ffn_norm"), py::arg("q_norm"), py::arg("k_norm"), py::arg("attn_out_norm"),
           py::arg("ffn_out_norm"), py::arg("eps"), py::arg("linears"), py::arg("num_q_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("qmax"), py::arg("scale"), py::arg("window"),
           py::arg("activation"))
      .def("forward", &DecoderLayer::forward, NoGil());
}
