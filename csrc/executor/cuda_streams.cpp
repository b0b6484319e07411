#include "executor/cuda_streams.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>

namespace roundpipe::executor::cuda {

c10::Stream pool_stream(c10::Device device, bool high_priority) {
  return c10::cuda::getStreamFromPool(high_priority, device.index());
}

c10::Stream current_stream(c10::Device device) {
  return c10::cuda::getCurrentCUDAStream(device.index());
}

void record_use(const at::Tensor& tensor, const c10::Stream& stream) {
  c10::cuda::CUDACachingAllocator::recordStream(tensor.storage().data_ptr(),
                                                c10::cuda::CUDAStream(stream));
}

}  // namespace roundpipe::executor::cuda
