// The optimizer kernels' algorithms, written once over an instruction-set abstraction `Isa` and
// instantiated by each per-ISA translation unit (kernels_<isa>.cpp) with its own vector type.
// Include it only from those files, with `Isa` defined in an anonymous namespace there, so each
// instantiation stays private to the translation unit that was compiled with matching flags.
//
// An Isa provides: a vector type F of kWidth floats; set1, load, store (fp32); load_as<DType>
// and store_as<DType> (exact bf16/fp16 conversions); add, sub, mul, div, sqrt, neg;
// max(a, b) = a > b ? a : b (as x86's maxps); and any_nan. For compact moments also: a vector I
// of kWidth 32-bit integers and a mask type M; bits/from_bits (reinterpretation); iset1, iota
// (0, 1, ...); iadd, isub, iand, ixor, imul (low 32 bits), imin/imax (signed); shl<n>, shr<n>
// (logical), sar<n>; less (ordered float a < b), iless (signed), is_nan; select/iselect(mask,
// if_true, if_false); load_codes<kSigned> (8-bit codes widened, sign- or zero-extended),
// store_codes and store_u16 (the low 8 or 16 bits of each lane); hmax (largest lane, signed).
//
// The operation order mirrors torch.optim.Adam's single-tensor CPU path (lerp for the first
// moment, mul + addcmul for the second, sqrt / bias correction + eps, addcdiv) so results stay
// within float rounding of torch; the one departure is a multiplication by the bias correction's
// reciprocal in place of the division by it (one rounding apart). No FMA: every Isa rounds each
// operation once, which keeps all variants bit-identical to the scalar one.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <type_traits>

#include "optim/adam.h"

namespace roundpipe::optim::kernels {

// How far ahead of the element being updated the Adam kernel prefetches each stream: 2 KiB of
// fp32 state. The hardware prefetchers stop at every 4 KiB page boundary and track few streams;
// Adam runs 4 to 6 streams per thread, and without this it is latency-bound below the memory
// bandwidth (benchmarks/adam_cpu.py measures the distances).
inline constexpr std::int64_t kPrefetchAhead = 512;

// The random bits of stochastic rounding: a hash (murmur3's finaliser) of the element's index
// in its tensor and the step's seed, 16 bits for each moment (low half exp_avg, high exp_avg_sq).
template <class Isa>
typename Isa::I rounding_bits(std::int64_t i, std::uint32_t seed) {
  using I = typename Isa::I;
  I h = Isa::imul(Isa::iadd(Isa::iset1(static_cast<std::uint32_t>(i)), Isa::iota()),
                  Isa::iset1(0x9E3779B1u));
  h = Isa::ixor(h, Isa::iset1(seed));
  h = Isa::ixor(h, Isa::template shr<16>(h));
  h = Isa::imul(h, Isa::iset1(0x85EBCA6Bu));
  h = Isa::ixor(h, Isa::template shr<13>(h));
  h = Isa::imul(h, Isa::iset1(0xC2B2AE35u));
  return Isa::ixor(h, Isa::template shr<16>(h));
}

// bf16 with stochastic rounding: 16 random bits added below the kept ones, then truncated, so
// a value rounds up with probability equal to its distance from the value below. NaN stays NaN.
template <class Isa>
void store_bf16_stochastic(void* base, std::int64_t i, typename Isa::F x, typename Isa::I random) {
  const auto rounded = Isa::template shr<16>(Isa::iadd(Isa::bits(x), random));
  Isa::store_u16(base, i, Isa::iselect(Isa::is_nan(x), Isa::iset1(0x7FC0u), rounded));
}

// The 8-bit codes of kInt8 moments: a float with 3 mantissa bits and exponent bias `kBias` in
// units of the block's scale, so 1.0 (the block's largest magnitude) is the top code kBias << 3,
// and codes below 1 << 3 are subnormal steps of 2^(-2 - kBias). Encoding and decoding work on
// the fp32 bit pattern with integer operations, identical on every Isa.
template <int kBias>
struct MomentCode {
  static constexpr int kMantissa = 3;
  static constexpr int kDropped = 23 - kMantissa;
  static constexpr std::uint32_t kTop = static_cast<std::uint32_t>(kBias) << kMantissa;
  static constexpr std::uint32_t kOffset = static_cast<std::uint32_t>(127 - kBias) << kMantissa;
  // 2^(1 - kBias), the smallest normal code's value.
  static constexpr std::uint32_t kSmallestNormalBits = static_cast<std::uint32_t>(128 - kBias)
                                                       << 23;

