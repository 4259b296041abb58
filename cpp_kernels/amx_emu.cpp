// Software AMX tile emulator: palette 1 (8 tiles of up to 16 rows x 64 bytes), ldtilecfg
// validation, strided loads and stores, tilezero, tdpbusd and tdpbf16ps with the semantics of
// Intel's SDM pseudo-code. It runs the same tile programs as amx_hw.cpp so that tests on
// machines without AMX prove their layout and loop. It is a test tool: slow, and strict — any
// use the hardware would fault on (#UD/#GP) is reported as an error code instead.
#include <cmath>

#include "amx_program.hpp"

namespace {

enum Fault : int {
  kOk = 0,
  kBadConfig = 1,      // ldtilecfg would #GP
  kNotConfigured = 2,  // tile instruction before ldtilecfg: #UD
  kTileOff = 3,        // tile with rows/colsb 0 used
  kShape = 4,          // operand shapes do not match (#UD)
};

struct EmuTiles {
  kt_amx::TileConfig cfg{};
  bool configured = false;
  int fault = kOk;
  alignas(64) uint8_t data[8][16][64];

  // Prefetch is only a hint: the emulator computes the addresses (with a distance, so that
  // code runs) and reads nothing.
  size_t prefetch_bytes() const { return 4096; }
  void prefetch(const void*) {}
  void unpack_int4(const uint8_t* tile, uint8_t* lo, uint8_t* hi) {
    kt_amx::unpack_int4_tile(tile, lo, hi);
  }

  void fail(int f) {
    if (fault == kOk) fault = f;
  }

  void configure(const kt_amx::TileConfig& c) {
    bool ok = c.palette_id == 1 && c.start_row == 0;
    for (uint8_t r : c.reserved) ok = ok && r == 0;
    for (int t = 0; t < 16; ++t) {
      if (t >= 8) {
        ok = ok && c.rows[t] == 0 && c.colsb[t] == 0;
        continue;
      }
      ok = ok && c.rows[t] <= 16 && c.colsb[t] <= 64 && (c.rows[t] == 0) == (c.colsb[t] == 0);
    }
    if (!ok) {
      fail(kBadConfig);
      return;
    }
    cfg = c;
    configured = true;
    std::memset(data, 0, sizeof data);  // ldtilecfg zeroes every tile
  }

  bool usable(int t) {
    if (!configured) {
      fail(kNotConfigured);
      return false;
    }
    if (cfg.rows[t] == 0) {
      fail(kTileOff);
      return false;
    }
    return true;
  }

  template <int T>
  void zero() {
    if (usable(T)) std::memset(data[T], 0, sizeof data[T]);
  }

  template <int T>
  void load(const void* base, size_t stride) {
    if (!usable(T)) return;
    std::memset(data[T], 0, sizeof data[T]);  // bytes past rows/colsb read as zero
    const char* p = static_cast<const char*>(base);
    for (size_t r = 0; r < cfg.rows[T]; ++r) std::memcpy(data[T][r], p + r * stride, cfg.colsb[T]);
  }

  template <int T>
  void store(void* base, size_t stride) {
    if (!usable(T)) return;
    char* p = static_cast<char*>(base);
    for (size_t r = 0; r < cfg.rows[T]; ++r) std::memcpy(p + r * stride, data[T][r], cfg.colsb[T]);
  }

  // C (M x N dwords) += A (M x K dwords) . B (K x N dwords), dword = 4 bytes or 2 bf16.
  bool shapes_ok(int c, int a, int b) {
    if (!usable(c) || !usable(a) || !usable(b)) return false;
    const bool ok = cfg.rows[c] == cfg.rows[a] && cfg.colsb[c] == cfg.colsb[b] &&
                    cfg.colsb[a] == 4 * cfg.rows[b] && cfg.colsb[a] % 4 == 0 &&
                    cfg.colsb[c] % 4 == 0 && c != a && c != b && a != b;
    if (!ok) fail(kShape);
    return ok;
  }

  template <int C, int A, int B>
  void dpbusd() {
    if (!shapes_ok(C, A, B)) return;
    const size_t m_rows = cfg.rows[C], n = cfg.colsb[C] / 4, kq = cfg.colsb[A] / 4;
    for (size_t m = 0; m < m_rows; ++m)
      for (size_t j = 0; j < n; ++j) {
        int32_t acc;
        std::memcpy(&acc, &data[C][m][4 * j], 4);
        uint32_t sum = static_cast<uint32_t>(acc);  // wrapping, like the hardware
        for (size_t q = 0; q < kq; ++q)
          for (size_t b = 0; b < 4; ++b) {
            const int32_t x = data[A][m][4 * q + b];
            const int32_t w = static_cast<int8_t>(data[B][q][4 * j + b]);
            sum += static_cast<uint32_t>(x * w);
          }
        acc = static_cast<int32_t>(sum);
        std::memcpy(&data[C][m][4 * j], &acc, 4);
      }
  }

  static float bf16_to_f32_daz(uint16_t h) {
    uint32_t bits = static_cast<uint32_t>(h) << 16;
    if ((bits & 0x7F800000u) == 0) bits &= 0x80000000u;  // denormal inputs read as zero
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }

