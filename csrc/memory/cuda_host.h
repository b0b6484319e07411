// Page-locked host memory through the CUDA runtime. Compiled only when torch has CUDA; the rest of
// memory/ reaches CUDA only through these functions.
#pragma once

#include <cstddef>

namespace roundpipe::memory::cuda {

// cudaHostAlloc with cudaHostAllocPortable (page-locked for every device, not only the current
// one); throws c10::Error on failure. Freed by free_pinned.
void* allocate_pinned(std::size_t bytes);
void free_pinned(void* data);

// cudaHostRegister with cudaHostRegisterPortable of memory the caller owns; throws on failure.
// Undone by unregister before the memory is freed.
void register_pinned(void* data, std::size_t bytes);
void unregister(void* data);

// Whether `data` lies in page-locked host memory known to CUDA.
bool is_page_locked(const void* data);

}  // namespace roundpipe::memory::cuda
