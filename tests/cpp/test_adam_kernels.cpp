#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/cpu_features.h"
#include "common/thread_pool.h"
#include "harness.h"
#include "optim/adam.h"

using namespace roundpipe;
using namespace roundpipe::optim;

namespace {

// 30 = one 64-byte line, one AVX2 vector and a scalar tail: every loop of the kernels runs.
const std::vector<std::int64_t> kOddSizes{0, 1, 7, 17, 30, 4099};

// Levels above scalar that this CPU can run; on other CPUs those tests have nothing to compare.
std::vector<SimdLevel> simd_levels_to_compare() {
  std::vector<SimdLevel> levels;
  for (SimdLevel level : {SimdLevel::kAvx2, SimdLevel::kAvx512}) {
    if (level <= detect_cpu_simd_level()) levels.push_back(level);
  }
  return levels;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// Decodes a 16-bit float from its fields, as a double (brute force, independent of the kernels).
double decode(std::uint16_t bits, int mantissa_bits, int exponent_bias) {
  const int exponent_mask = (1 << (15 - mantissa_bits)) - 1;
  const int exponent = (bits >> mantissa_bits) & exponent_mask;
  const int mantissa = bits & ((1 << mantissa_bits) - 1);
  const double sign = (bits & 0x8000) != 0 ? -1.0 : 1.0;
  if (exponent == exponent_mask) return sign * std::numeric_limits<double>::infinity();
  if (exponent == 0) return sign * std::ldexp(mantissa, 1 - exponent_bias - mantissa_bits);
  return sign *
         std::ldexp(mantissa + (1 << mantissa_bits), exponent - exponent_bias - mantissa_bits);
}

// Every finite positive pattern, its decoded value, and rounding at and around each midpoint to
// the next pattern (the one after the largest finite value is infinity, valued 2^(emax+1)).
void check_rounding(float (*to_float)(std::uint16_t), std::uint16_t (*from_float)(float),
                    int mantissa_bits, int exponent_bias, std::uint16_t infinity) {
  for (std::uint32_t h = 0; h < infinity; ++h) {
    const auto bits = static_cast<std::uint16_t>(h);
    const double value = decode(bits, mantissa_bits, exponent_bias);
    CHECK_EQ(static_cast<double>(to_float(bits)), value);
    CHECK_EQ(from_float(static_cast<float>(value)), bits);
    CHECK_EQ(from_float(-static_cast<float>(value)), static_cast<std::uint16_t>(bits | 0x8000));
    const double next =
        h + 1 == infinity ? std::ldexp(1.0, (1 << (15 - mantissa_bits)) - 1 - exponent_bias)
                          : decode(static_cast<std::uint16_t>(h + 1), mantissa_bits, exponent_bias);
    const auto midpoint = static_cast<float>((value + next) / 2);
    CHECK_EQ(static_cast<double>(midpoint), (value + next) / 2);  // exactly representable
    const auto even = static_cast<std::uint16_t>(h % 2 == 0 ? h : h + 1);
    CHECK_EQ(from_float(midpoint), even);
    CHECK_EQ(from_float(std::nextafter(midpoint, 0.0f)), bits);
    CHECK_EQ(from_float(std::nextafter(midpoint, std::numeric_limits<float>::infinity())),
             static_cast<std::uint16_t>(h + 1));
  }
  CHECK(std::isinf(to_float(infinity)));
  CHECK_EQ(from_float(std::numeric_limits<float>::infinity()), infinity);
  CHECK_EQ(from_float(std::numeric_limits<float>::max()), infinity);
}

struct AdamState {
  std::vector<float> param, exp_avg, exp_avg_sq, max_exp_avg_sq;
  std::vector<std::uint16_t> grad16, lowp;
  std::vector<float> grad32;

  AdamState(std::int64_t n, std::uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    const auto size = static_cast<std::size_t>(n);
    for (auto* v : {&param, &exp_avg, &grad32}) {
      v->resize(size);
      for (float& x : *v) x = normal(rng);
    }
    exp_avg_sq.resize(size);
    max_exp_avg_sq.resize(size);
    for (std::size_t i = 0; i < size; ++i) {
      exp_avg_sq[i] = std::abs(normal(rng));
      max_exp_avg_sq[i] = exp_avg_sq[i] * (i % 2 == 0 ? 2.0f : 0.5f);
    }
    grad16.resize(size);
    for (std::size_t i = 0; i < size; ++i) grad16[i] = float_to_bf16(grad32[i]);
    lowp.assign(size, 0);
  }

  AdamBuffers buffers(DType grad_dtype, bool write_lowp, DType lowp_dtype) {
    const void* grad = grad_dtype == DType::kFloat32 ? static_cast<const void*>(grad32.data())
                                                     : static_cast<const void*>(grad16.data());
    return AdamBuffers{param.data(),
                       grad,
                       grad_dtype,
                       exp_avg.data(),
                       exp_avg_sq.data(),
                       max_exp_avg_sq.data(),
                       write_lowp ? lowp.data() : nullptr,
                       lowp_dtype,
                       static_cast<std::int64_t>(param.size())};
  }

  bool operator==(const AdamState& other) const {
    return same_bits(param, other.param) && same_bits(exp_avg, other.exp_avg) &&
           same_bits(exp_avg_sq, other.exp_avg_sq) &&
           same_bits(max_exp_avg_sq, other.max_exp_avg_sq) && lowp == other.lowp;
  }
};

AdamHyper hyper_variant(int variant) {
  AdamHyper hyper;
  hyper.lr = 1e-2;
  hyper.amsgrad = (variant & 1) != 0;
  hyper.maximize = (variant & 2) != 0;
  hyper.weight_decay = (variant & 12) != 0 ? 0.1 : 0.0;
  hyper.decoupled_weight_decay = (variant & 8) != 0;
  hyper.beta1 = (variant & 16) != 0 ? 0.3 : 0.9;  // lerp weight >= 0.5 takes torch's other formula
  return hyper;
}

}  // namespace

TEST_CASE("bf16_conversions_round_to_nearest_even") {
  check_rounding(bf16_to_float, float_to_bf16, 7, 127, 0x7F80);
  CHECK_EQ(float_to_bf16(std::numeric_limits<float>::quiet_NaN()), 0x7FC0);
  CHECK_EQ(float_to_bf16(-std::numeric_limits<float>::quiet_NaN()), 0x7FC0);
}

TEST_CASE("fp16_conversions_round_to_nearest_even") {
  check_rounding(fp16_to_float, float_to_fp16, 10, 15, 0x7C00);
  CHECK_EQ(float_to_fp16(std::numeric_limits<float>::quiet_NaN()), 0x7E00);
  CHECK_EQ(float_to_fp16(-std::numeric_limits<float>::quiet_NaN()), 0xFE00);
  CHECK_EQ(float_to_fp16(1e-10f), 0);  // below half the smallest subnormal
  CHECK(std::isnan(fp16_to_float(0x7C01)));
}

TEST_CASE("adam_scalar_matches_a_double_reference") {
  for (int variant = 0; variant < 32; ++variant) {
    const AdamHyper hyper = hyper_variant(variant);
    AdamState state(64, 7);
    AdamState start = state;
    const auto buffers = state.buffers(DType::kFloat32, false, DType::kFloat32);
    for (int step = 1; step <= 3; ++step) {
      adam_update(SimdLevel::kScalar, adam_coefficients(hyper, step, 1.0f), buffers, 0, 64);
    }
    for (std::size_t i = 0; i < 64; ++i) {
      double p = start.param[i], m = start.exp_avg[i], v = start.exp_avg_sq[i];
      double vmax = start.max_exp_avg_sq[i];
      for (int step = 1; step <= 3; ++step) {
        double g = hyper.maximize ? -start.grad32[i] : start.grad32[i];
        if (hyper.decoupled_weight_decay) p *= 1 - hyper.lr * hyper.weight_decay;
        if (!hyper.decoupled_weight_decay) g += hyper.weight_decay * p;
        m = hyper.beta1 * m + (1 - hyper.beta1) * g;
        v = hyper.beta2 * v + (1 - hyper.beta2) * g * g;
        vmax = std::max(vmax, v);
        const double second = hyper.amsgrad ? vmax : v;
        const double denom =
            std::sqrt(second) / std::sqrt(1 - std::pow(hyper.beta2, step)) + hyper.eps;
        p -= hyper.lr / (1 - std::pow(hyper.beta1, step)) * m / denom;
      }
      CHECK(std::abs(state.param[i] - p) <= 1e-5 * (1 + std::abs(p)));
      CHECK(std::abs(state.exp_avg[i] - m) <= 1e-5 * (1 + std::abs(m)));
      CHECK(std::abs(state.exp_avg_sq[i] - v) <= 1e-5 * (1 + std::abs(v)));
    }
  }
}

TEST_CASE("adam_simd_variants_match_scalar_bit_for_bit") {
  for (SimdLevel level : simd_levels_to_compare()) {
    for (std::int64_t n : kOddSizes) {
      for (int variant = 0; variant < 32; ++variant) {
        for (DType grad_dtype : {DType::kFloat32, DType::kBFloat16}) {
          for (int out = 0; out < 3; ++out) {
            const DType lowp_dtype = out == 2 ? DType::kFloat16 : DType::kBFloat16;
            AdamState scalar(n, static_cast<std::uint32_t>(variant + 1));
            AdamState simd = scalar;
            const AdamHyper hyper = hyper_variant(variant);
            for (int step = 1; step <= 3; ++step) {
              const AdamCoefficients c = adam_coefficients(hyper, step, 0.25f);
              adam_update(SimdLevel::kScalar, c, scalar.buffers(grad_dtype, out > 0, lowp_dtype), 0,
                          n);
              adam_update(level, c, simd.buffers(grad_dtype, out > 0, lowp_dtype), 0, n);
            }
            CHECK(simd == scalar);
          }
        }
      }
    }
  }
}

TEST_CASE("adam_simd_variants_match_scalar_on_fp16_grads_and_special_values") {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // With lr = 0 the weights pass through unchanged, so the low-precision copy exercises the
  // conversions on exactly these values: ties, subnormals, overflow, infinities, NaN.
  const std::vector<float> specials{
      0.0f, -0.0f,     1.0f,        1.00048828125f, 65504.0f, 65520.0f,
      7e4f, -65520.0f, 6e-8f,       3e-8f,          1e-40f,   inf,
      -inf, nan,       1.00390625f, 3.0e38f,        -1e-30f,  0.0001220703f};
  for (SimdLevel level : simd_levels_to_compare()) {
    for (DType lowp_dtype : {DType::kBFloat16, DType::kFloat16}) {
      const auto n = static_cast<std::int64_t>(specials.size() * 3);
      AdamState scalar(n, 3);
      for (std::size_t i = 0; i < scalar.param.size(); ++i) {
        scalar.param[i] = specials[i % specials.size()];
        scalar.grad16[i] = float_to_fp16(scalar.grad32[i]);
      }
      AdamState simd = scalar;
      AdamHyper hyper;
      hyper.lr = 0.0;
      const AdamCoefficients c = adam_coefficients(hyper, 1, 1.0f);
      adam_update(SimdLevel::kScalar, c, scalar.buffers(DType::kFloat16, true, lowp_dtype), 0, n);
      adam_update(level, c, simd.buffers(DType::kFloat16, true, lowp_dtype), 0, n);
      CHECK(simd.lowp == scalar.lowp);
      CHECK(same_bits(simd.exp_avg, scalar.exp_avg));
      for (std::size_t i = 0; i < scalar.lowp.size(); ++i) {
        // Unchanged up to the sign of zero (-0 + +0 is +0).
        const float value = scalar.param[i];
        CHECK(value == specials[i % specials.size()] || std::isnan(value));
        CHECK_EQ(scalar.lowp[i],
                 lowp_dtype == DType::kBFloat16 ? float_to_bf16(value) : float_to_fp16(value));
      }
    }
  }
}

// A tensor with compact moments (bf16, or 8-bit codes with their block scales), zero at first.
struct CompactState {
  StateDType state_dtype;
  std::vector<float> param, grad, exp_avg_scale, exp_avg_sq_scale;
  std::vector<std::uint16_t> exp_avg16, exp_avg_sq16;
  std::vector<std::int8_t> exp_avg8;
  std::vector<std::uint8_t> exp_avg_sq8;

