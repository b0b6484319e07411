// Host optimizer kernels on raw buffers: Adam/AdamW and the gradient passes the runtime runs
// before it (cast + accumulate + inf/NaN check). Torch-free.
//
// Master weights and moments are fp32. Gradients may be fp32, bf16 or fp16 and are unscaled
// (multiplied by a GradScaler's inverse scale) as they are read; the updated weights may also be
// written as bf16/fp16 into the model's low-precision parameter buffer in the same pass. bf16 and
// fp16 are handled as uint16 bit patterns, with round-to-nearest-even conversions that match
// torch's `.to(dtype)` bit for bit (NaN becomes one canonical quiet NaN).
//
// Every SIMD variant (scalar, AVX2, AVX-512; picked at run time by active_simd_level()) performs
// the same IEEE operations in the same order without FMA contraction, so all variants give
// bit-identical results, and the result never depends on how the work was split into chunks.
#pragma once

#include <cstdint>
#include <span>

#include "common/cpu_features.h"
#include "common/thread_pool.h"

namespace roundpipe::optim {

enum class DType : std::uint8_t { kFloat32, kBFloat16, kFloat16 };

// Hyper-parameters of one param group, as the user gave them (torch.optim.Adam's meaning).
struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool amsgrad = false;
  bool maximize = false;
  bool decoupled_weight_decay = false;  // AdamW
};

// The per-element constants of one tensor's update at a given step count. Derived in double
// precision and rounded to float exactly where torch.optim.Adam does, so results track it.
struct AdamCoefficients {
  float grad_scale_inv;
  float lerp_weight;  // 1 - beta1, the weight of the gradient in the first moment
  float beta2;
  float one_minus_beta2;
  float l2_weight_decay;            // added to the gradient (Adam); 0 when decoupled or disabled
  float decay_factor;               // 1 - lr * weight_decay (AdamW); 1 when coupled or disabled
  float neg_step_size;              // -lr / (1 - beta1^step)
  float inv_bias_correction2_sqrt;  // 1 / float(sqrt(1 - beta2^step)): torch's divisor, inverted
  float eps;
  bool amsgrad;
  bool maximize;
  bool l2_decay;       // l2_weight_decay applies
  bool decay_weights;  // decay_factor applies
};

AdamCoefficients adam_coefficients(const AdamHyper& hyper, double step, float grad_scale_inv);

// One tensor's buffers, all `numel` elements long and contiguous.
struct AdamBuffers {
  float* param;
  const void* grad;
  DType grad_dtype;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // only with amsgrad
  void* lowp_param;       // optional: receives the updated weights as lowp_dtype (bf16/fp16)
  DType lowp_dtype;
  std::int64_t numel;
};

// Updates elements [begin, end) of one tensor with the kernel of `level`.
void adam_update(SimdLevel level, const AdamCoefficients& coefficients, const AdamBuffers& buffers,
                 std::int64_t begin, std::int64_t end);

// One Adam step over many tensors, split into chunks across all of them on `num_threads` threads
// of `pool`. coefficients[k] belongs to buffers[k].
void adam_step(ThreadPool& pool, int num_threads, SimdLevel level,
               std::span<const AdamCoefficients> coefficients,
               std::span<const AdamBuffers> buffers);

// What a gradient pass does with each element of `src` (after casting it to fp32).
enum class GradMode : std::uint8_t {
  kCheck,       // only check that it is finite
  kCopy,        // dst = src
  kAccumulate,  // dst += src
};

struct GradBuffers {
  float* dst;  // unused by kCheck
  const void* src;
  DType src_dtype;
  std::int64_t numel;
};

// Applies `mode` to elements [begin, end) and returns true iff all of them are finite.
bool grad_pass(SimdLevel level, GradMode mode, const GradBuffers& buffers, std::int64_t begin,
               std::int64_t end);

// grad_pass over many tensors in parallel chunks; true iff every element is finite.
bool grad_pass(ThreadPool& pool, int num_threads, SimdLevel level, GradMode mode,
               std::span<const GradBuffers> buffers);

// Exact conversions, exposed for tests and scalar code paths.
float bf16_to_float(std::uint16_t bits);
std::uint16_t float_to_bf16(float value);
float fp16_to_float(std::uint16_t bits);
std::uint16_t float_to_fp16(float value);

}  // namespace roundpipe::optim
