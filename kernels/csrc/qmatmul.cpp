// Block-quantized matmul: float activations rounded to int16 blocks, packed weights of GGUF's block
// formats, exact integer dot products per block (AVX-512 VNNI's vpdpwssd; AVX2's vpmaddwd; on CPUs
// with AMX, calls of kAmxMinRows rows or more take its int8 tiles: qamx.cpp), float32 scaling.
//
// Why int16 activations: the products of 16-bit activations and 4- to 8-bit weights are exact in
// int32, twice as many per instruction as float32 FMAs, and an activation block keeps 1/65534 of its
// largest value as resolution, far finer than bf16's 1/512 per element (greedy agreement in
// docs/performance.md). qmax 127 gives llama.cpp's int8 rounding with the same kernel.
//
// Packed weights (built once at load by kernels/packing.py, whose docstring has the byte layout):
// output columns in panels of 16; for each panel and 32-input block, 16 columns' codes interleaved
// so that one 32-byte load expands to the operand of one vector instruction (8-bit: 16 chunks;
// otherwise 8 chunks of nibbles, then 2 or 4 rows of the bits above them for 5- or 6-bit codes, each
// row byte parallel to the chunks' bytes, so one load + widen + shift gives the same lanes' high
// bits), then the block's 16 scales (and offsets) as the file stores them; a K-quant's 8 blocks are
// followed by its float16 D (and -Dmin). A code's integer weight is q (Q8_0, Q4_x, Q5_1, Q4_K, Q5_K),
// q - 16 (Q5_0) or q - 32 (Q6_K), subtracted in int16 before the dot (AVX2's byte tile instead takes
// offset * sum(xq) off the integer sum: the same integer).
// Per (row, block): int32 s = sum w * xq (Q6_K: one per 16-element half), then
// acc = fma(float(s), dw * dx, acc) per sum, then (formats with offsets) acc = fma(mw, dx * sum(xq), acc),
// where dw is the block's float16 d or, for K-quants, float(sc) * D (exact), and mw the float16 m or
// float(mn) * -Dmin (exact). Every path does exactly these float operations per column, so AVX-512,
// AVX2 and scalar builds give the same bits.

#include "common.h"
#include "kernels.h"
#include "qamx.h"
#include "qlayout.h"
#include "qrows.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>

namespace tandem {
namespace {

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
template <QuantFormat F, int R>
void panel_tile(const uint8_t* panel, const QRows& x, int64_t r0, float* out, int64_t ldo, int64_t cols) {
  using L = Layout<F>;
  constexpr int kSplit = R >= 4 ? 1 : 4 / R;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi16(0x0F), offset = _mm512_set1_epi16(L::kOffset);
  const __m512i high_mask = _mm512_set1_epi16(((1 << L::kHighBits) - 1) << 4);
  for (int64_t b = 0; b < x.nb; ++b) {
    const uint8_t* blk = block_at<F>(panel, b);
    prefetch_ahead<F>(blk);
    __m512i isum[R][L::kSums * kSplit];
    for (int r = 0; r < R; ++r)
      for (int s = 0; s < L::kSums * kSplit; ++s) isum[r][s] = _mm512_setzero_si512();
    const int16_t* xq[R];
    for (int r = 0; r < R; ++r) xq[r] = x.q + (r0 + r) * x.k + b * kBlock;
    if constexpr (L::kInt8) {
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i) {
        const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * i)));
        for (int r = 0; r < R; ++r) {
          __m512i& s = isum[r][i % kSplit];
          s = _mm512_dpwssd_epi32(s, w, _mm512_set1_epi32(pair_at(xq[r] + 2 * i)));
        }
      }
    } else {
#pragma GCC unroll 4
      for (int row = 0; row < L::kHighRows; ++row) {
        [[maybe_unused]] __m512i high = _mm512_setzero_si512();
        if constexpr (L::kHighBits > 0)
          high = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 256 + 32 * row)));
