// Host optimizer kernels on raw buffers: Adam/AdamW and the gradient passes the runtime runs
// before it (cast + accumulate + inf/NaN check). Torch-free.
//
// Master weights are fp32. The moments are fp32, bf16 or block-wise 8-bit (see StateDType); compact
// moments are written back with stochastic rounding driven by counter-based random bits of the
// element's index and the step, so results do not depend on threads, chunks or instruction set.
// Gradients may be fp32, bf16 or fp16 and are unscaled (multiplied by a GradScaler's inverse scale)
// as they are read; the updated weights may also be written as bf16/fp16 into the model's
// low-precision parameter buffer in the same pass. bf16 and fp16 are handled as uint16 bit
// patterns, with round-to-nearest-even conversions that match torch's `.to(dtype)` bit for bit (NaN
// becomes one canonical quiet NaN).
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

// How Adam's moments are stored.
//   kFloat32:  fp32, as torch.optim.Adam.
//   kBFloat16: bf16, stochastically rounded (round-to-nearest would freeze the second moment: its
//              per-step change, (1 - beta2) = 0.1%, is below half a bf16 step, 0.2%).
//   kInt8:     8-bit codes with one fp32 scale per kStateBlock elements (the block's largest
//              magnitude), stochastically rounded. A code is the top of an IEEE half: magnitude
//              code c stands for the half with bits c << 7 (5 exponent bits, bias 15, and 3
//              mantissa bits; codes below 8 are subnormal steps of 2^-17).
//              exp_avg: int8, sign in bit 7 and c below; the value is half * scale, so the
//              block's largest magnitude is code 120 and the smallest step 2^-17 of it.
//              exp_avg_sq: uint8 c; the value is half * 2^-15 * scale (largest code 240), and
//              c >= 8: anything below 2^-29 of the block's largest is stored as 2^-29 of it, so a
//              second moment never decodes to zero (which would make the update m / eps).
//              Decoding is one shift and the hardware's exact half-to-float conversion.
//              Scales are the largest finite magnitudes, so any finite moment (up to float's
//              largest, down to its subnormals) is coded in its block, and a non-finite one never
//              spoils its block: an exp_avg_sq of inf or NaN is code 248 or 252 (the half's inf
//              and NaN), which decode to inf and NaN; an exp_avg of inf or NaN (its weight is NaN
//              then, as in torch's Adam) is stored as 0.
enum class StateDType : std::uint8_t { kFloat32, kBFloat16, kInt8 };

// Elements per scale of kInt8 moments: 0.03 byte per parameter of scales (two fp32 per block),
// and the step's fp32 staging of two blocks (4 KiB) stays in L1. Larger blocks cost precision
// (one scale spans more values) and measured no faster; smaller ones measured slower
// (docs/design/compact_adam_state.md).
inline constexpr std::int64_t kStateBlock = 256;

inline constexpr std::int64_t state_blocks(std::int64_t numel) {
  return (numel + kStateBlock - 1) / kStateBlock;
}

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
  float beta1;
  float beta2;
  float one_minus_beta2;
  float l2_weight_decay;            // added to the gradient (Adam); 0 when decoupled or disabled
  float decay_factor;               // 1 - lr * weight_decay (AdamW); 1 when coupled or disabled
  float neg_step_size;              // -lr / (1 - beta1^step)
  float inv_bias_correction2_sqrt;  // 1 / float(sqrt(1 - beta2^step)): torch's divisor, inverted
  float eps;
  bool amsgrad;
  bool maximize;
  bool l2_decay;                // l2_weight_decay applies
  bool decay_weights;           // decay_factor applies
  std::uint32_t rounding_seed;  // of the step's stochastic rounding of compact moments
};

AdamCoefficients adam_coefficients(const AdamHyper& hyper, double step, float grad_scale_inv);

// One tensor's buffers, all `numel` elements long and contiguous.
struct AdamBuffers {
  float* param;
  const void* grad;
  DType grad_dtype;
  void* exp_avg;          // float, bf16 (uint16) or int8 codes, as state_dtype says
  void* exp_avg_sq;       // float, bf16 (uint16) or uint8 codes
  float* max_exp_avg_sq;  // only with amsgrad (fp32 moments only)
  void* lowp_param;       // optional: receives the updated weights as lowp_dtype (bf16/fp16)
  DType lowp_dtype;
  std::int64_t numel;
  StateDType state_dtype = StateDType::kFloat32;
  float* exp_avg_scale = nullptr;     // kInt8: state_blocks(numel) scales
  float* exp_avg_sq_scale = nullptr;  // kInt8: likewise
};

// Updates elements [begin, end) of one tensor with the kernel of `level`. With kInt8 moments
// both ends must lie on a block boundary (a multiple of kStateBlock, or numel).
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

// Encodes fp32 moments (`numel` elements) as kInt8 codes and scales, rounded to the nearest code
// (ties to even), as a step would store them but without its random rounding: what a state in
// another form becomes when loaded into an optimizer with 8-bit moments. `is_exp_avg` picks the
// int8 code of the first moment, else the uint8 code of the second. With `given_scales` the
// scales are read, not computed: values decoded from codes and these scales encode back into the
// same codes.
void quantize_moment(ThreadPool& pool, int num_threads, bool is_exp_avg, const float* values,
                     void* codes, float* scales, std::int64_t numel, bool given_scales = false);

// The inverse: codes and scales back to fp32 values (exact: every code times its scale).
void dequantize_moment(ThreadPool& pool, int num_threads, bool is_exp_avg, const void* codes,
                       const float* scales, float* values, std::int64_t numel);

// Exact conversions, exposed for tests and scalar code paths.
float bf16_to_float(std::uint16_t bits);
std::uint16_t float_to_bf16(float value);
float fp16_to_float(std::uint16_t bits);
std::uint16_t float_to_fp16(float value);

}  // namespace roundpipe::optim
