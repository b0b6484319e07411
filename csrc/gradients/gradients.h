// Typed views of a stage's flat uint8 buffers and the .grad of the tensors cut from them: the
// native side of roundpipe/gradients.py, and what a stage's upload (call/stage.h) cuts its
// parameter and gradient views with.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace roundpipe::gradients {

// How cut_typed cuts a tensor out of the buffer: a view (as_strided, through the dispatcher), or
// a tensor of its own on the buffer's storage (no autograd view of it), requiring grad when its
// `like` does or never.
enum class Cut { kView, kOwnLikeGrad, kOwn };

// Views of the uint8 `buffer` laid out like `likes[i]` (dtype, shape, strides), at byte
// offsets[i] - first_byte: what roundpipe.memory.typed_view makes one at a time, cut with
// as_strided from one view of the buffer per dtype; or, with `cut` kOwnLikeGrad or kOwn, tensors
// of their own on its storage (a stage's parameter copies, requiring grad exactly when their
// `like` does; its gradient views, which are only ever a .grad).
std::vector<at::Tensor> cut_typed(const at::Tensor& buffer, std::int64_t first_byte,
                                  const std::vector<std::int64_t>& offsets,
                                  const std::vector<at::Tensor>& likes, Cut cut);

// tensors[i].grad = grads[i] for views cut by cut_typed (a Python `.grad =` per parameter costs
// its own checks and a call through the tensor's Python type). Shape, dtype and device must match,
// as the Python setter demands.
void set_grads(const std::vector<at::Tensor>& tensors, const std::vector<at::Tensor>& grads);

}  // namespace roundpipe::gradients
