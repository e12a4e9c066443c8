// What every Tandem CPU kernel shares: the instruction set the compiler targets, and small vector helpers.
//
// The kernels are compiled for one machine (kernels/native.py: -march=native, or x86-64-v3 for
// images). Each has up to three paths, picked at compile time by what the compiler targets:
// AVX-512 (F, BW, VL, VNNI), AVX2 + FMA, and portable scalar code. Where a kernel promises it, the
// paths compute the same bits (same integer sums, same float operations in the same order per lane).
//
// Every kernel is row-invariant: an output row is computed by the same sequence of operations
// whatever the number of rows in the call and however threads split the work (threads split
// output columns or (sequence, kv head) pairs, never a reduction). Greedy decoding is therefore
// independent of which other requests share a batch.
#pragma once

#include <cstdint>
#include <memory>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define TANDEM_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define TANDEM_AVX2 1
#endif
#if defined(TANDEM_AVX512) || defined(TANDEM_AVX2)
#include <immintrin.h>
#endif

namespace tandem {

// Scratch memory the caller writes in full before reading: unlike std::vector, not zero-filled first
// (the fused layer's buffers are a few MB per layer in a long prefill).
template <typename T>
std::unique_ptr<T[]> scratch(int64_t n) {
  return std::unique_ptr<T[]>(new T[n]);
}

constexpr int64_t kBlock = 32;   // elements per quantization block (GGUF's QK8_0 / QK4_0 / QK4_1)

// The instruction set this build computes with, for logs and docs.
inline const char* isa_name() {
#if defined(TANDEM_AVX512)
  return "avx512-vnni";
#elif defined(TANDEM_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

#ifdef TANDEM_AVX2
inline float hsum(__m256 v) {
  __m128 r = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  r = _mm_add_ss(r, _mm_movehdup_ps(r));
  return _mm_cvtss_f32(r);
}
#endif

}  // namespace tandem
