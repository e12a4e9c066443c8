// Batched LoRA over segments of rows (Punica's shrink / expand split): shrink t = x A^T into the
// low rank, expand y += scaling * t B^T back out, each segment with its own adapter slot.
//
// Decode gives segments of one row, so both are GEMV-shaped and vectorized along their long side:
// shrink takes dots of x with A's rows along `in`; expand takes, per tile of kWidth outputs, the
// dots along r of B's rows with t (r <= 64: t's slice stays in registers) and transposes them into
// one vector of outputs (Vec::sum_each), added to y. Threads split rows; every (row, column) value
// is computed by the same operations whatever the split, so the kernels are row-invariant (common.h).

#include "kernels.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <utility>

namespace tandem {
namespace {

constexpr int64_t kMinTaskWork = 32768;   // multiply-adds per thread at least: decode's tiny calls do not fork
constexpr int64_t kShrinkRanks = 4;       // A rows dotted with one x row at a time (x is loaded once for them)

int64_t row_grain(int64_t work_per_row) {
  return std::max<int64_t>(1, kMinTaskWork / std::max<int64_t>(1, work_per_row));
}

// Calls fn(row, slot) for the rows in [begin, end), each with its segment's slot.
template <typename Fn>
void for_rows(const LoraSegments& seg, int64_t begin, int64_t end, Fn fn) {
  for (int64_t s = 0; s < seg.num_segments; ++s) {
    const int64_t lo = std::max<int64_t>(begin, seg.starts[s]), hi = std::min<int64_t>(end, seg.starts[s + 1]);
    for (int64_t row = lo; row < hi; ++row) fn(row, seg.slots[s]);
  }
}

// out[j] = x . a_rows[j] over n inputs, for j < count (<= kShrinkRanks); unused lanes repeat the last row.
void dot_ranks(const float* x, const float* a, int64_t n, int64_t count, float* out) {
  const float* rows[kShrinkRanks];
  for (int64_t j = 0; j < kShrinkRanks; ++j) rows[j] = a + std::min(j, count - 1) * n;
  float sums[kShrinkRanks] = {};
  int64_t i = 0;
#if defined(TANDEM_AVX512) || defined(TANDEM_AVX2)
  Vec::Reg acc[kShrinkRanks];
  for (auto& reg : acc) reg = Vec::zero();
  for (; i + Vec::kWidth <= n; i += Vec::kWidth) {
    const Vec::Reg v = Vec::load(x + i);
    for (int64_t j = 0; j < kShrinkRanks; ++j) acc[j] = Vec::fma(v, Vec::load(rows[j] + i), acc[j]);
  }
  for (int64_t j = 0; j < kShrinkRanks; ++j) sums[j] = Vec::reduce_add(acc[j]);
#endif
  for (; i < n; ++i)
    for (int64_t j = 0; j < kShrinkRanks; ++j) sums[j] += x[i] * rows[j][i];
  for (int64_t j = 0; j < count; ++j) out[j] = sums[j];
}

#if defined(TANDEM_AVX512) || defined(TANDEM_AVX2)
// y[o] += scaling * (b_rows[o] . t) for the kWidth outputs o of each whole tile, b_rows [out, r]
// row-major with r in kChunks vectors (the last maybe partial); returns the outputs done. kChunks
// is a compile-time constant so that the loops unroll and t stays in registers.
template <int64_t kChunks>
int64_t expand_tiles(const float* t, const float* b, int64_t r, int64_t out, float scaling, float* y) {
  const int64_t tail = r - (kChunks - 1) * Vec::kWidth;   // floats in the last chunk, 1..kWidth
  Vec::Reg tv[kChunks];
  for (int64_t c = 0; c < kChunks - 1; ++c) tv[c] = Vec::load(t + c * Vec::kWidth);
  tv[kChunks - 1] = Vec::load_first(t + (kChunks - 1) * Vec::kWidth, tail);
  const Vec::Reg scale = Vec::set1(scaling);
  int64_t o = 0;
  for (; o + Vec::kWidth <= out; o += Vec::kWidth) {
    Vec::Reg dots[Vec::kWidth];
    for (int64_t j = 0; j < Vec::kWidth; ++j) {
      const float* row = b + (o + j) * r;
      Vec::Reg acc = Vec::mul(Vec::load_first(row + (kChunks - 1) * Vec::kWidth, tail), tv[kChunks - 1]);
      for (int64_t c = 0; c < kChunks - 1; ++c) acc = Vec::fma(Vec::load(row + c * Vec::kWidth), tv[c], acc);
      dots[j] = acc;
    }
    Vec::store(y + o, Vec::fma(scale, Vec::sum_each(dots), Vec::load(y + o)));
  }
  return o;
}

template <int64_t... C>
int64_t expand_tiles_of(int64_t num_chunks, const float* t, const float* b, int64_t r, int64_t out, float scaling,
                        float* y, std::integer_sequence<int64_t, C...>) {
  using Tiles = int64_t (*)(const float*, const float*, int64_t, int64_t, float, float*);
  constexpr Tiles kByChunks[] = {&expand_tiles<C + 1>...};
  return kByChunks[num_chunks - 1](t, b, r, out, scaling, y);
}
#endif

// y[o] += scaling * (b_rows[o] . t) for o < out, b_rows [out, r] row-major, 1 <= r <= kMaxLoraRank.
void expand_row(const float* t, const float* b, int64_t r, int64_t out, float scaling, float* y) {
  int64_t o = 0;
#if defined(TANDEM_AVX512) || defined(TANDEM_AVX2)
  constexpr int64_t kMaxChunks = kMaxLoraRank / Vec::kWidth;
  o = expand_tiles_of((r + Vec::kWidth - 1) / Vec::kWidth, t, b, r, out, scaling, y,
                      std::make_integer_sequence<int64_t, kMaxChunks>{});
#endif
  for (; o < out; ++o) {
    const float* row = b + o * r;
    float dot = 0.0f;
    for (int64_t k = 0; k < r; ++k) dot += row[k] * t[k];
    y[o] += scaling * dot;
  }
}

}  // namespace

void lora_shrink(const float* x, int64_t n, int64_t in, const float* a, int64_t rank, const LoraSegments& seg,
                 float* t) {
  at::parallel_for(0, n, row_grain(rank * in), [&](int64_t begin, int64_t end) {
    for_rows(seg, begin, end, [&](int64_t row, int32_t slot) {
      float* out = t + row * rank;
      if (slot < 0) {
        std::memset(out, 0, rank * sizeof(float));
        return;
      }
      const float* a_slot = a + slot * rank * in;
      for (int64_t k = 0; k < rank; k += kShrinkRanks)
        dot_ranks(x + row * in, a_slot + k * in, in, std::min(kShrinkRanks, rank - k), out + k);
    });
  });
}

void lora_expand(const float* t, int64_t t_stride, int64_t r, const float* b, int64_t out, const LoraSegments& seg,
                 const float* scaling, float* y, int64_t y_stride) {
  if (r == 0) return;   // nothing to add (and no chunk of t to read)
  at::parallel_for(0, seg.starts[seg.num_segments], row_grain(r * out), [&](int64_t begin, int64_t end) {
    for_rows(seg, begin, end, [&](int64_t row, int32_t slot) {
      if (slot >= 0) expand_row(t + row * t_stride, b + slot * out * r, r, out, scaling[slot], y + row * y_stride);
    });
  });
}

}  // namespace tandem
