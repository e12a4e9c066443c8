// Tandem's CPU kernels: block-quantized matmul and paged attention over CSR page tables.
//
// Both kernels are row-invariant: every output row is computed by the same sequence of
// operations whatever the number of rows in the call and however the work is split across
// threads (threads split output columns or (sequence, kv head) pairs, never a reduction).
// That makes greedy decoding independent of which other requests share a batch.
//
// Built once at install time (kernels/native.py) with the build machine's instruction set;
// AVX2+FMA paths where the compiler targets them, portable scalar code otherwise.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TANDEM_AVX2 1
#endif

namespace {

constexpr int64_t kBlock = 32;   // elements per quantization block (GGUF's QK8_0 / QK4_0 / QK4_1)

enum Format : int64_t { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };

// ---- activation quantization ------------------------------------------------------------------

// One row of `k` floats -> int8 blocks with one scale each (round to nearest even), and each
// block's d * sum(q) (needed by Q4_1's min term).
void quantize_row(const float* x, int64_t k, int8_t* q, float* d_out, float* s_out) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    int8_t* qb = q + b * kBlock;
#ifdef TANDEM_AVX2
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
    __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
    __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                             _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float d = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    const __m256 mul = _mm256_set1_ps(id);
    __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, mul), _MM_FROUND_TO_NEAREST_INT));
    __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, mul), _MM_FROUND_TO_NEAREST_INT));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, mul), _MM_FROUND_TO_NEAREST_INT));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, mul), _MM_FROUND_TO_NEAREST_INT));
    __m256i sum32 = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    __m128i s4 = _mm_add_epi32(_mm256_extracti128_si256(sum32, 1), _mm256_castsi256_si128(sum32));
    s4 = _mm_hadd_epi32(s4, s4);
    s4 = _mm_hadd_epi32(s4, s4);
    const int sum = _mm_cvtsi128_si32(s4);
    // packs interleave 128-bit lanes; the permute puts the 32 bytes back in element order
    __m256i p01 = _mm256_packs_epi32(i0, i1), p23 = _mm256_packs_epi32(i2, i3);
    __m256i p = _mm256_packs_epi16(p01, p23);
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb), p);
#else
    float amax = 0.0f;
    for (int i = 0; i < kBlock; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
    const float d = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int i = 0; i < kBlock; ++i) {
      const int v = static_cast<int>(std::nearbyint(xb[i] * id));
      qb[i] = static_cast<int8_t>(v);
      sum += v;
    }
#endif
    d_out[b] = d;
    s_out[b] = d * static_cast<float>(sum);
  }
}

// ---- block dot products -------------------------------------------------------------------------

#ifdef TANDEM_AVX2
inline __m256i unpack_nibbles(const uint8_t* qs) {   // 16 bytes -> 32 values 0..15 in element order
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

inline __m256 dot_signed(__m256i w, __m256i x) {      // 8 partial int32 sums of w * x, as floats
  const __m256i prod = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, _mm256_set1_epi16(1)));
}

inline __m256 dot_unsigned(__m256i w, __m256i x) {    // w in 0..255, x signed
  const __m256i prod = _mm256_maddubs_epi16(w, x);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, _mm256_set1_epi16(1)));
}

inline float hsum(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}
#endif

// Weights of one output column, as the kernel reads them.
struct Column {
  const uint8_t* qs;      // Q8_0: k int8; Q4_x: k / 2 bytes, GGUF nibble order per block
  const float* scales;    // k / 32
  const float* mins;      // Q4_1 only
};

// Activations: `rows` quantized rows starting at row m0.
struct QRows {
  const int8_t* q;
  const float* d;
  const float* s;
  int64_t k;
};

constexpr int kRowTile = 4;

