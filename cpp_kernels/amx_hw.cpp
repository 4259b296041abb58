// AMX hardware backend: the tile programs of amx_program.hpp on the real instructions.
// Compiled with -mamx-tile -mamx-int8 -mamx-bf16 and AVX-512 F/BW (every AMX CPU has them; the
// Rust side's amx level requires them). The Rust side calls these only when CPUID, XCR0 and
// Linux's arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) all allow AMX.
#include <immintrin.h>

#include <atomic>

#include "amx_program.hpp"

namespace {

// Bytes ahead of the tile being loaded that the programs prefetch (kt_amx_set_prefetch): [0]
// the programs whose tile loads read the weights, [1] AMXINT4's, whose vector unpacking reads
// them. Tuned apart (kernels::amx::AmxStream): how much each gains differs by machine. These
// start values are kernels::amx::PREFETCH_BYTES and INT4_PREFETCH_BYTES; keep them equal.
std::atomic<size_t> g_prefetch_bytes[2] = {1024, 4096};

// Our own asm, not GCC's tile intrinsics: GCC 12's _tile_loadconfig tells the compiler it reads
// 8 bytes (so the stores that fill rows and column widths may be dropped as dead; seen: tilezero
// then faults with #UD) and _tile_loadd tells it it reads no memory (so stores to a buffer a
// tile is loaded from may be moved past the load). Here the configuration is a 64-byte "m"
// operand and every tile load or store clobbers memory.
#define KT_STR(x) #x
#define KT_XSTR(x) KT_STR(x)
#define KT_TILE_LOAD(t, base, stride) \
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm" KT_XSTR(t)::"r"(base), "r"(stride) : "memory")
#define KT_TILE_STORE(t, base, stride) \
  __asm__ volatile("tilestored %%tmm" KT_XSTR(t) ", (%0,%1,1)" ::"r"(base), "r"(stride) : "memory")
#define KT_TILE_ZERO(t, unused) __asm__ volatile("tilezero %%tmm" KT_XSTR(t)::)
#define KT_TDPBUSD(c, a, b) \
  __asm__ volatile("tdpbusd %%tmm" KT_XSTR(b) ", %%tmm" KT_XSTR(a) ", %%tmm" KT_XSTR(c)::)
#define KT_TDPBF16PS(c, a, b) \
  __asm__ volatile("tdpbf16ps %%tmm" KT_XSTR(b) ", %%tmm" KT_XSTR(a) ", %%tmm" KT_XSTR(c)::)

// The tile number is part of the instruction text, so it must be a literal: these expand one
// branch per tile (or per operand triple we use).
#define KT_EACH_TILE(T, OP, ...)                  \
  do {                                            \
    if constexpr ((T) == 0) OP(0, __VA_ARGS__);   \
    else if constexpr ((T) == 1) OP(1, __VA_ARGS__); \
    else if constexpr ((T) == 2) OP(2, __VA_ARGS__); \
    else if constexpr ((T) == 3) OP(3, __VA_ARGS__); \
    else if constexpr ((T) == 4) OP(4, __VA_ARGS__); \
    else if constexpr ((T) == 5) OP(5, __VA_ARGS__); \
    else if constexpr ((T) == 6) OP(6, __VA_ARGS__); \
    else OP(7, __VA_ARGS__);                      \
  } while (0)

#define KT_ZERO(t, unused) KT_TILE_ZERO(t, unused)
#define KT_LOAD(t, base, stride) KT_TILE_LOAD(t, base, stride)
#define KT_STORE(t, base, stride) KT_TILE_STORE(t, base, stride)

template <int C, int A, int B>
constexpr bool kKnownTriple = (C == 0 && A == 4 && B == 6) || (C == 1 && A == 4 && B == 7) ||
                              (C == 2 && A == 5 && B == 6) || (C == 3 && A == 5 && B == 7);

#define KT_EACH_TRIPLE(C, A, B, OP)                                                      \
  do {                                                                                   \
    static_assert(kKnownTriple<C, A, B>, "add this operand triple to the dispatch");     \
    if constexpr ((C) == 0) OP(0, 4, 6);                                                 \
    else if constexpr ((C) == 1) OP(1, 4, 7);                                            \
    else if constexpr ((C) == 2) OP(2, 5, 6);                                            \
    else OP(3, 5, 7);                                                                    \
  } while (0)

struct HwTiles {
  size_t prefetch_bytes() const { return g_prefetch_bytes[0].load(std::memory_order_relaxed); }
  // Into L2 (measured on Emerald Rapids: T0, T1 and T2 alike, NTA half as fast), leaving L1
  // to the activations. asm, not _mm_prefetch: GCC 12 dropped the builtin's prefetches from
  // these loops.
  void prefetch(const void* line) { __asm__ volatile("prefetcht1 (%0)" ::"r"(line)); }
  void unpack_int4(const uint8_t* tile, uint8_t* lo, uint8_t* hi) {
    const __m512i high = _mm512_set1_epi8(static_cast<char>(0xF0));
    for (size_t i = 0; i < 2048; i += 64) {
      const __m512i v = _mm512_loadu_si512(tile + i);
      // A 16-bit shift moves each byte's low nibble into its high nibble; the mask drops what
      // crossed over from the neighbouring byte.
      _mm512_store_si512(lo + i, _mm512_and_si512(_mm512_slli_epi16(v, 4), high));
      _mm512_store_si512(hi + i, _mm512_and_si512(v, high));
    }
  }
  // Checked on every call: other code on the same thread (oneDNN inside torch, say) may have
  // changed the tile configuration since our last kernel ran. Loaded only when it differs:
  // ldtilecfg costs several hundred cycles (it also zeroes every tile), sttilecfg and the
  // compare a few (measured: a 512-input bf16 panel call 18% faster, a 2048-input one 12%).
  void configure(const kt_amx::TileConfig& c) {
    kt_amx::TileConfig current;
    __asm__ volatile("sttilecfg %0" : "=m"(current));
    if (std::memcmp(&current, &c, sizeof c) != 0) __asm__ volatile("ldtilecfg %0" ::"m"(c));
  }
  template <int T>
  void zero() {
    KT_EACH_TILE(T, KT_ZERO, 0);
  }
  template <int T>
  void load(const void* base, size_t stride) {
    KT_EACH_TILE(T, KT_LOAD, base, stride);
  }
  template <int T>
  void store(void* base, size_t stride) {
    KT_EACH_TILE(T, KT_STORE, base, stride);
  }
  template <int C, int A, int B>
  void dpbusd() {
    KT_EACH_TRIPLE(C, A, B, KT_TDPBUSD);
  }
  template <int C, int A, int B>
  void dpbf16ps() {
    KT_EACH_TRIPLE(C, A, B, KT_TDPBF16PS);
  }
};

// AMXINT4's groups: the vector unpacking, not the tile loads, reads the weights.
struct Int4HwTiles : HwTiles {
  size_t prefetch_bytes() const { return g_prefetch_bytes[1].load(std::memory_order_relaxed); }
};

// For weights already in cache (panels a decoder has just written): prefetching them again
// only spends load slots (MXFP4's 512-token layer: 61-68 ms with, 58 ms without).
struct CachedHwTiles : HwTiles {
  size_t prefetch_bytes() const { return 0; }
};

template <bool kBf16>
uint64_t tile_peak(uint64_t iters) {
  alignas(64) static const uint8_t zeros[1024] = {};
  HwTiles tm;
  kt_amx::begin(tm, 32);
  tm.load<kt_amx::A0>(zeros, 64);
  tm.load<kt_amx::A1>(zeros, 64);
  tm.load<kt_amx::B0>(zeros, 64);
  tm.load<kt_amx::B1>(zeros, 64);
  for (uint64_t i = 0; i < iters; ++i) {
    if constexpr (kBf16) {
      tm.dpbf16ps<kt_amx::C00, kt_amx::A0, kt_amx::B0>();
      tm.dpbf16ps<kt_amx::C01, kt_amx::A0, kt_amx::B1>();
      tm.dpbf16ps<kt_amx::C10, kt_amx::A1, kt_amx::B0>();
      tm.dpbf16ps<kt_amx::C11, kt_amx::A1, kt_amx::B1>();
    } else {
      tm.dpbusd<kt_amx::C00, kt_amx::A0, kt_amx::B0>();
      tm.dpbusd<kt_amx::C01, kt_amx::A0, kt_amx::B1>();
      tm.dpbusd<kt_amx::C10, kt_amx::A1, kt_amx::B0>();
      tm.dpbusd<kt_amx::C11, kt_amx::A1, kt_amx::B1>();
    }
  }
  // Multiply-adds per instruction: 16 x 16 outputs, 64 bytes (int8) or 32 bf16 each.
  return iters * 4 * (16 * 16 * (kBf16 ? 32 : 64)) * 2;
}

}  // namespace

