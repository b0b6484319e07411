// The copies a layer's inputs take between devices and for the recompute, laid out and placed as
// their originals, and the cut of a forward stage's outputs from their graph: the native side of
// roundpipe/call/transfers.py, also used by the layer loop (layer_loop.h).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace roundpipe::call {

// An uninitialised tensor like `tensor` on `device`, laid out and placed as it is: its strides
// (on the host whenever its elements do not overlap, so a strided view stays one; on a CUDA
// device when they are dense; else contiguous), and its first element as far past an alignment
// boundary as tensor's: 64 bytes on the host (what torch's CPU allocator aligns to), 512 on a
// CUDA device (the caching allocator's), counted from the start of tensor's storage when it
// comes from the host (where plain PyTorch would have moved the whole batch). Matrix kernels
// choose their code path by the layout and alignment of their operands (MKL rounds a GEMM with
// a 16-byte-misaligned input differently), so a microbatch view of the user's batch, or a view a
// layer returned, and the copy a layer gets of it must agree for the layer to round as it does
// in plain PyTorch.
at::Tensor empty_placed(const at::Tensor& tensor, c10::Device device);

// A copy of `tensor` that autograd does not know of, as tensor.detach().clone() (without the
// detached alias and the autograd layer of the dispatch in between), placed as `tensor` is
// (empty_placed).
at::Tensor plain_copy(const at::Tensor& tensor);

// `tensor` cut from the graph that made it, requiring grad as it did: a new tensor on the same
// memory whose history is one node of its own (torch_internals::collect_grad). A forward stage
// of a training call runs its layers in grad mode, as plain PyTorch does (layers may branch on
// it, kernels choose by requires_grad), but keeps no graph: the recompute builds it. Cut after
// each layer, an output keeps none of the layer's saved tensors alive, and the next layer sees an
// input that requires grad and is no leaf, so it may change it in place as plain PyTorch's
// activations allow.
at::Tensor graph_cut(const at::Tensor& tensor);

}  // namespace roundpipe::call
