// The device registry: which compute devices the runtime dispatches stages to.
//
// CUDA devices when the build has CUDA and a GPU is visible; otherwise N virtual CPU devices that
// run the same scheduler, executors and copy engine on the host. Resolution is lazy: nothing is
// probed until the first query, so importing roundpipe touches no device and starts no thread.
//
// Configuration (later sources override earlier ones):
//   ROUNDPIPE_DEVICE_KIND = auto | cpu | cuda   (environment; default auto)
//   ROUNDPIPE_CPU_DEVICES = N                    (environment; default 1)
//   Registry::configure(kind, cpu_devices)       (roundpipe.configure_devices in Python)
//
// Torch-free: CUDA facts come from a provider that the CUDA build installs.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

namespace roundpipe::device {

enum class DeviceKind { kCpu, kCuda };

std::string_view device_kind_name(DeviceKind kind);

// What the registry asks of CUDA. Installed by the CUDA build (see cuda_devices.h).
struct CudaProvider {
  int (*device_count)();
  std::uint64_t (*total_memory)(int index);
};

// Upper bound on virtual CPU devices; more would only add threads contending for the same cores.
inline constexpr int kMaxCpuDevices = 64;

class Registry {
 public:
  static Registry& instance();

  void set_cuda_provider(const CudaProvider* provider);

  // kind: "auto", "cpu" or "cuda" (nullopt keeps the current choice); cpu_devices in
  // [1, kMaxCpuDevices] (nullopt keeps the current count). Throws std::invalid_argument naming the
  // bad argument, and std::runtime_error when "cuda" is asked for but no CUDA device is usable.
  void configure(std::optional<std::string_view> kind, std::optional<int> cpu_devices);

  DeviceKind kind();
  int count();
  // Total memory of device `index` in bytes: the GPU's memory, or the host's physical memory for
  // a virtual CPU device (they all share it).
  std::uint64_t total_memory(int index);

 private:
  Registry() = default;
  void resolve_locked();

  std::mutex mutex_;
  const CudaProvider* cuda_ = nullptr;
  bool resolved_ = false;
  std::string requested_kind_ = "auto";
  int cpu_devices_ = 1;
  DeviceKind kind_ = DeviceKind::kCpu;
  int count_ = 0;
};

// Parses a CPU device count given as text (the environment variable); throws
// std::invalid_argument naming `source` when it is not an integer in [1, kMaxCpuDevices].
int parse_cpu_device_count(std::string_view text, std::string_view source);

}  // namespace roundpipe::device
