// Completion of one asynchronous job (a copy, an accumulation, a compute step).
//
// On virtual CPU devices an event completes when a host worker finishes the job; on CUDA it may
// also carry a CUDA event recorded on the stream that ran the job. Errors raised by the job are
// stored and rethrown to whoever waits, so failures in worker threads reach the caller.
#pragma once

#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>

namespace roundpipe::executor {

class Event {
 public:
  // An event that completes when a host job calls complete().
  Event() = default;
  // An event that is already complete (synchronous work, e.g. compute on a CPU device).
  static std::shared_ptr<Event> completed();
  // An event completed by the device: recorded now on `stream` (CUDA streams only).
  static std::shared_ptr<Event> recorded_on(const c10::Stream& stream);

  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  // Marks the host part done; `error` (if any) is rethrown by every later wait.
  void complete(std::exception_ptr error = nullptr);
  // Records the device part on `stream` (after the host part, if any, has completed).
  void record_device(const c10::Stream& stream);

  // Blocks the calling thread until the job finished; rethrows its error. Call without the GIL.
  void synchronize();
  // Makes later work on `stream` wait for the job: a device-side wait for the CUDA part (no host
  // block), a host wait for the host part.
  void block(const c10::Stream& stream);
  // True when the job has finished (errors are not rethrown here).
  bool query();

 private:
  void wait_host();

  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool host_done_ = false;
  std::exception_ptr error_;
  std::optional<c10::Event> device_event_;
};

using EventPtr = std::shared_ptr<Event>;

}  // namespace roundpipe::executor
