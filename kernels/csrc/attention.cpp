// Causal attention over a paged KV cache (FlashInfer's CSR page table), float32 math over a
// float32 or bfloat16 cache, reading each sequence's pages in place: no padding, no masks, no copies.
//
// Work items are (sequence, up to 8 query rows, all kv heads or one); threads split items, so each
// row's result depends only on its own sequence. Per row and kv head, with the group's query heads:
//   1. scores: keys in tiles of one vector width; per query head, each key's products are summed
//      across head_dim in registers, then a transpose-add tree turns a tile into one vector;
//   2. softmax per query head (vectorized exp);
//   3. output: each value row is loaded once and multiplied into up to 4 query heads' accumulators
//      (2 on AVX2, whose register file is half as wide).
// The vector path needs head_dim a multiple of the width (16 on AVX-512, 8 on AVX2) and at most 256;
// other shapes, and builds without AVX2, take the scalar path.
//
// A sliding window (`window` > 0) limits a row at position p to keys p - window + 1 .. p: its walk
// starts at that key's page and slot, so pages wholly before the window are never read. Keys are
// visited in the same order and with the same operations either way, so a row with no window, or one
// whose window covers every key, has the bits it has without one.

#include "kernels.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace tandem {
namespace {

constexpr int64_t kRowsPerItem = 8;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Query rows [row_begin, row_end) of sequence `seq`, for kv heads [head_begin, head_end).
struct WorkItem {
  int64_t seq, head_begin, head_end, row_begin, row_end;
};

// One row's view of the cache for one kv head: element offset of its j-th visible key's K (V: +
// kv_stride), the first visible key being slot `first_slot` of page `pages[0]` (a window's start).
// `fetch_bytes`: how much of each token's K (and V) row to prefetch, from its first head: the
// whole row (every head) while the first head of an item that covers them all is computed, so
// that the others find it in cache; else nothing beyond what the head itself reads.
struct SeqKV {
  const PagedKV& kv;
  const int32_t* pages;
  int64_t first_slot;
  int64_t head_offset;
  int64_t fetch_bytes;
  int64_t offset(int64_t j) const {
    j += first_slot;
    return pages[j / kv.page_size] * kv.page_stride + (j % kv.page_size) * kv.token_stride + head_offset;
  }
};

// Walks the visible keys in order, page by page (no division per token; a page id is read only when used).
struct TokenCursor {
  const SeqKV& s;
  int64_t page = 0, in_page;
  explicit TokenCursor(const SeqKV& seq) : s(seq), in_page(seq.first_slot) {}
  int64_t token() const { return s.pages[page] * s.kv.page_stride + in_page * s.kv.token_stride; }
  int64_t at() const { return token() + s.head_offset; }
  void next() {
    if (++in_page == s.kv.page_size) {
      in_page = 0;
      ++page;
    }
  }
};

#if defined(TANDEM_AVX512) || defined(TANDEM_AVX2)
constexpr int W = Vec::kWidth;
using Reg = Vec::Reg;

// Asks for the cache lines of `bytes` bytes at p (the cache rows of one head: their pages are scattered,
// so the hardware prefetcher does not see them coming and a large batch waits on memory latency).
inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(static_cast<const char*>(p) + b, _MM_HINT_T1);
}

// scores[g * W + l] (stride `stride` between heads) = q_g . keys[l] for one tile of W keys.
template <typename T>
inline void score_tile(const T* const* keys, const float* q, int64_t group, int64_t d, float* scores,
                       int64_t stride) {
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * d;
    Reg part[W];
    const Reg q0 = Vec::load(qg);
    for (int l = 0; l < W; ++l) part[l] = Vec::mul(q0, Vec::load(keys[l]));
    for (int64_t c = W; c < d; c += W) {
      const Reg qc = Vec::load(qg + c);
      for (int l = 0; l < W; ++l) part[l] = Vec::fma(qc, Vec::load(keys[l] + c), part[l]);
    }
    Vec::store(scores + g * stride, Vec::sum_each(part));
  }
}