#pragma GCC unroll 8
        for (int c = 0; c < 8 / L::kHighRows; ++c) {
          const int i = row * (8 / L::kHighRows) + c;
          const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * i)));
          __m512i wa = _mm512_and_si512(v, low4), wb = _mm512_srli_epi16(v, 4);
          if constexpr (L::kHighBits > 0) {
            wa = _mm512_or_si512(wa, _mm512_and_si512(_mm512_slli_epi16(high, 4), high_mask));
            wb = _mm512_or_si512(wb, _mm512_and_si512(_mm512_slli_epi16(high, 4 - L::kHighBits), high_mask));
            high = _mm512_srli_epi16(high, 2 * L::kHighBits);
          }
          if constexpr (L::kOffset > 0) {
            wa = _mm512_sub_epi16(wa, offset);
            wb = _mm512_sub_epi16(wb, offset);
          }
          for (int r = 0; r < R; ++r) {
            __m512i& s = isum[r][i * L::kSums / 8 * kSplit + i % kSplit];
            s = _mm512_dpwssd_epi32(s, wa, _mm512_set1_epi32(pair_at(xq[r] + 4 * i)));
            s = _mm512_dpwssd_epi32(s, wb, _mm512_set1_epi32(pair_at(xq[r] + 4 * i + 2)));
          }
        }
      }
    }
    const Scales<F> w = block_scales<F>(blk + value_bytes(F), tail_at<F>(panel, b));
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * x.nb + b;
      for (int h = 0; h < L::kSums; ++h) {
        __m512i total = isum[r][h * kSplit];
        for (int s = 1; s < kSplit; ++s) total = _mm512_add_epi32(total, isum[r][h * kSplit + s]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(w.d[h], _mm512_set1_ps(x.d[at])), acc[r]);
      }
      if constexpr (L::kHasMins) acc[r] = _mm512_fmadd_ps(w.m, _mm512_set1_ps(x.s[at]), acc[r]);
    }
  }
  const __mmask16 mask = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + (r0 + r) * ldo, mask, acc[r]);
}
constexpr int kRowTile = 8;

#elif defined(TANDEM_AVX2)
constexpr int kBytesTileRows = 2;   // rows up to which codes with high bits take the byte-domain tile
inline __m256 halves8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m128i load8(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
inline __m256i widen16(const uint8_t* p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// The 8 columns' (half `half` of the panel) weight scales of a block (Q6_K: one per half) and offsets.
template <QuantFormat F>
struct Scales {
  __m256 d[Layout<F>::kSums];
  __m256 m;
};
template <QuantFormat F>
inline Scales<F> block_scales(const uint8_t* s, const uint8_t* tail, int half) {
  Scales<F> w{};
  if constexpr (F == QuantFormat::kQ6_K) {
    const __m256 dd = halves8(tail + 16 * half);
    for (int h = 0; h < 2; ++h)
      w.d[h] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load8(s + 16 * h + 8 * half))), dd);
  } else if constexpr (is_k_quant(F)) {
    w.d[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(load8(s + 8 * half))), halves8(tail + 16 * half));
    w.m = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(load8(s + 16 + 8 * half))),
                        halves8(tail + 32 + 16 * half));
  } else {
    w.d[0] = halves8(s + 16 * half);
    if constexpr (Layout<F>::kHasMins) w.m = halves8(s + 32 + 16 * half);
  }
  return w;
}

