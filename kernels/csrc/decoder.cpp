// One dense decoder layer (Llama, Qwen2) of float32 rows in one call: RMSNorm, q/k/v, rotary and the
// KV store, paged attention, o, RMSNorm, gate/up, SiLU * up, down, over packed weights. The kernels
// and their order are those the Python layer calls one by one (engine/model.py), so the bits are
// the same; what the call saves is the Python between them, which at batch 1 was a fifth of a step.

#include "kernels.h"

#include <cstring>
#include <vector>

namespace tandem {
namespace {

void linear(const PackedLinear& w, const float* x, int64_t t, int qmax, float* out) {
  qmatmul(x, t, w.k, w.data, w.n, w.bits, qmax, out);
  if (w.bias)
    for (int64_t r = 0; r < t; ++r)
      for (int64_t j = 0; j < w.n; ++j) out[r * w.n + j] += w.bias[j];
}

}  // namespace

void decoder_layer(const DecoderLayerWeights& w, const DecoderStep& step, const float* x, float* residual,
                   bool is_first, int64_t t, float* out) {
  const int64_t hidden = w.o.n, d = w.head_dim, q_size = w.num_q_heads * d, kv_size = w.num_kv_heads * d;
  std::vector<float> h(t * hidden), qkv(t * w.qkv.n), attn(t * q_size), o(t * hidden);
  if (is_first) {
    std::memcpy(residual, x, t * hidden * sizeof(float));
    rms_norm(residual, t, hidden, w.input_norm, w.eps, nullptr, h.data());
  } else {
    rms_norm(x, t, hidden, w.input_norm, w.eps, residual, h.data());
  }
  linear(w.qkv, h.data(), t, w.qmax, qkv.data());
  RopeStore rope = step.rope;
  rope.q = qkv.data();
  rope.k = qkv.data() + q_size;
  rope.v = qkv.data() + q_size + kv_size;
  rope.q_row_stride = rope.k_row_stride = rope.v_row_stride = w.qkv.n;
  rope.num_q_heads = w.num_q_heads;
  rope.num_kv_heads = w.num_kv_heads;
  rope.head_dim = d;
  rope_and_store(rope, t);
  paged_attention(qkv.data(), w.qkv.n, w.num_q_heads, step.kv, step.qo_indptr, step.kv_indptr, step.kv_indices,
                  step.last_page_len, step.batch, w.scale, attn.data());
  linear(w.o, attn.data(), t, w.qmax, o.data());
  rms_norm(o.data(), t, hidden, w.post_norm, w.eps, residual, h.data());
  std::vector<float> gate_up(t * w.gate_up.n), act(t * w.down.k);
  linear(w.gate_up, h.data(), t, w.qmax, gate_up.data());
  silu_and_mul(gate_up.data(), t, w.down.k, act.data());
  linear(w.down, act.data(), t, w.qmax, out);
}

}  // namespace tandem
