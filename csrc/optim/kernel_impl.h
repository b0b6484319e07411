// The optimizer kernels' algorithms, written once over an instruction-set abstraction `Isa` and
// instantiated by each per-ISA translation unit (kernels_<isa>.cpp) with its own vector type.
// Include it only from those files, with `Isa` defined in an anonymous namespace there, so each
// instantiation stays private to the translation unit that was compiled with matching flags.
//
// An Isa provides: a vector type F of kWidth floats; set1, load, store (fp32); load_as<DType>
// and store_as<DType> (exact bf16/fp16 conversions); add, sub, mul, div, sqrt, neg;
// max(a, b) = a > b ? a : b (as x86's maxps); and any_nan.
//
// The operation order mirrors torch.optim.Adam's single-tensor CPU path (lerp for the first
// moment, mul + addcmul for the second, sqrt / bias correction + eps, addcdiv) so results stay
// within float rounding of torch; the one departure is a multiplication by the bias correction's
// reciprocal in place of the division by it (one rounding apart). No FMA: every Isa rounds each
// operation once, which keeps all variants bit-identical to the scalar one.
#pragma once

#include <cstdint>
#include <type_traits>

#include "optim/adam.h"

namespace roundpipe::optim::kernels {

// How far ahead of the element being updated the Adam kernel prefetches each stream: 2 KiB of
// fp32 state. The hardware prefetchers stop at every 4 KiB page boundary and track few streams;
// Adam runs 4 to 6 streams per thread, and without this it is latency-bound below the memory
// bandwidth (+10% measured at 10M and 100M parameters; 256 to 1024 measured alike, 2048 worse).
inline constexpr std::int64_t kPrefetchAhead = 512;

// Runs the Isa's full vectors over [begin, end) and returns where it stopped; the caller finishes
// the remaining (fewer than kWidth) elements with the scalar kernel. `O` is the dtype written to
// lowp_param; kFloat32 there means no low-precision copy is written.
template <class Isa, DType G, DType O>
std::int64_t adam_vectors(const AdamCoefficients& c, const AdamBuffers& b, std::int64_t begin,
                          std::int64_t end) {
  using F = typename Isa::F;
  using GradElement = std::conditional_t<G == DType::kFloat32, float, std::uint16_t>;
  // Local copies: the stores below go through may-alias vector types, which would otherwise make
  // the compiler reload every pointer from `b` after each store.
  float* const param_ptr = b.param;
  const auto* const grad_ptr = static_cast<const GradElement*>(b.grad);
  float* const exp_avg_ptr = b.exp_avg;
  float* const exp_avg_sq_ptr = b.exp_avg_sq;
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

    F exp_avg = Isa::load(exp_avg_ptr + i);
    const F diff = Isa::sub(grad, exp_avg);
    exp_avg = small_lerp_weight ? Isa::add(exp_avg, Isa::mul(lerp_weight, diff))
                                : Isa::sub(grad, Isa::mul(diff, lerp_weight));
    F exp_avg_sq = Isa::load(exp_avg_sq_ptr + i);
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
    Isa::store(exp_avg_ptr + i, exp_avg);
    Isa::store(exp_avg_sq_ptr + i, exp_avg_sq);
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

template <class Isa, DType G>
std::int64_t adam_vectors_for_output(const AdamCoefficients& c, const AdamBuffers& b,
                                     std::int64_t begin, std::int64_t end) {
  if (b.lowp_param == nullptr) return adam_vectors<Isa, G, DType::kFloat32>(c, b, begin, end);
  if (b.lowp_dtype == DType::kBFloat16) {
    return adam_vectors<Isa, G, DType::kBFloat16>(c, b, begin, end);
  }
  return adam_vectors<Isa, G, DType::kFloat16>(c, b, begin, end);
}

template <class Isa>
std::int64_t adam_dispatch(const AdamCoefficients& c, const AdamBuffers& b, std::int64_t begin,
                           std::int64_t end) {
  switch (b.grad_dtype) {
    case DType::kBFloat16:
      return adam_vectors_for_output<Isa, DType::kBFloat16>(c, b, begin, end);
    case DType::kFloat16:
      return adam_vectors_for_output<Isa, DType::kFloat16>(c, b, begin, end);
    case DType::kFloat32:
      break;
  }
  return adam_vectors_for_output<Isa, DType::kFloat32>(c, b, begin, end);
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
