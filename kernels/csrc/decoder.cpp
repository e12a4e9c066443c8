// One dense decoder layer of float32 rows in one call, over packed weights: RMSNorm, q/k/v, the
// optional per-head q/k RMSNorm, rotary (the layer's own tables) and the KV store, paged attention
// (with the layer's softmax scale and sliding window), o, the optional norm of the attention output
// (Gemma's sandwich), RMSNorm, gate/up, SiLU or GeLU-tanh * up, down, the optional norm of the MLP
// output. That covers Llama, Qwen2/3, Mistral, Phi-3 and Gemma 3 (MoE layers stay in Python). The
// kernels and their order are those the Python layer calls one by one (engine/models/layers.py), so
// the bits are the same; what the call saves is the Python between them, at batch 1 a fifth of a step.

#include "common.h"
#include "kernels.h"

#include <cstring>

namespace tandem {
namespace {

void linear(const PackedLinear& linear, const float* x, int64_t t, int qmax, float* out) {
  const int64_t n = linear.w.n;
  qmatmul(x, t, linear.w, qmax, out);
  if (linear.bias)
    for (int64_t r = 0; r < t; ++r)
      for (int64_t j = 0; j < n; ++j) out[r * n + j] += linear.bias[j];
}

// attn [t, q_size] = attention of the rows h [t, hidden]: q/k/v, q/k norms, rotary + store, attention.
void attention(const DecoderLayerWeights& w, const DecoderStep& step, const float* h, int64_t t, float* attn) {
  const int64_t d = w.head_dim, q_size = w.num_q_heads * d, kv_size = w.num_kv_heads * d, n = w.qkv.w.n;
  const auto qkv = scratch<float>(t * n);
  linear(w.qkv, h, t, w.qmax, qkv.get());
  if (w.q_norm) rms_norm_heads(qkv.get(), t, n, w.num_q_heads, d, w.q_norm, w.eps);
  if (w.k_norm) rms_norm_heads(qkv.get() + q_size, t, n, w.num_kv_heads, d, w.k_norm, w.eps);
  RopeStore rope = step.rope;
  rope.q = qkv.get();
  rope.k = qkv.get() + q_size;
  rope.v = qkv.get() + q_size + kv_size;
  rope.q_row_stride = rope.k_row_stride = rope.v_row_stride = n;
  rope.num_q_heads = w.num_q_heads;
  rope.num_kv_heads = w.num_kv_heads;
  rope.head_dim = d;
  rope_and_store(rope, t);
  paged_attention(qkv.get(), n, w.num_q_heads, step.kv, step.qo_indptr, step.kv_indptr, step.kv_indices,
                  step.last_page_len, step.batch, w.scale, w.window, attn);
}

}  // namespace

void decoder_layer(const DecoderLayerWeights& w, const DecoderStep& step, const float* x, float* residual,
                   bool is_first, int64_t t, float* out) {
  const int64_t hidden = w.o.w.n, width = w.down.w.k;
  const auto h = scratch<float>(t * hidden), attn = scratch<float>(t * w.o.w.k), o = scratch<float>(t * hidden);
  if (is_first) {
    std::memcpy(residual, x, t * hidden * sizeof(float));
    rms_norm(residual, t, hidden, w.input_norm, w.eps, nullptr, h.get());
  } else {
    rms_norm(x, t, hidden, w.input_norm, w.eps, residual, h.get());
  }
  attention(w, step, h.get(), t, attn.get());
  linear(w.o, attn.get(), t, w.qmax, o.get());
  if (w.attn_out_norm) rms_norm(o.get(), t, hidden, w.attn_out_norm, w.eps, nullptr, o.get());   // in place
  rms_norm(o.get(), t, hidden, w.ffn_norm, w.eps, residual, h.get());
  const auto gate_up = scratch<float>(t * w.gate_up.w.n), act = scratch<float>(t * width);
  linear(w.gate_up, h.get(), t, w.qmax, gate_up.get());
  if (w.activation == Activation::kGeluTanh)
    gelu_tanh_and_mul(gate_up.get(), t, width, act.get());
  else
    silu_and_mul(gate_up.get(), t, width, act.get());
  linear(w.down, act.get(), t, w.qmax, out);
  if (w.ffn_out_norm) rms_norm(out, t, hidden, w.ffn_out_norm, w.eps, nullptr, out);
}

}  // namespace tandem
