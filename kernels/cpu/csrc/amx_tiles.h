// The grouped matmul's AMX path: bf16 panel-major weights times bf16-valued rows on Intel AMX tiles
// (TDPBF16PS), for experts with at least kAmxMinRows rows; and a software model of the tiles that
// runs the same kernel on any CPU (the tests' way to check the tiling on machines without AMX).
//
// Tiles. The kernel configures all 8 tiles as 16 rows x 64 bytes (TileConfig, palette 1):
//   C tiles tmm0..tmm3: 16 rows x 16 fp32 sums; A tiles tmm4, tmm5: 16 rows x 16 dwords, each a bf16
//   pair of x (x[2j] high, x[2j+1] low: the bf16 dot product's pair rows, AmxRows); B tiles tmm6,
//   tmm7: 16 pair rows x 16 columns of one strip of the panels as they lie (panel_layout.h: dword c
//   of pair row j holds w[2j][c] high, w[2j+1][c] low; 2 W elements from one pair row to the next).
//   The panels the engine makes are the tiles' B layout (VNNI pairs), so the weights are not
//   repacked for AMX. A block is up to 32 rows (2 A tiles) x 32 columns (2 strips) with its 4 sums
//   in tiles over all of K, 32 k (16 pair rows) per step; pair rows past K (and a strip's past the
//   panel's end) come from a zeroed copy, rows past the expert's from zero rows of AmxRows.
//
// Rounding. TDPBF16PS adds, per lane, the products of a dword's two bf16 halves in some order, each
// accumulation rounded to nearest even (output denormals flushed, input denormals read as zero).
// Where it adds the high half's product first (AmxOrder::kHighFirst) every product-add is one
// rounding in k order, as on every other path of the kernel, so the AMX path gives their bits.
// The order is probed once per process (DotOrder over the cases of simd.h Bf16DotIsFma); the kernels
// run AMX by default only where it is kHighFirst (simd.h DetectIsa: Isa::kAmxBf16); a CPU that adds
// otherwise keeps the AVX-512 bf16 dot product and says so (expertd_native_cpu_amx_state).
//
// The software model (EmulatedTiles) holds 8 tiles per thread, checks every configuration and
// operand shape the hardware checks (a violation counts in EmulatedTiles::faults instead of
// faulting) and adds in the order it is told (high first, or low first as Intel's pseudo-code
// writes it), so the tests run the kernel, its tails and its probe on every CPU.
#pragma once

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "panel_layout.h"
#include "simd.h"

namespace expertd::amx {

// Experts with fewer rows keep the AVX-512 bf16 dot product: one A tile is 16 rows, and below it
// the padded tile multiplies zeros while the streaming path is already at the read rate.
constexpr int64_t kAmxMinRows = 16;
constexpr int kTileRows = 16;       // rows of every tile as configured
constexpr int kTileBytes = 64;      // bytes of a tile row
constexpr int64_t kStepPairs = 16;  // pair rows (32 k) per step: an A tile's dwords, a B tile's rows

// The 64-byte operand of LDTILECFG (palette 1: 8 tiles of up to 16 rows x 64 bytes).
struct alignas(64) TileConfig {
  uint8_t palette_id = 0;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row, tiles 0..7 (8..15 reserved, zero)
  uint8_t rows[16] = {};    // rows, tiles 0..7 (8..15 reserved, zero)
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

// The kernel's configuration: all 8 tiles 16 rows x 64 bytes.
inline TileConfig KernelConfig() {
  TileConfig config;
  config.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = kTileBytes;
    config.rows[t] = kTileRows;
  }
  return config;
}

// The order TDPBF16PS (or its model) adds a dword's two products in: kHighFirst the kernels' k order
// (and the bf16 dot product's); kLowFirst the other way round; kOther neither (e.g. one rounding of
// the pair's sum); kNone: not probed (no AMX).
enum class AmxOrder : int { kNone = 0, kHighFirst = 1, kLowFirst = 2, kOther = 3 };

// The model's order, set at run time (expertd_native_cpu_emulate_amx; kNone: the model is off and
// the kernels run AMX only on the hardware).
inline std::atomic<int>& EmulatedOrder() {
  static std::atomic<int> order{static_cast<int>(AmxOrder::kNone)};
  return order;
}

// A bf16 as the tiles read it: input denormals as (signed) zero.
inline float TileInput(uint16_t bits) { return (bits & 0x7F80u) == 0 ? Bf16ToFloat(bits & 0x8000u) : Bf16ToFloat(bits); }

// An fp32 sum as the tiles store it: output denormals flushed to (signed) zero.
inline float FlushDenormal(float v) { return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.0f, v) : v; }

