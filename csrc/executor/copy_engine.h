// The copy engine of one device: asynchronous parameter uploads, activation transfers and
// gradient downloads, each returning an Event.
//
// CUDA devices: one stream per lane (activations on a high-priority stream so they overtake
// parameter prefetch); copies are issued from the calling thread and complete on the GPU, unless
// `after` still has host work to finish, in which case the engine's worker waits for it and issues
// the copy then. A copy into device memory first waits for the work issued so far to the calling
// thread's current stream of that device (the caching allocator may have handed the block out on
// it while kernels still read its previous contents). The host-side gradient accumulation after a
// download runs on the engine's worker thread.
// Virtual CPU devices: copies run on the engine's worker thread, activations first, so transfers
// overlap the compute that the calling thread runs meanwhile; a copy or accumulation of at most
// inline_copy_bytes() bytes whose `after` has completed runs on the calling thread instead, when
// the worker is idle (so in submission order): handing
// it to the worker and waiting for it costs two thread wake-ups, far more than the copy itself
// (see set_inline_copy_bytes). It still returns an event carrying its error, as a job would.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "executor/event.h"
#include "executor/work_queue.h"

namespace roundpipe::executor {

// Lanes in priority order.
enum class Lane : int { kActivation = 0, kGradient = 1, kParameter = 2 };

class CopyEngine {
 public:
  explicit CopyEngine(c10::Device device);
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  c10::Device device() const { return device_; }

  // dst.copy_(src) once `after` (may be null) has completed.
  EventPtr copy(const at::Tensor& dst, const at::Tensor& src, Lane lane, const EventPtr& after);
  // dst += src once `after` has completed; dst is a host tensor, src may be on the device. On
  // CUDA, a device src is downloaded into `staging` (a page-locked host tensor of src's dtype and
  // size, not reused by the caller before the returned event completed) or, without it, into a
  // buffer of torch's caching host allocator.
  EventPtr accumulate(const at::Tensor& dst, const at::Tensor& src, const EventPtr& after,
                      const std::optional<at::Tensor>& staging = std::nullopt) {
    return land(dst, src, after, staging, /*add=*/true);
  }
  // dst.copy_(src) the same way: through `staging` on CUDA, so the calling thread never waits for
  // a download into pageable memory.
  EventPtr download(const at::Tensor& dst, const at::Tensor& src, const EventPtr& after,
                    const std::optional<at::Tensor>& staging = std::nullopt) {
    return land(dst, src, after, staging, /*add=*/false);
  }

  // dsts[i].copy_(srcs[i]) for every i, on the parameter lane once `after` has completed: byte
  // (uint8) tensors, contiguous, each dst in device memory of this (CUDA) engine and each src in
  // pageable host memory (a model kept with pin_model="off"). The engine's worker copies the
  // sources into a ring of page-locked bounce buffers, each buffer's DMA overlapping the filling
  // of the next, so the calling thread never waits for the copies. The worker waits only to reuse
  // a buffer whose DMA has not run yet: an upload larger than the ring completes (host part) once
  // all but its last kBounceSlots * kBounceBytes are on the device.
  EventPtr upload_pageable(const std::vector<at::Tensor>& dsts, const std::vector<at::Tensor>& srcs,
                           const EventPtr& after);

  // Returns once every host job submitted so far has run (`check`: see WorkQueue::drain).
  void drain(const WaitCheck& check = {}) { worker_.drain(check); }

  // Bounce buffers of upload_pageable: kBounceSlots page-locked buffers of kBounceBytes each.
  static constexpr int kBounceSlots = 4;
  static constexpr std::int64_t kBounceBytes = 8 << 20;

 private:
  bool on_cuda() const { return device_.is_cuda(); }
  // accumulate (add) or download (replace).
  EventPtr land(const at::Tensor& dst, const at::Tensor& src, const EventPtr& after,
                const std::optional<at::Tensor>& staging, bool add);
  c10::Stream lane_stream(Lane lane) const;
  // work() on a virtual CPU device's `lane` once `after` has completed: on the calling thread
  // when it moves at most inline_copy_bytes() bytes, `after` is done and the worker idle, else on
  // the worker.
  EventPtr host_work(Lane lane, std::int64_t bytes, const EventPtr& after,
                     std::function<void()> work);

  // One bounce buffer and the event of the last copy out of it (null: free). Used only by jobs on
  // the engine's worker, one at a time.
  struct BounceSlot {
    at::Tensor buffer;
    EventPtr drained;
  };

  c10::Device device_;
  c10::Stream activation_;
  c10::Stream parameter_;
  c10::Stream gradient_;
  std::vector<BounceSlot> bounce_;  // allocated by the first upload_pageable job
  std::size_t bounce_slot_ = 0;     // the buffer being filled
  std::int64_t bounce_filled_ = 0;  // its bytes used since it was last free
  WorkQueue worker_;
};

// The process-wide engine of device `index` of the registry's current kind, created on first use
// (a logical CUDA device's engine works on its GPU, device::Registry::physical_index).
CopyEngine& copy_engine(int index);

// Waits for the host jobs of every copy engine created so far (before interpreter shutdown);
// `check`: see WorkQueue::drain.
void drain_copy_engines(const WaitCheck& check = {});

// Virtual CPU devices: copies and accumulations of at most this many bytes run on the calling
// thread when nothing they wait for is pending (default kDefaultInlineCopyBytes); 0 sends every
// one to the engine's worker (tests use it to exercise the asynchronous path).
constexpr std::int64_t kDefaultInlineCopyBytes = 64 << 10;
void set_inline_copy_bytes(std::int64_t bytes);
std::int64_t inline_copy_bytes();

// An event that completes when the work issued so far to the device's current stream has
// (already complete on virtual CPU devices).
EventPtr record_event(int index);

// The stream that compute on device `index` is currently issued to (the CPU pseudo-stream on
// virtual CPU devices; the GPU's current stream, shared, for logical CUDA devices).
c10::Stream current_stream(int index);

}  // namespace roundpipe::executor
