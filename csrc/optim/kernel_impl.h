// The optimizer kernels' algorithms, written once over an instruction-set abstraction `Isa` and
// instantiated by each per-ISA translation unit (kernels_<isa>.cpp) with its own vector type.
// Include it only from those files, with `Isa` defined in an anonymous namespace there, so each
// instantiation stays private to the translation unit that was compiled with matching flags.
//
// An Isa provides: a vector type F of kWidth floats; set1, load, store (fp32); load_as<DType>
// and store_as<DType> (exact bf16/fp16 conversions); add, sub, mul, div, sqrt;
// max(a, b) = a > b ? a : b (as x86's maxps); and any_nan. For compact moments also: a vector I
// of kWidth 32-bit integers and a mask type M; bits/from_bits (reinterpretation); iset1, iota
// (0, 1, ...); iadd, iand, ior, ixor, imul (low 32 bits), imax (signed), umax (unsigned);
// shr<n> (logical); is_nan; iselect(mask, if_true, if_false); or_where_negative(y, x, bits)
// (x | bits in the lanes where y, as a signed integer, is negative); mul_add(a, b, c) (a * b + c,
// fused or not, used only where both round alike); load_half_codes<kSigned> (8-bit codes as the
// halves they stand for, see the 8-bit codes below); store_codes and store_u16 (the low 8 or 16
// bits of each lane), store_u16_pair (two vectors' low 16 bits, one after the other); hmax,
// humax (largest lane, signed and unsigned).
//
// The operation order mirrors torch.optim.Adam's single-tensor CPU path (lerp for the first
// moment, mul + addcmul for the second, sqrt / bias correction + eps, addcdiv) so results stay
// within float rounding of torch; the one departure is a multiplication by the bias correction's
// reciprocal in place of the division by it (one rounding apart); 8-bit moments depart a little
// more (adam_int8_blocks). No FMA contraction: every Isa rounds each operation once (the one fused
// multiply-add, mul_add_where, rounds as the separate operations would), which keeps all variants
// bit-identical to the scalar one.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <optional>
#include <type_traits>

#include "optim/adam.h"

namespace roundpipe::optim::kernels {

// How far ahead of the element being updated the Adam kernels with compact moments prefetch each
// stream: 2 KiB of fp32 state. The hardware prefetchers stop at every 4 KiB page boundary and
// track few streams. The kernel of fp32 moments, which computes least per byte, leaves its
// streams to them: each thread streams one long run (host_ops' runs), where the prefetch
// instructions measured 4 to 7% slower (benchmarks/adam_state_step.py, one 50M tensor).
inline constexpr std::int64_t kPrefetchAhead = 512;

// The random bits of the stochastic rounding of compact moments: a Weyl sequence, the step's seed
// plus the element's index in its tensor times an odd constant. The seed (a hash of the step)
// makes each element's bits independent and uniform from step to step, which is all unbiased
// rounding needs, and the next vector's bits are one addition away. exp_avg takes the top kBits
// bits, exp_avg_sq the bottom ones.
template <class Isa, int kBits>
class WeylBits {
 public:
  static constexpr std::uint32_t kStep = 0x9E3779B9u;
  static_assert(kBits > 0 && kBits < 32);

  WeylBits(std::int64_t index, std::uint32_t seed)
      : state_(Isa::iadd(
            Isa::imul(Isa::iadd(Isa::iset1(static_cast<std::uint32_t>(index)), Isa::iota()),
                      Isa::iset1(kStep)),
            Isa::iset1(seed))),
        stride_(Isa::iset1(kStep * static_cast<std::uint32_t>(Isa::kWidth))) {}

  typename Isa::I exp_avg() const { return Isa::template shr<32 - kBits>(state_); }
  typename Isa::I exp_avg_sq() const { return Isa::iand(state_, Isa::iset1((1u << kBits) - 1)); }
  void advance() { state_ = Isa::iadd(state_, stride_); }

