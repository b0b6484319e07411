// roundpipe_copy_bench: stage upload and gradient download + accumulate through the copy engine,
// each beside a raw cudaMemcpyAsync of the same bytes between the same page-locked host memory and
// the same device buffer, on a stream of its own (the bound the engine should reach).
//
//   roundpipe_copy_bench [--sizes-mib 16,256,1024] [--iters 10]
//
// upload:   host parameter arena (allocate_host_arena, pin "alloc") -> device, parameter lane
// download: device fp32 gradients -> page-locked staging -> += into a pageable host arena
//           (CopyEngine::accumulate, the gradient lane and the engine's worker), beside the raw
//           download alone and the raw download followed by the same add_ on the calling thread
// Each figure is the median over --iters copies, each waited for before the next (as a stage's
// upload is). Without a CUDA device (or without CUDA in the build) it prints why and exits 0.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_util.h"

#ifdef ROUNDPIPE_WITH_CUDA
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>

#include "device/cuda_devices.h"
#include "device/registry.h"
#include "executor/copy_engine.h"
#include "memory/host_arena.h"
#endif

namespace {

struct Options {
  std::vector<long> sizes_mib{16, 256, 1024};
  int iters = 10;
};

// Parses the command line; returns false (after printing why) on a bad argument.
bool parse(int argc, char** argv, Options& options) {
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--sizes-mib" && i + 1 < argc) {
      options.sizes_mib.clear();
      std::string list = argv[++i];
      for (std::size_t start = 0; start <= list.size();) {
        std::size_t comma = list.find(',', start);
        if (comma == std::string::npos) comma = list.size();
        long size = std::atol(list.substr(start, comma - start).c_str());
        if (size <= 0) {
          std::fprintf(stderr, "--sizes-mib: '%s' is not a list of positive integers\n",
                       list.c_str());
          return false;
        }
        options.sizes_mib.push_back(size);
        start = comma + 1;
      }
    } else if (arg == "--iters" && i + 1 < argc) {
      options.iters = std::atoi(argv[++i]);
      if (options.iters < 1) {
        std::fprintf(stderr, "--iters must be a positive integer\n");
        return false;
      }
    } else {
      std::fprintf(stderr, "usage: %s [--sizes-mib 16,256,1024] [--iters 10]\n", argv[0]);
      return false;
    }
  }
  return true;
}

#ifdef ROUNDPIPE_WITH_CUDA
using roundpipe::bench::median;
using roundpipe::bench::now_seconds;
using roundpipe::bench::Report;
using roundpipe::bench::Row;
namespace executor = roundpipe::executor;
namespace memory = roundpipe::memory;

// A CUDA stream of the benchmark's own for the raw copies; destroyed with the object.
class RawStream {
 public:
  RawStream() { C10_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~RawStream() { static_cast<void>(cudaStreamDestroy(stream_)); }
  RawStream(const RawStream&) = delete;
  RawStream& operator=(const RawStream&) = delete;

  // Seconds for one cudaMemcpyAsync of `bytes` (issued and waited for).
  double copy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
    const double start = now_seconds();
    C10_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, stream_));
    C10_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return now_seconds() - start;
  }

 private:
  cudaStream_t stream_ = nullptr;
};

double gb_per_s(std::size_t bytes, double seconds) {
  return static_cast<double>(bytes) / seconds / 1e9;
}

// Times `once` (returns seconds) `iters` times after one warm-up; the median.
template <typename Once>
double median_seconds(int iters, Once once) {
  once();
  std::vector<double> samples;
  for (int i = 0; i < iters; ++i) samples.push_back(once());
  return median(samples);
}