// One or two rows x one panel, for codes with bits above the nibble (Q5_x, Q6_K): a chunk's 32 bytes
// (both halves of the panel) are put together in bytes, then widened by interleaving with zero, so
// the integer lanes hold columns 0-3 and 8-11 (group 0) or 4-7 and 12-15 (group 1); the sums are put
// back in column order before the float part, which is the two-halves tile's. A format's offset is
// taken off the sums (offset * the 16 activations' sum) instead of off every weight: the same integers.
template <QuantFormat F, int R>
void panel_tile_bytes(const uint8_t* panel, const QRows& x, int64_t r0, float* out, int64_t ldo, int64_t cols) {
  using L = Layout<F>;
  constexpr int kChunks = 8 / L::kSums;   // chunks (4 inputs each) per integer sum
  const __m256i low4 = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
  const __m256i high_mask = _mm256_set1_epi8(static_cast<char>(((1 << L::kHighBits) - 1) << 4));
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.nb; ++b) {
    const uint8_t* blk = block_at<F>(panel, b);
    prefetch_ahead<F>(blk);
    const Scales<F> w[2] = {block_scales<F>(blk + value_bytes(F), tail_at<F>(panel, b), 0),
                            block_scales<F>(blk + value_bytes(F), tail_at<F>(panel, b), 1)};
    const int16_t* xq[R];
    for (int r = 0; r < R; ++r) xq[r] = x.q + (r0 + r) * x.k + b * kBlock;
#pragma GCC unroll 2
    for (int h = 0; h < L::kSums; ++h) {
      __m256i isum[R][2];
      for (int r = 0; r < R; ++r) isum[r][0] = isum[r][1] = zero;
#pragma GCC unroll 8
      for (int c = 0; c < kChunks; ++c) {
        const int i = h * kChunks + c;
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * i));
        const __m256i high = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(blk + 256 + 32 * (L::kHighBits * 2 * i / 8)));
        const __m256i wa = _mm256_or_si256(_mm256_and_si256(v, low4), high_field<F>(high, i, 0, high_mask));
        const __m256i wb = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4),
                                           high_field<F>(high, i, 1, high_mask));
        const __m256i a0 = _mm256_unpacklo_epi8(wa, zero), a1 = _mm256_unpackhi_epi8(wa, zero);
        const __m256i b0 = _mm256_unpacklo_epi8(wb, zero), b1 = _mm256_unpackhi_epi8(wb, zero);
        for (int r = 0; r < R; ++r) {
          const __m256i xa = _mm256_set1_epi32(pair_at(xq[r] + 4 * i)), xb = _mm256_set1_epi32(pair_at(xq[r] + 4 * i + 2));
          isum[r][0] = _mm256_add_epi32(isum[r][0], _mm256_add_epi32(_mm256_madd_epi16(a0, xa), _mm256_madd_epi16(b0, xb)));
          isum[r][1] = _mm256_add_epi32(isum[r][1], _mm256_add_epi32(_mm256_madd_epi16(a1, xa), _mm256_madd_epi16(b1, xb)));
        }
      }
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * x.nb + b;
        if constexpr (L::kOffset > 0) {
          const int32_t* hx = x.h + 2 * at;
          const int32_t taken = L::kSums == 2 ? hx[h] : hx[0] + hx[1];
          const __m256i off = _mm256_set1_epi32(L::kOffset * taken);
          isum[r][0] = _mm256_sub_epi32(isum[r][0], off);
          isum[r][1] = _mm256_sub_epi32(isum[r][1], off);
        }
        const __m256 dx = _mm256_set1_ps(x.d[at]);
        const __m256i half0 = _mm256_permute2x128_si256(isum[r][0], isum[r][1], 0x20);
        const __m256i half1 = _mm256_permute2x128_si256(isum[r][0], isum[r][1], 0x31);
        acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(half0), _mm256_mul_ps(w[0].d[h], dx), acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(half1), _mm256_mul_ps(w[1].d[h], dx), acc[r][1]);
      }
    }
    if constexpr (L::kHasMins) {
      for (int r = 0; r < R; ++r) {
        const __m256 sx = _mm256_set1_ps(x.s[(r0 + r) * x.nb + b]);
        acc[r][0] = _mm256_fmadd_ps(w[0].m, sx, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(w[1].m, sx, acc[r][1]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(32) float lanes[16];
    _mm256_store_ps(lanes, acc[r][0]);
    _mm256_store_ps(lanes + 8, acc[r][1]);
    for (int64_t j = 0; j < cols; ++j) out[(r0 + r) * ldo + j] = lanes[j];
  }
}

// R rows x one panel, as two halves of 8 columns (16 ymm registers hold no more).
template <QuantFormat F, int R>
void panel_tile(const uint8_t* panel, const QRows& x, int64_t r0, float* out, int64_t ldo, int64_t cols) {
  using L = Layout<F>;
  if constexpr (L::kHighBits > 0 && R <= kBytesTileRows) {
    panel_tile_bytes<F, R>(panel, x, r0, out, ldo, cols);
    return;
  }
  const __m256i low4 = _mm256_set1_epi16(0x0F), offset = _mm256_set1_epi16(L::kOffset);
  const __m256i high_mask = _mm256_set1_epi16(((1 << L::kHighBits) - 1) << 4);
  for (int half = 0; half < 2; ++half) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < x.nb; ++b) {
      const uint8_t* blk = block_at<F>(panel, b);
      if (half == 0) prefetch_ahead<F>(blk);
      __m256i isum[R][L::kSums];
      for (int r = 0; r < R; ++r)
        for (int s = 0; s < L::kSums; ++s) isum[r][s] = _mm256_setzero_si256();
      const int16_t* xq[R];
      for (int r = 0; r < R; ++r) xq[r] = x.q + (r0 + r) * x.k + b * kBlock;
      if constexpr (L::kInt8) {
        for (int i = 0; i < 16; ++i) {
          const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 * i + 16 * half)));
          for (int r = 0; r < R; ++r)
            isum[r][0] = _mm256_add_epi32(isum[r][0], _mm256_madd_epi16(w, _mm256_set1_epi32(pair_at(xq[r] + 2 * i))));
        }
      } else {
        for (int row = 0; row < L::kHighRows; ++row) {
          [[maybe_unused]] __m256i high = _mm256_setzero_si256();
          if constexpr (L::kHighBits > 0) high = widen16(blk + 256 + 32 * row + 16 * half);
          for (int c = 0; c < 8 / L::kHighRows; ++c) {
            const int i = row * (8 / L::kHighRows) + c;
            const __m256i v = widen16(blk + 32 * i + 16 * half);
            __m256i wa = _mm256_and_si256(v, low4), wb = _mm256_srli_epi16(v, 4);
            if constexpr (L::kHighBits > 0) {
              wa = _mm256_or_si256(wa, _mm256_and_si256(_mm256_slli_epi16(high, 4), high_mask));
              wb = _mm256_or_si256(wb, _mm256_and_si256(_mm256_slli_epi16(high, 4 - L::kHighBits), high_mask));
              high = _mm256_srli_epi16(high, 2 * L::kHighBits);
            }
            if constexpr (L::kOffset > 0) {
              wa = _mm256_sub_epi16(wa, offset);
              wb = _mm256_sub_epi16(wb, offset);
            }
            for (int r = 0; r < R; ++r) {
              __m256i& s = isum[r][i * L::kSums / 8];
              s = _mm256_add_epi32(s, _mm256_madd_epi16(wa, _mm256_set1_epi32(pair_at(xq[r] + 4 * i))));
              s = _mm256_add_epi32(s, _mm256_madd_epi16(wb, _mm256_set1_epi32(pair_at(xq[r] + 4 * i + 2))));
            }
          }
        }
      }
      const Scales<F> w = block_scales<F>(blk + value_bytes(F), tail_at<F>(panel, b), half);
      for (int r = 0; r < R; ++r) {
        const int64_t at = (r0 + r) * x.nb + b;
        for (int h = 0; h < L::kSums; ++h)
          acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][h]), _mm256_mul_ps(w.d[h], _mm256_set1_ps(x.d[at])), acc[r]);
        if constexpr (L::kHasMins) acc[r] = _mm256_fmadd_ps(w.m, _mm256_set1_ps(x.s[at]), acc[r]);
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
// Portable: the same integer sums and float operations, one column at a time, read from the layout's
// definition (kernels/packing.py) rather than from the vector paths' shifts.
template <QuantFormat F>
inline int weight_at(const uint8_t* blk, int64_t j, int k) {
  using L = Layout<F>;
  if constexpr (L::kInt8) return static_cast<int8_t>(blk[32 * (k / 2) + 2 * j + k % 2]);
  const int i = k / 4, u = k % 4 / 2, t = k % 2;
  int q = (blk[32 * i + 2 * j + t] >> (4 * u)) & 0x0F;
  if constexpr (L::kHighBits > 0) {
    const int position = L::kHighBits * (2 * i + u);
    q |= ((blk[256 + 32 * (position / 8) + 2 * j + t] >> (position % 8)) & ((1 << L::kHighBits) - 1)) << 4;
  }
  return q - L::kOffset;
}

