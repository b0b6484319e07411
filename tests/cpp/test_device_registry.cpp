#include <stdexcept>

#include "device/registry.h"
#include "harness.h"

using roundpipe::device::CudaProvider;
using roundpipe::device::DeviceKind;
using roundpipe::device::parse_cpu_device_count;
using roundpipe::device::Registry;

namespace {

int two_gpus() { return 2; }
int no_gpu() { return 0; }
std::uint64_t eighty_gib(int) { return 80ull << 30; }

const CudaProvider kTwoGpus{&two_gpus, &eighty_gib};
const CudaProvider kNoGpu{&no_gpu, &eighty_gib};

// The registry is a process-wide singleton; each test leaves it on CPU with one device.
struct RestoreRegistry {
  ~RestoreRegistry() {
    Registry::instance().set_cuda_provider(nullptr);
    Registry::instance().configure("auto", 1);
  }
};

}  // namespace

TEST_CASE("cpu_device_count_parses_and_validates") {
  CHECK_EQ(parse_cpu_device_count("3", "ROUNDPIPE_CPU_DEVICES"), 3);
  CHECK_THROWS(parse_cpu_device_count("0", "ROUNDPIPE_CPU_DEVICES"), std::invalid_argument,
               "ROUNDPIPE_CPU_DEVICES must be an integer in [1, 64]");
  CHECK_THROWS(parse_cpu_device_count("3x", "ROUNDPIPE_CPU_DEVICES"), std::invalid_argument,
               "got '3x'");
  CHECK_THROWS(parse_cpu_device_count("", "ROUNDPIPE_CPU_DEVICES"), std::invalid_argument,
               "ROUNDPIPE_CPU_DEVICES");
}

TEST_CASE("registry_uses_virtual_cpu_devices_without_cuda") {
  RestoreRegistry restore;
  Registry& registry = Registry::instance();
  registry.set_cuda_provider(nullptr);
  registry.configure("auto", 3);
  CHECK(registry.kind() == DeviceKind::kCpu);
  CHECK_EQ(registry.count(), 3);
  CHECK(registry.total_memory(2) > 0);
  CHECK_THROWS(registry.total_memory(3), std::out_of_range, "device index 3");
}

TEST_CASE("registry_prefers_cuda_when_visible_unless_cpu_is_forced") {
  RestoreRegistry restore;
  Registry& registry = Registry::instance();
  registry.set_cuda_provider(&kTwoGpus);
  registry.configure("auto", 4);
  CHECK(registry.kind() == DeviceKind::kCuda);
  CHECK_EQ(registry.count(), 2);
  CHECK_EQ(registry.total_memory(1), 80ull << 30);
  registry.configure("cpu", std::nullopt);
  CHECK(registry.kind() == DeviceKind::kCpu);
  CHECK_EQ(registry.count(), 4);
}

TEST_CASE("registry_rejects_cuda_without_a_gpu") {
  RestoreRegistry restore;
  Registry& registry = Registry::instance();
  registry.set_cuda_provider(&kNoGpu);
  CHECK_THROWS(registry.configure("cuda", std::nullopt), std::runtime_error,
               "no CUDA device is usable");
  CHECK_THROWS(registry.configure("gpu", std::nullopt), std::invalid_argument,
               "kind must be 'auto', 'cpu' or 'cuda'");
  CHECK_THROWS(registry.configure(std::nullopt, 65), std::invalid_argument, "num_cpu_devices");
  CHECK(registry.kind() == DeviceKind::kCpu);
}
