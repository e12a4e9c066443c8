// Elementwise layers in float32, one call each where torch needs several: RMSNorm (with the
// residual add; over rows or over the heads inside rows), SiLU * up, GeLU-tanh * up, and rotary
// embedding with the KV store. Rows are independent.

#include "kernels.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

namespace tandem {
namespace {

float sum_of_squares(const float* x, int64_t n) {
  int64_t i = 0;
  float total = 0.0f;
#if defined(TANDEM_AVX512) || defined(TANDEM_AVX2)
  Vec::Reg acc = Vec::zero();
  for (; i + Vec::kWidth <= n; i += Vec::kWidth) {
    const Vec::Reg v = Vec::load(x + i);
    acc = Vec::fma(v, v, acc);
  }
  total = Vec::reduce_add(acc);
#endif
  for (; i < n; ++i) total += x[i] * x[i];
  return total;
}

// silu(g) = g * sigmoid(g), with sigmoid from e = exp(-|g|) (never overflows):
// 1 / (1 + e) for g >= 0, e / (1 + e) below.
inline float silu(float g) {
  const float e = std::exp(-std::fabs(g));
  return g * ((g >= 0.0f ? 1.0f : e) / (1.0f + e));
}

// out = weight * row / sqrt(mean(row^2) + eps): every RMSNorm's arithmetic, so that its forms agree
// bit for bit (out may be row).
inline void norm_row(const float* row, int64_t h, const float* weight, float eps, float* out) {
  const float inv = 1.0f / std::sqrt(sum_of_squares(row, h) / static_cast<float>(h) + eps);
  for (int64_t i = 0; i < h; ++i) out[i] = weight[i] * (row[i] * inv);
}

// g * sigmoid(z), sigmoid from e = exp(-|z|) as in silu (z = g: SiLU; z = 2u: GeLU-tanh)
#if defined(TANDEM_AVX512) || defined(TANDEM_AVX2)
inline Vec::Reg times_sigmoid(Vec::Reg g, Vec::Reg z) {
  const Vec::Reg one = Vec::set1(1.0f);
  const Vec::Reg e = Vec::exp_nonpositive(Vec::sub(Vec::zero(), Vec::abs(z)));
  return Vec::mul(g, Vec::div(Vec::select_nonnegative(z, one, e), Vec::add(one, e)));
}
#endif

constexpr float kGeluScale = 1.5957691216057308f;   // 2 * sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

inline float gelu_tanh(float g) {
  const float z = kGeluScale * (g * (1.0f + kGeluCubic * (g * g)));
  const float e = std::exp(-std::fabs(z));
  return g * ((z >= 0.0f ? 1.0f : e) / (1.0f + e));
}

inline uint16_t to_bf16(float f) {   // round to nearest even, as torch's conversion
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if (std::isnan(f)) return 0x7FC0;
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

}  // namespace

void rms_norm(const float* x, int64_t rows, int64_t h, const float* weight, float eps, float* residual, float* out) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * h;
      if (residual) {
        float* sum = residual + r * h;
        for (int64_t i = 0; i < h; ++i) sum[i] += row[i];
        row = sum;
      }
      norm_row(row, h, weight, eps, out + r * h);
    }
  });
}

void rms_norm_heads(float* x, int64_t rows, int64_t row_stride, int64_t heads, int64_t d, const float* weight,
                    float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t h = 0; h < heads; ++h) {
        float* head = x + r * row_stride + h * d;
        norm_row(head, d, weight, eps, head);
      }
  });
}

void silu_and_mul(const float* gate_up, int64_t rows, int64_t width, float* out) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = gate_up + r * 2 * width;
      const float* up = gate + width;
      float* o = out + r * width;
      int64_t i = 0;
#if defined(TANDEM_AVX512) || defined(TANDEM_AVX2)
      for (; i + Vec::kWidth <= width; i += Vec::kWidth) {
        const Vec::Reg g = Vec::load(gate + i);
        Vec::store(o + i, Vec::mul(times_sigmoid(g, g), Vec::load(up + i)));
      }
#endif
      for (; i < width; ++i) o[i] = silu(gate[i]) * up[i];
    }
  });
}

void gelu_tanh_and_mul(const float* gate_up, int64_t rows, int64_t width, float* out) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = gate_up + r * 2 * width;
      const float* up = gate + width;
      float* o = out + r * width;
      int64_t i = 0;
#if defined(TANDEM_AVX512) || defined(TANDEM_AVX2)
      const Vec::Reg scale = Vec::set1(kGeluScale), cubic = Vec::set1(kGeluCubic), one = Vec::set1(1.0f);
      for (; i + Vec::kWidth <= width; i += Vec::kWidth) {
        const Vec::Reg g = Vec::load(gate + i);
        const Vec::Reg z = Vec::mul(scale, Vec::mul(g, Vec::fma(cubic, Vec::mul(g, g), one)));
        Vec::store(o + i, Vec::mul(times_sigmoid(g, z), Vec::load(up + i)));
      }
#endif
      for (; i < width; ++i) o[i] = gelu_tanh(gate[i]) * up[i];
    }
  });
}

void rope_and_store(const RopeStore& a, int64_t tokens) {
  const int64_t d = a.head_dim, half = d / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = a.cos + a.positions[t] * d;
      const float* sn = a.sin + a.positions[t] * d;
      auto rotate = [&](float* head) {
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = head[i], x2 = head[i + half];
          head[i] = x1 * c[i] - x2 * sn[i];
          head[i + half] = x2 * c[i + half] + x1 * sn[i + half];
        }
      };
      for (int64_t h = 0; h < a.num_q_heads; ++h) rotate(a.q + t * a.q_row_stride + h * d);
      for (int64_t h = 0; h < a.num_kv_heads; ++h) rotate(a.k + t * a.k_row_stride + h * d);
      const int64_t base = a.write_pages[t] * a.page_stride + a.write_offsets[t] * a.token_stride;
      for (int64_t h = 0; h < a.num_kv_heads; ++h) {
        const float* ks = a.k + t * a.k_row_stride + h * d;
        const float* vs = a.v + t * a.v_row_stride + h * d;
        const int64_t kd = base + h * d, vd = kd + a.kv_stride;
        if (a.cache_is_bf16) {
          uint16_t* dst = static_cast<uint16_t*>(a.cache);
          for (int64_t i = 0; i < d; ++i) {
            dst[kd + i] = to_bf16(ks[i]);
            dst[vd + i] = to_bf16(vs[i]);
          }
        } else {
          float* dst = static_cast<float*>(a.cache);
          std::memcpy(dst + kd, ks, d * sizeof(float));
          std::memcpy(dst + vd, vs, d * sizeof(float));
        }
      }
    }
  });
}

}  // namespace tandem