  CompactState(StateDType dtype, std::int64_t n)
      : state_dtype(dtype),
        param(static_cast<std::size_t>(n), 0.5f),
        grad(static_cast<std::size_t>(n)),
        exp_avg_scale(static_cast<std::size_t>(state_blocks(n))),
        exp_avg_sq_scale(static_cast<std::size_t>(state_blocks(n))),
        exp_avg16(static_cast<std::size_t>(n)),
        exp_avg_sq16(static_cast<std::size_t>(n)),
        exp_avg8(static_cast<std::size_t>(n)),
        exp_avg_sq8(static_cast<std::size_t>(n)) {}

  AdamBuffers buffers() {
    const bool int8 = state_dtype == StateDType::kInt8;
    AdamBuffers b{param.data(),
                  grad.data(),
                  DType::kFloat32,
                  int8 ? static_cast<void*>(exp_avg8.data()) : exp_avg16.data(),
                  int8 ? static_cast<void*>(exp_avg_sq8.data()) : exp_avg_sq16.data(),
                  nullptr,
                  nullptr,
                  DType::kBFloat16,
                  static_cast<std::int64_t>(param.size()),
                  state_dtype};
    b.exp_avg_scale = exp_avg_scale.data();
    b.exp_avg_sq_scale = exp_avg_sq_scale.data();
    return b;
  }

