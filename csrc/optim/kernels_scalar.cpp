// The portable kernels (baseline x86-64 / any CPU), the exact dtype conversions, and the tails of
// the SIMD kernels.
#include <algorithm>
#include <bit>
#include <cmath>

#include "optim/kernel_impl.h"
#include "optim/kernels.h"

namespace roundpipe::optim {

float bf16_to_float(std::uint16_t bits) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
}

std::uint16_t float_to_bf16(float value) {
  if (std::isnan(value)) return 0x7FC0;
  const auto bits = std::bit_cast<std::uint32_t>(value);
  // Adding 0x7FFF plus the kept part's lowest bit rounds the dropped half to nearest, ties to even.
  return static_cast<std::uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

float fp16_to_float(std::uint16_t bits) {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t exponent = (bits >> 10) & 0x1Fu;
  const std::uint32_t mantissa = bits & 0x3FFu;
  if (exponent == 0x1F) {
    // inf, or NaN made quiet (as the F16C instruction does).
    const std::uint32_t quiet = mantissa != 0 ? 0x00400000u : 0u;
    return std::bit_cast<float>(sign | 0x7F800000u | quiet | (mantissa << 13));
  }
  if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24 is exact in float.
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return std::bit_cast<float>(sign | std::bit_cast<std::uint32_t>(magnitude));
  }
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

std::uint16_t float_to_fp16(float value) {
  const auto bits = std::bit_cast<std::uint32_t>(value);
  const auto sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return sign | 0x7E00u;
  // 65520 (halfway between the largest half, 65504, and 2^16) and above round to infinity.
  if (magnitude >= 0x477FF000u) return sign | 0x7C00u;
  if (magnitude < 0x38800000u) {
    // Below the smallest normal half (2^-14): the float sum with 0.5 (whose ulp is 2^-24, the
    // subnormal half's step) rounds to nearest even, leaving the half's mantissa in its low bits.
    const float sum = std::bit_cast<float>(magnitude) + 0.5f;
    return sign | static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(sum) - 0x3F000000u);
  }
  const std::uint32_t rounded = magnitude + 0xFFFu + ((magnitude >> 13) & 1u);
  return sign | static_cast<std::uint16_t>((rounded >> 13) - (112u << 10));
}

namespace kernels {
namespace {

struct ScalarIsa {
  using F = float;
  static constexpr std::int64_t kWidth = 1;
  static F set1(float x) { return x; }
  static F load(const float* p) { return *p; }
  static void store(float* p, F x) { *p = x; }
  template <DType G>
  static F load_as(const void* base, std::int64_t i) {
    if constexpr (G == DType::kFloat32) {
      return static_cast<const float*>(base)[i];
    } else if constexpr (G == DType::kBFloat16) {
      return bf16_to_float(static_cast<const std::uint16_t*>(base)[i]);
    } else {
      return fp16_to_float(static_cast<const std::uint16_t*>(base)[i]);
    }
  }
  template <DType O>
  static void store_as(void* base, std::int64_t i, F x) {
    auto* out = static_cast<std::uint16_t*>(base) + i;
    *out = O == DType::kBFloat16 ? float_to_bf16(x) : float_to_fp16(x);
  }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return std::sqrt(a); }
  static F max(F a, F b) { return a > b ? a : b; }
  static bool any_nan(F a) { return std::isnan(a); }