  static float flush(float f) {
    return std::fpclassify(f) == FP_SUBNORMAL ? std::copysign(0.0f, f) : f;
  }

  // Per SDM: for each k pair, acc += a.even * b.even, then acc += a.odd * b.odd, each product
  // exact in fp32 and each add rounded to nearest even; denormal results flushed.
  template <int C, int A, int B>
  void dpbf16ps() {
    if (!shapes_ok(C, A, B)) return;
    const size_t m_rows = cfg.rows[C], n = cfg.colsb[C] / 4, kq = cfg.colsb[A] / 4;
    for (size_t m = 0; m < m_rows; ++m)
      for (size_t j = 0; j < n; ++j) {
        float acc;
        std::memcpy(&acc, &data[C][m][4 * j], 4);
        for (size_t q = 0; q < kq; ++q)
          for (size_t t = 0; t < 2; ++t) {
            uint16_t a, b;
            std::memcpy(&a, &data[A][m][4 * q + 2 * t], 2);
            std::memcpy(&b, &data[B][q][4 * j + 2 * t], 2);
            acc = flush(acc + bf16_to_f32_daz(a) * bf16_to_f32_daz(b));
          }
        std::memcpy(&data[C][m][4 * j], &acc, 4);
      }
  }
};

// The emulator of the hardware's cached-panel kernels: no prefetch addresses computed.
struct CachedEmuTiles : EmuTiles {
  size_t prefetch_bytes() const { return 0; }
};

// A few tile programs of its own that the hardware would reject, each must fault as stated.
int check_faults() {
  {
    EmuTiles tm;
    tm.zero<0>();
    if (tm.fault != kNotConfigured) return 101;
  }
  {
    EmuTiles tm;
    kt_amx::TileConfig c = kt_amx::make_config(16, 16);
    c.rows[0] = 17;
    tm.configure(c);
    if (tm.fault != kBadConfig) return 102;
  }
  {
    EmuTiles tm;
    kt_amx::TileConfig c = kt_amx::make_config(16, 16);
    c.colsb[3] = 68;
    tm.configure(c);
    if (tm.fault != kBadConfig) return 103;
  }
  {
    EmuTiles tm;
    kt_amx::TileConfig c = kt_amx::make_config(16, 0);
    c.palette_id = 0;
    tm.configure(c);
    if (tm.fault != kBadConfig) return 104;
  }
  {
    EmuTiles tm;
    tm.configure(kt_amx::make_config(16, 0));  // second row block off
    tm.zero<kt_amx::C10>();
    if (tm.fault != kTileOff) return 105;
  }
  {
    EmuTiles tm;
    tm.configure(kt_amx::make_config(8, 4));  // C00 has 8 rows, A1 has 4
    tm.dpbusd<kt_amx::C00, kt_amx::A1, kt_amx::B0>();
    if (tm.fault != kShape) return 106;
  }
  return kOk;
}

// tdpbusd and tdpbf16ps on random tiles against plain loops over the same numbers, with a
// config of 5 rows so the load/store strides and the zeroed upper rows are exercised.
int check_arithmetic() {
  uint32_t seed = 12345;
  auto next = [&]() {
    seed = seed * 1664525u + 1013904223u;
    return seed >> 8;
  };
  const size_t m = 5, stride_a = 80;
  alignas(64) uint8_t a[m * stride_a];
  alignas(64) uint8_t b[16 * 64];
  for (auto& x : a) x = static_cast<uint8_t>(next());
  for (auto& x : b) x = static_cast<uint8_t>(next());
  EmuTiles tm;
  tm.configure(kt_amx::make_config(m, 0));
  tm.zero<kt_amx::C00>();
  tm.load<kt_amx::A0>(a, stride_a);
  tm.load<kt_amx::B0>(b, 64);
  tm.dpbusd<kt_amx::C00, kt_amx::A0, kt_amx::B0>();
  tm.dpbusd<kt_amx::C00, kt_amx::A0, kt_amx::B0>();  // accumulates
  int32_t c[16][16];
  tm.store<kt_amx::C00>(c, 64);
  if (tm.fault != kOk) return 201;
  for (size_t r = 0; r < m; ++r)
    for (size_t j = 0; j < 16; ++j) {
      int64_t want = 0;
      for (size_t kk = 0; kk < 64; ++kk)
        want += int64_t{a[r * stride_a + kk]} * static_cast<int8_t>(b[(kk / 4) * 64 + 4 * j + kk % 4]);
      if (c[r][j] != 2 * want) return 202;
    }
  if (tm.data[kt_amx::A0][m][0] != 0) return 203;  // rows past the config stay zero

  // bf16: small integers times powers of two, so every sum is exact and order-free.
  alignas(64) uint16_t fa[m * 40], fb[16 * 32];
  auto bf = [&](int v) {
    float f = static_cast<float>(v) * 0.25f;
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    return static_cast<uint16_t>(bits >> 16);
  };
  for (auto& x : fa) x = bf(static_cast<int>(next() % 15) - 7);
  for (auto& x : fb) x = bf(static_cast<int>(next() % 15) - 7);
  tm.configure(kt_amx::make_config(m, 0));
  tm.zero<kt_amx::C00>();
  tm.load<kt_amx::A0>(fa, 80);
  tm.load<kt_amx::B0>(fb, 64);
  tm.dpbf16ps<kt_amx::C00, kt_amx::A0, kt_amx::B0>();
  float fc[16][16];
  tm.store<kt_amx::C00>(fc, 64);
  if (tm.fault != kOk) return 204;
  auto val = [](uint16_t h) {
    uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  };
  for (size_t r = 0; r < m; ++r)
    for (size_t j = 0; j < 16; ++j) {
      double want = 0;
      for (size_t kk = 0; kk < 32; ++kk)
        want += double(val(fa[r * 40 + kk])) * double(val(fb[(kk / 2) * 32 + 2 * j + kk % 2]));
      if (double(fc[r][j]) != want) return 205;
    }
  return kOk;
}

}  // namespace