// scores[g * padded + j] = q_g . key_j for j < visible (q already scaled); -inf up to `padded`.
template <typename T>
void score_keys(const T* base, const SeqKV& seq, const float* q, int64_t group, int64_t d, int64_t visible,
                int64_t padded, float* scores) {
  TokenCursor cursor(seq), ahead(seq);
  const T* keys[W];
  const int64_t row_bytes = std::max(seq.fetch_bytes, d * static_cast<int64_t>(sizeof(T)));
  const int64_t row_offset = seq.fetch_bytes ? 0 : seq.head_offset;
  for (int64_t j = 0; j < std::min<int64_t>(2 * W, visible); ++j, ahead.next())
    prefetch(base + ahead.token() + row_offset, row_bytes);
  for (int64_t j0 = 0; j0 < visible; j0 += W) {
    const int64_t n = std::min<int64_t>(W, visible - j0);
    for (int64_t l = 0; l < n; ++l, cursor.next()) keys[l] = base + cursor.at();
    for (int64_t l = n; l < W; ++l) keys[l] = keys[n - 1];   // a short last tile repeats a key
    // the next tile's keys, and the first values (read right after the scores)
    for (int64_t j = j0 + 2 * W; j < std::min<int64_t>(j0 + 3 * W, visible); ++j, ahead.next())
      prefetch(base + ahead.token() + row_offset, row_bytes);
    if (j0 + W >= visible) prefetch(base + seq.offset(0) - seq.head_offset + row_offset + seq.kv.kv_stride, row_bytes);
    score_tile(keys, q, group, d, scores + j0, padded);
  }
  for (int64_t g = 0; g < group; ++g) std::fill(scores + g * padded + visible, scores + (g + 1) * padded, kNegInf);
}

// Softmax of scores[0:padded] in place; returns the sum of the exponentials.
float softmax(float* s, int64_t padded) {
  Reg mx = Vec::set1(kNegInf);
  for (int64_t j = 0; j < padded; j += W) mx = Vec::max(mx, Vec::load(s + j));
  const Reg top = Vec::set1(Vec::reduce_max(mx));
  Reg total = Vec::zero();
  for (int64_t j = 0; j < padded; j += W) {
    const Reg e = Vec::exp_nonpositive(Vec::sub(Vec::load(s + j), top));
    Vec::store(s + j, e);
    total = Vec::add(total, e);
  }
  return Vec::reduce_add(total);
}