 private:
  typename Isa::I state_;
  typename Isa::I stride_;
};

// bf16 with stochastic rounding, as bit patterns in the low 16 bits of each lane: 16 random bits
// added below the kept ones, then truncated, so a value rounds up with probability equal to its
// distance from the value below. NaN stays NaN.
template <class Isa>
typename Isa::I bf16_stochastic(typename Isa::F x, typename Isa::I random) {
  const auto rounded = Isa::template shr<16>(Isa::iadd(Isa::bits(x), random));
  return Isa::iselect(Isa::is_nan(x), Isa::iset1(0x7FC0u), rounded);
}

// The 8-bit codes of kInt8 moments (the format adam.h describes): the top bits of an IEEE half
// (fp16) with 3 mantissa bits, so a code decodes exactly by a shift and the hardware's
// half-to-float conversion. Encoding works on the fp32 bit pattern with integer operations.
//
// Encoding takes its input in units of 2^-16 of a half (the factor is part of the inverse scales
// below): a value in [2^-14, 2^15] halves then lies in [4, 2^31], and its code, the fp32
// exponent field minus 128 followed by the top 3 mantissa bits, is the low byte of the pattern
// shifted right by 20 (the bit above it, the exponent field's top one, is dropped when the code
// is stored as a byte).
inline constexpr int kCodeDropped = 20;           // fp32 mantissa bits below a code's 3
inline constexpr float kSmallestNormal = 4.0f;    // 2^-14 halves, in encoding units
inline constexpr float kExpAvgSqUnit = 0x1p-15f;  // exp_avg_sq's value of a half 1.0, per scale
inline constexpr std::uint32_t kMagnitudeMask = 0x7FFFFFFFu;

// The code of y >= kSmallestNormal (in the low byte). `random` holds kCodeDropped random bits
// for stochastic rounding; without them (kStochastic false) the rounding is to nearest even.
template <class Isa, bool kStochastic>
typename Isa::I encode_normal(typename Isa::F y, typename Isa::I random) {
  const auto z = Isa::bits(y);
  auto increment = random;
  if constexpr (!kStochastic) {
    const auto lowest_kept = Isa::iand(Isa::template shr<kCodeDropped>(z), Isa::iset1(1));
    increment = Isa::iadd(Isa::iset1((1u << (kCodeDropped - 1)) - 1), lowest_kept);
  }
  return Isa::template shr<kCodeDropped>(Isa::iadd(z, increment));
}

// The code of any y >= 0, subnormal codes included. Below the smallest normal half, y / 2 + 2
// lies in [2, 4): exponent field 128, whose steps are the subnormal ones, so one rounding serves
// both. (y / 2 is exact there, or too small to change the sum, so a fused multiply-add gives the
// same bits.)
// For y >= 4 the sum is y or less, for y < 4 more than y: the larger of the two is the one to
// encode (for NaN y, NaN).
template <class Isa, bool kStochastic>
typename Isa::I encode_magnitude(typename Isa::F y, typename Isa::I random) {
  const auto subnormal = Isa::mul_add(y, Isa::set1(0.5f), Isa::set1(2.0f));
  return encode_normal<Isa, kStochastic>(Isa::max(subnormal, y), random);
}

// exp_avg's code of `value`: sign in bit 7, magnitude code below. `inv_scale` is a BlockCoding's
// factor. inf and NaN give meaningless codes (settle_block keeps them out of a step's blocks).
template <class Isa, bool kStochastic>
typename Isa::I encode_exp_avg(typename Isa::F value, typename Isa::F inv_scale,
                               typename Isa::I random) {
  const auto y = Isa::bits(Isa::mul(value, inv_scale));
  const auto magnitude = Isa::from_bits(Isa::iand(y, Isa::iset1(kMagnitudeMask)));
  const auto code = encode_magnitude<Isa, kStochastic>(magnitude, random);
  return Isa::or_where_negative(y, code, Isa::iset1(0x80u));
}

// exp_avg_sq's code of `value` >= 0, never below the smallest normal one: inf (NaN) gives code
// 248 (252), the half's inf (NaN). `inv_scale` is a BlockCoding's factor.
template <class Isa, bool kStochastic>
typename Isa::I encode_exp_avg_sq(typename Isa::F value, typename Isa::F inv_scale,
                                  typename Isa::I random) {
  // max(a, b) is b when either is NaN: a NaN stays NaN.
  const auto y = Isa::max(Isa::set1(kSmallestNormal), Isa::mul(value, inv_scale));
  return encode_normal<Isa, kStochastic>(y, random);
}

// How one block of a moment is encoded: `scale`, what its codes are in units of (stored beside
// them), and `factor`, which maps its values into encoding units.
struct BlockCoding {
  float scale;
  float factor;
};

inline constexpr std::uint32_t kInfinityBits = 0x7F800000u;
// Scales from here up to float's largest take the plain factor `units / scale`; below it the
// factor would overflow, so a block is scaled up by kTinyBoost first (exactly: a power of two).
inline constexpr float kSmallestPlainScale = 0x1p-96f;
inline constexpr float kTinyBoost = 0x1p64f;

// Encoding units per scale: a value equal to its block's scale encodes as 2^16 (exp_avg's 1.0
// half) or 2^31 (exp_avg_sq's 2^15 half).
inline float encoding_units(bool is_exp_avg) {
  return is_exp_avg ? 0x1p16f : 0x1p16f / kExpAvgSqUnit;
}

// The coding of a block with `scale` >= 0 (finite), whose `n` values at `values` may be changed to
// fit it: scaled up for a tiny scale.
inline BlockCoding code_against(bool is_exp_avg, float* values, std::int64_t n, float scale) {
  if (scale == 0.0f) return {0.0f, 0.0f};  // all zeros: code 0, or exp_avg_sq's floor
  const float units = encoding_units(is_exp_avg);
  if (scale >= kSmallestPlainScale) return {scale, units / scale};
  for (std::int64_t i = 0; i < n; ++i) values[i] *= kTinyBoost;
  return {scale, units / (scale * kTinyBoost)};
}

// The coding of a block of `n` values whose largest magnitude has the bit pattern `largest` (at or
// above kInfinityBits when one is inf or NaN). A block of finite values of plain scale costs two
// comparisons; the others (rare) are fixed up in place: a non-finite exp_avg becomes 0 and a NaN
// exp_avg_sq a quiet one (code 252), and the scale is the largest finite magnitude, so that no
// non-finite value spoils its block. A block of an exp_avg_sq of zeros and infinities takes
// float's smallest normal as its scale, at which zeros still decode to 0 and inf to inf.
inline BlockCoding settle_block(bool is_exp_avg, float* values, std::int64_t n,
                                std::uint32_t largest) {
  if (largest >= std::bit_cast<std::uint32_t>(kSmallestPlainScale) && largest < kInfinityBits) {
    const float scale = std::bit_cast<float>(largest);
    return {scale, encoding_units(is_exp_avg) / scale};
  }
  if (largest >= kInfinityBits) {
    largest = 0;
    bool infinite = false;
    for (std::int64_t i = 0; i < n; ++i) {
      const std::uint32_t magnitude = std::bit_cast<std::uint32_t>(values[i]) & kMagnitudeMask;
      if (magnitude < kInfinityBits) {
        largest = std::max(largest, magnitude);
      } else if (is_exp_avg) {
        values[i] = 0.0f;
      } else {
        infinite = infinite || magnitude == kInfinityBits;
        values[i] = std::bit_cast<float>(magnitude == kInfinityBits ? kInfinityBits : 0x7FC00000u);
      }
    }
    if (largest == 0 && infinite) largest = std::bit_cast<std::uint32_t>(0x1p-126f);
  }
  return code_against(is_exp_avg, values, n, std::bit_cast<float>(largest));
}

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
  const bool l2_decay = c.l2_decay;

