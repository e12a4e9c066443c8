// Float vectors of the width the build targets (16 lanes on AVX-512, 8 on AVX2), behind one
// interface, so that the attention, elementwise and LoRA kernels are written once for both. Only what they need.
#pragma once

#include "common.h"

#include <cstring>

namespace tandem {

#if defined(TANDEM_AVX512)
struct Vec {
  using Reg = __m512;
  static constexpr int kWidth = 16;
  static Reg zero() { return _mm512_setzero_ps(); }
  static Reg set1(float v) { return _mm512_set1_ps(v); }
  static Reg load(const float* p) { return _mm512_loadu_ps(p); }
  static Reg load(const uint16_t* p) {   // bfloat16 bits -> float32
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  // the first n floats at p (all kWidth when n >= kWidth), zeros after; reads nothing past them
  static Reg load_first(const float* p, int64_t n) {
    return n >= kWidth ? load(p) : _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
  }
  static void store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  static Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static Reg sub(Reg a, Reg b) { return _mm512_sub_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static Reg fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static Reg max(Reg a, Reg b) { return _mm512_max_ps(a, b); }
  static float reduce_add(Reg v) { return _mm512_reduce_add_ps(v); }
  static float reduce_max(Reg v) { return _mm512_reduce_max_ps(v); }
  // lane l of the result = the sum of v[l]'s lanes, for kWidth vectors (a transpose-add tree)
  static Reg sum_each(Reg* v) {
    Reg a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i)
      a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
      const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
      b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; ++i)
      c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  }
  // exp(x) for x <= 0 (scores minus their max), Cephes-style 2^n * p(r); below -87 (and -inf) it is 0
  static Reg exp_nonpositive(Reg x) {
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const Reg n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    Reg r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    Reg p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i pow2 = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(static_cast<__mmask16>(~tiny), p, _mm512_castsi512_ps(pow2));
  }
  static Reg div(Reg a, Reg b) { return _mm512_div_ps(a, b); }
  static Reg abs(Reg a) { return _mm512_abs_ps(a); }
  static Reg select_nonnegative(Reg x, Reg if_nonnegative, Reg otherwise) {   // x >= 0 ? a : b, per lane
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), otherwise, if_nonnegative);
  }
};
#elif defined(TANDEM_AVX2)
struct Vec {
  using Reg = __m256;
  static constexpr int kWidth = 8;
  static Reg zero() { return _mm256_setzero_ps(); }
  static Reg set1(float v) { return _mm256_set1_ps(v); }
  static Reg load(const float* p) { return _mm256_loadu_ps(p); }
  static Reg load(const uint16_t* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  static Reg load_first(const float* p, int64_t n) {
    if (n >= kWidth) return load(p);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lanes));
  }
  static void store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  static Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static Reg sub(Reg a, Reg b) { return _mm256_sub_ps(a, b); }
  static Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static Reg fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static Reg max(Reg a, Reg b) { return _mm256_max_ps(a, b); }
  static float reduce_add(Reg v) { return hsum(v); }
  static float reduce_max(Reg v) {
    __m128 r = _mm_max_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    r = _mm_max_ps(r, _mm_movehl_ps(r, r));
    r = _mm_max_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
  }
  static Reg sum_each(Reg* v) {
    Reg a[4], b[2];
    for (int i = 0; i < 4; ++i)
      a[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; ++i) {
      const __m256d x = _mm256_castps_pd(a[2 * i]), y = _mm256_castps_pd(a[2 * i + 1]);
      b[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(b[0], b[1], 0x20), _mm256_permute2f128_ps(b[0], b[1], 0x31));
  }
  static Reg exp_nonpositive(Reg x) {
    const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const Reg n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
    Reg r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    Reg p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(pow2)));
  }
  static Reg div(Reg a, Reg b) { return _mm256_div_ps(a, b); }
  static Reg abs(Reg a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
  static Reg select_nonnegative(Reg x, Reg if_nonnegative, Reg otherwise) {
    return _mm256_blendv_ps(otherwise, if_nonnegative, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
  }
};
#endif

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace tandem
