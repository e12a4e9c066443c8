// The quantized matmul on AMX tiles (qamx.h). Per panel of 16 columns, every block's codes are first
// unpacked to int8 integer weights (the code less the format's offset) in the tile layout: for each
// block, 8 rows of 64 bytes, row i holding inputs 4i..4i+3 of each column. Then per 16 rows and block
// (Q6_K: per 16-input half), two tile multiplies give the exact int32 sums of the activations' high
// bytes (signed x signed, tdpbssd) and low bytes (unsigned x signed, tdpbusd) with the weights, and
// 256 * high + low is the integer sum the vector tiles compute with vpdpwssd. Its float part is
// theirs, operation for operation: acc = fma(float(sum), dw * dx, acc) per sum, then the offsets'
// fma, so the bits are the same. A tile multiply does 16 x 16 x 32 byte products (256 vpdpwssd's
// worth) in about 8 ns on the Xeon measured; the sums' trip through memory, the float part and the
// unpacking are what is left (docs/performance.md).

#include "qamx.h"

#include "qlayout.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <utility>

#ifdef TANDEM_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace tandem {

void tile_rows(const QRows& x, int64_t rows, int8_t* hi, uint8_t* lo, float* d, float* s) {
  at::parallel_for(0, rows, kAmxRows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = r * x.k; i < (r + 1) * x.k; ++i) {
        hi[i] = static_cast<int8_t>(x.q[i] >> 8);   // arithmetic shift: q = 256 * hi + lo, lo in [0, 255]
        lo[i] = static_cast<uint8_t>(x.q[i] & 0xFF);
      }
      const int64_t tile = r / kAmxRows * kAmxRows * x.nb, row = r % kAmxRows;
      for (int64_t b = 0; b < x.nb; ++b) {
        d[tile + kAmxRows * b + row] = x.d[r * x.nb + b];
        s[tile + kAmxRows * b + row] = x.s[r * x.nb + b];
      }
    }
  });
}

#ifdef TANDEM_AMX
namespace {

// Linux keeps the tile data state off until a process asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); a tile instruction before that is a SIGILL.
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;

// ldtilecfg's 64 bytes (palette 1): each tile's rows and bytes per row.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0, tmm1 (and tmm5, tmm6, for every other step): the sums of the high and of the low bytes (16
// rows x 16 columns, int32); tmm2, tmm3: the high and the low bytes of 16 rows x `depth` inputs;
// tmm4: the weights of `depth` inputs x 16 columns, 4 inputs of each column per 64-byte row.
TileConfig tile_config(int depth) {
  TileConfig c;
  c.rows[0] = c.rows[1] = c.rows[2] = c.rows[3] = c.rows[5] = c.rows[6] = kAmxRows;
  c.colsb[0] = c.colsb[1] = c.colsb[5] = c.colsb[6] = 64;
  c.colsb[2] = c.colsb[3] = static_cast<uint16_t>(depth);
  c.rows[4] = static_cast<uint8_t>(depth / 4);
  c.colsb[4] = 64;
  return c;
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// One block's codes -> 512 bytes of int8 weights in the tile layout. Both loads of a chunk pair hold
// the 16 columns' 16-bit words (2 inputs each): inputs 4i, 4i+1 (wa) and 4i+2, 4i+3 (wb), so
// interleaving their words puts each column's 4 inputs together (within 128-bit lanes: columns 0-3
// and 8-11, then 4-7 and 12-15, put in order by the lane permutes).
template <QuantFormat F>
void unpack_block(const uint8_t* blk, int8_t* dst) {
  using L = Layout<F>;
  const __m256i low4 = _mm256_set1_epi8(0x0F), offset = _mm256_set1_epi8(L::kOffset);
  [[maybe_unused]] const __m256i high_mask = _mm256_set1_epi8(static_cast<char>(((1 << L::kHighBits) - 1) << 4));
  prefetch_ahead<F>(blk);
  for (int i = 0; i < 8; ++i) {
    __m256i wa, wb;
    if constexpr (L::kInt8) {
      wa = load32(blk + 64 * i);
      wb = load32(blk + 64 * i + 32);
    } else {
      const __m256i v = load32(blk + 32 * i);
      wa = _mm256_and_si256(v, low4);
      wb = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      if constexpr (L::kHighBits > 0) {
        const __m256i high = load32(blk + 256 + 32 * (L::kHighBits * 2 * i / 8));
        wa = _mm256_or_si256(wa, high_field<F>(high, i, 0, high_mask));
        wb = _mm256_or_si256(wb, high_field<F>(high, i, 1, high_mask));
      }
      if constexpr (L::kOffset > 0) {
        wa = _mm256_sub_epi8(wa, offset);
        wb = _mm256_sub_epi8(wb, offset);
      }
    }
    const __m256i lo = _mm256_unpacklo_epi16(wa, wb), hi = _mm256_unpackhi_epi16(wa, wb);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 64 * i), _mm256_permute2x128_si256(lo, hi, 0x20));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 64 * i + 32), _mm256_permute2x128_si256(lo, hi, 0x31));
  }
}