  const F grad_scale_inv = Isa::set1(c.grad_scale_inv);
  // maximize negates the gradient (flips its sign bit); decay_weights multiplies the weight:
  // both always applied, as a no-op (xor with 0, times 1: the same bits) when off.
  const auto gradient_sign = Isa::iset1(c.maximize ? 0x80000000u : 0u);
  const F decay_factor = Isa::set1(c.decay_weights ? c.decay_factor : 1.0f);
  const F l2_weight_decay = Isa::set1(c.l2_weight_decay);
  // torch's lerp: start + w * (end - start) for |w| < 0.5, else end - (end - start) * (1 - w).
  const bool small_lerp_weight = c.lerp_weight < 0.5f;
  const F lerp_weight = Isa::set1(small_lerp_weight ? c.lerp_weight : 1.0f - c.lerp_weight);
  const F beta2 = Isa::set1(c.beta2);
  const F one_minus_beta2 = Isa::set1(c.one_minus_beta2);
  const F inv_bias_correction2_sqrt = Isa::set1(c.inv_bias_correction2_sqrt);
  const F eps = Isa::set1(c.eps);
  const F neg_step_size = Isa::set1(c.neg_step_size);

  WeylBits<Isa, 16> random(begin, c.rounding_seed);
  // Updates the vector at i; returns its moments' bf16 bit patterns (S kBFloat16) for the caller to
  // store, which stores two vectors' at once where it can.
  struct Rounded {
    typename Isa::I exp_avg, exp_avg_sq;
  };
  const auto update = [&](std::int64_t i) __attribute__((always_inline)) {
    F grad = Isa::mul(Isa::template load_as<G>(grad_ptr, i), grad_scale_inv);
    grad = Isa::from_bits(Isa::ixor(Isa::bits(grad), gradient_sign));
    F param = Isa::mul(Isa::load(param_ptr + i), decay_factor);
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
    if constexpr (O != DType::kFloat32) Isa::template store_as<O>(lowp_ptr, i, param);
    if constexpr (S == StateDType::kFloat32) {
      Isa::store(exp_avg_ptr + i, exp_avg);
      Isa::store(exp_avg_sq_ptr + i, exp_avg_sq);
      return Rounded{};
    } else {
      const Rounded rounded{bf16_stochastic<Isa>(exp_avg, random.exp_avg()),
                            bf16_stochastic<Isa>(exp_avg_sq, random.exp_avg_sq())};
      random.advance();
      return rounded;
    }
  };
  const auto update_one = [&](std::int64_t i) __attribute__((always_inline)) {
    const Rounded r = update(i);
    if constexpr (S != StateDType::kFloat32) {
      Isa::store_u16(exp_avg_ptr, i, r.exp_avg);
      Isa::store_u16(exp_avg_sq_ptr, i, r.exp_avg_sq);
    }
  };
  // Two vectors of bf16 moments pack into one store per moment.
  constexpr bool kPairs =
      S != StateDType::kFloat32 && (64 / sizeof(float)) % (2 * Isa::kWidth) == 0;

