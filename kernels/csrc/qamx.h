// The quantized matmul on AMX tiles (qamx.cpp): the int8 tile multiply of Xeons since Sapphire Rapids,
// for calls of many rows (prefill, large decode batches). The same integer sums and float operations
// as the vector tiles (qmatmul.cpp), so the same bits whichever path a call takes.
#pragma once

#include "common.h"
#include "kernels.h"
#include "qrows.h"

#include <cstdint>

#if defined(TANDEM_AVX512) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define TANDEM_AMX 1
#endif

namespace tandem {

constexpr int64_t kAmxRows = 16;      // rows of one tile
constexpr int64_t kAmxMinRows = 32;   // calls of fewer rows take the vector tiles (docs/performance.md)

// Whether this build has the AMX path (compiled for a CPU with AMX-INT8) and Linux granted this
// process the tile state (asked once per process); false on every other build and system.
bool amx_ready();

// The rounded activations as the tiles read them: a tile multiplies bytes, so the int16 codes split
// as q = 256 * hi + lo (hi signed, lo unsigned), each [rows, k]; and per 16 rows (one tile) and
// block, the 16 rows' scales d and offsets' sums s side by side ([rows / 16, nb, 16]). rows: a
// multiple of 16, the rows past the call's m rounded from zeros.
struct QBytes {
  const int8_t* hi;
  const uint8_t* lo;
  const float* d;
  const float* s;
};
void tile_rows(const QRows& x, int64_t rows, int8_t* hi, uint8_t* lo, float* d, float* s);

// Bytes of the per-thread scratch amx_panel_rows unpacks a panel's codes into.
constexpr int64_t amx_scratch_bytes(int64_t k) { return k / kBlock * 512; }

// Rows [0, m) of x times one panel of format f (cols of its 16 columns) into out (row stride ldo).
// The calling thread's tile state is configured here; amx_release gives it back once a thread is done.
void amx_panel_rows(QuantFormat f, const uint8_t* panel, const QRows& x, const QBytes& bytes, int64_t m, float* out,
                    int64_t ldo, int64_t cols, int8_t* scratch);
void amx_release();

}  // namespace tandem