// sum over blocks of mins[b] * sums[b] (Q4_1's offset term), in a fixed order for any caller.
inline float min_term(const float* mins, const float* sums, int64_t nb) {
  int64_t b = 0;
  float total = 0.0f;
#ifdef TANDEM_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; b + 8 <= nb; b += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(mins + b), _mm256_loadu_ps(sums + b), acc);
  total = hsum(acc);
#endif
  for (; b < nb; ++b) total += mins[b] * sums[b];
  return total;
}

// out[r] = dot(column, activation row m0 + r) for r < R. Each row's arithmetic is the same for
// every R, so a row's result does not depend on how many rows share the call.
template <int F, int R>
void column_dot(const Column& w, const QRows& x, int64_t m0, float* out) {
  const int64_t nb = x.k / kBlock;
  const int8_t* xq[R];
  const float* xd[R];
  for (int r = 0; r < R; ++r) { xq[r] = x.q + (m0 + r) * x.k; xd[r] = x.d + (m0 + r) * nb; }
#ifdef TANDEM_AVX2
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i wb;
    if (F == kQ8_0) wb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs + b * kBlock));
    else wb = unpack_nibbles(w.qs + b * (kBlock / 2));
    if (F == kQ4_0) wb = _mm256_sub_epi8(wb, _mm256_set1_epi8(8));
    const __m256i wabs = F == kQ4_1 ? wb : _mm256_sign_epi8(wb, wb);
    const __m256 wd = _mm256_set1_ps(w.scales[b]);
    for (int r = 0; r < R; ++r) {
      __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[r] + b * kBlock));
      if (F != kQ4_1) xb = _mm256_sign_epi8(xb, wb);
      const __m256i prod = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xb), _mm256_set1_epi16(1));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(prod), _mm256_mul_ps(wd, _mm256_set1_ps(xd[r][b])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
#else
  for (int r = 0; r < R; ++r) {
    float total = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* xb = xq[r] + b * kBlock;
      int32_t isum = 0;
      for (int i = 0; i < kBlock; ++i) {
        int wv;
        if (F == kQ8_0) wv = static_cast<int8_t>(w.qs[b * kBlock + i]);
        else {
          const uint8_t byte = w.qs[b * (kBlock / 2) + (i % 16)];
          wv = i < 16 ? (byte & 0x0F) : (byte >> 4);
          if (F == kQ4_0) wv -= 8;
        }
        isum += wv * xb[i];
      }
      total += static_cast<float>(isum) * (w.scales[b] * xd[r][b]);
    }
    out[r] = total;
  }
#endif
  if (F == kQ4_1)
    for (int r = 0; r < R; ++r) out[r] += min_term(w.mins, x.s + (m0 + r) * nb, nb);
}

// The same dot with float32 activations: each weight block is dequantized to floats once and
// multiplied into every row (no activation rounding: as exact as the float path, in another order).
template <int F>
inline void dequantize_block(const Column& w, int64_t b, float* out32) {
  const float d = w.scales[b];
  const float m = F == kQ4_1 ? w.mins[b] : 0.0f;
  for (int i = 0; i < kBlock; ++i) {
    int q;
    if (F == kQ8_0) q = static_cast<int8_t>(w.qs[b * kBlock + i]);
    else {
      const uint8_t byte = w.qs[b * (kBlock / 2) + (i % 16)];
      q = i < 16 ? (byte & 0x0F) : (byte >> 4);
      if (F == kQ4_0) q -= 8;
    }
    out32[i] = F == kQ4_1 ? std::fma(static_cast<float>(q), d, m) : static_cast<float>(q) * d;
  }
}

