#include "common/cpu_features.h"

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace roundpipe {

std::string_view simd_level_name(SimdLevel level) {
  switch (level) {
    case SimdLevel::kScalar:
      return "scalar";
    case SimdLevel::kAvx2:
      return "avx2";
    case SimdLevel::kAvx512:
      return "avx512";
  }
  return "unknown";
}

SimdLevel parse_simd_level(std::string_view name) {
  for (SimdLevel level : {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512}) {
    if (name == simd_level_name(level)) return level;
  }
  throw std::invalid_argument("unknown SIMD level '" + std::string(name) +
                              "': expected one of scalar, avx2, avx512");
}

SimdLevel detect_cpu_simd_level() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return SimdLevel::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return SimdLevel::kAvx2;
#endif
  return SimdLevel::kScalar;
}

SimdLevel active_simd_level() {
  static const SimdLevel level = [] {
    SimdLevel detected = detect_cpu_simd_level();
    const char* requested = std::getenv("ROUNDPIPE_SIMD");
    if (requested == nullptr || *requested == '\0') return detected;
    return std::min(detected, parse_simd_level(requested));
  }();
  return level;
}

}  // namespace roundpipe