  // The same bits, but for NaN weights, which only need to be NaN alike: a NaN's payload and sign
  // depend on which of two NaN operands an instruction passes on, which compilers may swap.
  bool operator==(const CompactState& other) const {
    const auto same_weight = [](float a, float b) {
      return std::isnan(a) ? std::isnan(b)
                           : std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b);
    };
    return std::equal(param.begin(), param.end(), other.param.begin(), other.param.end(),
                      same_weight) &&
           same_bits(exp_avg_scale, other.exp_avg_scale) &&
           same_bits(exp_avg_sq_scale, other.exp_avg_sq_scale) && exp_avg16 == other.exp_avg16 &&
           exp_avg_sq16 == other.exp_avg_sq16 && exp_avg8 == other.exp_avg8 &&
           exp_avg_sq8 == other.exp_avg_sq8;
  }
};

TEST_CASE("compact_state_variants_match_scalar_on_gradients_of_every_magnitude") {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // Per block of 256: the gradients' magnitude, from subnormal moments to overflowing squares;
  // some blocks also hold one inf or NaN.
  const std::vector<float> magnitudes{1.0f, 1e-30f, 1e-42f, 1e20f, 1.5e20f, 1e21f, 0.0f, 1e-3f};
  std::vector<SimdLevel> levels = simd_levels_to_compare();
  for (StateDType dtype : {StateDType::kBFloat16, StateDType::kInt8}) {
    for (std::int64_t n : {1, 17, 256, 300, 2048 + 77}) {
      CompactState scalar(dtype, n);
      std::vector<CompactState> simd(levels.size(), scalar);
      std::mt19937 rng(static_cast<std::uint32_t>(n));
      std::normal_distribution<float> normal;
      for (int step = 1; step <= 4; ++step) {
        for (std::size_t i = 0; i < scalar.grad.size(); ++i) {
          const std::size_t block = i / kStateBlock;
          scalar.grad[i] = normal(rng) * magnitudes[(block + step) % magnitudes.size()];
          if (i % 613 == 5) scalar.grad[i] = (i / 613 + step) % 2 == 0 ? inf : nan;
        }
        for (auto& state : simd) state.grad = scalar.grad;
        const AdamCoefficients c = adam_coefficients(hyper_variant(4), step, 1.0f);
        adam_update(SimdLevel::kScalar, c, scalar.buffers(), 0, n);
        for (std::size_t l = 0; l < levels.size(); ++l) {
          adam_update(levels[l], c, simd[l].buffers(), 0, n);
        }
      }
      for (const auto& state : simd) CHECK(state == scalar);
      // Scales are finite: no inf or NaN spoils a block.
      for (float scale : scalar.exp_avg_scale) CHECK(std::isfinite(scale));
      for (float scale : scalar.exp_avg_sq_scale) CHECK(std::isfinite(scale));
    }
  }
}

