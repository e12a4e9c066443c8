// Block-quantized matmul: float activations rounded to int16 blocks, packed 4- or 8-bit weights,
// exact integer dot products per block (AVX-512 VNNI's vpdpwssd; AVX2's vpmaddwd), float32 scaling.
//
// Why int16 activations: the products of 16-bit activations and 4/8-bit weights are exact in int32,
// twice as many per instruction as float32 FMAs, and an activation block keeps 1/65534 of its
// largest value as resolution, far finer than bf16's 1/512 per element (greedy agreement in
// docs/performance.md). qmax 127 gives llama.cpp's int8 rounding with the same kernel.
//
// Packed weights (built once at load by kernels/packing.py): output columns in panels of 16; for
// each panel and 32-input block, 16 columns' values interleaved so that one 32-byte load expands to
// the operand of one vector instruction, then the 16 scales and (4-bit) the 16 offsets, float16:
//   4-bit: 8 chunks of 32 bytes; chunk i byte 2j+t = q[j][4i+t] | q[j][4i+2+t] << 4  (column j, t < 2)
//   8-bit: 16 chunks of 32 bytes; chunk i byte 2j+t = q[j][2i+t] (int8)
// A 4-bit weight is d * q + m (Q4_0 is packed with m = -8 d); an 8-bit weight d * q.
// Per (row, block): int32 s = sum q * xq, then acc = fma(float(s), d * dx, acc), then (4-bit)
// acc = fma(m, dx * sum(xq), acc). Every path does exactly these float operations per column, so
// AVX-512, AVX2 and scalar builds give the same bits.

#include "common.h"
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace tandem {
namespace {

// Rounded activations: q [m, k] int16, and per row and block the scale d and d * sum(q).
struct QRows {
  const int16_t* q;
  const float* d;
  const float* s;
  int64_t k, nb;
};

// One row: blocks of 32 floats -> int16 with scale amax / qmax, round half to even. A block holding
// a NaN or an infinity gets a NaN scale, so its row's outputs are NaN (as a float matmul's would
// be non-finite) instead of the value vanishing in the rounding.
void quantize_row(const float* x, int64_t k, int qmax, int16_t* q, float* d_out, float* s_out) {
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
    const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
#else
    bool has_nan = false;
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) {
      has_nan |= std::isnan(xb[i]);
      amax = std::fmax(amax, std::fabs(xb[i]));
    }
    const float id = amax != 0.0f ? static_cast<float>(qmax) / amax : 0.0f;
    int sum = 0;
    for (int i = 0; i < kBlock; ++i) {
      const int v = std::isnan(xb[i]) ? 0 : static_cast<int>(std::nearbyint(xb[i] * id));
      qb[i] = static_cast<int16_t>(v);
      sum += v;
    }
#endif
    const bool is_finite = !has_nan && !std::isinf(amax);
    const float d = is_finite ? amax / static_cast<float>(qmax) : std::numeric_limits<float>::quiet_NaN();
    d_out[b] = d;
    s_out[b] = d * static_cast<float>(sum);
  }
}