template <int F, int R>
void column_dot_float(const Column& w, const float* x, int64_t k, int64_t m0, float* out) {
  const int64_t nb = k / kBlock;
#ifdef TANDEM_AVX2
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) { acc0[r] = _mm256_setzero_ps(); acc1[r] = _mm256_setzero_ps(); }
  for (int64_t b = 0; b < nb; ++b) {
    __m256i qi[4];   // the block's 32 values as 4 x 8 int32, in element order
    if (F == kQ8_0) {
      const int8_t* src = reinterpret_cast<const int8_t*>(w.qs + b * kBlock);
      for (int i = 0; i < 4; ++i)
        qi[i] = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + 8 * i)));
    } else {   // byte j holds element j (low nibble) and element j + 16 (high nibble)
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + b * (kBlock / 2)));
      const __m256i lo8 = _mm256_cvtepu8_epi32(raw), hi8 = _mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8));
      const __m256i mask = _mm256_set1_epi32(0x0F);
      qi[0] = _mm256_and_si256(lo8, mask);
      qi[1] = _mm256_and_si256(hi8, mask);
      qi[2] = _mm256_srli_epi32(lo8, 4);
      qi[3] = _mm256_srli_epi32(hi8, 4);
      if (F == kQ4_0)
        for (int i = 0; i < 4; ++i) qi[i] = _mm256_sub_epi32(qi[i], _mm256_set1_epi32(8));
    }
    const __m256 d = _mm256_set1_ps(w.scales[b]);
    __m256 wv[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 q = _mm256_cvtepi32_ps(qi[i]);
      wv[i] = F == kQ4_1 ? _mm256_fmadd_ps(q, d, _mm256_set1_ps(w.mins[b])) : _mm256_mul_ps(q, d);
    }
    for (int r = 0; r < R; ++r) {
      const float* xb = x + (m0 + r) * k + b * kBlock;
      acc0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xb), wv[0], acc0[r]);
      acc1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8), wv[1], acc1[r]);
      acc0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 16), wv[2], acc0[r]);
      acc1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 24), wv[3], acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(_mm256_add_ps(acc0[r], acc1[r]));
#else
  float wf[kBlock];
  for (int r = 0; r < R; ++r) out[r] = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    dequantize_block<F>(w, b, wf);
    for (int r = 0; r < R; ++r) {
      const float* xb = x + (m0 + r) * k + b * kBlock;
      float s = 0.0f;
      for (int i = 0; i < kBlock; ++i) s += xb[i] * wf[i];
      out[r] += s;
    }
  }
#endif
}

// Either dot over the activations, chosen once per call.
struct Activations {
  const QRows* quantized;   // int8 blocks, or null for float rows
  const float* x;
  int64_t k;
};

template <int F, int R>
inline void dot_rows(const Column& w, const Activations& a, int64_t m0, float* out) {
  if (a.quantized) column_dot<F, R>(w, *a.quantized, m0, out);
  else column_dot_float<F, R>(w, a.x, a.k, m0, out);
}

template <int F>
void qmatmul_impl(const Activations& x, int64_t m, const uint8_t* qs, int64_t qs_row_bytes, const float* scales,
                  const float* mins, int64_t n, float* out) {
  const int64_t nb = x.k / kBlock;
  constexpr int64_t kRowPanel = 64;     // activation rows kept hot in cache while columns stream by
  at::parallel_for(0, n, 8, [&](int64_t n_begin, int64_t n_end) {
    float col_out[kRowTile];
    for (int64_t p = 0; p < m; p += kRowPanel) {
      const int64_t p_end = std::min(m, p + kRowPanel);
      for (int64_t col = n_begin; col < n_end; ++col) {
        const Column w{qs + col * qs_row_bytes, scales + col * nb, mins ? mins + col * nb : nullptr};
        int64_t r = p;
        for (; r + kRowTile <= p_end; r += kRowTile) {
          dot_rows<F, kRowTile>(w, x, r, col_out);
          for (int i = 0; i < kRowTile; ++i) out[(r + i) * n + col] = col_out[i];
        }
        for (; r < p_end; ++r) {
          dot_rows<F, 1>(w, x, r, col_out);
          out[r * n + col] = col_out[0];
        }
      }
    }
  });
}

}  // namespace

