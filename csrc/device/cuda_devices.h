// CUDA facts for the device registry. Compiled only when torch has CUDA.
#pragma once

#include "device/registry.h"

namespace roundpipe::device {

// The provider backed by the CUDA runtime (through c10::cuda, no cuBLAS headers needed).
const CudaProvider* cuda_provider();

}  // namespace roundpipe::device