int run(const Options& options) {
  auto& registry = roundpipe::device::Registry::instance();
  registry.set_cuda_provider(roundpipe::device::cuda_provider());
  if (c10::cuda::device_count() == 0) {
    std::printf("skipped: no CUDA device\n");
    return 0;
  }
  registry.configure("cuda", std::nullopt, 0);
  const c10::Device gpu(c10::DeviceType::CUDA, 0);
  executor::CopyEngine& engine = executor::copy_engine(0);
  RawStream raw;
  Report upload("stage_upload"), download("grad_download");

  for (long mib : options.sizes_mib) {
    const std::size_t bytes = static_cast<std::size_t>(mib) << 20;
    const auto n = static_cast<std::int64_t>(bytes);
    const std::string size = std::to_string(mib) + " MiB";

    // Upload: the pinned parameter arena to a device buffer.
    at::Tensor arena = memory::allocate_host_arena(n, memory::PinMode::kAlloc, /*zero=*/false);
    arena.fill_(7);
    if (!memory::is_page_locked(arena)) {
      std::fprintf(stderr, "the parameter arena is not page-locked on CUDA\n");
      return 1;
    }
    at::Tensor device_buffer = at::empty({n}, at::TensorOptions().dtype(at::kByte).device(gpu));
    const double raw_up = median_seconds(options.iters, [&] {
      return raw.copy(device_buffer.data_ptr(), arena.data_ptr(), bytes, cudaMemcpyHostToDevice);
    });
    const double ours_up = median_seconds(options.iters, [&] {
      const double start = now_seconds();
      engine.copy(device_buffer, arena, executor::Lane::kParameter, nullptr)->synchronize();
      return now_seconds() - start;
    });
    if (device_buffer[n - 1].item<std::uint8_t>() != 7) {
      std::fprintf(stderr, "upload check failed: the device buffer does not hold the arena\n");
      return 1;
    }
    upload.add(Row{"upload " + size,
                   {{"raw_GBps", gb_per_s(bytes, raw_up)},
                    {"ours_GBps", gb_per_s(bytes, ours_up)},
                    {"ours/raw", raw_up / ours_up}}});

    // Download + accumulate: fp32 device gradients into a pageable host arena.
    const std::int64_t floats = n / 4;
    at::Tensor grads = at::ones({floats}, at::TensorOptions().dtype(at::kFloat).device(gpu));
    at::Tensor host =
        memory::allocate_host_arena(n, memory::PinMode::kOff, /*zero=*/true).view(at::kFloat);
    at::Tensor staging = memory::allocate_pinned_staging(n).view(at::kFloat);
    const double raw_down = median_seconds(options.iters, [&] {
      return raw.copy(staging.data_ptr(), grads.data_ptr(), bytes, cudaMemcpyDeviceToHost);
    });
    const double raw_down_add = median_seconds(options.iters, [&] {
      const double start = now_seconds();
      raw.copy(staging.data_ptr(), grads.data_ptr(), bytes, cudaMemcpyDeviceToHost);
      host.add_(staging);
      return now_seconds() - start;
    });
    host.zero_();
    const double ours_down = median_seconds(options.iters, [&] {
      const double start = now_seconds();
      engine.accumulate(host, grads, nullptr, staging)->synchronize();
      return now_seconds() - start;
    });
    const float expected = static_cast<float>(options.iters + 1);  // warm-up + iters
    if (host[0].item<float>() != expected || host[floats - 1].item<float>() != expected) {
      std::fprintf(stderr, "accumulate check failed: expected %g in every element\n", expected);
      return 1;
    }
    download.add(Row{"download+accumulate " + size,
                     {{"raw_GBps", gb_per_s(bytes, raw_down)},
                      {"raw+add_GBps", gb_per_s(bytes, raw_down_add)},
                      {"ours_GBps", gb_per_s(bytes, ours_down)},
                      {"ours/raw", raw_down / ours_down},
                      {"ours/raw+add", raw_down_add / ours_down}}});
  }
  std::printf("GPU 0, %d copies per figure (median); GB/s = 1e9 bytes/s\n", options.iters);
  upload.print();
  download.print();
  return 0;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  Options options;
  if (!parse(argc, argv, options)) return 2;
#ifdef ROUNDPIPE_WITH_CUDA
  try {
    return run(options);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "roundpipe_copy_bench failed: %s\n", error.what());
    return 1;
  }
#else
  std::printf("skipped: no CUDA device (this build has no CUDA)\n");
  return 0;
#endif
}