// x [M, K] float32 contiguous; qs [N, K or K/2] uint8; scales [N, K/32] float32; mins [N, K/32] or
// empty. Returns [M, N] float32.
torch::Tensor qmatmul(torch::Tensor x, torch::Tensor qs, torch::Tensor scales, torch::Tensor mins,
                      int64_t format, bool int8_activations) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: [M, K] float32");
  TORCH_CHECK(qs.is_contiguous() && scales.is_contiguous() && scales.scalar_type() == torch::kFloat32,
              "qs and scales must be contiguous; scales float32");
  const int64_t m = x.size(0), k = x.size(1), n = qs.size(0);
  TORCH_CHECK(k % kBlock == 0, "K must be a multiple of 32, got ", k);
  TORCH_CHECK(scales.size(0) == n && scales.size(1) == k / kBlock, "scales shape");
  auto out = torch::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  const float* xp = x.data_ptr<float>();
  torch::Tensor xq, xd, xs;
  QRows quantized{nullptr, nullptr, nullptr, k};
  if (int8_activations) {
    xq = torch::empty({m, k}, torch::dtype(torch::kInt8));
    xd = torch::empty({m, k / kBlock}, x.options());
    xs = torch::empty({m, k / kBlock}, x.options());
    int8_t* xqp = xq.data_ptr<int8_t>();
    float* xdp = xd.data_ptr<float>();
    float* xsp = xs.data_ptr<float>();
    at::parallel_for(0, m, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r)
        quantize_row(xp + r * k, k, xqp + r * k, xdp + r * (k / kBlock), xsp + r * (k / kBlock));
    });
    quantized = QRows{xqp, xdp, xsp, k};
  }
  const Activations rows{int8_activations ? &quantized : nullptr, xp, k};
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  switch (format) {
    case kQ8_0:
      TORCH_CHECK(qs.size(1) == k, "Q8_0 qs must be [N, K]");
      qmatmul_impl<kQ8_0>(rows, m, qp, k, sp, nullptr, n, op);
      break;
    case kQ4_0:
      TORCH_CHECK(qs.size(1) == k / 2, "Q4_0 qs must be [N, K/2]");
      qmatmul_impl<kQ4_0>(rows, m, qp, k / 2, sp, nullptr, n, op);
      break;
    case kQ4_1:
      TORCH_CHECK(qs.size(1) == k / 2 && mins.is_contiguous() && mins.scalar_type() == torch::kFloat32 &&
                  mins.size(0) == n, "Q4_1 needs qs [N, K/2] and mins [N, K/32] float32");
      qmatmul_impl<kQ4_1>(rows, m, qp, k / 2, sp, mins.data_ptr<float>(), n, op);
      break;
    default:
      TORCH_CHECK(false, "unknown quantization format ", format);
  }
  return out;
}

// ---- paged attention ----------------------------------------------------------------------------

namespace {

#ifdef TANDEM_AVX2
// exp for x <= 0 (scores minus their max), Cephes-style: 2^n * p(r); below -87 it is 0.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 is_tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i pow2 = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(is_tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(pow2)));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#endif

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }

template <typename T>
float dot_row(const float* q, const T* k, int64_t d) {
#ifdef TANDEM_AVX2
  if (d % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), acc);
    return hsum(acc);
  }
#endif
  float acc = 0.0f;
  for (int64_t i = 0; i < d; ++i) acc += q[i] * to_float(k[i]);
  return acc;
}

template <typename T>
void axpy_row(float a, const T* v, float* out, int64_t d) {
#ifdef TANDEM_AVX2
  if (d % 8 == 0) {
    const __m256 av = _mm256_set1_ps(a);
    for (int64_t i = 0; i < d; i += 8)
      _mm256_storeu_ps(out + i, _mm256_fmadd_ps(av, load8(v + i), _mm256_loadu_ps(out + i)));
    return;
  }
#endif
  for (int64_t i = 0; i < d; ++i) out[i] += a * to_float(v[i]);
}

struct PagedKV {
  const void* base;
  int64_t page_stride, kv_stride, token_stride, head_stride;   // in elements
  int64_t page_size;
};

