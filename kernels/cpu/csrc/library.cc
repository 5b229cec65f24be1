// The library's plain C entry points, which ../library.py calls through ctypes: the instruction-set
// level the kernels run at (simd.h), its cap and limit; the ParallelFor rule's bound and the trace
// build's records (parallel.h); the grouped matmul's per-path item counters (grouped_matmul_paths.h).
// (host_copy.cc's entry points are its own.)
#include <algorithm>
#include <cstdint>

#include "amx_tiles.h"
#include "grouped_matmul_paths.h"
#include "parallel.h"
#include "simd.h"

// The expertd::Isa level the kernels run at (0 portable, 1 AVX2, 2 AVX-512, 3 AVX-512 with the bf16 dot
// product, 4 AMX-BF16 tiles too), and the highest one this CPU runs under the process cap; cap_isa
// sets that cap (once, at load), limit_isa a further cap for later calls.
extern "C" int expertd_native_cpu_isa() { return static_cast<int>(expertd::CpuIsa()); }
extern "C" int expertd_native_cpu_detected_isa() { return static_cast<int>(expertd::DetectedIsa()); }
extern "C" void expertd_native_cpu_cap_isa(int level) { expertd::IsaCap().store(level); }
extern "C" void expertd_native_cpu_limit_isa(int level) { expertd::IsaLimit().store(level); }
// simd.h's AMX check: the hardware's TDPBF16PS adds in k order (probed once per process).
bool expertd::AmxBf16Ready() { return expertd::amx::HardwareOrder() == expertd::amx::AmxOrder::kHighFirst; }

// The AMX hardware as probed (amx_tiles.h AmxOrder: 0 absent or refused, 1 adds high half first,
// i.e. in k order, 2 low half first, 3 otherwise); whether the kernels run it is the level (isa).
extern "C" int expertd_native_cpu_amx_order() { return static_cast<int>(expertd::amx::HardwareOrder()); }
// The tiles' software model: 0 off, else the AmxOrder it adds in; the AMX path then runs on it at
// every level from AVX2 (the tests' way to run the tile kernel without AMX). Between calls only.
extern "C" void expertd_native_cpu_emulate_amx(int order) { expertd::amx::EmulatedOrder().store(order); }
// Operations the model refused as the hardware would (a bad configuration or operand shape).
extern "C" int64_t expertd_native_cpu_amx_faults() { return expertd::amx::EmulatedTiles::faults.load(); }
// The model's probe: the AmxOrder it adds in, as DotOrder finds it on the model.
extern "C" int expertd_native_cpu_emulated_amx_order() {
  return static_cast<int>(expertd::amx::DotOrder<expertd::amx::EmulatedTiles>());
}

// The ParallelFor rule's bound (parallel.h): calls of at most this many multiply-adds run on the
// caller alone; the setter is for benchmarks that A/B the rule in one process.
extern "C" int64_t expertd_caller_only_work() { return expertd::caller_only_work.load(); }
extern "C" void expertd_set_caller_only_work(int64_t work) { expertd::caller_only_work.store(work); }
// Work items run on each Path since the library loaded (a column tail alone counts as portable).
extern "C" int64_t expertd_native_cpu_path_items(int path) {
  return path >= 0 && path < expertd::kNumPaths ? expertd::path_items[path].load() : -1;
}

// Copies the ParallelFor records (parallel.h, 8 int64 each) kept since the last call into out, at
// most capacity / 8 of them, and clears them; -1 unless built with -DEXPERTD_TRACE_PARALLEL_FOR.
extern "C" int64_t expertd_parallel_for_trace(int64_t* out, int64_t capacity) {
#ifdef EXPERTD_TRACE_PARALLEL_FOR
  const int64_t n = std::min({expertd::trace_count.load(), expertd::kTraceCapacity, capacity / 8});
  for (int64_t i = 0; i < n; ++i) {
    const expertd::ParallelForRecord& r = expertd::trace_records[i];
    const int64_t fields[8] = {r.start, r.caller_done, r.helper_start, r.helper_done, r.returned, r.tasks,
                               r.caller_tasks, r.helpers};
    std::copy(fields, fields + 8, out + 8 * i);
  }
  expertd::trace_count.store(0);
  return n;
#else
  (void)out;
  (void)capacity;
  return -1;
#endif
}