// Column j's weight scale of half h of a block (one half but for Q6_K), and its offset.
template <QuantFormat F>
inline float weight_scale(const uint8_t* s, const uint8_t* tail, int64_t j, int h) {
  if constexpr (F == QuantFormat::kQ6_K) return static_cast<float>(static_cast<int8_t>(s[16 * h + j])) * half_at(tail + 2 * j);
  else if constexpr (is_k_quant(F)) return static_cast<float>(s[j]) * half_at(tail + 2 * j);
  else return half_at(s + 2 * j);
}
template <QuantFormat F>
inline float weight_min(const uint8_t* s, const uint8_t* tail, int64_t j) {
  if constexpr (is_k_quant(F)) return static_cast<float>(s[16 + j]) * half_at(tail + 32 + 2 * j);
  else return half_at(s + 32 + 2 * j);
}

template <QuantFormat F, int R>
void panel_tile(const uint8_t* panel, const QRows& x, int64_t r0, float* out, int64_t ldo, int64_t cols) {
  using L = Layout<F>;
  for (int r = 0; r < R; ++r) {
    for (int64_t j = 0; j < cols; ++j) {
      float acc = 0.0f;
      for (int64_t b = 0; b < x.nb; ++b) {
        const uint8_t* blk = block_at<F>(panel, b);
        const uint8_t* scales = blk + value_bytes(F);
        const int16_t* xq = x.q + (r0 + r) * x.k + b * kBlock;
        int32_t isum[L::kSums] = {};
        for (int k = 0; k < kBlock; ++k) isum[k * L::kSums / kBlock] += weight_at<F>(blk, j, k) * xq[k];
        const int64_t at = (r0 + r) * x.nb + b;
        for (int h = 0; h < L::kSums; ++h)
          acc = std::fma(static_cast<float>(isum[h]), weight_scale<F>(scales, tail_at<F>(panel, b), j, h) * x.d[at], acc);
        if constexpr (L::kHasMins) acc = std::fma(weight_min<F>(scales, tail_at<F>(panel, b), j), x.s[at], acc);
      }
      out[(r0 + r) * ldo + j] = acc;
    }
  }
}
constexpr int kRowTile = 4;
#endif