  // The code of y in [0, 1] (larger values and NaN give kTop). `random` holds kDropped random
  // bits for stochastic rounding; without it (kStochastic false) the rounding is to nearest even.
  // Below the smallest normal code, y + 2^(1 - kBias) lies in the first normal binade, whose
  // steps are the subnormal ones, so one rounding serves both.
  template <class Isa, bool kStochastic>
  static typename Isa::I encode(typename Isa::F y, typename Isa::I random) {
    const auto smallest_normal = Isa::from_bits(Isa::iset1(kSmallestNormalBits));
    const auto small = Isa::less(y, smallest_normal);
    const auto z = Isa::bits(Isa::select(small, Isa::add(y, smallest_normal), y));
    auto increment = random;
    if constexpr (!kStochastic) {
      const auto lowest_kept = Isa::iand(Isa::template shr<kDropped>(z), Isa::iset1(1));
      increment = Isa::iadd(Isa::iset1((1u << (kDropped - 1)) - 1), lowest_kept);
    }
    auto code =
        Isa::isub(Isa::template shr<kDropped>(Isa::iadd(z, increment)), Isa::iset1(kOffset));
    code = Isa::iselect(small, Isa::isub(code, Isa::iset1(1u << kMantissa)), code);
    return Isa::imin(code, Isa::iset1(kTop));
  }

