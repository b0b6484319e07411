// Runtime CPU feature detection for SIMD dispatch. Kernels are compiled for several instruction
// sets ahead of time; the best one the running CPU supports is chosen at run time (never
// -march=native in a shipped build).
#pragma once

#include <string_view>

namespace roundpipe {

// Ordered: a higher level implies every lower one is also usable.
enum class SimdLevel : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

std::string_view simd_level_name(SimdLevel level);

// Parses "scalar", "avx2" or "avx512"; throws std::invalid_argument naming the accepted values.
SimdLevel parse_simd_level(std::string_view name);

// What the CPU in use supports (AVX2 means AVX2+FMA; AVX512 means AVX-512F).
SimdLevel detect_cpu_simd_level();

// The level kernels dispatch on: the detected level, lowered by the environment variable
// ROUNDPIPE_SIMD (scalar|avx2|avx512) when set, so every code path can be tested on one machine.
// Never raised above what the CPU supports. Computed once.
SimdLevel active_simd_level();

}  // namespace roundpipe
