#include "device/registry.h"

#include <unistd.h>

#include <charconv>
#include <cstdlib>
#include <stdexcept>

namespace roundpipe::device {
namespace {

std::string checked_kind(std::string_view kind, std::string_view source) {
  if (kind == "auto" || kind == "cpu" || kind == "cuda") return std::string(kind);
  throw std::invalid_argument(std::string(source) + " must be 'auto', 'cpu' or 'cuda', got '" +
                              std::string(kind) + "'");
}

int checked_count(int count, std::string_view source) {
  if (count < 1 || count > kMaxCpuDevices) {
    throw std::invalid_argument(std::string(source) + " must be an integer in [1, " +
                                std::to_string(kMaxCpuDevices) + "], got " + std::to_string(count));
  }
  return count;
}

// The whole of `text` as an integer; otherwise std::invalid_argument naming `source`.
int parse_int(std::string_view text, std::string_view source) {
  int value = 0;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size()) {
    throw std::invalid_argument(std::string(source) + " must be an integer in [1, " +
                                std::to_string(kMaxCpuDevices) + "], got '" + std::string(text) +
                                "'");
  }
  return value;
}

std::uint64_t host_physical_memory() {
  long pages = sysconf(_SC_PHYS_PAGES);
  long page_size = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) return 0;
  return static_cast<std::uint64_t>(pages) * static_cast<std::uint64_t>(page_size);
}

}  // namespace

std::string_view device_kind_name(DeviceKind kind) {
  return kind == DeviceKind::kCuda ? "cuda" : "cpu";
}

int parse_cpu_device_count(std::string_view text, std::string_view source) {
  return checked_count(parse_int(text, source), source);
}

int parse_cuda_logical_count(std::string_view text, std::string_view source) {
  return checked_count(parse_int(text, source), source);
}

Registry& Registry::instance() {
  // Leaked on purpose: executors may still query it while static destructors run at exit.
  static Registry* registry = new Registry();
  return *registry;
}

void Registry::read_environment_locked() {
  if (environment_read_) return;
  // Parsed completely before anything is set: a bad value raises again at the next query.
  std::string kind = requested_kind_;
  int cpu_devices = cpu_devices_, cuda_logical = cuda_logical_;
  if (const char* value = std::getenv("ROUNDPIPE_DEVICE_KIND"); value && *value) {
    kind = checked_kind(value, "ROUNDPIPE_DEVICE_KIND");
  }
  if (const char* n = std::getenv("ROUNDPIPE_CPU_DEVICES"); n && *n) {
    cpu_devices = parse_cpu_device_count(n, "ROUNDPIPE_CPU_DEVICES");
  }
  if (const char* n = std::getenv("ROUNDPIPE_CUDA_LOGICAL_DEVICES"); n && *n) {
    cuda_logical = parse_cuda_logical_count(n, "ROUNDPIPE_CUDA_LOGICAL_DEVICES");
  }
  requested_kind_ = std::move(kind);
  cpu_devices_ = cpu_devices;
  cuda_logical_ = cuda_logical;
  environment_read_ = true;
}

void Registry::set_cuda_provider(const CudaProvider* provider) {
  std::lock_guard<std::mutex> lock(mutex_);
  cuda_ = provider;
  resolved_ = false;
}

void Registry::configure(std::optional<std::string_view> kind, std::optional<int> cpu_devices,
                         std::optional<int> cuda_logical) {
  std::lock_guard<std::mutex> lock(mutex_);
  read_environment_locked();
  std::string new_kind = kind ? checked_kind(*kind, "kind") : requested_kind_;
  int new_count = cpu_devices ? checked_count(*cpu_devices, "num_cpu_devices") : cpu_devices_;
  int new_logical = cuda_logical_;
  if (cuda_logical) {
    new_logical = *cuda_logical == 0 ? 0 : checked_count(*cuda_logical, "num_cuda_devices");
  }
  if (new_kind == "cuda" && (cuda_ == nullptr || cuda_->device_count() == 0)) {
    throw std::runtime_error(
        "kind='cuda' was requested but no CUDA device is usable (this build has CUDA " +
        std::string(cuda_ ? "on" : "off") + "); use kind='cpu' or 'auto'");
  }
  requested_kind_ = std::move(new_kind);
  cpu_devices_ = new_count;
  cuda_logical_ = new_logical;
  resolved_ = false;
}

void Registry::resolve_locked() {
  if (resolved_) return;
  read_environment_locked();
  int cuda_count = cuda_ ? cuda_->device_count() : 0;
  if (requested_kind_ == "cuda" && cuda_count == 0) {
    throw std::runtime_error(
        "ROUNDPIPE_DEVICE_KIND=cuda but no CUDA device is usable; unset it or use 'cpu'");
  }
  if (requested_kind_ != "cpu" && cuda_count > 0) {
    kind_ = DeviceKind::kCuda;
    physical_count_ = cuda_count;
    count_ = cuda_logical_ > 0 ? cuda_logical_ : cuda_count;
  } else {
    kind_ = DeviceKind::kCpu;
    physical_count_ = 0;
    count_ = cpu_devices_;
  }
  resolved_ = true;
}

DeviceKind Registry::kind() {
  std::lock_guard<std::mutex> lock(mutex_);
  resolve_locked();
  return kind_;
}

int Registry::count() {
  std::lock_guard<std::mutex> lock(mutex_);
  resolve_locked();
  return count_;
}

void Registry::check_index_locked(int index) const {
  if (index < 0 || index >= count_) {
    throw std::out_of_range("device index " + std::to_string(index) + " is out of range [0, " +
                            std::to_string(count_) + ")");
  }
}

std::uint64_t Registry::total_memory(int index) {
  std::lock_guard<std::mutex> lock(mutex_);
  resolve_locked();
  check_index_locked(index);
  // Logical devices on one GPU each report the whole GPU: they take turns with their stages.
  return kind_ == DeviceKind::kCuda ? cuda_->total_memory(index % physical_count_)
                                    : host_physical_memory();
}

int Registry::physical_index(int index) {
  std::lock_guard<std::mutex> lock(mutex_);
  resolve_locked();
  check_index_locked(index);
  return kind_ == DeviceKind::kCuda ? index % physical_count_ : 0;
}

int Registry::cuda_logical_devices() {
  std::lock_guard<std::mutex> lock(mutex_);
  read_environment_locked();
  return cuda_logical_;
}

}  // namespace roundpipe::device