  // The value of a code in [0, kTop], in units of the scale.
  template <class Isa>
  static typename Isa::F decode(typename Isa::I code) {
    const auto normal =
        Isa::from_bits(Isa::template shl<kDropped>(Isa::iadd(code, Isa::iset1(kOffset))));
    const auto shifted = Isa::from_bits(
        Isa::template shl<kDropped>(Isa::iadd(code, Isa::iset1(kOffset + (1u << kMantissa)))));
    const auto subnormal = Isa::sub(shifted, Isa::from_bits(Isa::iset1(kSmallestNormalBits)));
    return Isa::select(Isa::iless(code, Isa::iset1(1u << kMantissa)), subnormal, normal);
  }
};
using ExpAvgCode = MomentCode<15>;    // int8: sign and magnitude codes 0..120
using ExpAvgSqCode = MomentCode<31>;  // uint8: codes 0..248

inline constexpr std::uint32_t kMagnitudeMask = 0x7FFFFFFFu;
inline constexpr std::uint32_t kSignMask = 0x80000000u;

// A signed first-moment code: two's complement of the magnitude's code for negative values.
template <class Isa>
typename Isa::F decode_exp_avg(typename Isa::I code, typename Isa::F scale) {
  const auto sign = Isa::template sar<31>(code);
  const auto magnitude = Isa::isub(Isa::ixor(code, sign), sign);
  const auto value = Isa::mul(ExpAvgCode::decode<Isa>(magnitude), scale);
  return Isa::from_bits(Isa::ixor(Isa::bits(value), Isa::iand(sign, Isa::iset1(kSignMask))));
}

template <class Isa, bool kStochastic>
typename Isa::I encode_exp_avg(typename Isa::F value, typename Isa::F inv_scale,
                               typename Isa::I random) {
  const auto bits = Isa::bits(value);
  const auto y = Isa::mul(Isa::from_bits(Isa::iand(bits, Isa::iset1(kMagnitudeMask))), inv_scale);
  const auto code = ExpAvgCode::encode<Isa, kStochastic>(y, random);
  const auto sign = Isa::template sar<31>(bits);
  return Isa::isub(Isa::ixor(code, sign), sign);
}

template <class Isa, bool kStochastic>
typename Isa::I encode_exp_avg_sq(typename Isa::F value, typename Isa::F inv_scale,
                                  typename Isa::I random) {
  const auto y = Isa::mul(value, inv_scale);
  const auto code = ExpAvgSqCode::encode<Isa, kStochastic>(y, random);
  // A positive second moment never becomes zero: the update would be m / eps.
  const auto positive = Isa::less(Isa::set1(0.0f), y);
  return Isa::imax(code, Isa::iselect(positive, Isa::iset1(1), Isa::iset1(0)));
}

// A block's scale from the largest magnitude's bit pattern (NaN made canonical), and the factor
// that maps the block into [0, 1] (0 for an all-zero block).
inline float block_scale(std::uint32_t largest_bits) {
  return std::bit_cast<float>(largest_bits > 0x7F800000u ? 0x7FC00000u : largest_bits);
}
inline float inverse_scale(float scale) { return scale > 0.0f ? 1.0f / scale : 0.0f; }

// Runs the Isa's full vectors over [begin, end) and returns where it stopped; the caller finishes
// the remaining (fewer than kWidth) elements with the scalar kernel. `O` is the dtype written to
// lowp_param; kFloat32 there means no low-precision copy is written. `S` is the moments' dtype,
// kFloat32 or kBFloat16 (8-bit moments take adam_int8_blocks).
// The element type of fp32 or bf16 moments.
constexpr DType element_dtype(StateDType state) {
  return state == StateDType::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
}

template <class Isa, DType G, DType O, StateDType S>
std::int64_t adam_vectors(const AdamCoefficients& c, const AdamBuffers& b, std::int64_t begin,
                          std::int64_t end) {
  using F = typename Isa::F;
  using GradElement = std::conditional_t<G == DType::kFloat32, float, std::uint16_t>;
  // Local copies: the stores below go through may-alias vector types, which would otherwise make
  // the compiler reload every pointer from `b` after each store.
  constexpr DType kState = element_dtype(S);
  using StateElement = std::conditional_t<S == StateDType::kFloat32, float, std::uint16_t>;
  float* const param_ptr = b.param;
  const auto* const grad_ptr = static_cast<const GradElement*>(b.grad);
  auto* const exp_avg_ptr = static_cast<StateElement*>(b.exp_avg);
  auto* const exp_avg_sq_ptr = static_cast<StateElement*>(b.exp_avg_sq);
  float* const max_exp_avg_sq_ptr = b.max_exp_avg_sq;
  auto* const lowp_ptr = static_cast<std::uint16_t*>(b.lowp_param);
  const bool amsgrad = c.amsgrad;
  const bool maximize = c.maximize;
  const bool l2_decay = c.l2_decay;
  const bool decay_weights = c.decay_weights;

  const F grad_scale_inv = Isa::set1(c.grad_scale_inv);
  const F l2_weight_decay = Isa::set1(c.l2_weight_decay);
  const F decay_factor = Isa::set1(c.decay_factor);
  // torch's lerp: start + w * (end - start) for |w| < 0.5, else end - (end - start) * (1 - w).
  const bool small_lerp_weight = c.lerp_weight < 0.5f;
  const F lerp_weight = Isa::set1(small_lerp_weight ? c.lerp_weight : 1.0f - c.lerp_weight);
  const F beta2 = Isa::set1(c.beta2);
  const F one_minus_beta2 = Isa::set1(c.one_minus_beta2);
  const F inv_bias_correction2_sqrt = Isa::set1(c.inv_bias_correction2_sqrt);
  const F eps = Isa::set1(c.eps);
  const F neg_step_size = Isa::set1(c.neg_step_size);

  const auto update = [&](std::int64_t i) {
    F grad = Isa::mul(Isa::template load_as<G>(grad_ptr, i), grad_scale_inv);
    if (maximize) grad = Isa::neg(grad);
    F param = Isa::load(param_ptr + i);
    if (decay_weights) param = Isa::mul(param, decay_factor);
    if (l2_decay) grad = Isa::add(grad, Isa::mul(l2_weight_decay, param));

    F exp_avg = Isa::template load_as<kState>(exp_avg_ptr, i);
    const F diff = Isa::sub(grad, exp_avg);
    exp_avg = small_lerp_weight ? Isa::add(exp_avg, Isa::mul(lerp_weight, diff))
                                : Isa::sub(grad, Isa::mul(diff, lerp_weight));
    F exp_avg_sq = Isa::template load_as<kState>(exp_avg_sq_ptr, i);
    exp_avg_sq =
        Isa::add(Isa::mul(exp_avg_sq, beta2), Isa::mul(Isa::mul(one_minus_beta2, grad), grad));
    F second_moment = exp_avg_sq;
    if (amsgrad) {
      second_moment = Isa::max(Isa::load(max_exp_avg_sq_ptr + i), exp_avg_sq);
      Isa::store(max_exp_avg_sq_ptr + i, second_moment);
    }
    // torch divides by the bias correction here; multiplying by its reciprocal saves one of the
    // two divisions, which with the sqrt bound the kernel while its data is in cache.
    const F denom = Isa::add(Isa::mul(Isa::sqrt(second_moment), inv_bias_correction2_sqrt), eps);
    param = Isa::add(param, Isa::div(Isa::mul(neg_step_size, exp_avg), denom));

    Isa::store(param_ptr + i, param);
    if constexpr (S == StateDType::kFloat32) {
      Isa::store(exp_avg_ptr + i, exp_avg);
      Isa::store(exp_avg_sq_ptr + i, exp_avg_sq);
    } else {
      const auto random = rounding_bits<Isa>(i, c.rounding_seed);
      store_bf16_stochastic<Isa>(exp_avg_ptr, i, exp_avg, Isa::iand(random, Isa::iset1(0xFFFFu)));
      store_bf16_stochastic<Isa>(exp_avg_sq_ptr, i, exp_avg_sq, Isa::template shr<16>(random));
    }
    if constexpr (O != DType::kFloat32) Isa::template store_as<O>(lowp_ptr, i, param);
  };

  // One 64-byte line of each fp32 stream per iteration, each line prefetched once, kPrefetchAhead
  // elements ahead (also past `end`, into the next chunk, but never past the buffer).
  constexpr std::int64_t kLine = 64 / sizeof(float);
  static_assert(kLine % Isa::kWidth == 0);
  const std::int64_t prefetch_end = b.numel - kPrefetchAhead;
  std::int64_t i = begin;
  for (; i + kLine <= end; i += kLine) {
    if (i < prefetch_end) {
      const std::int64_t j = i + kPrefetchAhead;
      __builtin_prefetch(param_ptr + j, 1);
      __builtin_prefetch(exp_avg_ptr + j, 1);
      __builtin_prefetch(exp_avg_sq_ptr + j, 1);
      __builtin_prefetch(grad_ptr + j, 0);
      if (amsgrad) __builtin_prefetch(max_exp_avg_sq_ptr + j, 1);
      if constexpr (O != DType::kFloat32) __builtin_prefetch(lowp_ptr + j, 1);
    }
    for (std::int64_t k = 0; k < kLine; k += Isa::kWidth) update(i + k);
  }
  for (; i + Isa::kWidth <= end; i += Isa::kWidth) update(i);
  return i;
}

// One block of 8-bit moments, `n` elements (a multiple of kWidth) from `first` on: decode the
// moments, update them and the weights, keep the new moments in fp32 on the stack, then encode
// them against the block's new largest magnitudes. `index` is the block's first element's index
// in its tensor (the rounding's counter).
template <class Isa, DType G, DType O>
struct Int8Block {
  using F = typename Isa::F;
  using I = typename Isa::I;
  using GradElement = std::conditional_t<G == DType::kFloat32, float, std::uint16_t>;
  float* param;
  const GradElement* grad;
  std::int8_t* exp_avg;
  std::uint8_t* exp_avg_sq;
  std::uint16_t* lowp;
  float* exp_avg_scale;
  float* exp_avg_sq_scale;