#ifdef TANDEM_AVX2
// Scores of one key against every query head of its group (q already scaled); d % 8 == 0, group <= 8.
template <typename T>
inline void score_key(const float* q, int64_t group, int64_t d, const T* key, float* scores, int64_t stride) {
  __m256 acc[8];
  for (int64_t g = 0; g < group; ++g) acc[g] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 k = load8(key + i);
    for (int64_t g = 0; g < group; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * d + i), k, acc[g]);
  }
  for (int64_t g = 0; g < group; ++g) scores[g * stride] = hsum(acc[g]);
}

// out[0:64] = sum_j p[j] * value_j[c:c+64] over the visible keys, accumulated in registers.
template <typename T>
inline void weighted_values_64(const float* p, const T* base, const int32_t* pages, const PagedKV& kv,
                               int64_t value_offset, int64_t visible, float* out) {
  __m256 acc[8];
  for (int v = 0; v < 8; ++v) acc[v] = _mm256_setzero_ps();
  for (int64_t page = 0, j = 0; j < visible; ++page) {
    const T* value = base + pages[page] * kv.page_stride + value_offset;
    for (int64_t off = 0; off < kv.page_size && j < visible; ++off, ++j, value += kv.token_stride) {
      const __m256 w = _mm256_set1_ps(p[j]);
      for (int v = 0; v < 8; ++v) acc[v] = _mm256_fmadd_ps(w, load8(value + v * 8), acc[v]);
    }
  }
  for (int v = 0; v < 8; ++v) _mm256_storeu_ps(out + v * 8, acc[v]);
}
#endif

// Softmax of scores[0:n] in place (n padded with -inf up to a multiple of 8); returns the sum.
float softmax_inplace(float* s, int64_t n_padded, float max_score) {
#ifdef TANDEM_AVX2
  const __m256 mx = _mm256_set1_ps(max_score);
  __m256 total = _mm256_setzero_ps();
  for (int64_t j = 0; j < n_padded; j += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), mx));
    _mm256_storeu_ps(s + j, e);
    total = _mm256_add_ps(total, e);
  }
  return hsum(total);
#else
  float total = 0.0f;
  for (int64_t j = 0; j < n_padded; ++j) { s[j] = std::exp(s[j] - max_score); total += s[j]; }
  return total;
#endif
}

// One work item: query rows [row_begin, row_end) of sequence `seq`, the query heads of kv head `kv_head`.
struct WorkItem {
  int64_t seq, kv_head, row_begin, row_end;
};

