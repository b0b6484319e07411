#include "optim/adam.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>

#include "optim/kernels.h"

namespace roundpipe::optim {

namespace {
// Elements per parallel task of the passes other than Adam's: large enough to amortise claiming a
// task, small enough to balance the load across threads (about 1 MiB of memory per task).
constexpr std::int64_t kChunkElements = 1 << 15;
// Adam's step claims runs of elements: a share of what is left (1 / (2 * threads)), within these
// bounds, on multiples of kRunGrain. Each run is one contiguous stretch of every buffer a thread
// streams through, its prefetches never landing in another thread's run but at its end; runs
// shrink towards the end, so threads finish together even when one of them was slowed.
constexpr std::int64_t kLargestRun = 1 << 20;
constexpr std::int64_t kSmallestRun = 1 << 15;
constexpr std::int64_t kRunGrain = kStateBlock;

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
  // The buffers one after the other: a run may span several (small tensors share one).
  std::vector<std::int64_t> offsets(buffers.size() + 1, 0);
  for (std::size_t k = 0; k < buffers.size(); ++k) offsets[k + 1] = offsets[k] + buffers[k].numel;
  const std::int64_t total = offsets.back();
  if (total == 0) return;
  const std::int64_t threads = std::max(num_threads, 1);
  std::atomic<std::int64_t> next{0};
  // Claims the next run; false once everything is claimed.
  const auto claim = [&](std::int64_t& begin, std::int64_t& end) {
    begin = next.load(std::memory_order_relaxed);
    do {
      if (begin >= total) return false;
      const std::int64_t share =
          std::clamp((total - begin) / (2 * threads), kSmallestRun, kLargestRun);
      end = std::min(total, (begin + share + kRunGrain - 1) / kRunGrain * kRunGrain);
    } while (!next.compare_exchange_weak(begin, end, std::memory_order_relaxed));
    return true;
  };
  const std::int64_t runs =
      std::min<std::int64_t>(threads, (total + kSmallestRun - 1) / kSmallestRun);
  pool.run(runs, num_threads, [&](std::int64_t) {
    std::int64_t begin = 0;
    std::int64_t end = 0;
    while (claim(begin, end)) {
      auto k = static_cast<std::size_t>(std::upper_bound(offsets.begin(), offsets.end(), begin) -
                                        offsets.begin() - 1);
      for (; begin < end; ++k) {
        const AdamBuffers& b = buffers[k];
        std::int64_t first = begin - offsets[k];
        std::int64_t last = std::min(end, offsets[k + 1]) - offsets[k];
        if (b.state_dtype == StateDType::kInt8) {
          first = block_boundary(first, b.numel);
          last = block_boundary(last, b.numel);
        }
        if (first < last) adam_update(level, coefficients[k], b, first, last);
        begin = std::max(begin, offsets[k + 1]);
      }
    }
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