// The software model of the 8 tiles, per thread.
struct EmulatedTiles {
  struct State {
    bool configured = false;
    TileConfig config;
    alignas(64) uint8_t data[8][kTileRows][kTileBytes];
  };
  static inline std::atomic<int64_t> faults{0};  // operations the hardware would have refused

  static State& Tiles() {
    thread_local State state;
    return state;
  }
  static bool Fault() {
    faults.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  static bool Usable(int t) {
    const State& s = Tiles();
    return s.configured && s.config.rows[t] > 0 && s.config.colsb[t] > 0 ? true : Fault();
  }
  static void Configure(const TileConfig& config) {
    bool ok = config.palette_id == 1 && config.start_row == 0;
    for (uint8_t b : config.reserved) ok = ok && b == 0;
    for (int t = 0; t < 16; ++t) {
      const bool used = t < 8;
      ok = ok && (used ? config.rows[t] <= kTileRows && config.colsb[t] <= kTileBytes && config.colsb[t] % 4 == 0
                       : config.rows[t] == 0 && config.colsb[t] == 0);
      ok = ok && (config.rows[t] == 0) == (config.colsb[t] == 0);
    }
    State& s = Tiles();
    s.configured = ok || Fault();
    s.config = config;
    std::memset(s.data, 0, sizeof(s.data));
  }
  template <int t>
  static void Zero() {
    if (Usable(t)) std::memset(Tiles().data[t], 0, sizeof(Tiles().data[t]));
  }
  template <int t>
  static void Load(const void* base, int64_t stride) {
    if (!Usable(t)) return;
    State& s = Tiles();
    std::memset(s.data[t], 0, sizeof(s.data[t]));
    for (int r = 0; r < s.config.rows[t]; ++r) {
      std::memcpy(s.data[t][r], static_cast<const uint8_t*>(base) + r * stride, s.config.colsb[t]);
    }
  }
  template <int t>
  static void Store(void* base, int64_t stride) {
    if (!Usable(t)) return;
    const State& s = Tiles();
    for (int r = 0; r < s.config.rows[t]; ++r) {
      std::memcpy(static_cast<uint8_t*>(base) + r * stride, s.data[t][r], s.config.colsb[t]);
    }
  }
  // c += a . b: c [M][N] fp32, a [M][K] bf16 pairs, b [K][N] bf16 pairs (K = a's dwords = b's rows).
  template <int c, int a, int b>
  static void Dot() {
    if (!Usable(c) || !Usable(a) || !Usable(b)) return;
    State& s = Tiles();
    const TileConfig& g = s.config;
    if (g.rows[c] != g.rows[a] || g.colsb[c] != g.colsb[b] || g.colsb[a] / 4 != g.rows[b] || c == a || c == b ||
        a == b) {
      Fault();
      return;
    }
    const bool high_first = EmulatedOrder().load(std::memory_order_relaxed) != static_cast<int>(AmxOrder::kLowFirst);
    for (int m = 0; m < g.rows[c]; ++m) {
      for (int n = 0; n < g.colsb[c] / 4; ++n) {
        float acc;
        std::memcpy(&acc, s.data[c][m] + 4 * n, 4);
        for (int k = 0; k < g.colsb[a] / 4; ++k) {
          uint32_t x, w;
          std::memcpy(&x, s.data[a][m] + 4 * k, 4);
          std::memcpy(&w, s.data[b][k] + 4 * n, 4);
          const float xh = TileInput(x >> 16), xl = TileInput(x & 0xFFFFu);
          const float wh = TileInput(w >> 16), wl = TileInput(w & 0xFFFFu);
          if (high_first) {
            acc = FlushDenormal(std::fma(xl, wl, FlushDenormal(std::fma(xh, wh, acc))));
          } else {
            acc = FlushDenormal(std::fma(xh, wh, FlushDenormal(std::fma(xl, wl, acc))));
          }
        }
        std::memcpy(s.data[c][m] + 4 * n, &acc, 4);
      }
    }
  }
  static void Release() { Tiles().configured = false; }
};

// The hardware's tiles, in inline assembly of our own: the compiler's AMX macros (GCC 12) tell it
// nothing of the memory a tile load reads or a store writes, so it could move the stores that fill
// a tile's source past the load; these clobber memory. The tile index is part of the instruction,
// hence one literal per tile (EXPERTD_TILE_LITERAL).
#define EXPERTD_TILE_LITERAL(t, OP)                          \
  if constexpr (t == 0) OP("0");                             \
  else if constexpr (t == 1) OP("1");                        \
  else if constexpr (t == 2) OP("2");                        \
  else if constexpr (t == 3) OP("3");                        \
  else if constexpr (t == 4) OP("4");                        \
  else if constexpr (t == 5) OP("5");                        \
  else if constexpr (t == 6) OP("6");                        \
  else OP("7")
struct HardwareTiles {
  static void Configure(const TileConfig& config) { __asm__ volatile("ldtilecfg %0" ::"m"(config) : "memory"); }
  template <int t>
  static void Zero() {
#define EXPERTD_TILEZERO(i) __asm__ volatile("tilezero %%tmm" i ::: "memory")
    EXPERTD_TILE_LITERAL(t, EXPERTD_TILEZERO);
#undef EXPERTD_TILEZERO
  }
  template <int t>
  static void Load(const void* base, int64_t stride) {
#define EXPERTD_TILELOAD(i) __asm__ volatile("tileloadd (%0,%1,1), %%tmm" i ::"r"(base), "r"(stride) : "memory")
    EXPERTD_TILE_LITERAL(t, EXPERTD_TILELOAD);
#undef EXPERTD_TILELOAD
  }
  template <int t>
  static void Store(void* base, int64_t stride) {
#define EXPERTD_TILESTORE(i) __asm__ volatile("tilestored %%tmm" i ", (%0,%1,1)" ::"r"(base), "r"(stride) : "memory")
    EXPERTD_TILE_LITERAL(t, EXPERTD_TILESTORE);
#undef EXPERTD_TILESTORE
  }
  // tmm c += tmm a . tmm b (AT&T operand order: b, a, c); the kernel's four products only.
  template <int c, int a, int b>
  static void Dot() {
    static_assert((c == 0 && a == 4 && b == 6) || (c == 1 && a == 4 && b == 7) || (c == 2 && a == 5 && b == 6) ||
                  (c == 3 && a == 5 && b == 7), "the kernel's tile products");
    if constexpr (c == 0) __asm__ volatile("tdpbf16ps %%tmm6, %%tmm4, %%tmm0" ::: "memory");
    else if constexpr (c == 1) __asm__ volatile("tdpbf16ps %%tmm7, %%tmm4, %%tmm1" ::: "memory");
    else if constexpr (c == 2) __asm__ volatile("tdpbf16ps %%tmm6, %%tmm5, %%tmm2" ::: "memory");
    else __asm__ volatile("tdpbf16ps %%tmm7, %%tmm5, %%tmm3" ::: "memory");
  }
  static void Release() { __asm__ volatile("tilerelease" ::: "memory"); }
};
#undef EXPERTD_TILE_LITERAL

// Whether this CPU has AMX-TILE and AMX-BF16, the OS saves their state (XCR0 bits 17, 18), and
// Linux lets this process use the tile data (ARCH_REQ_XCOMP_PERM, once per process; refused, for
// one, where a thread's signal stack is too small for the tile state).
inline bool HardwarePermitted() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx = (edx >> 24 & 1) && (edx >> 22 & 1);  // AMX-TILE, AMX-BF16
  if (!amx || !__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !(ecx >> 27 & 1)) return false;  // OSXSAVE
  uint32_t xcr0_low, xcr0_high;
  __asm__ volatile("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
  if ((xcr0_low & (3u << 17)) != (3u << 17)) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// The order Tiles adds a dword's products in, from simd.h's rounding cases (Bf16RoundingCase): each
// case in lane 0 of one 16 x 16 product whose other lanes are zero.
template <class Tiles>
AmxOrder DotOrder() {
  alignas(64) static thread_local uint32_t a[kTileRows][16], b[kStepPairs][16];
  alignas(64) static thread_local float c[kTileRows][16];
  bool high = true, low = true;
  Tiles::Configure(KernelConfig());
  for (const auto& rc : Bf16RoundingCases()) {
    std::memset(a, 0, sizeof(a));
    std::memset(b, 0, sizeof(b));
    std::memset(c, 0, sizeof(c));
    a[0][0] = rc.x_pair;
    b[0][0] = rc.w_pair;
    c[0][0] = rc.acc;
    Tiles::template Load<0>(c, sizeof(c[0]));
    Tiles::template Load<4>(a, sizeof(a[0]));
    Tiles::template Load<6>(b, sizeof(b[0]));
    Tiles::template Dot<0, 4, 6>();
    Tiles::template Store<0>(c, sizeof(c[0]));
    high = high && FloatBits(c[0][0]) == FloatBits(rc.HighFirst());
    low = low && FloatBits(c[0][0]) == FloatBits(rc.LowFirst());
  }
  Tiles::Release();
  return high ? AmxOrder::kHighFirst : low ? AmxOrder::kLowFirst : AmxOrder::kOther;
}

// The hardware's order (probed once per process), kNone where the hardware is absent or refused.
inline AmxOrder HardwareOrder() {
  static const AmxOrder order = HardwarePermitted() ? DotOrder<HardwareTiles>() : AmxOrder::kNone;
  return order;
}

// x's `rows` rows as A tiles read them: pair rows (x[2j] high, x[2j+1] low) padded with zeros to a
// multiple of kStepPairs dwords (`*stride` of them a row) and to a multiple of kTileRows rows, in a
// buffer of this thread's; nullptr where a value is not exact in bf16 (the FMA paths run then).
inline const uint32_t* AmxRows(const float* const* x, int64_t rows, int64_t k_dim, int64_t* stride) {
  thread_local std::vector<uint32_t> buffer;
  const int64_t k2 = (k_dim + 1) / 2, padded = (k2 + kStepPairs - 1) / kStepPairs * kStepPairs;
  const int64_t padded_rows = (rows + kTileRows - 1) / kTileRows * kTileRows;
  buffer.assign(padded_rows * padded, 0u);
  uint32_t inexact = 0;
  for (int64_t r = 0; r < rows; ++r) inexact |= PackPairRow(x[r], k_dim, buffer.data() + r * padded);
  *stride = padded;
  return inexact == 0 ? buffer.data() : nullptr;
}

// One block: rows [r, r + 16 a_tiles) of `a` x strips [q, q + b_tiles), all K, into y (c_dim apart)
// for columns below c_end. `strip(q, j)` is where strip q's pair row j starts (zero-filled copies
// at K's tail), `b_stride` the bytes from one of its pair rows to the next.
template <class Tiles, class StripRow>
void Block(const uint32_t* a, int64_t a_stride, int a_tiles, int b_tiles, int64_t k2, int64_t q,
           const StripRow& strip, int64_t valid_rows, int64_t c_end, int64_t c_dim, float* y) {
  alignas(64) float sums[2 * kTileRows][2 * 16];
  Tiles::template Zero<0>();
  Tiles::template Zero<1>();
  Tiles::template Zero<2>();
  Tiles::template Zero<3>();
  const int64_t a_bytes = a_stride * 4;
  for (int64_t j = 0; j < k2; j += kStepPairs) {
    int64_t b_stride;
    Tiles::template Load<4>(a + j, a_bytes);
    if (a_tiles > 1) Tiles::template Load<5>(a + kTileRows * a_stride + j, a_bytes);
    const void* b0 = strip(q, j, &b_stride);
    Tiles::template Load<6>(b0, b_stride);
    Tiles::template Dot<0, 4, 6>();
    if (a_tiles > 1) Tiles::template Dot<2, 5, 6>();
    if (b_tiles > 1) {
      const void* b1 = strip(q + 1, j, &b_stride);
      Tiles::template Load<7>(b1, b_stride);
      Tiles::template Dot<1, 4, 7>();
      if (a_tiles > 1) Tiles::template Dot<3, 5, 7>();
    }
  }
  constexpr int64_t kSumsRow = sizeof(sums[0]);
  Tiles::template Store<0>(&sums[0][0], kSumsRow);
  if (b_tiles > 1) Tiles::template Store<1>(&sums[0][16], kSumsRow);
  if (a_tiles > 1) Tiles::template Store<2>(&sums[kTileRows][0], kSumsRow);
  if (a_tiles > 1 && b_tiles > 1) Tiles::template Store<3>(&sums[kTileRows][16], kSumsRow);
  const int64_t c0 = 16 * q, columns = std::min<int64_t>(16 * b_tiles, c_end - c0);
  for (int64_t r = 0; r < valid_rows; ++r) std::memcpy(y + r * c_dim + c0, sums[r], columns * sizeof(float));
}

// Columns [c0, c1) (c0 a multiple of 16) of y = x @ w for `rows` rows of one expert's bf16 panels
// `w` (panels of `panel_cols` columns, k_dim rows), x as AmxRows laid it out (`a`, `a_stride`
// dwords a row). y rows are c_dim floats apart.
template <class Tiles>
void Panels(const uint32_t* a, int64_t a_stride, int64_t rows, const uint16_t* w, int64_t k_dim,
            int64_t panel_cols, int64_t c0, int64_t c1, int64_t c_dim, float* y) {
  const int64_t k2 = (k_dim + 1) / 2, panel_elems = PanelElements(k_dim, true, panel_cols);
  const int64_t pair_row_bytes = 2 * panel_cols * 2;
  // K's last step past the panel's pair rows: a zero-filled copy of its rows, per strip of a block.
  alignas(64) thread_local uint8_t tail[2][kStepPairs][kTileBytes];
  const int64_t tail_j = k2 / kStepPairs * kStepPairs;
  auto strip = [&](int64_t q, int64_t j, int64_t* stride) -> const void* {
    const uint16_t* start = w + StripOffset(q, panel_elems, true, panel_cols) + j * 2 * panel_cols;
    if (j < tail_j) {
      *stride = pair_row_bytes;
      return start;
    }
    uint8_t(&copy)[kStepPairs][kTileBytes] = tail[q % 2];
    std::memset(copy, 0, sizeof(copy));
    for (int64_t p = 0; p < k2 - j; ++p) std::memcpy(copy[p], reinterpret_cast<const uint8_t*>(start) + p * pair_row_bytes, kTileBytes);
    *stride = kTileBytes;
    return copy;
  };
  Tiles::Configure(KernelConfig());
  const int64_t q0 = c0 / kStripColumns, q1 = (c1 + kStripColumns - 1) / kStripColumns;
  for (int64_t q = q0; q < q1; q += 2) {
    const int b_tiles = q + 1 < q1 ? 2 : 1;
    for (int64_t r = 0; r < rows; r += 2 * kTileRows) {
      const int64_t valid = std::min<int64_t>(2 * kTileRows, rows - r);
      const int a_tiles = valid > kTileRows ? 2 : 1;
      Block<Tiles>(a + r * a_stride, a_stride, a_tiles, b_tiles, k2, q, strip, valid, c1, c_dim, y + r * c_dim);
    }
  }
  Tiles::Release();
}

}  // namespace expertd::amx