template <typename T>
void attend(const float* q, float* out, int64_t num_q_heads, int64_t head_dim, int64_t group, const PagedKV& kv,
            const int32_t* pages, int64_t seq_len, int64_t first_pos, int64_t first_row, const WorkItem& item,
            float scale, std::vector<float>& scores, std::vector<float>& q_scaled) {
  const T* base = static_cast<const T*>(kv.base);
  const int64_t d = head_dim;
  const bool is_fast = d % 64 == 0 && group <= 8;   // the AVX2 register-blocked paths apply
  (void)is_fast;
  for (int64_t row = item.row_begin; row < item.row_end; ++row) {
    const int64_t visible = first_pos + (row - first_row) + 1;   // causal: keys at positions 0..pos
    const int64_t padded = (visible + 7) / 8 * 8;
    scores.assign(group * padded, -std::numeric_limits<float>::infinity());
    q_scaled.resize(group * d);
    float max_score[64];
    for (int64_t g = 0; g < group; ++g) {
      const float* qh = q + (row * num_q_heads + item.kv_head * group + g) * d;
      for (int64_t i = 0; i < d; ++i) q_scaled[g * d + i] = qh[i] * scale;
      max_score[g] = -std::numeric_limits<float>::infinity();
    }
    // keys page by page (no division per key); j is the key's position
    for (int64_t page = 0, j = 0; j < visible; ++page) {
      const T* key = base + pages[page] * kv.page_stride + item.kv_head * kv.head_stride;
      for (int64_t off = 0; off < kv.page_size && j < visible; ++off, ++j, key += kv.token_stride) {
#ifdef TANDEM_AVX2
        if (is_fast) {
          score_key(q_scaled.data(), group, d, key, scores.data() + j, padded);
          continue;
        }
#endif
        for (int64_t g = 0; g < group; ++g) scores[g * padded + j] = dot_row(q_scaled.data() + g * d, key, d);
      }
    }
    for (int64_t g = 0; g < group; ++g)
      for (int64_t j = 0; j < visible; ++j) max_score[g] = std::fmax(max_score[g], scores[g * padded + j]);
    for (int64_t g = 0; g < group; ++g) {
      float* o = out + (row * num_q_heads + item.kv_head * group + g) * d;
      std::memset(o, 0, d * sizeof(float));
      float* sg = scores.data() + g * padded;
      const float total = softmax_inplace(sg, padded, max_score[g]);
#ifdef TANDEM_AVX2
      if (is_fast) {
        for (int64_t c = 0; c < d; c += 64)
          weighted_values_64(sg, base, pages, kv, kv.kv_stride + item.kv_head * kv.head_stride + c, visible, o + c);
        const float inv = 1.0f / total;
        for (int64_t i = 0; i < d; ++i) o[i] *= inv;
        continue;
      }
#endif
      for (int64_t page = 0, j = 0; j < visible; ++page) {
        const T* value = base + pages[page] * kv.page_stride + kv.kv_stride + item.kv_head * kv.head_stride;
        for (int64_t off = 0; off < kv.page_size && j < visible; ++off, ++j, value += kv.token_stride)
          axpy_row(sg[j], value, o, d);
      }
      const float inv = 1.0f / total;
      for (int64_t i = 0; i < d; ++i) o[i] *= inv;
    }
  }
}

}  // namespace