// out[g][c0 + u * W + i] = sum_j p[g][j] * value_j[c0 + u * W + i] for NG query heads and CC vectors.
template <typename T, int NG, int CC>
void weigh_values(const T* base, const SeqKV& seq, const float* p, int64_t padded, int64_t visible, int64_t c0,
                  const float* inv_total, float* out, int64_t d) {
  Reg acc[NG][CC];
  for (int g = 0; g < NG; ++g)
    for (int u = 0; u < CC; ++u) acc[g][u] = Vec::zero();
  TokenCursor cursor(seq), ahead(seq);
  const int64_t v_offset = seq.kv.kv_stride + c0;
  constexpr int64_t kAhead = 16;   // values prefetched this many tokens ahead
  const int64_t fetch_offset = seq.kv.kv_stride + (seq.fetch_bytes ? 0 : seq.head_offset + c0);
  const int64_t fetch_bytes = seq.fetch_bytes ? (c0 == 0 ? seq.fetch_bytes : 0) : CC * W * int64_t{sizeof(T)};
  for (int64_t j = 0; j < std::min(kAhead, visible); ++j) ahead.next();
  for (int64_t j = 0; j < visible; ++j, cursor.next()) {
    if (j + kAhead < visible) {
      prefetch(base + ahead.token() + fetch_offset, fetch_bytes);
      ahead.next();
    }
    const T* value = base + cursor.at() + v_offset;
    Reg v[CC];
    for (int u = 0; u < CC; ++u) v[u] = Vec::load(value + u * W);
    for (int g = 0; g < NG; ++g) {
      const Reg w = Vec::set1(p[g * padded + j]);
      for (int u = 0; u < CC; ++u) acc[g][u] = Vec::fma(w, v[u], acc[g][u]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int u = 0; u < CC; ++u) Vec::store(out + g * d + c0 + u * W, Vec::mul(acc[g][u], Vec::set1(inv_total[g])));
}

template <typename T, int NG>
void weigh_values_cc(int cc, const T* base, const SeqKV& seq, const float* p, int64_t padded, int64_t visible,
                     int64_t c0, const float* inv_total, float* out, int64_t d) {
  switch (cc) {
    case 1: weigh_values<T, NG, 1>(base, seq, p, padded, visible, c0, inv_total, out, d); break;
    case 2: weigh_values<T, NG, 2>(base, seq, p, padded, visible, c0, inv_total, out, d); break;
    case 3: weigh_values<T, NG, 3>(base, seq, p, padded, visible, c0, inv_total, out, d); break;
    default: weigh_values<T, NG, 4>(base, seq, p, padded, visible, c0, inv_total, out, d); break;
  }
}

template <typename T>
void attend_row(const T* base, const SeqKV& seq, const float* q_scaled, int64_t group, int64_t d, int64_t visible,
                std::vector<float>& scores, float* out) {
  const int64_t padded = (visible + W - 1) / W * W;
  scores.resize(group * padded);
  score_keys(base, seq, q_scaled, group, d, visible, padded, scores.data());
  float inv_total[64];
  for (int64_t g = 0; g < group; ++g) inv_total[g] = 1.0f / softmax(scores.data() + g * padded, padded);
  constexpr int kMaxHeads = W == 16 ? 4 : 2;   // accumulators: heads x 4 vectors, within the register file
  for (int64_t g0 = 0; g0 < group; g0 += kMaxHeads) {
    const int ng = static_cast<int>(std::min<int64_t>(kMaxHeads, group - g0));
    for (int64_t c0 = 0; c0 < d; c0 += 4 * W) {
      const int cc = static_cast<int>(std::min<int64_t>(4, (d - c0) / W));
      const float* p = scores.data() + g0 * padded;
      float* o = out + g0 * d;
      if (ng == 1) weigh_values_cc<T, 1>(cc, base, seq, p, padded, visible, c0, inv_total + g0, o, d);
      else if (ng == 2) weigh_values_cc<T, 2>(cc, base, seq, p, padded, visible, c0, inv_total + g0, o, d);
      else if constexpr (kMaxHeads == 4) {
        if (ng == 3) weigh_values_cc<T, 3>(cc, base, seq, p, padded, visible, c0, inv_total + g0, o, d);
        else weigh_values_cc<T, 4>(cc, base, seq, p, padded, visible, c0, inv_total + g0, o, d);
      }
    }
  }
}
#endif

inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return bf16_to_float(v); }

// The scalar path: any head_dim, any build.
template <typename T>
void attend_row_scalar(const T* base, const SeqKV& seq, const float* q_scaled, int64_t group, int64_t d,
                       int64_t visible, std::vector<float>& scores, float* out) {
  scores.resize(group * visible);
  TokenCursor keys(seq);
  for (int64_t j = 0; j < visible; ++j, keys.next()) {
    const T* key = base + keys.at();
    for (int64_t g = 0; g < group; ++g) {
      float s = 0.0f;
      for (int64_t i = 0; i < d; ++i) s += q_scaled[g * d + i] * to_float(key[i]);
      scores[g * visible + j] = s;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores.data() + g * visible;
    const float top = *std::max_element(sg, sg + visible);
    float total = 0.0f;
    for (int64_t j = 0; j < visible; ++j) total += (sg[j] = std::exp(sg[j] - top));
    float* o = out + g * d;
    std::fill(o, o + d, 0.0f);
    TokenCursor values(seq);
    for (int64_t j = 0; j < visible; ++j, values.next()) {
      const T* value = base + values.at() + seq.kv.kv_stride;
      for (int64_t i = 0; i < d; ++i) o[i] += sg[j] * to_float(value[i]);
    }
    for (int64_t i = 0; i < d; ++i) o[i] /= total;
  }
}

template <typename T>
void attend_item(const WorkItem& item, const float* q, int64_t q_row_stride, int64_t num_q_heads, const PagedKV& kv,
                 const int32_t* pages, int64_t seq_len, int64_t q_len, int64_t first_row, float scale, int64_t window,
                 float* out, std::vector<float>& scores, std::vector<float>& q_scaled) {
  const T* base = static_cast<const T*>(kv.base);
  const int64_t d = kv.head_dim, group = num_q_heads / kv.num_kv_heads;
#if defined(TANDEM_AVX512) || defined(TANDEM_AVX2)
  const bool is_vector = d % W == 0 && d <= 256;
#else
  const bool is_vector = false;
#endif
  const bool has_all_heads = item.head_begin == 0 && item.head_end == kv.num_kv_heads && kv.num_kv_heads > 1;
  q_scaled.resize(group * d);
  for (int64_t h = item.head_begin; h < item.head_end; ++h) {
    const int64_t fetch_bytes = has_all_heads && h == 0 ? kv.num_kv_heads * d * int64_t{sizeof(T)} : 0;
    for (int64_t row = item.row_begin; row < item.row_end; ++row) {
      const int64_t pos = seq_len - q_len + (row - first_row);   // causal: keys at positions first..pos
      const int64_t first = window > 0 ? std::max<int64_t>(0, pos + 1 - window) : 0, visible = pos + 1 - first;
      const SeqKV seq{kv, pages + first / kv.page_size, first % kv.page_size, h * kv.head_stride, fetch_bytes};
      const float* qh = q + row * q_row_stride + h * group * d;
      for (int64_t i = 0; i < group * d; ++i) q_scaled[i] = qh[i] * scale;
      float* o = out + (row * num_q_heads + h * group) * d;
#if defined(TANDEM_AVX512) || defined(TANDEM_AVX2)
      if (is_vector) {
        attend_row(base, seq, q_scaled.data(), group, d, visible, scores, o);
        continue;
      }
#endif
      attend_row_scalar(base, seq, q_scaled.data(), group, d, visible, scores, o);
    }
  }
  (void)is_vector;
}

}  // namespace

void paged_attention(const float* q, int64_t q_row_stride, int64_t num_q_heads, const PagedKV& kv, const int32_t* qo_indptr,
                     const int32_t* kv_indptr, const int32_t* kv_indices, const int32_t* last_page_len,
                     int64_t batch, float scale, int64_t window, float* out) {
  // One item per (sequence, 8 rows) covering every kv head, so that each page is read whole and
  // once; one per kv head too when that is needed to give every thread work (small batches).
  int64_t row_items = 0;
  for (int64_t b = 0; b < batch; ++b) row_items += (qo_indptr[b + 1] - qo_indptr[b] + kRowsPerItem - 1) / kRowsPerItem;
  const int64_t heads_per_item = row_items >= 2 * at::get_num_threads() ? kv.num_kv_heads : 1;
  std::vector<WorkItem> items;
  std::vector<int64_t> seq_lens(batch);
  for (int64_t b = 0; b < batch; ++b) {
    seq_lens[b] = (kv_indptr[b + 1] - kv_indptr[b] - 1) * kv.page_size + last_page_len[b];
    for (int64_t h = 0; h < kv.num_kv_heads; h += heads_per_item)
      for (int64_t r = qo_indptr[b]; r < qo_indptr[b + 1]; r += kRowsPerItem)
        items.push_back({b, h, h + heads_per_item, r, std::min<int64_t>(qo_indptr[b + 1], r + kRowsPerItem)});
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, q_scaled;
    for (int64_t i = begin; i < end; ++i) {
      const WorkItem& item = items[i];
      const int64_t b = item.seq, q_len = qo_indptr[b + 1] - qo_indptr[b];
      const int32_t* pages = kv_indices + kv_indptr[b];
      if (kv.is_bf16)
        attend_item<uint16_t>(item, q, q_row_stride, num_q_heads, kv, pages, seq_lens[b], q_len, qo_indptr[b], scale,
                              window, out, scores, q_scaled);
      else
        attend_item<float>(item, q, q_row_stride, num_q_heads, kv, pages, seq_lens[b], q_len, qo_indptr[b], scale,
                           window, out, scores, q_scaled);
    }
  });
}

}  // namespace tandem
