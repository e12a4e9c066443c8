// How the matmul reads a panel of packed weights (kernels/packing.py writes them): each format's
// layout and arithmetic at compile time, a block's place in a panel, and the vector helpers that
// both the vector tiles (qmatmul.cpp) and the AMX tiles (qamx.cpp) read the layout with.
#pragma once

#include "common.h"
#include "kernels.h"

#include <cstdint>

namespace tandem {
namespace {

// A format's layout and arithmetic, at compile time (kernels.h has the byte sizes).
template <QuantFormat F>
struct Layout {
  static constexpr bool kInt8 = F == QuantFormat::kQ8_0;
  static constexpr int kHighBits = high_bits(F);
  static constexpr int kHighRows = kHighBits ? 2 * kHighBits : 1;   // chunk i's high bits: row i / (8 / kHighRows)
  static constexpr int kOffset = F == QuantFormat::kQ5_0 ? 16 : F == QuantFormat::kQ6_K ? 32 : 0;
  static constexpr bool kHasMins = F == QuantFormat::kQ4_0 || F == QuantFormat::kQ4_1 || F == QuantFormat::kQ5_1 ||
                                   F == QuantFormat::kQ4_K || F == QuantFormat::kQ5_K;
  static constexpr int kSums = F == QuantFormat::kQ6_K ? 2 : 1;   // integer sums per block (Q6_K: per 16)
  static constexpr int64_t kBlockBytes = value_bytes(F) + scale_bytes(F);
};

// Block b of a panel, and the D (and -Dmin) of its group (K-quants).
template <QuantFormat F>
inline const uint8_t* block_at(const uint8_t* panel, int64_t b) {
  return panel + b / group_blocks(F) * group_bytes(F) + b % group_blocks(F) * Layout<F>::kBlockBytes;
}
template <QuantFormat F>
inline const uint8_t* tail_at(const uint8_t* panel, int64_t b) {
  return panel + b / group_blocks(F) * group_bytes(F) + group_blocks(F) * Layout<F>::kBlockBytes;
}

#if defined(TANDEM_AVX512) || defined(TANDEM_AVX2)
// The weights a tile reads 4 KiB after block `blk` (later blocks, then the next panels: a matmul reads
// its segment front to back), asked for now. At one or two rows a tile does little work per byte, and
// the hardware's prefetcher alone kept one core at about half its memory rate (docs/performance.md).
constexpr int64_t kPrefetchBytes = 4096;
template <QuantFormat F>
inline void prefetch_ahead(const uint8_t* blk) {
  for (int64_t o = 0; o < Layout<F>::kBlockBytes; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchBytes + o), _MM_HINT_T0);
}
#endif

#ifdef TANDEM_AVX2
// The bits above chunk i's nibbles (u = 0: the low nibbles, 1: the high), moved to bits 4 and up of
// each byte of `high` (the chunk's row of high bits), the others cleared.
template <QuantFormat F>
inline __m256i high_field(__m256i high, int i, int u, __m256i mask) {
  constexpr int kBits = Layout<F>::kHighBits;
  const int at = kBits * (2 * i + u) % 8;
  if (at < 4) high = _mm256_slli_epi16(high, 4 - at);
  else if (at > 4) high = _mm256_srli_epi16(high, at - 4);
  return _mm256_and_si256(high, mask);   // the byte mask drops what a 16-bit shift carried across bytes
}
#endif

#ifdef TANDEM_AVX512
inline __m512 halves16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// The 16 columns' weight scales of a block (Q6_K: one per half) and offsets.
template <QuantFormat F>
struct Scales {
  __m512 d[Layout<F>::kSums];
  __m512 m;
};
template <QuantFormat F>
inline Scales<F> block_scales(const uint8_t* s, const uint8_t* tail) {
  Scales<F> w{};
  if constexpr (F == QuantFormat::kQ6_K) {
    const __m512 dd = halves16(tail);
    for (int h = 0; h < 2; ++h) w.d[h] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load16(s + 16 * h))), dd);
  } else if constexpr (is_k_quant(F)) {
    w.d[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(load16(s))), halves16(tail));
    w.m = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(load16(s + 16))), halves16(tail + 32));
  } else {
    w.d[0] = halves16(s);
    if constexpr (Layout<F>::kHasMins) w.m = halves16(s + 32);
  }
  return w;
}
#endif

}  // namespace
}  // namespace tandem