  // One 64-byte line of each fp32 stream per iteration; with bf16 moments each line prefetched
  // once, kPrefetchAhead elements ahead (also past `end`, into the next run, but never past the
  // buffer).
  constexpr std::int64_t kLine = 64 / sizeof(float);
  static_assert(kLine % Isa::kWidth == 0);
  constexpr bool kPrefetch = S != StateDType::kFloat32;
  const std::int64_t prefetch_end = b.numel - kPrefetchAhead;
  std::int64_t i = begin;
  for (; i + kLine <= end; i += kLine) {
    if (kPrefetch && i < prefetch_end) {
      const std::int64_t j = i + kPrefetchAhead;
      __builtin_prefetch(param_ptr + j, 1);
      __builtin_prefetch(exp_avg_ptr + j, 1);
      __builtin_prefetch(exp_avg_sq_ptr + j, 1);
      __builtin_prefetch(grad_ptr + j, 0);
      if (amsgrad) __builtin_prefetch(max_exp_avg_sq_ptr + j, 1);
      if constexpr (O != DType::kFloat32) __builtin_prefetch(lowp_ptr + j, 1);
    }
    if constexpr (kPairs) {
      for (std::int64_t k = 0; k < kLine; k += 2 * Isa::kWidth) {
        const Rounded first = update(i + k);
        const Rounded second = update(i + k + Isa::kWidth);
        Isa::store_u16_pair(exp_avg_ptr, i + k, first.exp_avg, second.exp_avg);
        Isa::store_u16_pair(exp_avg_sq_ptr, i + k, first.exp_avg_sq, second.exp_avg_sq);
      }
    } else {
      for (std::int64_t k = 0; k < kLine; k += Isa::kWidth) update_one(i + k);
    }
  }
  for (; i + Isa::kWidth <= end; i += Isa::kWidth) update_one(i);
  return i;
}

