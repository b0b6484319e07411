#include "device/cuda_devices.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>

namespace roundpipe::device {
namespace {

int cuda_device_count() { return static_cast<int>(c10::cuda::device_count()); }

std::uint64_t cuda_total_memory(int index) {
  cudaDeviceProp props{};
  C10_CUDA_CHECK(cudaGetDeviceProperties(&props, index));
  return static_cast<std::uint64_t>(props.totalGlobalMem);
}

}  // namespace

const CudaProvider* cuda_provider() {
  static const CudaProvider provider{&cuda_device_count, &cuda_total_memory};
  return &provider;
}

}  // namespace roundpipe::device
