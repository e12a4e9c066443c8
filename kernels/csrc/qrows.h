// Rounded activations for the quantized matmul (qmatmul.cpp): float rows -> int16 blocks of 32 with
// one float32 scale each, and the sums a tile needs besides the products.
#pragma once

#include "common.h"
#include "kernels.h"

#include <cmath>
#include <cstdint>
#include <limits>

namespace tandem {

// Rounded activations: q [m, k] int16, per row and block the scale d and d * sum(q), and per row and
// 16 inputs the integer sum of q (h [m, 2 * nb]: what a format's offset costs, see the AVX2 tiles).
struct QRows {
  const float* d;
  const float* s;
  const int16_t* q;
  const int32_t* h;
  int64_t k, nb;
};

namespace {

// One row: blocks of 32 floats -> int16 with scale amax / qmax, round half to even. A block holding
// a NaN or an infinity gets a NaN scale, so its row's outputs are NaN (as a float matmul's would
// be non-finite) instead of the value vanishing in the rounding.
inline void quantize_row(const float* x, int64_t k, int qmax, int16_t* q, float* d_out, float* s_out, int32_t* h_out) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    int16_t* qb = q + b * kBlock;
#ifdef TANDEM_AVX512
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    const bool has_nan = (_mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q)) != 0;
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float id = amax != 0.0f ? static_cast<float>(qmax) / amax : 0.0f;
    const __m512 mul = _mm512_set1_ps(id);
    const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, mul)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, mul));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), _mm512_cvtepi32_epi16(i0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + 16), _mm512_cvtepi32_epi16(i1));
    h_out[2 * b] = _mm512_reduce_add_epi32(i0);
    h_out[2 * b + 1] = _mm512_reduce_add_epi32(i1);
    const int sum = h_out[2 * b] + h_out[2 * b + 1];
#else
    bool has_nan = false;
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) {
      has_nan |= std::isnan(xb[i]);
      amax = std::fmax(amax, std::fabs(xb[i]));
    }
    const float id = amax != 0.0f ? static_cast<float>(qmax) / amax : 0.0f;
    int halves[2] = {0, 0};
    for (int i = 0; i < kBlock; ++i) {
      const int v = std::isnan(xb[i]) ? 0 : static_cast<int>(std::nearbyint(xb[i] * id));
      qb[i] = static_cast<int16_t>(v);
      halves[i / 16] += v;
    }
    h_out[2 * b] = halves[0];
    h_out[2 * b + 1] = halves[1];
    const int sum = halves[0] + halves[1];
#endif
    const bool is_finite = !has_nan && !std::isinf(amax);
    const float d = is_finite ? amax / static_cast<float>(qmax) : std::numeric_limits<float>::quiet_NaN();
    d_out[b] = d;
    s_out[b] = d * static_cast<float>(sum);
  }
}

}  // namespace
}  // namespace tandem