TEST_CASE("int8_parallel_step_equals_one_serial_pass") {
  ThreadPool pool(3);
  const std::vector<std::int64_t> sizes{0, 1, 300, 1 << 18, (1 << 17) + 7};
  std::vector<CompactState> parallel, serial;
  for (std::int64_t n : sizes) {
    parallel.emplace_back(StateDType::kInt8, n);
    std::mt19937 rng(static_cast<std::uint32_t>(n));
    std::normal_distribution<float> normal;
    for (float& g : parallel.back().grad) g = normal(rng);
    serial.push_back(parallel.back());
  }
  for (int step = 1; step <= 2; ++step) {
    const AdamCoefficients c = adam_coefficients(hyper_variant(0), step, 1.0f);
    std::vector<AdamBuffers> buffers;
    for (auto& state : parallel) buffers.push_back(state.buffers());
    adam_step(pool, 4, active_simd_level(), std::vector<AdamCoefficients>(sizes.size(), c),
              buffers);
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      adam_update(SimdLevel::kScalar, c, serial[k].buffers(), 0, sizes[k]);
    }
  }
  for (std::size_t k = 0; k < sizes.size(); ++k) CHECK(parallel[k] == serial[k]);
}

TEST_CASE("grad_pass_variants_match_scalar_and_detect_non_finite") {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<SimdLevel> levels = simd_levels_to_compare();
  levels.push_back(SimdLevel::kScalar);
  for (SimdLevel level : levels) {
    for (std::int64_t n : kOddSizes) {
      for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
        for (GradMode mode : {GradMode::kCheck, GradMode::kCopy, GradMode::kAccumulate}) {
          // Clean, then a bad value in the first element (a vector) and in the last (the tail).
          for (int poison = 0; poison < 3 && (poison == 0 || n > 0); ++poison) {
            AdamState source(n, 11);
            std::vector<float> expected = source.exp_avg;
            std::vector<float>& src32 = source.grad32;
            if (poison == 1) src32.front() = inf;
            if (poison == 2) src32.back() = nan;
            for (std::size_t i = 0; i < src32.size(); ++i) {
              source.grad16[i] =
                  dtype == DType::kFloat16 ? float_to_fp16(src32[i]) : float_to_bf16(src32[i]);
            }
            for (std::size_t i = 0; i < expected.size(); ++i) {
              const float value = dtype == DType::kFloat32    ? src32[i]
                                  : dtype == DType::kBFloat16 ? bf16_to_float(source.grad16[i])
                                                              : fp16_to_float(source.grad16[i]);
              if (mode == GradMode::kCopy) expected[i] = value;
              if (mode == GradMode::kAccumulate) expected[i] += value;
            }
            const void* src = dtype == DType::kFloat32 ? static_cast<const void*>(src32.data())
                                                       : source.grad16.data();
            const GradBuffers buffers{source.exp_avg.data(), src, dtype, n};
            CHECK_EQ(grad_pass(level, mode, buffers, 0, n), poison == 0);
            for (std::size_t i = 0; i < expected.size(); ++i) {
              const bool both_nan = std::isnan(expected[i]) && std::isnan(source.exp_avg[i]);
              CHECK(both_nan || std::bit_cast<std::uint32_t>(expected[i]) ==
                                    std::bit_cast<std::uint32_t>(source.exp_avg[i]));
            }
          }
        }
      }
    }
  }
}

