#include "executor/event.h"

#include <unistd.h>

#include <stdexcept>

#include "executor/work_queue.h"

#ifdef ROUNDPIPE_WITH_CUDA
#include "executor/cuda_wait.h"
#endif

namespace roundpipe::executor {

Event::Event() : owner_(current_pid()) {}

std::shared_ptr<Event> Event::completed() {
  auto event = std::make_shared<Event>();
  event->complete();
  return event;
}

std::shared_ptr<Event> Event::recorded_on(const c10::Stream& stream) {
  auto event = std::make_shared<Event>();
  event->record_device(stream);
  event->complete();
  return event;
}

void Event::complete(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    host_done_ = true;
    error_ = std::move(error);
  }
  done_cv_.notify_all();
}

void Event::record_device(const c10::Stream& stream) {
  if (stream.device_type() == c10::DeviceType::CPU) return;
  std::lock_guard<std::mutex> lock(mutex_);
  device_event_.emplace(stream.device_type());
  device_event_->record(stream);
}

template <typename Ready>
void Event::wait_locked(std::unique_lock<std::mutex>& lock, const WaitCheck& check, Ready ready) {
  if (!check) {
    done_cv_.wait(lock, ready);
    return;
  }
  while (!done_cv_.wait_for(lock, kWaitSlice, ready)) {
    lock.unlock();
    check();
    lock.lock();
  }
}

bool Event::host_done() {
  std::lock_guard<std::mutex> lock(mutex_);
  return host_done_;
}

void Event::wait_host(const WaitCheck& check) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!host_done_ && owner_ != current_pid()) {
    // The job ran on a worker thread of the parent process; no thread of this forked child will
    // ever complete it.
    throw std::runtime_error(
        "roundpipe: this event belongs to asynchronous work that was still running in the parent "
        "process when it forked; that work does not run in the child (wait for it before "
        "os.fork(), e.g. model.synchronize())");
  }
  wait_locked(lock, check, [this] { return host_done_; });
  if (error_) std::rethrow_exception(error_);
}

void Event::synchronize(const WaitCheck& check) {
  wait_host(check);
  std::unique_lock<std::mutex> lock(mutex_);
  if (!device_event_ || device_done_) return;
  if (device_event_->query()) {
    device_done_ = true;
    return;
  }
#ifdef ROUNDPIPE_WITH_CUDA
  if (!device_watched_) {
    device_watched_ = true;
    std::weak_ptr<Event> self = weak_from_this();
    cuda::notify_when_done(*device_event_, [self] {
      if (auto event = self.lock()) {
        {
          std::lock_guard<std::mutex> notified(event->mutex_);
          event->device_done_ = true;
        }
        event->done_cv_.notify_all();
      }
    });
  }
  wait_locked(lock, check, [this] { return device_done_; });
#else
  // Device parts exist only on CUDA streams, which a build without CUDA never has.
  lock.unlock();
  device_event_->synchronize();
#endif
}

void Event::block(const c10::Stream& stream, const WaitCheck& check) {
  wait_host(check);
  std::lock_guard<std::mutex> lock(mutex_);
  if (device_event_ && !device_done_) device_event_->block(stream);
}

bool Event::query() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!host_done_) return false;
  if (!device_event_ || device_done_) return true;
  device_done_ = device_event_->query();
  return device_done_;
}

}  // namespace roundpipe::executor
