// AMX tile programs for kt-kernel, written once against a tile backend.
//
// Two translation units instantiate them: amx_hw.cpp with the real instructions (compiled with
// -mamx-tile -mamx-int8 -mamx-bf16, called only when CPUID, XCR0 and Linux's arch_prctl
// permission all allow AMX) and amx_emu.cpp with a software tile emulator (runs anywhere; the
// tests compare it with the Rust scalar twins). Because both run this very code, the emulator
// proves the data layout, the tile configuration and the loop of the hardware kernels.
//
// A backend provides:
//   void configure(const TileConfig&);
//   template <int T> void zero();
//   template <int T> void load(const void* base, size_t stride);
//   template <int T> void store(void* base, size_t stride);
//   template <int C, int A, int B> void dpbusd();    // u8 x s8 -> s32
//   template <int C, int A, int B> void dpbf16ps();  // bf16 pairs -> f32
//   size_t prefetch_bytes();                       // how far ahead to prefetch weights (0: off)
//   void prefetch(const void* line);               // a hint for one 64-byte line; may be a no-op
//   void unpack_int4(const uint8_t* tile, uint8_t* lo, uint8_t* hi);  // see unpack_int4_tile
//
// Weight layouts (see crates/kt-core/src/quant.rs and pack.rs):
// - AMXINT8 group of 32 outputs: per 64 inputs a 2048-byte tile; its half h (outputs 16h..16h+16)
//   is 16 lines of 64 bytes, line w = inputs 4w..4w+4 of each of the 16 outputs. That is the
//   B-operand shape of tdpbusd, so a half loads as one tile with stride 64.
// - AMXINT4: the same lines, but each byte holds two inputs: the low nibble belongs to the first
//   64 inputs of a 128-input tile, the high nibble to the second 64. Each nibble moved to the top
//   of a byte is 16*v as a signed byte, so the unpacked lines are ordinary int8 B operands.
// - bf16 panel of 32 outputs: per input pair q, 64 bf16 = half h at +32h, output j, input bit t.
//   Half h of pairs q0..q0+16 is the tdpbf16ps B operand with a stride of 128 bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kt_amx {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");

// Tile roles: four accumulators (row block b, output half h) -> C<b><h>, two activation row
// blocks, two weight halves.
enum : int { C00 = 0, C01 = 1, C10 = 2, C11 = 3, A0 = 4, A1 = 5, B0 = 6, B1 = 7 };

constexpr size_t kMaxRows = 32;  // token rows per call: two 16-row tiles

// m0 rows in the first block, m1 (maybe 0) in the second; every row is 64 bytes wide.
inline TileConfig make_config(size_t m0, size_t m1) {
  TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette_id = 1;
  auto set = [&](int t, size_t rows) {
    c.rows[t] = static_cast<uint8_t>(rows);
    c.colsb[t] = rows ? 64 : 0;
  };
  set(C00, m0);
  set(C01, m0);
  set(A0, m0);
  set(C10, m1);
  set(C11, m1);
  set(A1, m1);
  set(B0, 16);
  set(B1, 16);
  return c;
}

// The activation operand of one 64-byte column block for both row blocks. Rows a constant
// stride apart load straight from the caller's memory; scattered rows are first gathered into a
// 64-byte-stride stage (the tile load needs one stride). Rows the caller packed already (see
// `Packed`) load straight from the packing.
class ActivationBlocks {
 public:
  // Rows packed by 64-byte column block: block c of row r at base + c * step_bytes + r * 64
  // (step_bytes >= m * 64). Each tile then loads 1 KiB of adjacent lines, and no column block
  // is gathered again for each weight panel that reuses the rows.
  struct Packed {
    const uint8_t* base;
    size_t step_bytes;
  };
  ActivationBlocks(Packed p, size_t m)
      : m_(m), stride_(64), contiguous_(true), packed_(p.base), step_bytes_(p.step_bytes) {}

  template <class T>
  ActivationBlocks(const T* const* rows_in, size_t m) : m_(m) {
    for (size_t r = 0; r < m; ++r) rows_[r] = reinterpret_cast<const uint8_t*>(rows_in[r]);
    const uint8_t* const* rows = rows_;
    stride_ = 64;
    contiguous_ = true;
    if (m > 1) {
      const ptrdiff_t s = rows[1] - rows[0];
      contiguous_ = s > 0;
      for (size_t r = 2; contiguous_ && r < m; ++r) contiguous_ = rows[r] - rows[r - 1] == s;
      if (contiguous_) stride_ = static_cast<size_t>(s);
    }
  }
  // Make columns [byte_col, byte_col + 64) of every row available.
  void select(size_t byte_col) {
    col_ = byte_col;
    if (packed_) return;
    if (!contiguous_)
      for (size_t r = 0; r < m_; ++r) std::memcpy(stage_ + r * 64, rows_[r] + byte_col, 64);
  }
  const uint8_t* block(size_t b) const {
    if (packed_) return packed_ + col_ / 64 * step_bytes_ + b * 16 * 64;
    return contiguous_ ? rows_[0] + b * 16 * stride_ + col_ : stage_ + b * 16 * 64;
  }
  size_t stride() const { return contiguous_ ? stride_ : 64; }

