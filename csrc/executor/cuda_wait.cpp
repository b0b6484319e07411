#include "executor/cuda_wait.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

namespace roundpipe::executor::cuda {
namespace {

constexpr int kMaxDevices = 64;
// Watch streams per device. A stream serves its waits first in, first out, so a wait queued
// behind an unfinished one would be notified late however early its own event completed; each
// wait therefore takes a stream with none queued. There are as many such waits at a time as
// threads blocked in them, a handful; past this cap a wait shares the least busy stream.
constexpr std::size_t kMaxWatchStreams = 16;

// A private non-blocking stream and the host functions queued on it that have not run yet.
struct WatchStream {
  cudaStream_t stream = nullptr;
  std::atomic<int> queued{0};
};

// The watch streams of each device, created on demand and kept for the process (host functions
// may still be queued on them when it exits).
class WatchStreams {
 public:
  static WatchStreams& instance() {
    static auto* streams = new WatchStreams();
    return *streams;
  }

  // A stream of `device` with no wait queued (a new one while under the cap), counted as busy
  // until its host function has run.
  WatchStream& acquire(c10::DeviceIndex device) {
    TORCH_CHECK(device >= 0 && device < kMaxDevices, "CUDA device index ", device,
                " is out of range");
    std::lock_guard<std::mutex> lock(mutex_);
    auto& pool = pools_[static_cast<std::size_t>(device)];
    WatchStream* chosen = nullptr;
    for (auto& watch : pool) {
      if (chosen == nullptr || watch->queued.load() < chosen->queued.load()) chosen = watch.get();
    }
    if (chosen == nullptr || (chosen->queued.load() > 0 && pool.size() < kMaxWatchStreams)) {
      auto watch = std::make_unique<WatchStream>();
      c10::cuda::CUDAGuard guard(device);
      C10_CUDA_CHECK(cudaStreamCreateWithFlags(&watch->stream, cudaStreamNonBlocking));
      chosen = pool.emplace_back(std::move(watch)).get();
    }
    chosen->queued.fetch_add(1);
    return *chosen;
  }

 private:
  std::mutex mutex_;
  std::array<std::vector<std::unique_ptr<WatchStream>>, kMaxDevices> pools_;
};

struct Pending {
  std::function<void()> notify;
  WatchStream* watch;
};

void CUDART_CB run_notify(void* data) {
  std::unique_ptr<Pending> pending(static_cast<Pending*>(data));
  pending->notify();
  pending->watch->queued.fetch_sub(1);
}

}  // namespace

void notify_when_done(const c10::Event& event, std::function<void()> notify) {
  const c10::DeviceIndex device = event.device_index();
  WatchStream& watch = WatchStreams::instance().acquire(device);
  auto pending = std::make_unique<Pending>(Pending{std::move(notify), &watch});
  try {
    c10::cuda::CUDAGuard guard(device);
    C10_CUDA_CHECK(cudaStreamWaitEvent(watch.stream, static_cast<cudaEvent_t>(event.eventId()), 0));
    C10_CUDA_CHECK(cudaLaunchHostFunc(watch.stream, &run_notify, pending.get()));
  } catch (...) {
    watch.queued.fetch_sub(1);
    throw;
  }
  static_cast<void>(pending.release());
}

}  // namespace roundpipe::executor::cuda