// One step's two tile multiplies (16 rows x `depth` inputs x 16 columns), their sums stored to
// sums[0] (high bytes) and sums[1] (low), in sum tiles HIGH and LOW (the intrinsics take the tile
// numbers as literal text, hence a macro for the two pairs).
#define TANDEM_AMX_MULTIPLY(NAME, HIGH, LOW)                                                                  \
  inline void NAME(const QBytes& bytes, int64_t at, int64_t stride, const int8_t* weights, int32_t(*sums)[256]) { \
    _tile_zero(HIGH);                                                                                        \
    _tile_zero(LOW);                                                                                         \
    _tile_loadd(2, bytes.hi + at, stride);                                                                   \
    _tile_loadd(3, bytes.lo + at, stride);                                                                   \
    _tile_loadd(4, weights, 64);                                                                             \
    _tile_dpbssd(HIGH, 2, 4);                                                                                \
    _tile_dpbusd(LOW, 3, 4);                                                                                 \
    _tile_stored(HIGH, sums[0], 64);                                                                         \
    _tile_stored(LOW, sums[1], 64);                                                                          \
  }
TANDEM_AMX_MULTIPLY(multiply_even, 0, 1)
TANDEM_AMX_MULTIPLY(multiply_odd, 5, 6)
#undef TANDEM_AMX_MULTIPLY

// Steps are (block, sum): one per block, two for Q6_K. Step i's multiplies go to tiles 0 and 1 or 5
// and 6 by its parity and are issued before step i - 1's float part, so that the tile unit works
// while the vector unit scales.
template <QuantFormat F>
void panel_rows_amx(const uint8_t* panel, const QRows& x, const QBytes& bytes, int64_t m, float* out, int64_t ldo,
                    int64_t cols, int8_t* weights) {
  using L = Layout<F>;
  constexpr int kDepth = kBlock / L::kSums;   // inputs per integer sum
  const TileConfig config = tile_config(kDepth);
  _tile_loadconfig(&config);
  for (int64_t b = 0; b < x.nb; ++b) unpack_block<F>(block_at<F>(panel, b), weights + 512 * b);
  alignas(64) int32_t sums[2][2][kAmxRows * 16];
  const __mmask16 mask = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const int64_t steps = x.nb * L::kSums;
  for (int64_t r0 = 0; r0 < m; r0 += kAmxRows) {
    const auto issue = [&](int64_t i) {
      const int64_t at = r0 * x.k + i * kDepth;
      const int8_t* w = weights + 64 * (kDepth / 4) * i;
      if (i % 2 == 0) multiply_even(bytes, at, x.k, w, sums[0]);
      else multiply_odd(bytes, at, x.k, w, sums[1]);
    };
    const float* d = bytes.d + r0 * x.nb;
    const float* sx = bytes.s + r0 * x.nb;
    __m512 acc[kAmxRows];   // in registers: every loop over it is unrolled
#pragma GCC unroll 16
    for (int r = 0; r < kAmxRows; ++r) acc[r] = _mm512_setzero_ps();
    issue(0);
    for (int64_t b = 0; b < x.nb; ++b) {
      const uint8_t* blk = block_at<F>(panel, b);
      const Scales<F> w = block_scales<F>(blk + value_bytes(F), tail_at<F>(panel, b));
      for (int h = 0; h < L::kSums; ++h) {
        const int64_t i = b * L::kSums + h;
        if (i + 1 < steps) issue(i + 1);
        const int32_t(*s)[256] = sums[i % 2];
#pragma GCC unroll 16
        for (int r = 0; r < kAmxRows; ++r) {
          const __m512i high = _mm512_load_si512(s[0] + 16 * r), low = _mm512_load_si512(s[1] + 16 * r);
          const __m512i total = _mm512_add_epi32(_mm512_slli_epi32(high, 8), low);
          const __m512 dx = _mm512_set1_ps(d[16 * b + r]);
          acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(w.d[h], dx), acc[r]);
        }
      }
      if constexpr (L::kHasMins) {
#pragma GCC unroll 16
        for (int r = 0; r < kAmxRows; ++r) acc[r] = _mm512_fmadd_ps(w.m, _mm512_set1_ps(sx[16 * b + r]), acc[r]);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < kAmxRows; ++r)
      if (r0 + r < m) _mm512_mask_storeu_ps(out + (r0 + r) * ldo, mask, acc[r]);
  }
}

using AmxPanelRows = void (*)(const uint8_t*, const QRows&, const QBytes&, int64_t, float*, int64_t, int64_t, int8_t*);
template <int... I>
constexpr std::array<AmxPanelRows, kNumFormats> amx_by_format(std::integer_sequence<int, I...>) {
  return {&panel_rows_amx<static_cast<QuantFormat>(I)>...};
}
constexpr std::array<AmxPanelRows, kNumFormats> kAmxPanelRows = amx_by_format(std::make_integer_sequence<int, kNumFormats>{});

}  // namespace

bool amx_ready() {
  static const bool ready = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return ready;
}

void amx_panel_rows(QuantFormat f, const uint8_t* panel, const QRows& x, const QBytes& bytes, int64_t m, float* out,
                    int64_t ldo, int64_t cols, int8_t* scratch) {
  kAmxPanelRows[static_cast<int>(f)](panel, x, bytes, m, out, ldo, cols, scratch);
}

void amx_release() { _tile_release(); }

#else
bool amx_ready() { return false; }
void amx_panel_rows(QuantFormat, const uint8_t*, const QRows&, const QBytes&, int64_t, float*, int64_t, int64_t, int8_t*) {}
void amx_release() {}
#endif

}  // namespace tandem