template <QuantFormat F, int R>
void tail_tile(int rows, const uint8_t* panel, const QRows& x, int64_t r0, float* out, int64_t ldo, int64_t cols) {
  if constexpr (R > 0) {
    if (rows == R) panel_tile<F, R>(panel, x, r0, out, ldo, cols);
    else tail_tile<F, R - 1>(rows, panel, x, r0, out, ldo, cols);
  }
}

// Every row of x times one panel of format F.
template <QuantFormat F>
void panel_rows(const uint8_t* panel, const QRows& x, int64_t m, float* out, int64_t ldo, int64_t cols) {
  int64_t r = 0;
  for (; r + kRowTile <= m; r += kRowTile) panel_tile<F, kRowTile>(panel, x, r, out, ldo, cols);
  if (r < m) tail_tile<F, kRowTile - 1>(static_cast<int>(m - r), panel, x, r, out, ldo, cols);
}

using PanelRows = void (*)(const uint8_t*, const QRows&, int64_t, float*, int64_t, int64_t);
template <int... I>
constexpr std::array<PanelRows, kNumFormats> panel_rows_by_format(std::integer_sequence<int, I...>) {
  return {&panel_rows<static_cast<QuantFormat>(I)>...};
}
constexpr std::array<PanelRows, kNumFormats> kPanelRows = panel_rows_by_format(std::make_integer_sequence<int, kNumFormats>{});

}  // namespace