// q [T, Hq, D] float32 contiguous; kv_cache [P, 2, S, Hkv, D] (float32 or bfloat16; any page stride,
// the rest contiguous); CSR page table as FlashInfer takes it (int32): qo_indptr [B+1] over q's rows,
// kv_indptr [B+1] over kv_indices (each sequence's pages in order), kv_last_page_len [B] in 1..S.
// Causal: query row i of a sequence with q_len rows and seq_len keys sits at seq_len - q_len + i.
// Returns [T, Hq, D] float32.
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor qo_indptr,
                              torch::Tensor kv_indptr, torch::Tensor kv_indices, torch::Tensor kv_last_page_len,
                              double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q: [T, Hq, D] float32");
  TORCH_CHECK(kv_cache.dim() == 5, "kv_cache: [P, 2, S, Hkv, D]");
  TORCH_CHECK(kv_cache.stride(4) == 1 && kv_cache.stride(3) == kv_cache.size(4) &&
              kv_cache.stride(2) == kv_cache.size(3) * kv_cache.size(4), "kv_cache: each page's rows contiguous");
  for (const auto& t : {qo_indptr, kv_indptr, kv_indices, kv_last_page_len})
    TORCH_CHECK(t.scalar_type() == torch::kInt32 && t.is_contiguous(), "page table tensors must be int32");
  const int64_t num_rows = q.size(0), num_q_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = kv_cache.size(3), page_size = kv_cache.size(2);
  TORCH_CHECK(kv_cache.size(4) == head_dim && num_q_heads % num_kv_heads == 0, "head shapes");
  const int64_t group = num_q_heads / num_kv_heads;
  TORCH_CHECK(group <= 64, "at most 64 query heads per kv head");
  const int64_t batch = qo_indptr.size(0) - 1;
  const int32_t* qo = qo_indptr.data_ptr<int32_t>();
  const int32_t* kvp = kv_indptr.data_ptr<int32_t>();
  const int32_t* last = kv_last_page_len.data_ptr<int32_t>();
  const int32_t* indices = kv_indices.data_ptr<int32_t>();
  TORCH_CHECK(qo[batch] == num_rows, "qo_indptr[-1] must equal q's rows");
  std::vector<WorkItem> items;
  std::vector<int64_t> seq_lens(batch);
  constexpr int64_t kRowsPerItem = 8;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t num_pages = kvp[b + 1] - kvp[b];
    TORCH_CHECK(num_pages >= 1 && last[b] >= 1 && last[b] <= page_size, "sequence ", b, ": bad page count");
    seq_lens[b] = (num_pages - 1) * page_size + last[b];
    TORCH_CHECK(qo[b + 1] - qo[b] <= seq_lens[b], "sequence ", b, " has more queries than keys");
    for (int32_t i = kvp[b]; i < kvp[b + 1]; ++i)
      TORCH_CHECK(indices[i] >= 0 && indices[i] < kv_cache.size(0), "page id out of range");
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t r = qo[b]; r < qo[b + 1]; r += kRowsPerItem)
        items.push_back({b, h, r, std::min<int64_t>(qo[b + 1], r + kRowsPerItem)});
  }
  auto out = torch::empty_like(q);
  const PagedKV kv{kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
                   kv_cache.stride(3), page_size};
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const bool is_bf16 = kv_cache.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(is_bf16 || kv_cache.scalar_type() == torch::kFloat32, "kv_cache must be float32 or bfloat16");
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, q_scaled;
    for (int64_t i = begin; i < end; ++i) {
      const WorkItem& item = items[i];
      const int64_t b = item.seq;
      const int64_t first_pos = seq_lens[b] - (qo[b + 1] - qo[b]);
      if (is_bf16)
        attend<at::BFloat16>(qp, op, num_q_heads, head_dim, group, kv, indices + kvp[b], seq_lens[b], first_pos,
                             qo[b], item, static_cast<float>(scale), scores, q_scaled);
      else
        attend<float>(qp, op, num_q_heads, head_dim, group, kv, indices + kvp[b], seq_lens[b], first_pos, qo[b],
                      item, static_cast<float>(scale), scores, q_scaled);
    }
  });
  return out;
}

// ---- fused elementwise layers (float32) ----------------------------------------------------------

namespace {

float sum_of_squares(const float* x, int64_t n) {
  int64_t i = 0;
  float total = 0.0f;
#ifdef TANDEM_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  total = hsum(acc);
#endif
  for (; i < n; ++i) total += x[i] * x[i];
  return total;
}

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), name,
              " must be a contiguous [T, H] float32 tensor");
}

}  // namespace

// RMSNorm as HF Llama computes it in float32: weight * (x / sqrt(mean(x^2) + eps)), row by row.
// With `residual` (same shape, defined): residual += x first (in place), and the sum is normalized.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, torch::optional<torch::Tensor> residual) {
  check_rows(x, "x");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() && weight.numel() == x.size(1),
              "weight must be [H] float32");
  const int64_t t = x.size(0), h = x.size(1);
  auto out = torch::empty_like(x);
  float* res = nullptr;
  if (residual.has_value()) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual must match x");
    res = residual->data_ptr<float>();
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, t, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * h;
      if (res) {
        float* sum = res + r * h;
        for (int64_t i = 0; i < h; ++i) sum[i] += row[i];
        row = sum;
      }
      const float inv = 1.0f / std::sqrt(sum_of_squares(row, h) / static_cast<float>(h) + static_cast<float>(eps));
      float* o = op + r * h;
      for (int64_t i = 0; i < h; ++i) o[i] = wp[i] * (row[i] * inv);
    }
  });
  return out;
}

// silu(gate) * up for gate_up [T, 2I] = [gate | up] -> [T, I].
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t t = gate_up.size(0), width = gate_up.size(1) / 2;
  auto out = torch::empty({t, width}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = gp + r * 2 * width;
      const float* up = gate + width;
      float* o = op + r * width;
      for (int64_t i = 0; i < width; ++i) o[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    }
  });
  return out;
}

