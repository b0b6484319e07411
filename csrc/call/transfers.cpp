#include "call/transfers.h"

#include <ATen/ops/empty.h>
#include <c10/util/strides.h>

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "torch_internals/torch_internals.h"

namespace roundpipe::call {
namespace {

// Whether no two elements of `tensor` share memory: with its dimensions ordered by stride, each
// stride steps past everything the smaller ones reach.
bool elements_apart(const at::Tensor& tensor) {
  std::vector<std::pair<std::int64_t, std::int64_t>> dims;  // (stride, size) of dims with size > 1
  for (std::int64_t dim = 0; dim < tensor.dim(); ++dim) {
    if (tensor.size(dim) > 1) dims.emplace_back(tensor.stride(dim), tensor.size(dim));
  }
  std::sort(dims.begin(), dims.end());
  std::int64_t reach = 0;  // the furthest element the dims so far reach
  for (const auto& [stride, size] : dims) {
    if (stride <= reach) return false;
    reach += (size - 1) * stride;
  }
  return true;
}

}  // namespace

at::Tensor empty_placed(const at::Tensor& tensor, c10::Device device) {
  const auto item = static_cast<std::uintptr_t>(tensor.element_size());
  const std::uintptr_t boundary = device.is_cuda() ? 512 : 64;
  const auto address = tensor.device().type() == device.type()
                           ? reinterpret_cast<std::uintptr_t>(tensor.data_ptr())
                           : static_cast<std::uintptr_t>(tensor.storage_offset()) * item;
  std::uintptr_t skew = address % boundary;
  if (skew % item != 0) skew = 0;
  const bool strided =
      device.is_cuda() ? tensor.is_non_overlapping_and_dense() : elements_apart(tensor);
  const auto options = tensor.options().device(device);
  if (tensor.numel() == 0) return at::empty(tensor.sizes(), options);
  const auto strides = strided ? c10::DimVector(tensor.strides().begin(), tensor.strides().end())
                               : c10::contiguous_strides(tensor.sizes());
  std::int64_t span = 1;  // elements from the first to the last, inclusive
  for (std::size_t dim = 0; dim < strides.size(); ++dim)
    span += (tensor.size(dim) - 1) * strides[dim];
  const auto shift = static_cast<std::int64_t>(skew / item);
  return at::empty({span + shift}, options).as_strided(tensor.sizes(), strides, shift);
}

at::Tensor plain_copy(const at::Tensor& tensor) {
  return torch_internals::below_autograd([&] {
    at::Tensor copy = empty_placed(tensor, tensor.device());
    copy.copy_(tensor);
    return copy;
  });
}

at::Tensor graph_cut(const at::Tensor& tensor) {
  at::Tensor cut = tensor.detach();
  if (tensor.requires_grad() && (cut.is_floating_point() || cut.is_complex())) {
    torch_internals::collect_grad(cut);
  }
  return cut;
}

}  // namespace roundpipe::call
