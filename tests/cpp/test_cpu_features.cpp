#include <stdexcept>

#include "common/cpu_features.h"
#include "harness.h"

using namespace roundpipe;

TEST_CASE("simd_level_names_round_trip") {
  for (SimdLevel level : {SimdLevel::kScalar, SimdLevel::kAvx2, SimdLevel::kAvx512}) {
    CHECK(parse_simd_level(simd_level_name(level)) == level);
  }
}

TEST_CASE("simd_level_rejects_unknown_names") {
  CHECK_THROWS(parse_simd_level("sse9"), std::invalid_argument, "scalar, avx2, avx512");
}

TEST_CASE("active_simd_level_never_exceeds_detected") {
  CHECK(static_cast<int>(active_simd_level()) <= static_cast<int>(detect_cpu_simd_level()));
}
