#include "memory/host_arena.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "device/registry.h"

#ifdef ROUNDPIPE_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>
#endif

namespace roundpipe::memory {
namespace {

constexpr std::int64_t kAlignment = 64;

std::int64_t round_up(std::int64_t bytes) {
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

void* allocate_pageable(std::int64_t bytes) {
  void* data = std::aligned_alloc(kAlignment, static_cast<std::size_t>(round_up(bytes)));
  TORCH_CHECK(data != nullptr, "roundpipe: out of host memory allocating ", bytes, " bytes");
  return data;
}

at::Tensor wrap(void* data, std::int64_t bytes, void (*deleter)(void*)) {
  return at::from_blob(data, {bytes}, deleter, at::TensorOptions().dtype(at::kByte));
}

#ifdef ROUNDPIPE_WITH_CUDA
bool cuda_in_use() { return device::Registry::instance().kind() == device::DeviceKind::kCuda; }
void free_pinned(void* data) { C10_CUDA_CHECK_WARN(cudaFreeHost(data)); }
void free_registered(void* data) {
  C10_CUDA_CHECK_WARN(cudaHostUnregister(data));
  std::free(data);
}
#endif

}  // namespace

PinMode parse_pin_mode(std::string_view name) {
  if (name == "alloc") return PinMode::kAlloc;
  if (name == "register") return PinMode::kRegister;
  if (name == "off") return PinMode::kOff;
  throw std::invalid_argument("pin_model must be 'alloc', 'register' or 'off', got '" +
                              std::string(name) + "'");
}

at::Tensor allocate_host_arena(std::int64_t bytes, PinMode mode) {
  TORCH_CHECK(bytes >= 0, "allocate_host_arena: bytes must be >= 0, got ", bytes);
  if (bytes == 0) return at::empty({0}, at::TensorOptions().dtype(at::kByte));
#ifdef ROUNDPIPE_WITH_CUDA
  if (mode == PinMode::kAlloc && cuda_in_use()) {
    void* data = nullptr;
    C10_CUDA_CHECK(cudaHostAlloc(&data, static_cast<std::size_t>(bytes), cudaHostAllocDefault));
    std::memset(data, 0, static_cast<std::size_t>(bytes));
    return wrap(data, bytes, &free_pinned);
  }
  if (mode == PinMode::kRegister && cuda_in_use()) {
    void* data = allocate_pageable(bytes);
    std::memset(data, 0, static_cast<std::size_t>(bytes));
    cudaError_t status =
        cudaHostRegister(data, static_cast<std::size_t>(bytes), cudaHostRegisterDefault);
    if (status != cudaSuccess) {
      std::free(data);
      C10_CUDA_CHECK(status);
    }
    return wrap(data, bytes, &free_registered);
  }
#else
  (void)mode;  // virtual CPU devices: nothing to pin
#endif
  void* data = allocate_pageable(bytes);
  std::memset(data, 0, static_cast<std::size_t>(bytes));
  return wrap(data, bytes, &std::free);
}

bool is_page_locked(const at::Tensor& tensor) {
#ifdef ROUNDPIPE_WITH_CUDA
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, tensor.data_ptr()) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error of a foreign pointer
    return false;
  }
  return attributes.type == cudaMemoryTypeHost;
#else
  (void)tensor;
  return false;
#endif
}

}  // namespace roundpipe::memory
