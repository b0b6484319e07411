#include "executor/event.h"

namespace roundpipe::executor {

std::shared_ptr<Event> Event::completed() {
  auto event = std::make_shared<Event>();
  event->complete();
  return event;
}

std::shared_ptr<Event> Event::recorded_on(const c10::Stream& stream) {
  auto event = std::make_shared<Event>();
  event->complete();
  event->record_device(stream);
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

void Event::wait_host() {
  std::unique_lock<std::mutex> lock(mutex_);
  done_cv_.wait(lock, [this] { return host_done_; });
  if (error_) std::rethrow_exception(error_);
}

void Event::synchronize() {
  wait_host();
  std::lock_guard<std::mutex> lock(mutex_);
  if (device_event_) device_event_->synchronize();
}

void Event::block(const c10::Stream& stream) {
  wait_host();
  std::lock_guard<std::mutex> lock(mutex_);
  if (device_event_) device_event_->block(stream);
}

bool Event::query() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!host_done_) return false;
  return !device_event_ || device_event_->query();
}

}  // namespace roundpipe::executor
