// AMX hardware backend: the tile programs of amx_program.hpp on the real instructions.
// Compiled with -mamx-tile -mamx-int8 -mamx-bf16. The Rust side calls these only when CPUID,
// XCR0 and Linux's arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) all allow AMX.
#include <immintrin.h>

#include "amx_program.hpp"

namespace {

// GCC's tile intrinsics are macros that paste the tile number into the assembly text, so the
// number must be a literal: these expand one branch per tile (or per operand triple we use).
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

#define KT_ZERO(t, unused) _tile_zero(t)
#define KT_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define KT_STORE(t, base, stride) _tile_stored(t, base, stride)

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
  // Loaded on every call: other code on the same thread (oneDNN inside torch, say) may have
  // changed the tile configuration since our last kernel ran.
  void configure(const kt_amx::TileConfig& c) { _tile_loadconfig(&c); }
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
    KT_EACH_TRIPLE(C, A, B, _tile_dpbusd);
  }
  template <int C, int A, int B>
  void dpbf16ps() {
    KT_EACH_TRIPLE(C, A, B, _tile_dpbf16ps);
  }
};

}  // namespace

extern "C" {

void kt_amx_int8_dot(const uint8_t* const* a, size_t m, size_t k, const uint8_t* group,
                     const int32_t* sums, int32_t* out) {
  HwTiles tm;
  kt_amx::int8_group(tm, a, m, k, group, sums, out);
}

void kt_amx_int4_dot(const uint8_t* const* a, size_t m, size_t k, const uint8_t* group,
                     const int32_t* sums, int32_t* out) {
  HwTiles tm;
  kt_amx::int4_group(tm, a, m, k, group, sums, out);
}

void kt_amx_bf16_dot(const uint32_t* const* a, size_t m, size_t k, const uint16_t* panel,
                     float* out) {
  HwTiles tm;
  kt_amx::bf16_panel(tm, a, m, k, panel, out);
}

}  // extern "C"