  void run(const AdamCoefficients& c, std::int64_t n, std::int64_t index) const {
    alignas(64) float new_exp_avg[kStateBlock];
    alignas(64) float new_exp_avg_sq[kStateBlock];
    const F grad_scale_inv = Isa::set1(c.grad_scale_inv);
    const F l2_weight_decay = Isa::set1(c.l2_weight_decay);
    const F decay_factor = Isa::set1(c.decay_factor);
    const bool small_lerp_weight = c.lerp_weight < 0.5f;
    const F lerp_weight = Isa::set1(small_lerp_weight ? c.lerp_weight : 1.0f - c.lerp_weight);
    const F beta2 = Isa::set1(c.beta2);
    const F one_minus_beta2 = Isa::set1(c.one_minus_beta2);
    const F inv_bias_correction2_sqrt = Isa::set1(c.inv_bias_correction2_sqrt);
    const F eps = Isa::set1(c.eps);
    const F neg_step_size = Isa::set1(c.neg_step_size);
    const F old_exp_avg_scale = Isa::set1(*exp_avg_scale);
    const F old_exp_avg_sq_scale = Isa::set1(*exp_avg_sq_scale);
    const I magnitude = Isa::iset1(kMagnitudeMask);
    I largest_exp_avg = Isa::iset1(0);
    I largest_exp_avg_sq = Isa::iset1(0);

    for (std::int64_t i = 0; i < n; i += Isa::kWidth) {
      F g = Isa::mul(Isa::template load_as<G>(grad, i), grad_scale_inv);
      if (c.maximize) g = Isa::neg(g);
      F p = Isa::load(param + i);
      if (c.decay_weights) p = Isa::mul(p, decay_factor);
      if (c.l2_decay) g = Isa::add(g, Isa::mul(l2_weight_decay, p));
      F m = decode_exp_avg<Isa>(Isa::template load_codes<true>(exp_avg, i), old_exp_avg_scale);
      const F diff = Isa::sub(g, m);
      m = small_lerp_weight ? Isa::add(m, Isa::mul(lerp_weight, diff))
                            : Isa::sub(g, Isa::mul(diff, lerp_weight));
      F v = Isa::mul(ExpAvgSqCode::decode<Isa>(Isa::template load_codes<false>(exp_avg_sq, i)),
                     old_exp_avg_sq_scale);
      v = Isa::add(Isa::mul(v, beta2), Isa::mul(Isa::mul(one_minus_beta2, g), g));
      const F denom = Isa::add(Isa::mul(Isa::sqrt(v), inv_bias_correction2_sqrt), eps);
      p = Isa::add(p, Isa::div(Isa::mul(neg_step_size, m), denom));
      Isa::store(param + i, p);
      if constexpr (O != DType::kFloat32) Isa::template store_as<O>(lowp, i, p);
      Isa::store(new_exp_avg + i, m);
      Isa::store(new_exp_avg_sq + i, v);
      largest_exp_avg = Isa::imax(largest_exp_avg, Isa::iand(Isa::bits(m), magnitude));
      largest_exp_avg_sq = Isa::imax(largest_exp_avg_sq, Isa::iand(Isa::bits(v), magnitude));
    }

    const float m_scale = block_scale(Isa::hmax(largest_exp_avg));
    const float v_scale = block_scale(Isa::hmax(largest_exp_avg_sq));
    *exp_avg_scale = m_scale;
    *exp_avg_sq_scale = v_scale;
    const F m_inv = Isa::set1(inverse_scale(m_scale));
    const F v_inv = Isa::set1(inverse_scale(v_scale));
    // The code's 20 dropped bits get the 16 random bits at their top.
    const I low16 = Isa::iset1(0xFFFFu);
    for (std::int64_t i = 0; i < n; i += Isa::kWidth) {
      const I random = rounding_bits<Isa>(index + i, c.rounding_seed);
      const I m_random = Isa::template shl<ExpAvgCode::kDropped - 16>(Isa::iand(random, low16));
      const I v_random =
          Isa::template shl<ExpAvgSqCode::kDropped - 16>(Isa::template shr<16>(random));
      Isa::store_codes(exp_avg, i,
                       encode_exp_avg<Isa, true>(Isa::load(new_exp_avg + i), m_inv, m_random));
      Isa::store_codes(
          exp_avg_sq, i,
          encode_exp_avg_sq<Isa, true>(Isa::load(new_exp_avg_sq + i), v_inv, v_random));
    }
  }
};

// The blocks in [begin, end) (block-aligned) of one tensor with 8-bit moments. A last block
// whose length is not a multiple of kWidth runs on zero-padded copies (zeros leave its scales
// as they are), so the tail rounds exactly as the scalar kernel would.
// Blocks ahead that adam_int8_blocks prefetches: kPrefetchAhead elements, as adam_vectors; all
// four lines of each block's codes are prefetched, not just the first (the step is latency-bound
// otherwise).
inline constexpr std::int64_t kAheadBlocks = kPrefetchAhead / kStateBlock;

template <class Isa, DType G, DType O>
void adam_int8_blocks(const AdamCoefficients& c, const AdamBuffers& b, std::int64_t begin,
                      std::int64_t end) {
  using Block = Int8Block<Isa, G, O>;
  using GradElement = typename Block::GradElement;
  for (std::int64_t first = begin; first < end; first += kStateBlock) {
    const std::int64_t n = std::min(kStateBlock, end - first);
    const std::int64_t block = first / kStateBlock;
    Block in_place{b.param + first,
                   static_cast<const GradElement*>(b.grad) + first,
                   static_cast<std::int8_t*>(b.exp_avg) + first,
                   static_cast<std::uint8_t*>(b.exp_avg_sq) + first,
                   static_cast<std::uint16_t*>(b.lowp_param) + (b.lowp_param ? first : 0),
                   b.exp_avg_scale + block,
                   b.exp_avg_sq_scale + block};
    if (n % Isa::kWidth == 0) {
      if (first + (kAheadBlocks + 1) * kStateBlock <= b.numel) {
        // The hardware prefetchers stop at page boundaries (as in adam_vectors).
        const std::int64_t ahead = first + kAheadBlocks * kStateBlock;
        for (std::int64_t k = 0; k < kStateBlock; k += 64 / sizeof(float)) {
          __builtin_prefetch(b.param + ahead + k, 1);
          __builtin_prefetch(static_cast<const GradElement*>(b.grad) + ahead + k, 0);
        }
        for (std::int64_t k = 0; k < kStateBlock; k += 64) {
          __builtin_prefetch(static_cast<std::int8_t*>(b.exp_avg) + ahead + k, 1);
          __builtin_prefetch(static_cast<std::uint8_t*>(b.exp_avg_sq) + ahead + k, 1);
        }
      }
      in_place.run(c, n, first);
      continue;
    }
    alignas(64) float param[kStateBlock] = {};
    alignas(64) GradElement grad[kStateBlock] = {};
    alignas(64) std::int8_t exp_avg[kStateBlock] = {};
    alignas(64) std::uint8_t exp_avg_sq[kStateBlock] = {};
    alignas(64) std::uint16_t lowp[kStateBlock] = {};
    std::copy_n(in_place.param, n, param);
    std::copy_n(in_place.grad, n, grad);
    std::copy_n(in_place.exp_avg, n, exp_avg);
    std::copy_n(in_place.exp_avg_sq, n, exp_avg_sq);
    const Block staged{
        param, grad, exp_avg, exp_avg_sq, lowp, in_place.exp_avg_scale, in_place.exp_avg_sq_scale};
    const std::int64_t padded = (n + Isa::kWidth - 1) / Isa::kWidth * Isa::kWidth;
    staged.run(c, padded, first);
    std::copy_n(param, n, in_place.param);
    std::copy_n(exp_avg, n, in_place.exp_avg);
    std::copy_n(exp_avg_sq, n, in_place.exp_avg_sq);
    if constexpr (O != DType::kFloat32) std::copy_n(lowp, n, in_place.lowp);
  }
}

template <class Isa, DType G, StateDType S>
std::int64_t adam_for_output(const AdamCoefficients& c, const AdamBuffers& b, std::int64_t begin,
                             std::int64_t end) {
  if constexpr (S == StateDType::kInt8) {
    if (b.lowp_param == nullptr) {
      adam_int8_blocks<Isa, G, DType::kFloat32>(c, b, begin, end);
    } else if (b.lowp_dtype == DType::kBFloat16) {
      adam_int8_blocks<Isa, G, DType::kBFloat16>(c, b, begin, end);
    } else {
      adam_int8_blocks<Isa, G, DType::kFloat16>(c, b, begin, end);
    }
    return end;
  } else {
    if (b.lowp_param == nullptr) return adam_vectors<Isa, G, DType::kFloat32, S>(c, b, begin, end);
    if (b.lowp_dtype == DType::kBFloat16) {
      return adam_vectors<Isa, G, DType::kBFloat16, S>(c, b, begin, end);
    }
    return adam_vectors<Isa, G, DType::kFloat16, S>(c, b, begin, end);
  }
}

template <class Isa, DType G>
std::int64_t adam_for_state(const AdamCoefficients& c, const AdamBuffers& b, std::int64_t begin,
                            std::int64_t end) {
  switch (b.state_dtype) {
    case StateDType::kBFloat16:
      return adam_for_output<Isa, G, StateDType::kBFloat16>(c, b, begin, end);
    case StateDType::kInt8:
      return adam_for_output<Isa, G, StateDType::kInt8>(c, b, begin, end);
    case StateDType::kFloat32:
      break;
  }
  return adam_for_output<Isa, G, StateDType::kFloat32>(c, b, begin, end);
}

// Updates [begin, end) with full vectors and returns where it stopped (the scalar kernel does
// the rest); 8-bit moments are done whole, their tails included.
template <class Isa>
std::int64_t adam_dispatch(const AdamCoefficients& c, const AdamBuffers& b, std::int64_t begin,
                           std::int64_t end) {
  switch (b.grad_dtype) {
    case DType::kBFloat16:
      return adam_for_state<Isa, DType::kBFloat16>(c, b, begin, end);
    case DType::kFloat16:
      return adam_for_state<Isa, DType::kFloat16>(c, b, begin, end);
    case DType::kFloat32:
      break;
  }
  return adam_for_state<Isa, DType::kFloat32>(c, b, begin, end);
}

// Like adam_vectors: full vectors only. Sets `finite` to whether every element read was finite.
template <class Isa, DType G>
std::int64_t grad_vectors(GradMode mode, const GradBuffers& b, std::int64_t begin, std::int64_t end,
                          bool& finite) {
  using F = typename Isa::F;
  // x - x is +0 for finite x and NaN for inf/NaN, so the sum turns NaN exactly when one was seen.
  F non_finite = Isa::set1(0.0f);
  std::int64_t i = begin;
  for (; i + Isa::kWidth <= end; i += Isa::kWidth) {
    const F value = Isa::template load_as<G>(b.src, i);
    non_finite = Isa::add(non_finite, Isa::sub(value, value));
    if (mode == GradMode::kCopy) {
      Isa::store(b.dst + i, value);
    } else if (mode == GradMode::kAccumulate) {
      Isa::store(b.dst + i, Isa::add(Isa::load(b.dst + i), value));
    }
  }
  finite = !Isa::any_nan(non_finite);
  return i;
}

template <class Isa>
std::int64_t grad_dispatch(GradMode mode, const GradBuffers& b, std::int64_t begin,
                           std::int64_t end, bool& finite) {
  switch (b.src_dtype) {
    case DType::kBFloat16:
      return grad_vectors<Isa, DType::kBFloat16>(mode, b, begin, end, finite);
    case DType::kFloat16:
      return grad_vectors<Isa, DType::kFloat16>(mode, b, begin, end, finite);
    case DType::kFloat32:
      break;
  }
  return grad_vectors<Isa, DType::kFloat32>(mode, b, begin, end, finite);
}

}  // namespace roundpipe::optim::kernels