 private:
  const uint8_t* rows_[kMaxRows];
  size_t m_;
  size_t stride_;
  bool contiguous_;
  size_t col_ = 0;
  const uint8_t* packed_ = nullptr;
  size_t step_bytes_ = 0;
  alignas(64) uint8_t stage_[kMaxRows * 64];
};

// The two int8 tiles of one 2048-byte AMXINT4 tile: each nibble moved to the top of its byte
// (16*v as a signed byte). The hardware backend does the same with vector instructions.
inline void unpack_int4_tile(const uint8_t* tile, uint8_t* lo, uint8_t* hi) {
  for (size_t i = 0; i < 2048; ++i) {
    lo[i] = static_cast<uint8_t>(tile[i] << 4);
    hi[i] = static_cast<uint8_t>(tile[i] & 0xF0);
  }
}

// Prefetch the weight bytes [at + dist, at + dist + bytes): a tile load that misses the caches
// stalls the in-order tile unit, so weights are asked for well before their tiles load.
template <class Tiles>
inline void prefetch_ahead(Tiles& tm, const uint8_t* at, size_t bytes, size_t dist) {
  if (dist == 0) return;
  for (size_t off = 0; off < bytes; off += 64) tm.prefetch(at + dist + off);
}

// One K step: both weight halves loaded, every live (row block, half) accumulator updated.
template <class Tiles, bool kBf16>
inline void step(Tiles& tm, const ActivationBlocks& act, bool second_block, const void* b0,
                 const void* b1, size_t b_stride) {
  tm.template load<A0>(act.block(0), act.stride());
  if (second_block) tm.template load<A1>(act.block(1), act.stride());
  tm.template load<B0>(b0, b_stride);
  tm.template load<B1>(b1, b_stride);
  if (kBf16) {
    tm.template dpbf16ps<C00, A0, B0>();
    tm.template dpbf16ps<C01, A0, B1>();
    if (second_block) {
      tm.template dpbf16ps<C10, A1, B0>();
      tm.template dpbf16ps<C11, A1, B1>();
    }
  } else {
    tm.template dpbusd<C00, A0, B0>();
    tm.template dpbusd<C01, A0, B1>();
    if (second_block) {
      tm.template dpbusd<C10, A1, B0>();
      tm.template dpbusd<C11, A1, B1>();
    }
  }
}

// Accumulators out to `out` (32 values of 4 bytes per row): C<b><h> -> rows 16b.., columns 16h...
template <class Tiles>
inline void store_all(Tiles& tm, void* out, bool second_block) {
  char* o = static_cast<char*>(out);
  tm.template store<C00>(o, 128);
  tm.template store<C01>(o + 64, 128);
  if (second_block) {
    tm.template store<C10>(o + 16 * 128, 128);
    tm.template store<C11>(o + 16 * 128 + 64, 128);
  }
}

template <class Tiles>
inline bool begin(Tiles& tm, size_t m) {
  const size_t m0 = m < 16 ? m : 16;
  const bool second = m > 16;
  tm.configure(make_config(m0, m - m0));
  tm.template zero<C00>();
  tm.template zero<C01>();
  if (second) {
    tm.template zero<C10>();
    tm.template zero<C11>();
  }
  return second;
}

// out[r*32 + j] -= 128 * sums[j] for r < m: the bias of the unsigned activations undone. The
// bias row is copied first and the pointers are restrict, so GCC vectorizes it at -O2 (it did
// not with out and sums possibly overlapping: 9% of the AMXINT8 kernel's time went here).
inline void unbias(int32_t* __restrict out, const int32_t* __restrict sums, size_t m) {
  int32_t bias[32];
  for (size_t j = 0; j < 32; ++j) bias[j] = 128 * sums[j];
  for (size_t r = 0; r < m; ++r)
    for (size_t j = 0; j < 32; ++j) out[r * 32 + j] -= bias[j];
}

// out[r*32 + j] = sum_kk (a[r][kk] - 128) * W[j][kk] for an AMXINT8 group (k % 64 == 0).
// Activations are biased unsigned bytes; `sums[j]` = sum_kk W[j][kk] undoes the bias.
template <class Tiles>
void int8_group(Tiles& tm, ActivationBlocks& act, size_t m, size_t k, const uint8_t* group,
                const int32_t* sums, int32_t* out) {
  const bool second = begin(tm, m);
  const size_t dist = tm.prefetch_bytes();
  for (size_t t = 0; t < k / 64; ++t) {
    act.select(t * 64);
    const uint8_t* tile = group + t * 2048;
    prefetch_ahead(tm, tile, 2048, dist);
    step<Tiles, false>(tm, act, second, tile, tile + 1024, 64);
  }
  store_all(tm, out, second);
  unbias(out, sums, m);
}

