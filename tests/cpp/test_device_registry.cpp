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
    Registry::instance().configure("auto", 1, 0);
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

TEST_CASE("cuda_logical_count_parses_and_validates") {
  using roundpipe::device::parse_cuda_logical_count;
  CHECK_EQ(parse_cuda_logical_count("3", "ROUNDPIPE_CUDA_LOGICAL_DEVICES"), 3);
  CHECK_EQ(parse_cuda_logical_count("64", "ROUNDPIPE_CUDA_LOGICAL_DEVICES"), 64);
  CHECK_THROWS(parse_cuda_logical_count("0", "ROUNDPIPE_CUDA_LOGICAL_DEVICES"),
               std::invalid_argument,
               "ROUNDPIPE_CUDA_LOGICAL_DEVICES must be an integer in [1, 64]");
  CHECK_THROWS(parse_cuda_logical_count("65", "ROUNDPIPE_CUDA_LOGICAL_DEVICES"),
               std::invalid_argument, "got 65");
  CHECK_THROWS(parse_cuda_logical_count("two", "ROUNDPIPE_CUDA_LOGICAL_DEVICES"),
               std::invalid_argument, "got 'two'");
}

TEST_CASE("logical_cuda_devices_map_round_robin_onto_the_gpus") {
  RestoreRegistry restore;
  Registry& registry = Registry::instance();
  registry.set_cuda_provider(&kTwoGpus);
  registry.configure("cuda", std::nullopt, 5);
  CHECK(registry.kind() == DeviceKind::kCuda);
  CHECK_EQ(registry.count(), 5);
  CHECK_EQ(registry.cuda_logical_devices(), 5);
  const int expected[] = {0, 1, 0, 1, 0};
  for (int i = 0; i < 5; ++i) CHECK_EQ(registry.physical_index(i), expected[i]);
  CHECK_EQ(registry.total_memory(4), 80ull << 30);
  CHECK_THROWS(registry.physical_index(5), std::out_of_range, "device index 5");
  // Fewer logical devices than GPUs: only the first GPUs are used.
  registry.configure(std::nullopt, std::nullopt, 1);
  CHECK_EQ(registry.count(), 1);
  CHECK_EQ(registry.physical_index(0), 0);
  // 0: one device per GPU again.
  registry.configure(std::nullopt, std::nullopt, 0);
  CHECK_EQ(registry.count(), 2);
  CHECK_EQ(registry.physical_index(1), 1);
  // The logical count applies to CUDA only; CPU devices keep theirs.
  registry.configure("cpu", 3, 4);
  CHECK(registry.kind() == DeviceKind::kCpu);
  CHECK_EQ(registry.count(), 3);
  CHECK_EQ(registry.physical_index(2), 0);
}

TEST_CASE("registry_rejects_bad_logical_counts_and_keeps_its_state") {
  RestoreRegistry restore;
  Registry& registry = Registry::instance();
  registry.set_cuda_provider(&kTwoGpus);
  registry.configure("cuda", std::nullopt, 3);
  CHECK_THROWS(registry.configure(std::nullopt, std::nullopt, 65), std::invalid_argument,
               "num_cuda_devices must be an integer in [1, 64]");
  CHECK_THROWS(registry.configure(std::nullopt, std::nullopt, -1), std::invalid_argument,
               "num_cuda_devices");
  CHECK_EQ(registry.count(), 3);
}
