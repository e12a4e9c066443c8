// One dense decoder layer (Llama, Qwen2) of float32 rows in one call: RMSNorm, q/k/v, rotary and the
// KV store, paged attention, o, RMSNorm, gate/up, SiLU * up, down, over packed weights. The kernels
// and their order are those the Python layer calls one by one (engine/model.py), so the bits are
// the same; what the call saves is the Python between them, which at batch 1 was a fifth of a step.

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

}  // namespace

void decoder_layer(const DecoderLayerWeights& w, const DecoderStep& step, const float* x, float* residual,
                   bool is_first, int64_t t, float* out) {
  const int64_t hidden = w.o.w.n, d = w.head_dim, q_size = w.num_q_heads * d, kv_size = w.num_kv_heads * d;
  const auto h = scratch<float>(t * hidden), qkv = scratch<float>(t * w.qkv.w.n), attn = scratch<float>(t * q_size),
             o = scratch<float>(t * hidden);
  if (is_first) {
    std::memcpy(residual, x, t * hidden * sizeof(float));
    rms_norm(residual, t, hidden, w.input_norm, w.eps, nullptr, h.get());
  } else {
    rms_norm(x, t, hidden, w.input_norm, w.eps, residual, h.get());
  }
  linear(w.qkv, h.get(), t, w.qmax, qkv.get());
  RopeStore rope = step.rope;
  rope.q = qkv.get();
  rope.k = qkv.get() + q_size;
  rope.v = qkv.get() + q_size + kv_size;
  rope.q_row_stride = rope.k_row_stride = rope.v_row_stride = w.qkv.w.n;
  rope.num_q_heads = w.num_q_heads;
  rope.num_kv_heads = w.num_kv_heads;
  rope.head_dim = d;
  rope_and_store(rope, t);
  paged_attention(qkv.get(), w.qkv.w.n, w.num_q_heads, step.kv, step.qo_indptr, step.kv_indptr, step.kv_indices,
                  step.last_page_len, step.batch, w.scale, attn.get());
  linear(w.o, attn.get(), t, w.qmax, o.get());
  rms_norm(o.get(), t, hidden, w.post_norm, w.eps, residual, h.get());
  const auto gate_up = scratch<float>(t * w.gate_up.w.n), act = scratch<float>(t * w.down.w.k);
  linear(w.gate_up, h.get(), t, w.qmax, gate_up.get());
  silu_and_mul(gate_up.get(), t, w.down.w.k, act.get());
  linear(w.down, act.get(), t, w.qmax, out);
}

}  // namespace tandem
