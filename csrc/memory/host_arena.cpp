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
#include "memory/cuda_host.h"
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

bool cuda_in_use() { return device::Registry::instance().kind() == device::DeviceKind::kCuda; }

#ifdef ROUNDPIPE_WITH_CUDA
void free_registered(void* data) {
  cuda::unregister(data);
  std::free(data);
}
#endif

// A host allocation of `bytes` (> 0) bytes per `mode`, not yet initialised.
at::Tensor allocate(std::int64_t bytes, PinMode mode) {
  if (mode != PinMode::kOff && cuda_in_use()) {
#ifdef ROUNDPIPE_WITH_CUDA
    const auto size = static_cast<std::size_t>(bytes);
    if (mode == PinMode::kAlloc)
      return wrap(cuda::allocate_pinned(size), bytes, &cuda::free_pinned);
    void* data = allocate_pageable(bytes);
    try {
      cuda::register_pinned(data, size);
    } catch (...) {
      std::free(data);
      throw;
    }
    return wrap(data, bytes, &free_registered);
#endif
  }
  return wrap(allocate_pageable(bytes), bytes, &std::free);
}

}  // namespace

PinMode parse_pin_mode(std::string_view name) {
  if (name == "alloc") return PinMode::kAlloc;
  if (name == "register") return PinMode::kRegister;
  if (name == "off") return PinMode::kOff;
  throw std::invalid_argument("pin_model must be 'alloc', 'register' or 'off', got '" +
                              std::string(name) + "'");
}

at::Tensor allocate_host_arena(std::int64_t bytes, PinMode mode, bool zero) {
  TORCH_CHECK(bytes >= 0, "allocate_host_arena: bytes must be >= 0, got ", bytes);
  if (bytes == 0) return at::empty({0}, at::TensorOptions().dtype(at::kByte));
  at::Tensor arena = allocate(bytes, mode);
  if (zero) std::memset(arena.data_ptr(), 0, static_cast<std::size_t>(bytes));
  return arena;
}

at::Tensor allocate_pinned_staging(std::int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "allocate_pinned_staging: bytes must be >= 0, got ", bytes);
  if (bytes == 0) return at::empty({0}, at::TensorOptions().dtype(at::kByte));
  return allocate(bytes, PinMode::kAlloc);
}

bool is_page_locked(const at::Tensor& tensor) {
#ifdef ROUNDPIPE_WITH_CUDA
  return cuda::is_page_locked(tensor.data_ptr());
#else
  static_cast<void>(tensor);
  return false;
#endif
}

}  // namespace roundpipe::memory
