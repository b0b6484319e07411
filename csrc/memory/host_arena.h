// CUDA is reached only through memory/cuda_host.h (compiled only when torch has CUDA), the same
// isolation as device/cuda_devices.h.
//
// Host arenas: one flat allocation per model holding every layer's parameters (or gradients) back
// to back, so a stage (a contiguous range of layers) uploads in one copy and downloads in one.
//
// The memory is exactly the size asked for (rounded up to the 64-byte alignment only; an arena
// page-locked in place, to whole pages), never padded to a power of two as a caching pinned
// allocator would.
//
// Pageable arenas of 1 MiB and more are anonymous mappings of their own, not malloc memory: they
// go back to the operating system the moment their last view dies (glibc keeps freed heap chunks,
// and raises its mmap threshold past any size it has freed once, so buffers allocated and freed
// per stage would otherwise stay resident), they start as untouched zero pages (a zeroed arena
// costs no memory until written), and zero_host_memory() can drop their pages instead of writing
// zeros over them.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string_view>

namespace roundpipe::memory {

enum class PinMode {
  kAlloc,     // page-locked allocation (cudaHostAlloc) when CUDA devices are in use
  kRegister,  // whole pages of their own, page-locked in place (cudaHostRegister) on CUDA
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

// Fills the contiguous CPU tensor `tensor` with zero bytes. The whole pages it covers inside a
// pageable arena of its own mapping are handed back to the operating system (they read as zero
// and take no memory until written again); other memory is written with zeros.
void zero_host_memory(const at::Tensor& tensor);

// Returns the free memory of the C heap to the operating system where the C library can
// (glibc's malloc_trim); false where it cannot. The original storage of parameters moved into an
// arena is such memory.
bool trim_host_heap();

// Whether `tensor`'s memory is page-locked for CUDA (false in a build without CUDA).
bool is_page_locked(const at::Tensor& tensor);

}  // namespace roundpipe::memory