// Elements ahead that the loop prefetches, a line of each stream at a time as adam_vectors does
// (prefetching a whole block at once measured slower): twice adam_vectors' distance, the best of
// those benchmarks/adam_state_step.py compared for this kernel, whose compute per byte is higher.
inline constexpr std::int64_t kInt8PrefetchAhead = 2 * kPrefetchAhead;

// The blocks in [begin, end) (block-aligned) of one tensor with 8-bit moments. A block's update
// decodes its moments, updates them and the weights, keeps the new moments in fp32 (`fresh`, in
// L1) and tracks their largest magnitudes; its encoding then stores them against the new scales.
// The loop over block k's vectors also encodes block k - 1, and finishes each vector's weight
// one vector late, so that the integer work and the division overlap the long chain through the
// square root. A last block whose length is not a multiple of kWidth runs on zero-padded copies
// (zeros leave its scales as they are), so the tail rounds exactly as the scalar kernel would.
//
// The moments are updated as torch's Adam updates them, with the decoding folded into the decay:
// exp_avg = half * (scale * beta1) + grad * (1 - beta1) and exp_avg_sq = half * (scale * 2^-15 *
// beta2) + (1 - beta2) * grad * grad, `half` being the code's value (the same values but for the
// last bit of a few roundings, well inside the 8-bit codes' steps).
template <class Isa, DType G, DType O>
void adam_int8_blocks(const AdamCoefficients& c, const AdamBuffers& b, std::int64_t begin,
                      std::int64_t end) {
  using F = typename Isa::F;
  using I = typename Isa::I;
  using GradElement = std::conditional_t<G == DType::kFloat32, float, std::uint16_t>;
  // Local copies, as in adam_vectors.
  float* const param_ptr = b.param;
  const auto* const grad_ptr = static_cast<const GradElement*>(b.grad);
  auto* const exp_avg_ptr = static_cast<std::int8_t*>(b.exp_avg);
  auto* const exp_avg_sq_ptr = static_cast<std::uint8_t*>(b.exp_avg_sq);
  auto* const lowp_ptr = static_cast<std::uint16_t*>(b.lowp_param);
  float* const exp_avg_scales = b.exp_avg_scale;
  float* const exp_avg_sq_scales = b.exp_avg_sq_scale;
  const bool l2_decay = c.l2_decay;
  const std::uint32_t seed = c.rounding_seed;
  const float beta1 = c.beta1;
  const float beta2 = c.beta2;

  const F grad_scale_inv = Isa::set1(c.grad_scale_inv);
  // As in adam_vectors: no-ops (the same bits) when off.
  const I gradient_sign = Isa::iset1(c.maximize ? 0x80000000u : 0u);
  const F decay_factor = Isa::set1(c.decay_weights ? c.decay_factor : 1.0f);
  const F l2_weight_decay = Isa::set1(c.l2_weight_decay);
  const F lerp_weight = Isa::set1(c.lerp_weight);
  const F one_minus_beta2 = Isa::set1(c.one_minus_beta2);
  const F inv_bias_correction2_sqrt = Isa::set1(c.inv_bias_correction2_sqrt);
  const F eps = Isa::set1(c.eps);
  const F neg_step_size = Isa::set1(c.neg_step_size);
  const I magnitude = Isa::iset1(kMagnitudeMask);

  // One block's buffers (the tensor's, or the tail's copies) and its fresh moments.
  struct Block {
    float* param;
    const GradElement* grad;
    std::int8_t* exp_avg;
    std::uint8_t* exp_avg_sq;
    std::uint16_t* lowp;
    float* fresh_exp_avg;
    float* fresh_exp_avg_sq;
  };
  // What an update carries from a block's start to its end.
  struct Update {
    F exp_avg_decay, exp_avg_sq_decay;
    I largest_exp_avg, largest_exp_avg_sq;
  };
  // A vector's weight, waiting for its division.
  struct Step {
    F param, numerator, denominator;
  };
  const auto start = [&](std::int64_t first) {
    const std::int64_t block = first / kStateBlock;
    return Update{Isa::set1(exp_avg_scales[block] * beta1),
                  Isa::set1(exp_avg_sq_scales[block] * kExpAvgSqUnit * beta2), Isa::iset1(0),
                  Isa::iset1(0)};
  };
  // The loop's lambdas are forced inline: a call would spill every vector register (all are
  // caller-saved), which measured far slower.
  const auto update = [&](const Block& k, Update& u,
                          std::int64_t i) __attribute__((always_inline)) {
    F g = Isa::mul(Isa::template load_as<G>(k.grad, i), grad_scale_inv);
    g = Isa::from_bits(Isa::ixor(Isa::bits(g), gradient_sign));
    const F p = Isa::mul(Isa::load(k.param + i), decay_factor);
    if (l2_decay) g = Isa::add(g, Isa::mul(l2_weight_decay, p));
    const F m =
        Isa::add(Isa::mul(Isa::template load_half_codes<true>(k.exp_avg, i), u.exp_avg_decay),
                 Isa::mul(g, lerp_weight));
    const F v = Isa::add(
        Isa::mul(Isa::template load_half_codes<false>(k.exp_avg_sq, i), u.exp_avg_sq_decay),
        Isa::mul(Isa::mul(one_minus_beta2, g), g));
    Isa::store(k.fresh_exp_avg + i, m);
    Isa::store(k.fresh_exp_avg_sq + i, v);
    u.largest_exp_avg = Isa::imax(u.largest_exp_avg, Isa::iand(Isa::bits(m), magnitude));
    // v is +0 or more (or NaN), so its bit patterns order as unsigned integers.
    u.largest_exp_avg_sq = Isa::umax(u.largest_exp_avg_sq, Isa::bits(v));
    return Step{p, Isa::mul(neg_step_size, m),
                Isa::add(Isa::mul(Isa::sqrt(v), inv_bias_correction2_sqrt), eps)};
  };
  const auto step = [&](const Block& k, const Step& s, std::int64_t i)
                        __attribute__((always_inline)) {
                          const F p = Isa::add(s.param, Isa::div(s.numerator, s.denominator));
                          Isa::store(k.param + i, p);
                          if constexpr (O != DType::kFloat32)
                            Isa::template store_as<O>(k.lowp, i, p);
                        };
  struct Encoding {
    F exp_avg_inverse, exp_avg_sq_inverse;
    WeylBits<Isa, kCodeDropped> random;
  };
  // Sets the block's new scales (its `n` fresh moments may be fixed up: settle_block); returns
  // its encoding.
  const auto finish = [&](const Block& k, const Update& u, std::int64_t first, std::int64_t n) {
    const std::int64_t block = first / kStateBlock;
    const BlockCoding m = settle_block(true, k.fresh_exp_avg, n, Isa::hmax(u.largest_exp_avg));
    const BlockCoding v =
        settle_block(false, k.fresh_exp_avg_sq, n, Isa::humax(u.largest_exp_avg_sq));
    exp_avg_scales[block] = m.scale;
    exp_avg_sq_scales[block] = v.scale;
    return Encoding{Isa::set1(m.factor), Isa::set1(v.factor),
                    WeylBits<Isa, kCodeDropped>(first, seed)};
  };
  const auto encode = [](const Block& k, Encoding& e,
                         std::int64_t i) __attribute__((always_inline)) {
    Isa::store_codes(k.exp_avg, i,
                     encode_exp_avg<Isa, true>(Isa::load(k.fresh_exp_avg + i), e.exp_avg_inverse,
                                               e.random.exp_avg()));
    Isa::store_codes(k.exp_avg_sq, i,
                     encode_exp_avg_sq<Isa, true>(Isa::load(k.fresh_exp_avg_sq + i),
                                                  e.exp_avg_sq_inverse, e.random.exp_avg_sq()));
    e.random.advance();
  };

  // One 64-byte line of each fp32 stream per kLine elements; a block's code lines all at its start.
  constexpr std::int64_t kLine = 64 / sizeof(float);
  static_assert(kLine % Isa::kWidth == 0 && kStateBlock % 64 == 0);
  const auto prefetch_floats = [&](std::int64_t j) __attribute__((always_inline)) {
    __builtin_prefetch(param_ptr + j, 1);
    __builtin_prefetch(grad_ptr + j, 0);
  };
  const auto prefetch_codes = [&](std::int64_t j) __attribute__((always_inline)) {
    for (std::int64_t line = 0; line < kStateBlock; line += 64) {
      __builtin_prefetch(exp_avg_ptr + j + line, 1);
      __builtin_prefetch(exp_avg_sq_ptr + j + line, 1);
    }
  };
  alignas(64) float fresh[2][2][kStateBlock];
  Block previous{};
  std::optional<Encoding> pending;
  const std::int64_t full_end = begin + (end - begin) / kStateBlock * kStateBlock;
  std::int64_t first = begin;
  for (int slot = 0; first < full_end; first += kStateBlock, slot ^= 1) {
    // Near the buffer's end the prefetches go to the block itself (in cache) instead of past it.
    const bool in_buffer = first + kStateBlock + kInt8PrefetchAhead <= b.numel;
    const std::int64_t ahead = in_buffer ? first + kInt8PrefetchAhead : first;
    const Block current{param_ptr + first,
                        grad_ptr + first,
                        exp_avg_ptr + first,
                        exp_avg_sq_ptr + first,
                        lowp_ptr + (lowp_ptr ? first : 0),
                        fresh[slot][0],
                        fresh[slot][1]};
    Update u = start(first);
    prefetch_codes(ahead);
    prefetch_floats(ahead);
    if (pending) {
      Encoding e = *pending;
      Step waiting = update(current, u, 0);
      encode(previous, e, 0);
      // Updates vector i, finishes vector i - 1's weight, encodes the previous block's vector i.
      const auto pipelined = [&](std::int64_t i) __attribute__((always_inline)) {
        const Step next = update(current, u, i);
        step(current, waiting, i - Isa::kWidth);
        waiting = next;
        encode(previous, e, i);
      };
      for (std::int64_t i = Isa::kWidth; i < kLine; i += Isa::kWidth) pipelined(i);
      for (std::int64_t line = kLine; line < kStateBlock; line += kLine) {
        prefetch_floats(ahead + line);
        for (std::int64_t i = 0; i < kLine; i += Isa::kWidth) pipelined(line + i);
      }
      step(current, waiting, kStateBlock - Isa::kWidth);
    } else {
      for (std::int64_t line = 0; line < kStateBlock; line += kLine) {
        if (line > 0) prefetch_floats(ahead + line);
        for (std::int64_t i = 0; i < kLine; i += Isa::kWidth) {
          step(current, update(current, u, line + i), line + i);
        }
      }
    }
    pending = finish(current, u, first, kStateBlock);
    previous = current;
  }
  if (pending) {
    for (std::int64_t i = 0; i < kStateBlock; i += Isa::kWidth) encode(previous, *pending, i);
  }
  if (first == end) return;

  const std::int64_t n = end - first;
  alignas(64) float param[kStateBlock] = {};
  alignas(64) GradElement grad[kStateBlock] = {};
  alignas(64) std::int8_t exp_avg[kStateBlock] = {};
  alignas(64) std::uint8_t exp_avg_sq[kStateBlock] = {};
  alignas(64) std::uint16_t lowp[kStateBlock] = {};
  std::copy_n(param_ptr + first, n, param);
  std::copy_n(grad_ptr + first, n, grad);
  std::copy_n(exp_avg_ptr + first, n, exp_avg);
  std::copy_n(exp_avg_sq_ptr + first, n, exp_avg_sq);
  const Block staged{param, grad, exp_avg, exp_avg_sq, lowp, fresh[0][0], fresh[0][1]};
  const std::int64_t padded = (n + Isa::kWidth - 1) / Isa::kWidth * Isa::kWidth;
  Update u = start(first);
  for (std::int64_t i = 0; i < padded; i += Isa::kWidth) step(staged, update(staged, u, i), i);
  Encoding e = finish(staged, u, first, padded);
  for (std::int64_t i = 0; i < padded; i += Isa::kWidth) encode(staged, e, i);
  std::copy_n(param, n, param_ptr + first);
  std::copy_n(exp_avg, n, exp_avg_ptr + first);
  std::copy_n(exp_avg_sq, n, exp_avg_sq_ptr + first);
  if constexpr (O != DType::kFloat32) std::copy_n(lowp, n, lowp_ptr + first);
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