inline int32_t pair_at(const int16_t* p) {   // two int16 as one int32 (the operand vpdpwssd broadcasts)
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The float16 at p, widened exactly (the vector paths' vcvtph2ps, in portable code).
inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const int exponent = (h >> 10) & 0x1F;
  const uint32_t mantissa = h & 0x3FF;
  float magnitude;
  if (exponent == 0) magnitude = std::ldexp(static_cast<float>(mantissa), -24);   // zero and subnormals
  else if (exponent == 31) magnitude = mantissa ? std::numeric_limits<float>::quiet_NaN() : INFINITY;
  else magnitude = std::ldexp(static_cast<float>(mantissa | 0x400), exponent - 25);
  uint32_t bits;
  std::memcpy(&bits, &magnitude, sizeof bits);
  bits |= sign;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

#ifdef TANDEM_AVX512
// R rows x one panel (16 columns). Integer sums use `kSplit` partial accumulators per row so that a
// short tile is not bound by vpdpwssd's latency; integer addition is exact, so any split gives the
// same sums.
template <int Bits, int R>
void panel_tile(const uint8_t* panel, const QRows& x, int64_t r0, float* out, int64_t ldo, int64_t cols) {
  constexpr int kSplit = R >= 4 ? 1 : 4 / R;
  constexpr int64_t kQBytes = Bits == 8 ? 512 : 256;
  constexpr int64_t kStride = panel_block_bytes(Bits);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi16(0x0F);
  for (int64_t b = 0; b < x.nb; ++b) {
    const uint8_t* blk = panel + b * kStride;
    __m512i isum[R][kSplit];
    for (int r = 0; r < R; ++r)
      for (int s = 0; s < kSplit; ++s) isum[r][s] = _mm512_setzero_si512();
    const int16_t* xq[R];
    for (int r = 0; r < R; ++r) xq[r] = x.q + (r0 + r) * x.k + b * kBlock;
    if constexpr (Bits == 4) {
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) {
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * i)));
        const __m512i wa = _mm512_and_si512(v, low4), wb = _mm512_srli_epi16(v, 4);
        for (int r = 0; r < R; ++r) {
          __m512i& s = isum[r][i % kSplit];
          s = _mm512_dpwssd_epi32(s, wa, _mm512_set1_epi32(pair_at(xq[r] + 4 * i)));
          s = _mm512_dpwssd_epi32(s, wb, _mm512_set1_epi32(pair_at(xq[r] + 4 * i + 2)));
        }
      }
    } else {
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * i)));
        for (int r = 0; r < R; ++r) {
          __m512i& s = isum[r][i % kSplit];
          s = _mm512_dpwssd_epi32(s, w, _mm512_set1_epi32(pair_at(xq[r] + 2 * i)));
        }
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kQBytes)));
    for (int r = 0; r < R; ++r) {
      __m512i total = isum[r][0];
      for (int s = 1; s < kSplit; ++s) total = _mm512_add_epi32(total, isum[r][s]);
      const int64_t at = (r0 + r) * x.nb + b;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(dw, _mm512_set1_ps(x.d[at])), acc[r]);
      if constexpr (Bits == 4) {
        const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kQBytes + 32)));
        acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.s[at]), acc[r]);
      }
    }
  }
  const __mmask16 mask = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + (r0 + r) * ldo, mask, acc[r]);
}
constexpr int kRowTile = 8;

#elif defined(TANDEM_AVX2)
// R rows x one panel, as two halves of 8 columns (16 ymm registers hold no more).
template <int Bits, int R>
void panel_tile(const uint8_t* panel, const QRows& x, int64_t r0, float* out, int64_t ldo, int64_t cols) {
  constexpr int64_t kQBytes = Bits == 8 ? 512 : 256;
  constexpr int64_t kStride = panel_block_bytes(Bits);
  const __m256i low4 = _mm256_set1_epi16(0x0F);
  for (int half = 0; half < 2; ++half) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < x.nb; ++b) {
      const uint8_t* blk = panel + b * kStride;
      __m256i isum[R];
      for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
      const int16_t* xq[R];
      for (int r = 0; r < R; ++r) xq[r] = x.q + (r0 + r) * x.k + b * kBlock;
      if constexpr (Bits == 4) {
        for (int i = 0; i < 8; ++i) {
          const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 * i + 16 * half));
          const __m256i v = _mm256_cvtepu8_epi16(raw);
          const __m256i wa = _mm256_and_si256(v, low4), wb = _mm256_srli_epi16(v, 4);
          for (int r = 0; r < R; ++r) {
            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(wa, _mm256_set1_epi32(pair_at(xq[r] + 4 * i))));
            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(wb, _mm256_set1_epi32(pair_at(xq[r] + 4 * i + 2))));
          }
        }
      } else {
        for (int i = 0; i < 16; ++i) {
          const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 * i + 16 * half));
          const __m256i w = _mm256_cvtepi8_epi16(raw);
          for (int r = 0; r < R; ++r)
            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(w, _mm256_set1_epi32(pair_at(xq[r] + 2 * i))));
        }
      }
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kQBytes + 16 * half)));
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * x.nb + b;
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(dw, _mm256_set1_ps(x.d[at])), acc[r]);
        if constexpr (Bits == 4) {
          const __m256 mw =
              _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kQBytes + 32 + 16 * half)));
          acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.s[at]), acc[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc[r]);
      for (int64_t j = 0; j < 8 && 8 * half + j < cols; ++j) out[(r0 + r) * ldo + 8 * half + j] = lanes[j];
    }
  }
}
constexpr int kRowTile = 4;