void qmatmul(const float* x, int64_t m, const PackedMatrix& w, int qmax, float* out) {
  const int64_t k = w.k, nb = k / kBlock;
  // Many rows on a CPU with AMX: tiles of 16 rows, the rows past m rounded as zeros (qamx.h).
  const bool on_tiles = m >= kAmxMinRows && amx_ready();
  const int64_t rows = on_tiles ? (m + kAmxRows - 1) / kAmxRows * kAmxRows : m;
  const auto q = scratch<int16_t>(rows * k);
  const auto d = scratch<float>(rows * nb), s = scratch<float>(rows * nb);
  const auto h = scratch<int32_t>(rows * 2 * nb);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      if (r < m) {
        quantize_row(x + r * k, k, qmax, q.get() + r * k, &d[r * nb], &s[r * nb], &h[r * 2 * nb]);
      } else {   // a tile's rows past m: zeros
        std::fill_n(q.get() + r * k, k, int16_t{0});
        std::fill_n(&d[r * nb], nb, 0.0f);
        std::fill_n(&s[r * nb], nb, 0.0f);
      }
    }
  });
  const QRows qrows{d.get(), s.get(), q.get(), h.get(), k, nb};
  std::unique_ptr<int8_t[]> hi;
  std::unique_ptr<uint8_t[]> lo;
  std::unique_ptr<float[]> tile_d, tile_s;
  if (on_tiles) {
    hi = scratch<int8_t>(rows * k), lo = scratch<uint8_t>(rows * k);
    tile_d = scratch<float>(rows * nb), tile_s = scratch<float>(rows * nb);
    tile_rows(qrows, rows, hi.get(), lo.get(), tile_d.get(), tile_s.get());
  }
  const QBytes tiles{hi.get(), lo.get(), tile_d.get(), tile_s.get()};
  int64_t panels = 0;
  for (int64_t i = 0; i < w.num_segments; ++i) panels += (w.segments[i].n + kPanel - 1) / kPanel;
  // Panels outer (every segment's, in one range the threads split): one panel's weights stay in L1
  // while every row tile passes over them.
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    const auto unpacked = on_tiles ? scratch<int8_t>(amx_scratch_bytes(k)) : nullptr;
    for (int64_t p = begin; p < end; ++p) {
      const PackedSegment* segment = w.segments;
      int64_t first = 0, col = 0;
      for (;; ++segment) {
        const int64_t count = (segment->n + kPanel - 1) / kPanel;
        if (p < first + count) break;
        first += count;
        col += segment->n;
      }
      const int64_t local = p - first;
      const uint8_t* panel = segment->data + local * panel_bytes(segment->format, k);
      const int64_t cols = std::min<int64_t>(kPanel, segment->n - local * kPanel);
      float* dst = out + col + local * kPanel;
      if (on_tiles) amx_panel_rows(segment->format, panel, qrows, tiles, m, dst, w.n, cols, unpacked.get());
      else kPanelRows[static_cast<int>(segment->format)](panel, qrows, m, dst, w.n, cols);
    }
    if (on_tiles) amx_release();
  });
}

}  // namespace tandem