  using I = std::uint32_t;
  using M = bool;
  static I bits(F x) { return std::bit_cast<I>(x); }
  static F from_bits(I x) { return std::bit_cast<F>(x); }
  static I iset1(std::uint32_t x) { return x; }
  static I iota() { return 0; }
  static I iadd(I a, I b) { return a + b; }
  static I iand(I a, I b) { return a & b; }
  static I ixor(I a, I b) { return a ^ b; }
  static I ior(I a, I b) { return a | b; }
  static I imul(I a, I b) { return a * b; }
  static I imax(I a, I b) { return signed_of(a) > signed_of(b) ? a : b; }
  static I umax(I a, I b) { return a > b ? a : b; }
  template <int n>
  static I shr(I a) {
    return a >> n;
  }
  static M is_nan(F a) { return std::isnan(a); }
  static F mul_add(F a, F b, F c) { return a * b + c; }
  static I or_where_negative(I y, I x, I bits) { return signed_of(y) < 0 ? x | bits : x; }
  static I iselect(M mask, I a, I b) { return mask ? a : b; }
  // The half whose top bits (after the sign) are the code: see kernel_impl.h.
  template <bool kSigned>
  static F load_half_codes(const void* base, std::int64_t i) {
    const std::uint32_t code = static_cast<const std::uint8_t*>(base)[i];
    const std::uint32_t sign = kSigned ? (code & 0x80u) << 8 : 0u;
    const std::uint32_t magnitude = kSigned ? code & 0x7Fu : code;
    return fp16_to_float(static_cast<std::uint16_t>(sign | magnitude << 7));
  }
  static void store_codes(void* base, std::int64_t i, I x) {
    static_cast<std::uint8_t*>(base)[i] = static_cast<std::uint8_t>(x);
  }
  static void store_u16(void* base, std::int64_t i, I x) {
    static_cast<std::uint16_t*>(base)[i] = static_cast<std::uint16_t>(x);
  }
  static void store_u16_pair(void* base, std::int64_t i, I a, I b) {
    store_u16(base, i, a);
    store_u16(base, i + 1, b);
  }
  static std::uint32_t hmax(I a) { return a; }
  static std::uint32_t humax(I a) { return a; }

 private:
  static std::int32_t signed_of(I a) { return static_cast<std::int32_t>(a); }
};

}  // namespace

void adam_scalar(const AdamCoefficients& c, const AdamBuffers& b, std::int64_t begin,
                 std::int64_t end) {
  adam_dispatch<ScalarIsa>(c, b, begin, end);
}

bool grad_pass_scalar(GradMode mode, const GradBuffers& b, std::int64_t begin, std::int64_t end) {
  bool finite = true;
  grad_dispatch<ScalarIsa>(mode, b, begin, end, finite);
  return finite;
}

void quantize_blocks(bool is_exp_avg, const float* values, void* codes, float* scales,
                     std::int64_t numel, std::int64_t first_block, std::int64_t last_block,
                     bool given_scales) {
  float block_values[kStateBlock];
  for (std::int64_t block = first_block; block < last_block; ++block) {
    const std::int64_t begin = block * kStateBlock;
    const std::int64_t n = std::min(begin + kStateBlock, numel) - begin;
    std::copy_n(values + begin, n, block_values);
    BlockCoding coding{};
    if (given_scales) {
      // A scale a step could have written: finite, >= 0. Others (NaN, from older versions that
      // let a NaN spoil its block) code nothing meaningful, which decodes to NaN at that scale.
      const float scale = scales[block];
      coding = scale >= 0.0f && scale < std::bit_cast<float>(kInfinityBits)
                   ? code_against(is_exp_avg, block_values, n, scale)
                   : BlockCoding{scale, 0.0f};
    } else {
      std::uint32_t largest = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        largest = ScalarIsa::imax(largest, ScalarIsa::bits(block_values[i]) & kMagnitudeMask);
      }
      coding = settle_block(is_exp_avg, block_values, n, largest);
      scales[block] = coding.scale;
    }
    for (std::int64_t i = 0; i < n; ++i) {
      const float value = block_values[i];
      ScalarIsa::store_codes(codes, begin + i,
                             is_exp_avg
                                 ? encode_exp_avg<ScalarIsa, false>(value, coding.factor, 0)
                                 : encode_exp_avg_sq<ScalarIsa, false>(value, coding.factor, 0));
    }
  }
}

void dequantize_blocks(bool is_exp_avg, const void* codes, const float* scales, float* values,
                       std::int64_t numel, std::int64_t first_block, std::int64_t last_block) {
  for (std::int64_t block = first_block; block < last_block; ++block) {
    const std::int64_t end = std::min((block + 1) * kStateBlock, numel);
    const float unit = scales[block] * kExpAvgSqUnit;
    for (std::int64_t i = block * kStateBlock; i < end; ++i) {
      values[i] = is_exp_avg ? ScalarIsa::load_half_codes<true>(codes, i) * scales[block]
                             : ScalarIsa::load_half_codes<false>(codes, i) * unit;
    }
  }
}

}  // namespace kernels
}  // namespace roundpipe::optim
