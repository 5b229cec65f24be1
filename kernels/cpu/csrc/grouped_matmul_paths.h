// The paths a work item of the grouped matmul can take, and how many items each has run since the
// library loaded (grouped_matmul_cpu.cc counts them; library.cc's expertd_native_cpu_path_items
// reads them: how the tests and benchmarks see which path ran, ../library.py PATHS).
#pragma once

#include <atomic>
#include <cstdint>

namespace expertd {

enum Path { kPathPortable, kPathAvx2Stream, kPathAvx2Packed, kPathAvx512Fma, kPathAvx512Bf16Dot, kPathAmxBf16, kNumPaths };
inline std::atomic<int64_t> path_items[kNumPaths];

}  // namespace expertd