// Rotary embedding (rotate-half) applied to q [T, Hq, D] and k [T, Hkv, D] in place, from tables
// cos/sin [max_pos, D] at `positions` [T]; then k and v [T, Hkv, D] are written into the paged
// cache [P, 2, S, Hkv, D] at (write_pages[t], write_offsets[t]). All float32 but the cache, which may
// be float32 or bfloat16. q, k, v may be strided views of one fused projection (rows contiguous).
void rope_and_store(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                    torch::Tensor positions, torch::Tensor kv_cache, torch::Tensor write_pages,
                    torch::Tensor write_offsets) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
              v.scalar_type() == torch::kFloat32, "q, k, v must be float32");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && q.stride(1) == q.size(2) &&
              k.stride(1) == k.size(2) && v.stride(1) == v.size(2), "q, k, v rows must be contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat32,
              "cos/sin tables must be contiguous float32");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && write_pages.scalar_type() == torch::kInt64 &&
              write_offsets.scalar_type() == torch::kInt64, "positions and write slots must be int64");
  TORCH_CHECK(kv_cache.stride(4) == 1 && kv_cache.stride(3) == kv_cache.size(4), "cache rows must be contiguous");
  const int64_t t = q.size(0), hq = q.size(1), hkv = k.size(1), d = q.size(2), half = d / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* pages = write_pages.data_ptr<int64_t>();
  const int64_t* offsets = write_offsets.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool is_bf16 = kv_cache.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(is_bf16 || kv_cache.scalar_type() == torch::kFloat32, "kv_cache must be float32 or bfloat16");
  for (int64_t r = 0; r < t; ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos.size(0) && pages[r] >= 0 && pages[r] < kv_cache.size(0) &&
                offsets[r] >= 0 && offsets[r] < kv_cache.size(2), "position or write slot out of range");
  at::parallel_for(0, t, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cp + pos[r] * d;
      const float* sn = sp + pos[r] * d;
      auto rotate = [&](float* head) {
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = head[i], x2 = head[i + half];
          head[i] = x1 * c[i] - x2 * sn[i];
          head[i + half] = x2 * c[i + half] + x1 * sn[i + half];
        }
      };
      for (int64_t h = 0; h < hq; ++h) rotate(qp + r * q.stride(0) + h * d);
      for (int64_t h = 0; h < hkv; ++h) rotate(kp + r * k.stride(0) + h * d);
      const int64_t base = pages[r] * kv_cache.stride(0) + offsets[r] * kv_cache.stride(2);
      for (int64_t h = 0; h < hkv; ++h) {
        const float* ks = kp + r * k.stride(0) + h * d;
        const float* vs = vp + r * v.stride(0) + h * d;
        const int64_t kd = base + h * kv_cache.stride(3), vd = kd + kv_cache.stride(1);
        if (is_bf16) {
          at::BFloat16* dst = kv_cache.data_ptr<at::BFloat16>();
          for (int64_t i = 0; i < d; ++i) { dst[kd + i] = ks[i]; dst[vd + i] = vs[i]; }
        } else {
          float* dst = kv_cache.data_ptr<float>();
          std::memcpy(dst + kd, ks, d * sizeof(float));
          std::memcpy(dst + vd, vs, d * sizeof(float));
        }
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qmatmul", &qmatmul, "x [M, K] float32 times block-quantized weights [N, K]^T -> [M, N]; the "
        "activations rounded to int8 blocks (llama.cpp's way) or kept in float32");
  m.def("paged_attention", &paged_attention, "causal attention over a paged KV cache (CSR page table)");
  m.def("rms_norm", &rms_norm, "RMSNorm of [T, H] float32 rows, optionally after adding them into a residual",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("residual") = py::none());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [T, 2I] float32 rows");
  m.def("rope_and_store", &rope_and_store, "rotary embedding on q, k in place; k, v written to the paged cache");
}