// The same for an AMXINT4 group (k % 128 == 0): each 2048-byte tile is unpacked to the two
// int8 tiles it holds, then multiplied like AMXINT8. Tile t+1 is unpacked before tile t is
// multiplied, so the tile loads never wait for the stores that just wrote their bytes.
template <class Tiles>
void int4_group(Tiles& tm, ActivationBlocks& act, size_t m, size_t k, const uint8_t* group,
                const int32_t* sums, int32_t* out) {
  const bool second = begin(tm, m);
  const size_t dist = tm.prefetch_bytes();
  alignas(64) uint8_t unpacked[2][2][2048];  // [ping-pong][low / high nibbles]
  const size_t tiles = k / 128;
  tm.unpack_int4(group, unpacked[0][0], unpacked[0][1]);
  for (size_t t = 0; t < tiles; ++t) {
    const uint8_t* tile = group + t * 2048;
    prefetch_ahead(tm, tile, 2048, dist);
    if (t + 1 < tiles) tm.unpack_int4(tile + 2048, unpacked[(t + 1) % 2][0], unpacked[(t + 1) % 2][1]);
    for (size_t s = 0; s < 2; ++s) {
      const uint8_t* b = unpacked[t % 2][s];
      act.select(t * 128 + s * 64);
      step<Tiles, false>(tm, act, second, b, b + 1024, 64);
    }
  }
  store_all(tm, out, second);
  unbias(out, sums, m);
}

template <class Tiles>
void int8_group(Tiles& tm, const uint8_t* const* a, size_t m, size_t k, const uint8_t* group,
                const int32_t* sums, int32_t* out) {
  ActivationBlocks act(a, m);
  int8_group(tm, act, m, k, group, sums, out);
}

template <class Tiles>
void int4_group(Tiles& tm, const uint8_t* const* a, size_t m, size_t k, const uint8_t* group,
                const int32_t* sums, int32_t* out) {
  ActivationBlocks act(a, m);
  int4_group(tm, act, m, k, group, sums, out);
}

// out[r*32 + j] = sum_kk a[r][kk] * W[j][kk] over a bf16 panel (k % 32 == 0); activations are
// bf16 pairs, k/2 per row.
template <class Tiles>
void bf16_panel(Tiles& tm, ActivationBlocks& act, size_t m, size_t k, const uint16_t* panel,
                float* out) {
  const bool second = begin(tm, m);
  const size_t dist = tm.prefetch_bytes();
  const uint8_t* p = reinterpret_cast<const uint8_t*>(panel);
  for (size_t s = 0; s < k / 32; ++s) {
    act.select(s * 64);  // 16 pairs = 64 bytes per row
    const uint8_t* pairs = p + s * 16 * 128;
    prefetch_ahead(tm, pairs, 16 * 128, dist);
    step<Tiles, true>(tm, act, second, pairs, pairs + 64, 128);
  }
  store_all(tm, out, second);
}

template <class Tiles>
void bf16_panel(Tiles& tm, const uint32_t* const* a, size_t m, size_t k, const uint16_t* panel,
                float* out) {
  ActivationBlocks act(a, m);
  bf16_panel(tm, act, m, k, panel, out);
}

// Writes block b (`block_inputs` inputs: block_inputs / 2 pair lines of the panel) of a bf16
// panel that a decoder produces from stored codes.
using DecodeBlockFn = void (*)(void* ctx, size_t b);

// bf16_panel over a panel that `decode` writes block by block as the tiles go: block b + 2 is
// decoded (vector instructions) right after the tile steps of block b are issued, so the
// decoder runs while the tile unit works on earlier blocks, and a block's tile loads come two
// blocks after the stores that wrote it. `panel` is where the decoder writes (the whole panel);
// on return it holds every block, for the expert's further row blocks. The decoder must not
// touch the tiles.
template <class Tiles>
void bf16_panel_decoding(Tiles& tm, ActivationBlocks& act, size_t m, size_t k, size_t block_inputs,
                         const uint16_t* panel, DecodeBlockFn decode, void* ctx, float* out) {
  const size_t blocks = k / block_inputs, steps = block_inputs / 32;
  for (size_t b = 0; b < blocks && b < 2; ++b) decode(ctx, b);
  const bool second = begin(tm, m);
  const uint8_t* p = reinterpret_cast<const uint8_t*>(panel);
  for (size_t b = 0; b < blocks; ++b) {
    for (size_t t = 0; t < steps; ++t) {
      const size_t s = b * steps + t;
      act.select(s * 64);
      const uint8_t* pairs = p + s * 16 * 128;
      step<Tiles, true>(tm, act, second, pairs, pairs + 64, 128);
    }
    if (b + 2 < blocks) decode(ctx, b + 2);
  }
  store_all(tm, out, second);
}

}  // namespace kt_amx
