// GGUF blocks -> the matmul's panels in one pass at load: each panel's 16 rows are decoded one
// group at a time (a block, or a K-quant's super-block of 8) into a few KB of codes and scale fields
// on the stack, then interleaved into the panel. The output is byte for byte what
// kernels/packing.py's `pack` makes of engine/weights/gguf_blocks.py's reading (tests/unit/kernels/
// test_repack.py), without a byte per weight in between. The block layouts are llama.cpp's
// (ggml-common.h); the panel layout is packing.py's docstring.

#include "common.h"
#include "kernels.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstring>

namespace tandem {
namespace {

constexpr uint16_t kSign = 0x8000;

uint16_t load16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// One row's group decoded: codes in element order, the fields its packed scales are made of.
struct Group {
  uint8_t q[256];
  uint16_t d, m;             // non-K: float16 d and m (Q4_0's m is -8 d, the form the kernel computes)
  uint8_t sc[16], mn[8];     // K: per block sc and mn (Q6_K: 16 int8 sc, one per 16 elements)
  uint16_t super_d, super_m; // K: float16 D and -Dmin
};

void nibbles(const uint8_t* qs, uint8_t* q) {   // Q4_x / Q5_x: element i low nibble, i + 16 high
  for (int i = 0; i < 16; ++i) {
    q[i] = qs[i] & 0x0F;
    q[i + 16] = qs[i] >> 4;
  }
}

void five_bits(const uint8_t* qh_bytes, uint8_t* q) {   // bit e of the little-endian 32-bit qh above e's nibble
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  for (int e = 0; e < 32; ++e) q[e] |= ((qh >> e) & 1) << 4;
}

void k_scales(const uint8_t* s, Group& g) {   // Q4_K / Q5_K: 8 6-bit sc and mn packed in 12 bytes
  for (int j = 0; j < 4; ++j) {
    g.sc[j] = s[j] & 63;
    g.mn[j] = s[j + 4] & 63;
    g.sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
    g.mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

void k_nibbles(const uint8_t* qs, uint8_t* q) {   // 32 bytes per pair of blocks: the first's low nibbles, the second's high
  for (int p = 0; p < 4; ++p) {
    for (int l = 0; l < 32; ++l) {
      q[64 * p + l] = qs[32 * p + l] & 0x0F;
      q[64 * p + 32 + l] = qs[32 * p + l] >> 4;
    }
  }
}

void decode(QuantFormat f, const uint8_t* b, Group& g) {
  switch (f) {
    case QuantFormat::kQ8_0:
      g.d = load16(b);
      std::memcpy(g.q, b + 2, 32);
      break;
    case QuantFormat::kQ4_0:
      g.d = load16(b);
      g.m = c10::Half(-8.0f * static_cast<float>(c10::Half(g.d, c10::Half::from_bits()))).x;
      nibbles(b + 2, g.q);
      break;
    case QuantFormat::kQ4_1:
      g.d = load16(b);
      g.m = load16(b + 2);
      nibbles(b + 4, g.q);
      break;
    case QuantFormat::kQ5_0:
      g.d = load16(b);
      nibbles(b + 6, g.q);
      five_bits(b + 2, g.q);
      break;
    case QuantFormat::kQ5_1:
      g.d = load16(b);
      g.m = load16(b + 2);
      nibbles(b + 8, g.q);
      five_bits(b + 4, g.q);
      break;
    case QuantFormat::kQ4_K:
    case QuantFormat::kQ5_K:
      g.super_d = load16(b);
      g.super_m = load16(b + 2) ^ kSign;
      k_scales(b + 4, g);
      if (f == QuantFormat::kQ4_K) {
        k_nibbles(b + 16, g.q);
      } else {   // the bit above block j's element l: bit j of qh[l]
        k_nibbles(b + 48, g.q);
        const uint8_t* qh = b + 16;
        for (int j = 0; j < 8; ++j)
          for (int l = 0; l < 32; ++l) g.q[32 * j + l] |= ((qh[l] >> j) & 1) << 4;
      }
      break;
    case QuantFormat::kQ6_K: {   // per half of 128: ql 64 bytes (e, e + 64 low / high), qh 32 bytes (e + 32 s at bits 2s)
      for (int h = 0; h < 2; ++h) {
        const uint8_t* ql = b + 64 * h;
        const uint8_t* qh = b + 128 + 32 * h;
        uint8_t* q = g.q + 128 * h;
        for (int s = 0; s < 4; ++s)   // elements 32 s + l
          for (int l = 0; l < 32; ++l)
            q[32 * s + l] = ((ql[32 * (s & 1) + l] >> (4 * (s >> 1))) & 0x0F) | (((qh[l] >> (2 * s)) & 3) << 4);
      }
      std::memcpy(g.sc, b + 192, 16);
      g.super_d = load16(b + 208);
      break;
    }
  }
}

// Block `blk` of the 16 rows' groups -> its value bytes, then its scale bytes; returns the end.
uint8_t* emit_block(QuantFormat f, const Group* rows, int blk, uint8_t* o) {
  if (f == QuantFormat::kQ8_0) {   // chunk i, byte 2j + t: q[j][2i + t]
    for (int j = 0; j < kPanel; ++j)
      for (int i = 0; i < 16; ++i) std::memcpy(o + 32 * i + 2 * j, rows[j].q + 2 * i, 2);
    o += 512;
  } else {
    const int h = high_bits(f);
    for (int j = 0; j < kPanel; ++j) {
      const uint8_t* q = rows[j].q + 32 * blk;
      for (int i = 0; i < 8; ++i)
        for (int t = 0; t < 2; ++t)
          o[32 * i + 2 * j + t] = (q[4 * i + t] & 0x0F) | ((q[4 * i + 2 + t] & 0x0F) << 4);
      for (int t = 0; t < 2 && h; ++t) {   // the bits above e's nibble at bit h * (e / 2) of the rows' byte 2j + e % 2 read as one number
        uint32_t bits = 0;
        for (int p = 0; p < 16; ++p) bits |= static_cast<uint32_t>(q[2 * p + t] >> 4) << (h * p);
        for (int r = 0; r < 2 * h; ++r) o[256 + 32 * r + 2 * j + t] = static_cast<uint8_t>(bits >> (8 * r));
      }
    }
    o += 256 + 64 * h;
  }
  const bool has_m = f == QuantFormat::kQ4_0 || f == QuantFormat::kQ4_1 || f == QuantFormat::kQ5_1;
  if (!is_k_quant(f)) {
    for (int j = 0; j < kPanel; ++j) std::memcpy(o + 2 * j, &rows[j].d, 2);
    if (has_m)
      for (int j = 0; j < kPanel; ++j) std::memcpy(o + 32 + 2 * j, &rows[j].m, 2);
  } else if (f == QuantFormat::kQ6_K) {
    for (int j = 0; j < kPanel; ++j) {
      o[j] = rows[j].sc[2 * blk];
      o[16 + j] = rows[j].sc[2 * blk + 1];
    }
  } else {
    for (int j = 0; j < kPanel; ++j) {
      o[j] = rows[j].sc[blk];
      o[16 + j] = rows[j].mn[blk];
    }
  }
  return o + scale_bytes(f);
}

// The bits at even positions of x, packed into the low 16 (BMI2's pext with 0x55555555).
uint32_t even_bits(uint32_t x) {
  x &= 0x55555555u;
  x = (x | (x >> 1)) & 0x33333333u;
  x = (x | (x >> 2)) & 0x0F0F0F0Fu;
  x = (x | (x >> 4)) & 0x00FF00FFu;
  return (x | (x >> 8)) & 0x0000FFFFu;
}

// Q8_0, Q4_x, Q5_x: one (panel, block) straight from the 16 rows' GGUF blocks (null: a padding
// row, whose bytes the caller zeroed), without decoding codes first (the bulk of a Q4_K_M file is Q5_0).
void emit_legacy(QuantFormat f, const uint8_t* const* blocks, uint8_t* o) {
  const bool has_m = f == QuantFormat::kQ4_1 || f == QuantFormat::kQ5_1;
  const bool is_q5 = f == QuantFormat::kQ5_0 || f == QuantFormat::kQ5_1;
  const int qh_at = has_m ? 4 : 2, qs_at = qh_at + (is_q5 ? 4 : 0);
  uint8_t* scales = o + value_bytes(f);
  for (int j = 0; j < kPanel; ++j) {
    const uint8_t* b = blocks[j];
    if (b == nullptr) continue;
    if (f == QuantFormat::kQ8_0) {   // chunk i, byte 2j + t: q[2i + t]
      for (int i = 0; i < 16; ++i) std::memcpy(o + 32 * i + 2 * j, b + 2 + 2 * i, 2);
    } else {   // element e < 16: low nibble of qs[e], e >= 16: high nibble of qs[e - 16]
      const uint8_t* qs = b + qs_at;
      for (int i = 0; i < 4; ++i)
        for (int t = 0; t < 2; ++t) {
          o[32 * i + 2 * j + t] = (qs[4 * i + t] & 0x0F) | ((qs[4 * i + 2 + t] & 0x0F) << 4);
          o[32 * (i + 4) + 2 * j + t] = (qs[4 * i + t] >> 4) | (qs[4 * i + 2 + t] & 0xF0);
        }
      if (is_q5) {   // element e's fifth bit, bit e of qh, goes to bit e / 2 of byte 2j + e % 2's 16-bit number
        uint32_t qh;
        std::memcpy(&qh, b + qh_at, 4);
        for (int t = 0; t < 2; ++t) {
          const uint32_t bits = even_bits(qh >> t);
          o[256 + 2 * j + t] = static_cast<uint8_t>(bits);
          o[288 + 2 * j + t] = static_cast<uint8_t>(bits >> 8);
        }
      }
    }
    std::memcpy(scales + 2 * j, b, 2);
    if (has_m) {
      std::memcpy(scales + 32 + 2 * j, b + 2, 2);
    } else if (f == QuantFormat::kQ4_0) {
      const uint16_t m = c10::Half(-8.0f * static_cast<float>(c10::Half(load16(b), c10::Half::from_bits()))).x;
      std::memcpy(scales + 32 + 2 * j, &m, 2);
    }
  }
}

}  // namespace

int64_t gguf_row_bytes(QuantFormat f, int64_t k) {
  static constexpr int64_t kBytes[kNumFormats] = {34, 18, 20, 22, 24, 144, 176, 210};   // per GGUF block
  return k / (is_k_quant(f) ? 256 : 32) * kBytes[static_cast<int>(f)];
}

void repack_gguf(const uint8_t* raw, QuantFormat f, int64_t n, int64_t k, const int64_t* order, uint8_t* out) {
  const int64_t row_bytes = gguf_row_bytes(f, k), groups = k / (32 * group_blocks(f));
  const int64_t in_group = row_bytes / groups, panels = (n + kPanel - 1) / kPanel, bytes = panel_bytes(f, k);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    Group rows[kPanel];
    const uint8_t* starts[kPanel];
    for (int64_t p = begin; p < end; ++p) {
      uint8_t* o = out + p * bytes;
      if (!is_k_quant(f)) {
        for (int64_t j = 0; j < kPanel; ++j) {
          const int64_t r = p * kPanel + j;
          starts[j] = r < n ? raw + (order ? order[r] : r) * row_bytes : nullptr;
        }
        if (p * kPanel + kPanel > n) std::memset(o, 0, bytes);   // padding columns: zero codes and scales
        const uint8_t* blocks[kPanel];
        for (int64_t g = 0; g < groups; ++g, o += group_bytes(f)) {
          for (int64_t j = 0; j < kPanel; ++j) blocks[j] = starts[j] ? starts[j] + g * in_group : nullptr;
          emit_legacy(f, blocks, o);
        }
        continue;
      }
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t j = 0; j < kPanel; ++j) {
          const int64_t r = p * kPanel + j;
          if (r < n) {
            decode(f, raw + (order ? order[r] : r) * row_bytes + g * in_group, rows[j]);
          } else {
            std::memset(&rows[j], 0, sizeof(Group));   // padding columns: zero codes and scales
          }
        }
        for (int blk = 0; blk < group_blocks(f); ++blk) o = emit_block(f, rows, blk, o);
        if (is_k_quant(f)) {
          for (int j = 0; j < kPanel; ++j) std::memcpy(o + 2 * j, &rows[j].super_d, 2);
          o += 32;
          if (f != QuantFormat::kQ6_K) {
            for (int j = 0; j < kPanel; ++j) std::memcpy(o + 2 * j, &rows[j].super_m, 2);
            o += 32;
          }
        }
      }
    }
  });
}

}  // namespace tandem
