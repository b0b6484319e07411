#include "executor/copy_engine.h"

#include <ATen/ops/empty.h>
#include <c10/core/StreamGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "device/registry.h"
#include "executor/jobs.h"

#ifdef ROUNDPIPE_WITH_CUDA
#include "executor/cuda_streams.h"
#endif

namespace roundpipe::executor {
namespace {

c10::Stream pool_stream(c10::Device device, [[maybe_unused]] bool high_priority) {
#ifdef ROUNDPIPE_WITH_CUDA
  if (device.is_cuda()) return cuda::pool_stream(device, high_priority);
#endif
  return c10::Stream(c10::Stream::DEFAULT, device);
}

// Tells the caching allocator that `tensor` is used on `stream`, so its block is not handed to
// other work before what is queued there has run (a device tensor used off its allocation stream).
void record_use([[maybe_unused]] const at::Tensor& tensor,
                [[maybe_unused]] const c10::Stream& stream) {
#ifdef ROUNDPIPE_WITH_CUDA
  if (tensor.is_cuda()) cuda::record_use(tensor, stream);
#endif
}

// The stream that compute on `device` is issued to from this thread.
c10::Stream compute_stream(c10::Device device) {
#ifdef ROUNDPIPE_WITH_CUDA
  if (device.is_cuda()) return cuda::current_stream(device);
#endif
  return c10::Stream(c10::Stream::DEFAULT, device);
}

// An event recorded now on the stream that compute on `device` is issued to from this thread. A
// lane copy into a block the caching allocator handed out on that stream waits for it, so it never
// overwrites memory that kernels queued there (before the block was freed and reused) still read.
c10::Event compute_position(c10::Device device) {
  c10::Event event(device.type());
  event.record(compute_stream(device));
  return event;
}

std::mutex& engines_mutex() {
  static std::mutex mutex;
  return mutex;
}

// Engines live for the whole process (leaked on purpose: worker threads must not be joined during
// static destruction, after libtorch may already be gone). Keyed by kind, index and GPU so that
// reconfiguring the registry never hands out an engine of the other kind or of another GPU.
using EngineKey = std::tuple<bool, int, int>;
std::map<EngineKey, std::unique_ptr<CopyEngine>>& engines() {
  static auto* map = new std::map<EngineKey, std::unique_ptr<CopyEngine>>();
  return *map;
}

std::atomic<std::int64_t>& inline_bytes() {
  static std::atomic<std::int64_t> bytes{kDefaultInlineCopyBytes};
  return bytes;
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

EventPtr CopyEngine::host_work(Lane lane, std::int64_t bytes, const EventPtr& after,
                               std::function<void()> work) {
  if (bytes <= inline_copy_bytes() && (!after || after->host_done()) && worker_.idle()) {
    // With the worker idle, in the order of submission, as the job would have run.
    auto done = std::make_shared<Event>();
    std::exception_ptr error;
    try {
      if (after) after->synchronize();
      work();
    } catch (...) {
      error = std::current_exception();
    }
    done->complete(error);
    return done;
  }
  return submit_job(worker_, static_cast<int>(lane), [after, work = std::move(work)](Event&) {
    if (after) after->synchronize();
    work();
  });
}

EventPtr CopyEngine::copy(const at::Tensor& dst, const at::Tensor& src, Lane lane,
                          const EventPtr& after) {
  TORCH_CHECK(dst.numel() == src.numel(), "CopyEngine.copy: dst has ", dst.numel(),
              " elements but src has ", src.numel());
  const int queue_lane = static_cast<int>(lane);
  if (!on_cuda()) {
    return host_work(lane, static_cast<std::int64_t>(src.nbytes()), after,
                     [dst, src] { dst.copy_(src); });
  }
  auto issue = [dst, src, stream = lane_stream(lane)](
                   const EventPtr& after, const std::optional<c10::Event>& compute, Event& done) {
    c10::StreamGuard guard(stream);
    if (after) after->block(stream);
    if (compute) compute->block(stream);
    dst.copy_(src, /*non_blocking=*/true);
    record_use(src, stream);
    record_use(dst, stream);
    done.record_device(stream);
  };
  // Recorded here: the compute stream is the issuing thread's current stream.
  std::optional<c10::Event> compute;
  if (dst.is_cuda()) compute.emplace(compute_position(dst.device()));
  if (after && !after->host_done()) {
    // The host part (e.g. the weight writer) is still running: the engine worker waits for it and
    // issues the copy then, so the calling thread goes on issuing compute meanwhile.
    return submit_job(
        worker_, queue_lane,
        [issue, after, compute = std::make_shared<std::optional<c10::Event>>(std::move(compute))](
            Event& done) { issue(after, *compute, done); });
  }
  auto done = std::make_shared<Event>();
  issue(after, compute, *done);
  done->complete();
  return done;
}

EventPtr CopyEngine::land(const at::Tensor& dst, const at::Tensor& src, const EventPtr& after,
                          const std::optional<at::Tensor>& staging, bool add) {
  const char* what = add ? "CopyEngine.accumulate" : "CopyEngine.download";
  TORCH_CHECK(dst.device().is_cpu(), what, ": dst must be a host tensor");
  TORCH_CHECK(dst.numel() == src.numel(), what, ": dst has ", dst.numel(), " elements but src has ",
              src.numel());
  if (staging) {
    TORCH_CHECK(staging->device().is_cpu() && staging->numel() == src.numel() &&
                    staging->scalar_type() == src.scalar_type(),
                what, ": staging must be a host tensor of src's dtype (", src.scalar_type(),
                ") with ", src.numel(), " elements, got ", staging->scalar_type(), " on ",
                staging->device(), " with ", staging->numel());
  }
  const int queue_lane = static_cast<int>(Lane::kGradient);
  if (!on_cuda()) {
    return host_work(Lane::kGradient, static_cast<std::int64_t>(src.nbytes()), after,
                     [dst, src, add] { add ? dst.add_(src) : dst.copy_(src); });
  }
  c10::Stream stream = lane_stream(Lane::kGradient);
  at::Tensor host;
  {
    c10::StreamGuard guard(stream);
    if (after) after->block(stream);
    host = staging ? staging->view(src.sizes())
                   : at::empty(src.sizes(), src.options().device(at::kCPU).pinned_memory(true));
    host.copy_(src, /*non_blocking=*/true);
    record_use(src, stream);
  }
  EventPtr downloaded = Event::recorded_on(stream);
  return submit_job(worker_, queue_lane, [dst, host, downloaded, add](Event&) {
    downloaded->synchronize();
    add ? dst.add_(host) : dst.copy_(host);
  });
}

EventPtr CopyEngine::upload_pageable(const std::vector<at::Tensor>& dsts,
                                     const std::vector<at::Tensor>& srcs, const EventPtr& after) {
  TORCH_CHECK(on_cuda(),
              "CopyEngine.upload_pageable: needs a CUDA device (virtual CPU devices "
              "copy with copy())");
  TORCH_CHECK(dsts.size() == srcs.size(), "CopyEngine.upload_pageable: ", dsts.size(),
              " destinations but ", srcs.size(), " sources");
  for (std::size_t i = 0; i < dsts.size(); ++i) {
    const at::Tensor &dst = dsts[i], &src = srcs[i];
    TORCH_CHECK(dst.scalar_type() == at::kByte && src.scalar_type() == at::kByte &&
                    dst.is_contiguous() && src.is_contiguous() && dst.numel() == src.numel(),
                "CopyEngine.upload_pageable: pair ", i,
                " must be contiguous uint8 tensors of one "
                "size, got ",
                dst.scalar_type(), "[", dst.numel(), "] and ", src.scalar_type(), "[", src.numel(),
                "]");
    TORCH_CHECK(dst.device() == device_ && src.device().is_cpu(),
                "CopyEngine.upload_pageable: pair ", i, " must copy from the host to ", device_,
                ", got ", src.device(), " -> ", dst.device());
  }
  std::optional<c10::Event> compute;
  if (!dsts.empty()) compute.emplace(compute_position(device_));
  auto job = [this, dsts, srcs, after,
              compute =
                  std::make_shared<std::optional<c10::Event>>(std::move(compute))](Event& done) {
    c10::Stream stream = lane_stream(Lane::kParameter);
    c10::StreamGuard guard(stream);
    if (after) after->block(stream);
    if (*compute) (*compute)->block(stream);
    if (bounce_.empty()) {
      auto pinned = at::TensorOptions().dtype(at::kByte).pinned_memory(true);
      for (int i = 0; i < kBounceSlots; ++i)
        bounce_.push_back({at::empty({kBounceBytes}, pinned), nullptr});
    }
    // The ring position carries over from job to job: a small upload fills the free rest of the
    // current buffer and waits for nothing; only a buffer being reused waits for its last DMA.
    auto advance = [&] {
      bounce_[bounce_slot_].drained = Event::recorded_on(stream);
      bounce_slot_ = (bounce_slot_ + 1) % bounce_.size();
      bounce_filled_ = 0;
      if (EventPtr drained = std::exchange(bounce_[bounce_slot_].drained, nullptr)) {
        drained->synchronize();
      }
    };
    try {
      for (std::size_t i = 0; i < dsts.size(); ++i) {
        const auto* source = static_cast<const std::uint8_t*>(srcs[i].data_ptr());
        for (std::int64_t begin = 0, bytes = srcs[i].numel(); begin < bytes;) {
          if (bounce_filled_ == kBounceBytes) advance();
          const std::int64_t chunk = std::min(bytes - begin, kBounceBytes - bounce_filled_);
          at::Tensor staged = bounce_[bounce_slot_].buffer.narrow(0, bounce_filled_, chunk);
          std::memcpy(staged.data_ptr(), source + begin, static_cast<std::size_t>(chunk));
          dsts[i].narrow(0, begin, chunk).copy_(staged, /*non_blocking=*/true);
          bounce_filled_ += chunk;
          begin += chunk;
        }
        record_use(dsts[i], stream);
      }
    } catch (...) {
      bounce_[bounce_slot_].drained = Event::recorded_on(stream);  // what was issued still reads
      throw;
    }
    // The buffer in use is busy until this job's copies out of it ran.
    bounce_[bounce_slot_].drained = Event::recorded_on(stream);
    done.record_device(stream);
  };
  return submit_job(worker_, static_cast<int>(Lane::kParameter), std::move(job));
}

void set_inline_copy_bytes(std::int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "set_inline_copy_bytes: bytes must be >= 0, got ", bytes);
  inline_bytes().store(bytes, std::memory_order_relaxed);
}

std::int64_t inline_copy_bytes() { return inline_bytes().load(std::memory_order_relaxed); }

c10::Stream current_stream(int index) { return compute_stream(copy_engine(index).device()); }

EventPtr record_event(int index) {
  c10::Stream stream = current_stream(index);
  return stream.device_type() == c10::DeviceType::CPU ? Event::completed()
                                                      : Event::recorded_on(stream);
}

CopyEngine& copy_engine(int index) {
  auto& registry = device::Registry::instance();
  const bool cuda = registry.kind() == device::DeviceKind::kCuda;
  TORCH_CHECK(index >= 0 && index < registry.count(), "device index ", index,
              " is out of range [0, ", registry.count(), ")");
  const int physical = registry.physical_index(index);
  std::lock_guard<std::mutex> lock(engines_mutex());
  auto& engine = engines()[{cuda, index, physical}];
  if (!engine) {
    // A logical CUDA device (several may share one GPU) has its own engine, and so its own lanes.
    c10::Device device =
        cuda ? c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(physical))
             : c10::Device(c10::DeviceType::CPU);
    engine = std::make_unique<CopyEngine>(device);
  }
  return *engine;
}

void drain_copy_engines(const WaitCheck& check) {
  std::vector<CopyEngine*> all;
  {
    std::lock_guard<std::mutex> lock(engines_mutex());
    for (auto& [key, engine] : engines()) all.push_back(engine.get());
  }
  for (CopyEngine* engine : all) engine->drain(check);
}

}  // namespace roundpipe::executor
