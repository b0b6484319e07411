#include "optim/adam.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "optim/kernels.h"

namespace roundpipe::optim {

namespace {
// Elements per parallel task: large enough to amortise claiming a task, small enough to balance
// the load across threads (a task touches about 1 MiB of optimizer state).
constexpr std::int64_t kChunkElements = 1 << 15;
// Larger with 8-bit moments: threads take chunks in turn, so a thread's streams start cold at each
// of its chunks (its prefetches past the previous one's end went to another thread's chunk), and
// this kernel, with less slack between compute and memory time, lost much of two threads' speed
// to that at the smaller size.
constexpr std::int64_t kInt8ChunkElements = 1 << 17;

// murmur3's 32-bit finaliser.
std::uint32_t mix(std::uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  return h ^ (h >> 16);
}

// A chunk boundary inside a tensor with 8-bit moments, moved to the next block boundary; both
// chunks that share a boundary move it alike, so the chunks still cover every block once.
std::int64_t block_boundary(std::int64_t index, std::int64_t numel) {
  return std::min(numel, (index + kStateBlock - 1) / kStateBlock * kStateBlock);
}

template <class Buffers>
std::vector<std::int64_t> numels_of(std::span<const Buffers> buffers) {
  std::vector<std::int64_t> numels;
  numels.reserve(buffers.size());
  for (const Buffers& b : buffers) numels.push_back(b.numel);
  return numels;
}
}  // namespace

AdamCoefficients adam_coefficients(const AdamHyper& hyper, double step, float grad_scale_inv) {
  // Same double-precision expressions as torch.optim.Adam's Python code, rounded to float where
  // torch hands them to a float kernel.
  const double bias_correction1 = 1.0 - std::pow(hyper.beta1, step);
  const double bias_correction2 = 1.0 - std::pow(hyper.beta2, step);
  const bool decay = hyper.weight_decay != 0.0;
  AdamCoefficients c{};
  c.grad_scale_inv = grad_scale_inv;
  c.lerp_weight = static_cast<float>(1.0 - hyper.beta1);
  c.beta1 = static_cast<float>(hyper.beta1);
  c.beta2 = static_cast<float>(hyper.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - hyper.beta2);
  c.l2_weight_decay = static_cast<float>(hyper.weight_decay);
  c.decay_factor = static_cast<float>(1.0 - hyper.lr * hyper.weight_decay);
  c.neg_step_size = static_cast<float>(-(hyper.lr / bias_correction1));
  c.inv_bias_correction2_sqrt = 1.0f / static_cast<float>(std::pow(bias_correction2, 0.5));
  c.eps = static_cast<float>(hyper.eps);
  c.amsgrad = hyper.amsgrad;
  c.maximize = hyper.maximize;
  c.l2_decay = decay && !hyper.decoupled_weight_decay;
  c.decay_weights = decay && hyper.decoupled_weight_decay;
  c.rounding_seed = mix(static_cast<std::uint32_t>(static_cast<std::int64_t>(step)) * 0x27D4EB2Fu);
  return c;
}

void adam_update(SimdLevel level, const AdamCoefficients& coefficients, const AdamBuffers& buffers,
                 std::int64_t begin, std::int64_t end) {
  switch (level) {
#ifdef ROUNDPIPE_HAVE_X86_SIMD
    case SimdLevel::kAvx512:
      kernels::adam_avx512(coefficients, buffers, begin, end);
      return;
    case SimdLevel::kAvx2:
      kernels::adam_avx2(coefficients, buffers, begin, end);
      return;
#endif
    default:
      kernels::adam_scalar(coefficients, buffers, begin, end);
  }
}

void adam_step(ThreadPool& pool, int num_threads, SimdLevel level,
               std::span<const AdamCoefficients> coefficients,
               std::span<const AdamBuffers> buffers) {
  const std::vector<std::int64_t> numels = numels_of(buffers);
  const bool int8 = std::any_of(buffers.begin(), buffers.end(), [](const AdamBuffers& b) {
    return b.state_dtype == StateDType::kInt8;
  });
  parallel_for_chunks(pool, num_threads, numels, int8 ? kInt8ChunkElements : kChunkElements,
                      [&](std::size_t k, std::int64_t begin, std::int64_t end) {
                        const AdamBuffers& b = buffers[k];
                        if (b.state_dtype == StateDType::kInt8) {
                          begin = block_boundary(begin, b.numel);
                          end = block_boundary(end, b.numel);
                        }
                        if (begin < end) adam_update(level, coefficients[k], b, begin, end);
                      });
}

void quantize_moment(ThreadPool& pool, int num_threads, bool is_exp_avg, const float* values,
                     void* codes, float* scales, std::int64_t numel, bool given_scales) {
  const std::int64_t blocks[] = {state_blocks(numel)};
  parallel_for_chunks(pool, num_threads, blocks, kChunkElements / kStateBlock,
                      [&](std::size_t, std::int64_t first, std::int64_t last) {
                        kernels::quantize_blocks(is_exp_avg, values, codes, scales, numel, first,
                                                 last, given_scales);
                      });
}

void dequantize_moment(ThreadPool& pool, int num_threads, bool is_exp_avg, const void* codes,
                       const float* scales, float* values, std::int64_t numel) {
  const std::int64_t blocks[] = {state_blocks(numel)};
  parallel_for_chunks(pool, num_threads, blocks, kChunkElements / kStateBlock,
                      [&](std::size_t, std::int64_t first, std::int64_t last) {
                        kernels::dequantize_blocks(is_exp_avg, codes, scales, values, numel, first,
                                                   last);
                      });
}

bool grad_pass(SimdLevel level, GradMode mode, const GradBuffers& buffers, std::int64_t begin,
               std::int64_t end) {
  switch (level) {
#ifdef ROUNDPIPE_HAVE_X86_SIMD
    case SimdLevel::kAvx512:
      return kernels::grad_pass_avx512(mode, buffers, begin, end);
    case SimdLevel::kAvx2:
      return kernels::grad_pass_avx2(mode, buffers, begin, end);
#endif
    default:
      return kernels::grad_pass_scalar(mode, buffers, begin, end);
  }
}

bool grad_pass(ThreadPool& pool, int num_threads, SimdLevel level, GradMode mode,
               std::span<const GradBuffers> buffers) {
  const std::vector<std::int64_t> numels = numels_of(buffers);
  std::atomic<bool> finite{true};
  parallel_for_chunks(pool, num_threads, numels, kChunkElements,
                      [&](std::size_t k, std::int64_t begin, std::int64_t end) {
                        if (!grad_pass(level, mode, buffers[k], begin, end)) finite.store(false);
                      });
  return finite.load();
}

}  // namespace roundpipe::optim
