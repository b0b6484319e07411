// CUDA is reached only through memory/cuda_host.h (compiled only when torch has CUDA), the same
// isolation as device/cuda_devices.h.
//
// Host arenas: one flat allocation per model holding every layer's parameters (or gradients) back
// to back, so a stage (a contiguous range of layers) uploads in one copy and downloads in one.
//
// The memory is exactly the size asked for (rounded up to the 64-byte alignment only), never
// padded to a power of two as a caching pinned allocator would.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string_view>

namespace roundpipe::memory {

enum class PinMode {
  kAlloc,     // page-locked allocation (cudaHostAlloc) when CUDA devices are in use
  kRegister,  // pageable allocation page-locked in place (cudaHostRegister) on CUDA
  kOff,       // pageable memory
};

// Parses "alloc", "register" or "off"; throws std::invalid_argument naming `pin_model`.
PinMode parse_pin_mode(std::string_view name);

// A uint8 CPU tensor of `bytes` bytes whose storage owns the allocation and frees (and unpins) it
// when the last view dies. On virtual CPU devices there is nothing to pin: every mode gives
// pageable memory; kOff gives pageable memory on CUDA too (host-only arenas such as gradients,
// which no DMA touches). Contents are zero when `zero` is set, otherwise unspecified (an arena the
// caller fills completely, such as the parameter arena, need not be written twice).
at::Tensor allocate_host_arena(std::int64_t bytes, PinMode mode, bool zero = true);

// An uninitialised uint8 CPU tensor of exactly `bytes` bytes, page-locked (portable) when CUDA
// devices are in use: a staging area for device-to-host downloads (pageable on virtual CPU
// devices, which need none).
at::Tensor allocate_pinned_staging(std::int64_t bytes);

// Whether `tensor`'s memory is page-locked for CUDA (false in a build without CUDA).
bool is_page_locked(const at::Tensor& tensor);

}  // namespace roundpipe::memory
