// The CUDA streams of the copy engines, through c10's public CUDA API. Compiled only when torch
// has CUDA.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>

namespace roundpipe::executor::cuda {

// A stream of torch's pool on `device`, of high priority or not: one per copy lane.
c10::Stream pool_stream(c10::Device device, bool high_priority);

// The current stream on `device`: where compute issued from this thread goes.
c10::Stream current_stream(c10::Device device);

// Tells the caching allocator that `tensor` (a CUDA tensor) is used on `stream`, so its block is
// not handed to other work before what is queued there has run.
void record_use(const at::Tensor& tensor, const c10::Stream& stream);

}  // namespace roundpipe::executor::cuda
