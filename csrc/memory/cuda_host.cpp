#include "memory/cuda_host.h"

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime_api.h>

namespace roundpipe::memory::cuda {

void* allocate_pinned(std::size_t bytes) {
  void* data = nullptr;
  C10_CUDA_CHECK(cudaHostAlloc(&data, bytes, cudaHostAllocPortable));
  return data;
}

void free_pinned(void* data) { C10_CUDA_CHECK_WARN(cudaFreeHost(data)); }

void register_pinned(void* data, std::size_t bytes) {
  C10_CUDA_CHECK(cudaHostRegister(data, bytes, cudaHostRegisterPortable));
}

void unregister(void* data) { C10_CUDA_CHECK_WARN(cudaHostUnregister(data)); }

bool is_page_locked(const void* data) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, data) != cudaSuccess) {
    static_cast<void>(cudaGetLastError());  // clear the sticky error of a foreign pointer
    return false;
  }
  return attributes.type == cudaMemoryTypeHost;
}

}  // namespace roundpipe::memory::cuda
