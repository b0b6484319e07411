// The device registry: which compute devices the runtime dispatches stages to.
//
// CUDA devices when the build has CUDA and a GPU is visible; otherwise N virtual CPU devices that
// run the same scheduler, executors and copy engine on the host. Resolution is lazy: nothing is
// probed until the first query, so importing roundpipe touches no device and starts no thread.
//
// Configuration (later sources override earlier ones):
//   ROUNDPIPE_DEVICE_KIND = auto | cpu | cuda   (environment; default auto)
//   ROUNDPIPE_CPU_DEVICES = N                    (environment; default 1)
//   ROUNDPIPE_CUDA_LOGICAL_DEVICES = N           (environment; default one per GPU)
//   Registry::configure(kind, cpu_devices, cuda_logical)   (roundpipe.configure_devices)
//
// Logical CUDA devices: N devices mapped round-robin onto the visible GPUs (logical i runs on GPU
// i % count), each with its own copy engine and copy lanes; they share their GPU's compute stream,
// so compute stays in issue order while every transfer between them takes the multi-device path
// (events across copy lanes). A one-GPU machine then runs the round-robin pipeline of N devices.
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
  // [1, kMaxCpuDevices] (nullopt keeps the current count); cuda_logical: logical CUDA devices in
  // [1, kMaxCpuDevices], or 0 for one per GPU (nullopt keeps the current choice). Throws
  // std::invalid_argument naming the bad argument, and std::runtime_error when "cuda" is asked
  // for but no CUDA device is usable.
  void configure(std::optional<std::string_view> kind, std::optional<int> cpu_devices,
                 std::optional<int> cuda_logical = std::nullopt);

  DeviceKind kind();
  int count();
  // Total memory of device `index` in bytes: the GPU's memory, or the host's physical memory for
  // a virtual CPU device (they all share it).
  std::uint64_t total_memory(int index);
  // The GPU that device `index` runs on (the index itself unless logical CUDA devices are
  // configured; 0 on virtual CPU devices).
  int physical_index(int index);
  // The configured number of logical CUDA devices; 0 means one per GPU.
  int cuda_logical_devices();

 private:
  Registry() = default;
  void resolve_locked();
  // The ROUNDPIPE_* variables, once (at the first query or configure, never at import); throws
  // std::invalid_argument naming a bad one.
  void read_environment_locked();
  // Throws std::out_of_range unless index is in [0, count_) (resolved).
  void check_index_locked(int index) const;

  std::mutex mutex_;
  const CudaProvider* cuda_ = nullptr;
  bool resolved_ = false;
  bool environment_read_ = false;
  std::string requested_kind_ = "auto";
  int cpu_devices_ = 1;
  int cuda_logical_ = 0;
  DeviceKind kind_ = DeviceKind::kCpu;
  int count_ = 0;
  int physical_count_ = 0;  // GPUs behind the CUDA devices (0 on CPU)
};

// Parses a CPU device count given as text (the environment variable); throws
// std::invalid_argument naming `source` when it is not an integer in [1, kMaxCpuDevices].
int parse_cpu_device_count(std::string_view text, std::string_view source);

// Parses a logical CUDA device count given as text (the environment variable); the same bounds
// and errors as parse_cpu_device_count.
int parse_cuda_logical_count(std::string_view text, std::string_view source);

}  // namespace roundpipe::device