#else
// Portable: the same integer sums and float operations, one column at a time.
template <int Bits, int R>
void panel_tile(const uint8_t* panel, const QRows& x, int64_t r0, float* out, int64_t ldo, int64_t cols) {
  constexpr int64_t kQBytes = Bits == 8 ? 512 : 256;
  constexpr int64_t kStride = panel_block_bytes(Bits);
  for (int r = 0; r < R; ++r) {
    for (int64_t j = 0; j < cols; ++j) {
      float acc = 0.0f;
      for (int64_t b = 0; b < x.nb; ++b) {
        const uint8_t* blk = panel + b * kStride;
        const int16_t* xq = x.q + (r0 + r) * x.k + b * kBlock;
        int32_t isum = 0;
        for (int k = 0; k < kBlock; ++k) {
          int w;
          if (Bits == 8) w = static_cast<int8_t>(blk[32 * (k / 2) + 2 * j + k % 2]);
          else w = (blk[32 * (k / 4) + 2 * j + k % 2] >> (k % 4 >= 2 ? 4 : 0)) & 0x0F;
          isum += w * xq[k];
        }
        const float dw = half_at(blk + kQBytes + 2 * j);
        const int64_t at = (r0 + r) * x.nb + b;
        acc = std::fma(static_cast<float>(isum), dw * x.d[at], acc);
        if (Bits == 4) acc = std::fma(half_at(blk + kQBytes + 32 + 2 * j), x.s[at], acc);
      }
      out[(r0 + r) * ldo + j] = acc;
    }
  }
}
constexpr int kRowTile = 4;
#endif

template <int Bits, int R>
void tail_tile(int rows, const uint8_t* panel, const QRows& x, int64_t r0, float* out, int64_t ldo, int64_t cols) {
  if constexpr (R > 0) {
    if (rows == R) panel_tile<Bits, R>(panel, x, r0, out, ldo, cols);
    else tail_tile<Bits, R - 1>(rows, panel, x, r0, out, ldo, cols);
  }
}

template <int Bits>
void qmatmul_panels(const QRows& x, int64_t m, const uint8_t* packed, int64_t n, float* out) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t panel_bytes = x.nb * panel_block_bytes(Bits);
  // Panels outer: one panel's weights stay in L1 while every row tile passes over them.
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* panel = packed + p * panel_bytes;
      const int64_t cols = std::min<int64_t>(kPanel, n - p * kPanel);
      float* o = out + p * kPanel;
      int64_t r = 0;
      for (; r + kRowTile <= m; r += kRowTile) panel_tile<Bits, kRowTile>(panel, x, r, o, n, cols);
      if (r < m) tail_tile<Bits, kRowTile - 1>(static_cast<int>(m - r), panel, x, r, o, n, cols);
    }
  });
}

}  // namespace

void qmatmul(const float* x, int64_t m, int64_t k, const uint8_t* packed, int64_t n, int bits, int qmax, float* out) {
  const int64_t nb = k / kBlock;
  const auto q = scratch<int16_t>(m * k);
  const auto d = scratch<float>(m * nb), s = scratch<float>(m * nb);
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(x + r * k, k, qmax, q.get() + r * k, &d[r * nb], &s[r * nb]);
  });
  const QRows rows{q.get(), d.get(), s.get(), k, nb};
  if (bits == 8) qmatmul_panels<8>(rows, m, packed, n, out);
  else qmatmul_panels<4>(rows, m, packed, n, out);
}

}  // namespace tandem