extern "C" {

// Each returns 0, or the fault code of the first instruction the hardware would reject.
int kt_amx_emu_int8_dot(const uint8_t* const* a, size_t m, size_t k, const uint8_t* group,
                        const int32_t* sums, int32_t* out) {
  EmuTiles tm;
  kt_amx::int8_group(tm, a, m, k, group, sums, out);
  return tm.fault;
}

int kt_amx_emu_int4_dot(const uint8_t* const* a, size_t m, size_t k, const uint8_t* group,
                        const int32_t* sums, int32_t* out) {
  EmuTiles tm;
  kt_amx::int4_group(tm, a, m, k, group, sums, out);
  return tm.fault;
}

int kt_amx_emu_bf16_dot(const uint32_t* const* a, size_t m, size_t k, const uint16_t* panel,
                        float* out) {
  EmuTiles tm;
  kt_amx::bf16_panel(tm, a, m, k, panel, out);
  return tm.fault;
}

// The emulator's own checks: 0, or the number of the first that failed.
int kt_amx_emu_self_test() {
  const int f = check_faults();
  return f != kOk ? f : check_arithmetic();
}

// As kt_amx_emu_bf16_dot, the rows packed by 64-byte column block (ActivationBlocks::Packed).
int kt_amx_emu_bf16_dot_packed(const uint8_t* packed, size_t step_bytes, size_t m, size_t k,
                               const uint16_t* panel, float* out) {
  EmuTiles tm;
  kt_amx::ActivationBlocks act(kt_amx::ActivationBlocks::Packed{packed, step_bytes}, m);
  kt_amx::bf16_panel(tm, act, m, k, panel, out);
  return tm.fault;
}

// The kernels for panels already in cache: the same program without the weight prefetch.
int kt_amx_emu_bf16_dot_cached(const uint32_t* const* a, size_t m, size_t k, const uint16_t* panel,
                               float* out) {
  CachedEmuTiles tm;
  kt_amx::bf16_panel(tm, a, m, k, panel, out);
  return tm.fault;
}

int kt_amx_emu_bf16_dot_packed_cached(const uint8_t* packed, size_t step_bytes, size_t m,
                                      size_t k, const uint16_t* panel, float* out) {
  CachedEmuTiles tm;
  kt_amx::ActivationBlocks act(kt_amx::ActivationBlocks::Packed{packed, step_bytes}, m);
  kt_amx::bf16_panel(tm, act, m, k, panel, out);
  return tm.fault;
}

int kt_amx_emu_bf16_dot_packed_decoding(const uint8_t* packed, size_t step_bytes, size_t m,
                                        size_t k, size_t block_inputs, const uint16_t* panel,
                                        kt_amx::DecodeBlockFn decode, void* ctx, float* out) {
  CachedEmuTiles tm;
  kt_amx::ActivationBlocks act(kt_amx::ActivationBlocks::Packed{packed, step_bytes}, m);
  kt_amx::bf16_panel_decoding(tm, act, m, k, block_inputs, panel, decode, ctx, out);
  return tm.fault;
}

// As kt_amx_emu_int8_dot, the rows packed by 64-byte column block (ActivationBlocks::Packed).
int kt_amx_emu_int8_dot_packed(const uint8_t* packed, size_t step_bytes, size_t m, size_t k,
                               const uint8_t* group, const int32_t* sums, int32_t* out) {
  EmuTiles tm;
  kt_amx::ActivationBlocks act(kt_amx::ActivationBlocks::Packed{packed, step_bytes}, m);
  kt_amx::int8_group(tm, act, m, k, group, sums, out);
  return tm.fault;
}

// As kt_amx_emu_int4_dot, the rows packed by 64-byte column block (ActivationBlocks::Packed).
int kt_amx_emu_int4_dot_packed(const uint8_t* packed, size_t step_bytes, size_t m, size_t k,
                               const uint8_t* group, const int32_t* sums, int32_t* out) {
  EmuTiles tm;
  kt_amx::ActivationBlocks act(kt_amx::ActivationBlocks::Packed{packed, step_bytes}, m);
  kt_amx::int4_group(tm, act, m, k, group, sums, out);
  return tm.fault;
}

}  // extern "C"
