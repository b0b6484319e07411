#include "gradients/gradients.h"

#include <map>
#include <utility>

#include "torch_internals/torch_internals.h"

namespace roundpipe::gradients {

std::vector<at::Tensor> cut_typed(const at::Tensor& buffer, std::int64_t first_byte,
                                  const std::vector<std::int64_t>& offsets,
                                  const std::vector<at::Tensor>& likes, Cut cut) {
  TORCH_CHECK(buffer.scalar_type() == at::kByte && buffer.dim() == 1 && buffer.is_contiguous(),
              "typed_views: buffer must be a contiguous 1-D uint8 tensor, got ",
              buffer.scalar_type(), " with ", buffer.dim(), " dimensions");
  TORCH_CHECK(offsets.size() == likes.size(), "typed_views: got ", offsets.size(), " offsets but ",
              likes.size(), " likes; pass one offset per tensor");
  std::map<at::ScalarType, at::Tensor> typed;
  std::vector<at::Tensor> views;
  views.reserve(likes.size());
  for (std::size_t i = 0; i < likes.size(); ++i) {
    const at::Tensor& like = likes[i];
    TORCH_CHECK(like.is_contiguous(), "typed_views: likes[", i, "] must be contiguous");
    const std::int64_t size = static_cast<std::int64_t>(like.element_size());
    // Written so that no sum or product can overflow: offsets come from the caller (the
    // difference is taken only once both are known to be non-negative).
    const bool ordered = first_byte >= 0 && offsets[i] >= first_byte;
    const std::int64_t start = ordered ? offsets[i] - first_byte : 0;
    const bool inside = ordered && start <= buffer.numel() &&
                        like.numel() <= (buffer.numel() - start) / size && start % size == 0;
    TORCH_CHECK(inside, "typed_views: offsets[", i, "] = ", offsets[i], " (", like.numel(), " x ",
                size, " bytes) does not lie aligned inside the buffer of ", buffer.numel(),
                " bytes starting at byte ", first_byte);
    if (cut != Cut::kView) {
      // To autograd a tensor of its own, not a view of the buffer, as a parameter is: ops on a
      // view of a leaf that requires grad, made in no-grad mode, require grad only when the
      // leaf is no view (weight.t() inside nn.Linear), and kernels choose by that (matmul folds
      // a strided 3-D input when the weight requires grad). Made directly on the buffer's
      // storage (what empty + set_ make, without a pass through the dispatcher for each).
      TORCH_CHECK((buffer.storage_offset() + start) % size == 0, "typed_views: offsets[", i,
                  "] is not aligned to its ", size, "-byte elements in the buffer's storage");
      at::Tensor own = torch_internals::tensor_on_storage(buffer, like,
                                                          (buffer.storage_offset() + start) / size);
      if (cut == Cut::kOwnLikeGrad && like.requires_grad()) own.set_requires_grad(true);
      views.push_back(std::move(own));
      continue;
    }
    auto base = typed.find(like.scalar_type());
    if (base == typed.end()) {
      const std::int64_t whole = buffer.numel() / size * size;
      base = typed.emplace(like.scalar_type(), buffer.slice(0, 0, whole).view(like.scalar_type()))
                 .first;
    }
    // as_strided's offset counts from the start of the storage, not of the buffer.
    views.push_back(base->second.as_strided(like.sizes(), like.strides(),
                                            base->second.storage_offset() + start / size));
  }
  return views;
}

void set_grads(const std::vector<at::Tensor>& tensors, const std::vector<at::Tensor>& grads) {
  TORCH_CHECK(tensors.size() == grads.size(), "set_grads: got ", tensors.size(), " tensors but ",
              grads.size(), " gradients; pass one gradient per tensor");
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    at::Tensor tensor = tensors[i];
    const at::Tensor& grad = grads[i];
    TORCH_CHECK(tensor.sizes() == grad.sizes() && tensor.scalar_type() == grad.scalar_type() &&
                    tensor.device() == grad.device(),
                "set_grads: grads[", i, "] (", grad.scalar_type(), " ", grad.sizes(), " on ",
                grad.device(), ") does not match tensors[", i, "] (", tensor.scalar_type(), " ",
                tensor.sizes(), " on ", tensor.device(), ")");
    tensor.mutable_grad() = grad;
  }
}

}  // namespace roundpipe::gradients