extern "C" {

void kt_amx_set_prefetch(size_t stream, size_t bytes) {
  if (stream < 2) g_prefetch_bytes[stream].store(bytes, std::memory_order_relaxed);
}

// Peak rate of this core's tile unit (the yardstick of the AMX kernels): `iters` rounds of four
// independent tdpbusd (or tdpbf16ps) on full 16x64-byte tiles. Returns the operations done,
// 2 per multiply-add.
uint64_t kt_amx_peak_int8(uint64_t iters) { return tile_peak<false>(iters); }

uint64_t kt_amx_peak_bf16(uint64_t iters) { return tile_peak<true>(iters); }

void kt_amx_int8_dot(const uint8_t* const* a, size_t m, size_t k, const uint8_t* group,
                     const int32_t* sums, int32_t* out) {
  HwTiles tm;
  kt_amx::int8_group(tm, a, m, k, group, sums, out);
}

void kt_amx_int4_dot(const uint8_t* const* a, size_t m, size_t k, const uint8_t* group,
                     const int32_t* sums, int32_t* out) {
  Int4HwTiles tm;
  kt_amx::int4_group(tm, a, m, k, group, sums, out);
}

void kt_amx_bf16_dot(const uint32_t* const* a, size_t m, size_t k, const uint16_t* panel,
                     float* out) {
  HwTiles tm;
  kt_amx::bf16_panel(tm, a, m, k, panel, out);
}

// As kt_amx_bf16_dot, the rows packed by 64-byte column block (ActivationBlocks::Packed).
void kt_amx_bf16_dot_packed(const uint8_t* packed, size_t step_bytes, size_t m, size_t k,
                            const uint16_t* panel, float* out) {
  HwTiles tm;
  kt_amx::ActivationBlocks act(kt_amx::ActivationBlocks::Packed{packed, step_bytes}, m);
  kt_amx::bf16_panel(tm, act, m, k, panel, out);
}

// kt_amx_bf16_dot and kt_amx_bf16_dot_packed for a panel already in cache (no prefetch).
void kt_amx_bf16_dot_cached(const uint32_t* const* a, size_t m, size_t k, const uint16_t* panel,
                            float* out) {
  CachedHwTiles tm;
  kt_amx::bf16_panel(tm, a, m, k, panel, out);
}

void kt_amx_bf16_dot_packed_cached(const uint8_t* packed, size_t step_bytes, size_t m, size_t k,
                                   const uint16_t* panel, float* out) {
  CachedHwTiles tm;
  kt_amx::ActivationBlocks act(kt_amx::ActivationBlocks::Packed{packed, step_bytes}, m);
  kt_amx::bf16_panel(tm, act, m, k, panel, out);
}

// kt_amx_bf16_dot_packed_cached over a panel that `decode` writes as the tiles go
// (kt_amx::bf16_panel_decoding).
void kt_amx_bf16_dot_packed_decoding(const uint8_t* packed, size_t step_bytes, size_t m, size_t k,
                                     size_t block_inputs, const uint16_t* panel,
                                     kt_amx::DecodeBlockFn decode, void* ctx, float* out) {
  CachedHwTiles tm;
  kt_amx::ActivationBlocks act(kt_amx::ActivationBlocks::Packed{packed, step_bytes}, m);
  kt_amx::bf16_panel_decoding(tm, act, m, k, block_inputs, panel, decode, ctx, out);
}

// As kt_amx_int8_dot, the rows packed by 64-byte column block (ActivationBlocks::Packed).
void kt_amx_int8_dot_packed(const uint8_t* packed, size_t step_bytes, size_t m, size_t k,
                            const uint8_t* group, const int32_t* sums, int32_t* out) {
  HwTiles tm;
  kt_amx::ActivationBlocks act(kt_amx::ActivationBlocks::Packed{packed, step_bytes}, m);
  kt_amx::int8_group(tm, act, m, k, group, sums, out);
}

// As kt_amx_int4_dot, the rows packed by 64-byte column block (ActivationBlocks::Packed).
void kt_amx_int4_dot_packed(const uint8_t* packed, size_t step_bytes, size_t m, size_t k,
                            const uint8_t* group, const int32_t* sums, int32_t* out) {
  Int4HwTiles tm;
  kt_amx::ActivationBlocks act(kt_amx::ActivationBlocks::Packed{packed, step_bytes}, m);
  kt_amx::int4_group(tm, act, m, k, group, sums, out);
}

}  // extern "C"
