#include "executor/copy_engine.h"

#include <ATen/ops/empty.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "device/registry.h"

namespace roundpipe::executor {
namespace {

c10::Stream pool_stream(c10::Device device, bool high_priority) {
  if (!device.is_cuda()) return c10::Stream(c10::Stream::DEFAULT, device);
  return c10::impl::getDeviceGuardImpl(device.type())
      ->getStreamFromGlobalPool(device, high_priority);
}

// Tells the caching allocator that `tensor` is used on `stream`, so its block is not handed to
// other work before what is queued there has run (a device tensor used off its allocation stream).
void record_use(const at::Tensor& tensor, const c10::Stream& stream) {
  if (!tensor.is_cuda()) return;
  c10::impl::getDeviceGuardImpl(tensor.device().type())
      ->recordDataPtrOnStream(tensor.storage().data_ptr(), stream);
}

// Runs `work` on the worker once `after` completed, completing the returned event with its error.
// The work (and the tensors it captured) is destroyed before the event completes (see WorkQueue).
template <typename Work>
EventPtr submit_host_job(WorkQueue& worker, Lane lane, EventPtr after, Work work) {
  auto done = std::make_shared<Event>();
  auto pending = std::make_shared<std::optional<Work>>(std::move(work));
  worker.submit(static_cast<int>(lane), [done, after = std::move(after), pending]() mutable {
    std::exception_ptr error;
    try {
      if (after) after->synchronize();
      (**pending)();
    } catch (...) {
      error = std::current_exception();
    }
    pending->reset();
    after.reset();
    done->complete(error);
  });
  return done;
}

std::mutex& engines_mutex() {
  static std::mutex mutex;
  return mutex;
}

// Engines live for the whole process (leaked on purpose: worker threads must not be joined during
// static destruction, after libtorch may already be gone). Keyed by kind and index so that
// reconfiguring the registry never hands out an engine of the other kind.
std::map<std::pair<bool, int>, std::unique_ptr<CopyEngine>>& engines() {
  static auto* map = new std::map<std::pair<bool, int>, std::unique_ptr<CopyEngine>>();
  return *map;
}

}  // namespace

CopyEngine::CopyEngine(c10::Device device)
    : device_(device),
      activation_(pool_stream(device, true)),
      parameter_(pool_stream(device, false)),
      gradient_(pool_stream(device, false)) {}

c10::Stream CopyEngine::lane_stream(Lane lane) const {
  switch (lane) {
    case Lane::kActivation:
      return activation_;
    case Lane::kGradient:
      return gradient_;
    case Lane::kParameter:
      return parameter_;
  }
  return parameter_;
}

EventPtr CopyEngine::copy(const at::Tensor& dst, const at::Tensor& src, Lane lane,
                          const EventPtr& after) {
  TORCH_CHECK(dst.numel() == src.numel(), "CopyEngine.copy: dst has ", dst.numel(),
              " elements but src has ", src.numel());
  if (!on_cuda()) {
    return submit_host_job(worker_, lane, after, [dst, src] { dst.copy_(src); });
  }
  c10::Stream stream = lane_stream(lane);
  c10::StreamGuard guard(stream);
  if (after) after->block(stream);
  dst.copy_(src, /*non_blocking=*/true);
  record_use(src, stream);
  record_use(dst, stream);
  return Event::recorded_on(stream);
}

EventPtr CopyEngine::accumulate(const at::Tensor& dst, const at::Tensor& src,
                                const EventPtr& after) {
  TORCH_CHECK(dst.device().is_cpu(), "CopyEngine.accumulate: dst must be a host tensor");
  TORCH_CHECK(dst.numel() == src.numel(), "CopyEngine.accumulate: dst has ", dst.numel(),
              " elements but src has ", src.numel());
  if (!on_cuda()) {
    return submit_host_job(worker_, Lane::kGradient, after, [dst, src] { dst.add_(src); });
  }
  c10::Stream stream = lane_stream(Lane::kGradient);
  at::Tensor staging;
  {
    c10::StreamGuard guard(stream);
    if (after) after->block(stream);
    staging = at::empty(src.sizes(), src.options().device(at::kCPU).pinned_memory(true));
    staging.copy_(src, /*non_blocking=*/true);
    record_use(src, stream);
  }
  EventPtr downloaded = Event::recorded_on(stream);
  return submit_host_job(worker_, Lane::kGradient, downloaded,
                         [dst, staging] { dst.add_(staging); });
}

c10::Stream current_stream(int index) {
  c10::Device device = copy_engine(index).device();
  if (!device.is_cuda()) return c10::Stream(c10::Stream::DEFAULT, device);
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
}

CopyEngine& copy_engine(int index) {
  auto& registry = device::Registry::instance();
  const bool cuda = registry.kind() == device::DeviceKind::kCuda;
  TORCH_CHECK(index >= 0 && index < registry.count(), "device index ", index,
              " is out of range [0, ", registry.count(), ")");
  std::lock_guard<std::mutex> lock(engines_mutex());
  auto& engine = engines()[{cuda, index}];
  if (!engine) {
    c10::Device device =
        cuda ? c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(index))
             : c10::Device(c10::DeviceType::CPU);
    engine = std::make_unique<CopyEngine>(device);
  }
  return *engine;
}

void drain_copy_engines() {
  std::vector<CopyEngine*> all;
  {
    std::lock_guard<std::mutex> lock(engines_mutex());
    for (auto& [key, engine] : engines()) all.push_back(engine.get());
  }
  for (CopyEngine* engine : all) engine->drain();
}

}  // namespace roundpipe::executor