TEST_CASE("parallel_adam_step_equals_one_serial_pass") {
  ThreadPool pool(3);
  const std::vector<std::int64_t> sizes{0, 1, 7, 40000, 100003, 17};
  const AdamHyper hyper = hyper_variant(1 | 4);
  std::vector<AdamState> parallel;
  std::vector<AdamState> serial;
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    parallel.emplace_back(sizes[k], static_cast<std::uint32_t>(k));
    serial.emplace_back(sizes[k], static_cast<std::uint32_t>(k));
  }
  const SimdLevel level = active_simd_level();
  for (int step = 1; step <= 2; ++step) {
    const AdamCoefficients c = adam_coefficients(hyper, step, 1.0f);
    std::vector<AdamBuffers> buffers;
    for (auto& state : parallel)
      buffers.push_back(state.buffers(DType::kBFloat16, true, DType::kBFloat16));
    const std::vector<AdamCoefficients> coefficients(sizes.size(), c);
    adam_step(pool, 4, level, coefficients, buffers);
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      adam_update(SimdLevel::kScalar, c,
                  serial[k].buffers(DType::kBFloat16, true, DType::kBFloat16), 0, sizes[k]);
    }
  }
  for (std::size_t k = 0; k < sizes.size(); ++k) CHECK(parallel[k] == serial[k]);
  CHECK(pool.started_workers() > 0);
}

TEST_CASE("parallel_grad_pass_reports_a_non_finite_value_in_any_buffer") {
  ThreadPool pool(3);
  std::vector<std::vector<float>> sources{std::vector<float>(70000, 1.0f),
                                          std::vector<float>(5, 2.0f),
                                          std::vector<float>(90001, 3.0f)};
  std::vector<std::vector<float>> sums;
  std::vector<GradBuffers> buffers;
  for (auto& source : sources) {
    sums.emplace_back(source.size(), 0.5f);
    buffers.push_back({sums.back().data(), source.data(), DType::kFloat32,
                       static_cast<std::int64_t>(source.size())});
  }
  CHECK(grad_pass(pool, 4, active_simd_level(), GradMode::kAccumulate, buffers));
  CHECK_EQ(sums[2][90000], 3.5f);
  sources[2][45000] = -std::numeric_limits<float>::infinity();
  CHECK(!grad_pass(pool, 4, active_simd_level(), GradMode::kCheck, buffers));
  CHECK_EQ(sums[0][0], 1.5f);
}
