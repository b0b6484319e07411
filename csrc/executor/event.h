// Completion of one asynchronous job (a copy, an accumulation, a compute step).
//
// On virtual CPU devices an event completes when a host worker finishes the job; on CUDA it may
// also carry a CUDA event recorded on the stream that ran the job. Errors raised by the job are
// stored and rethrown to whoever waits, so failures in worker threads reach the caller.
//
// Host waits never spin and never hold the event's lock while they wait: the host part is a
// condition variable, and a CUDA part is turned into a host notification by a host function
// queued behind the CUDA event on a private stream (executor/cuda_wait.h), so the waiting thread
// sleeps until the GPU is there.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>

namespace roundpipe::executor {

// Called between slices of a long wait; may throw to abandon the wait (the Python bindings raise
// KeyboardInterrupt from here).
using WaitCheck = std::function<void()>;

class Event : public std::enable_shared_from_this<Event> {
 public:
  // An event that completes when a host job calls complete().
  Event();
  // An event that is already complete (synchronous work, e.g. compute on a CPU device).
  static std::shared_ptr<Event> completed();
  // An event completed by the device: recorded now on `stream` (CUDA streams only).
  static std::shared_ptr<Event> recorded_on(const c10::Stream& stream);

  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  // Marks the host part done; `error` (if any) is rethrown by every later wait.
  void complete(std::exception_ptr error = nullptr);
  // Records the device part on `stream` (before complete(), by the job that issues device work).
  void record_device(const c10::Stream& stream);

  // Blocks the calling thread until the job finished; rethrows its error. Call without the GIL.
  // With `check`, waits in slices and calls it between them.
  void synchronize(const WaitCheck& check = {});
  // Makes later work on `stream` wait for the job: a device-side wait for the CUDA part (no host
  // block), a host wait for the host part.
  void block(const c10::Stream& stream, const WaitCheck& check = {});
  // True when the job has finished (errors are not rethrown here).
  bool query();
  // True once the host part has completed (the device part may still be running).
  bool host_done();
  // Waits for the host part only and rethrows its error.
  void wait_host(const WaitCheck& check = {});

 private:
  static constexpr std::chrono::milliseconds kWaitSlice{50};

  // Waits on done_cv_ until `ready` holds, in slices when `check` is set. `lock` holds mutex_.
  template <typename Ready>
  void wait_locked(std::unique_lock<std::mutex>& lock, const WaitCheck& check, Ready ready);

  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool host_done_ = false;
  bool device_done_ = false;     // set by the host notification of the device part
  bool device_watched_ = false;  // a host notification has been queued for the device part
  pid_t owner_;                  // the process that created the event (see fork handling)
  std::exception_ptr error_;
  std::optional<c10::Event> device_event_;
};

using EventPtr = std::shared_ptr<Event>;

}  // namespace roundpipe::executor
