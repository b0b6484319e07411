#include "executor/cuda_wait.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include <array>
#include <memory>
#include <mutex>

namespace roundpipe::executor::cuda {
namespace {

constexpr int kMaxDevices = 64;

// One non-blocking stream per device, created on first use and kept for the process.
cudaStream_t watch_stream(c10::DeviceIndex device) {
  static std::mutex mutex;
  static std::array<cudaStream_t, kMaxDevices> streams{};
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "CUDA device index ", device,
              " is out of range");
  std::lock_guard<std::mutex> lock(mutex);
  if (streams[device] == nullptr) {
    c10::cuda::CUDAGuard guard(device);
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[device], cudaStreamNonBlocking));
  }
  return streams[device];
}

void CUDART_CB run_notify(void* data) {
  std::unique_ptr<std::function<void()>> notify(static_cast<std::function<void()>*>(data));
  (*notify)();
}

}  // namespace

void notify_when_done(const c10::Event& event, std::function<void()> notify) {
  const c10::DeviceIndex device = event.device_index();
  cudaStream_t stream = watch_stream(device);
  c10::cuda::CUDAGuard guard(device);
  C10_CUDA_CHECK(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(event.eventId()), 0));
  auto owned = std::make_unique<std::function<void()>>(std::move(notify));
  C10_CUDA_CHECK(cudaLaunchHostFunc(stream, &run_notify, owned.get()));
  static_cast<void>(owned.release());
}

}  // namespace roundpipe::executor::cuda
