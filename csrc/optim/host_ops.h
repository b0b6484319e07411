// The host optimizer's tensor-level operations (roundpipe.optim's Adam, gradient passes and 8-bit
// moments): every tensor argument checked (host, dense, dtype, length) before any is touched, then
// the kernels of adam.h on their memory in place. Raises ValueError / TypeError (TORCH_CHECK_VALUE
// / TORCH_CHECK_TYPE) naming the argument. No Python: the bindings release the GIL around them.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace roundpipe::optim::host_ops {

using TensorList = std::vector<at::Tensor>;
using OptionalTensorList = std::vector<std::optional<at::Tensor>>;

// One Adam/AdamW step over a param group, in place, multi-threaded over chunks of all tensors:
// increments steps; reads grads (fp32/bf16/fp16) times grad_scale_inv; writes the new weights also
// into lowp_params (bf16/fp16) where given. Moments are fp32, bf16 (stochastically rounded) or
// 8-bit codes (int8 exp_avg, uint8 exp_avg_sq) with one float32 scale per kStateBlock elements.
// Nothing is written unless every argument is valid; version counters move as in-place ops move
// them.
void adam_step(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
               const TensorList& exp_avg_sqs, const std::optional<TensorList>& max_exp_avg_sqs,
               const TensorList& steps, double lr, double beta1, double beta2, double eps,
               double weight_decay, bool amsgrad, bool maximize, bool decoupled_weight_decay,
               double grad_scale_inv, const std::optional<OptionalTensorList>& lowp_params,
               std::optional<int> num_threads, const std::optional<TensorList>& exp_avg_scales,
               const std::optional<TensorList>& exp_avg_sq_scales);

// Bytes read, bytes written, the seconds the I/O threads spent reading and writing, and every
// request as (is_write, start_ns, end_ns, bytes) on the steady clock.
using StreamedStats =
    std::tuple<std::int64_t, std::int64_t, double, double,
               std::vector<std::tuple<bool, std::int64_t, std::int64_t, std::int64_t>>>;

// One Adam/AdamW step (no amsgrad) over tensors whose fp32 master weights and moments (in
// state_dtype: float32, bfloat16 or int8 codes with block scales) lie in `files` (fd, path) at
// `regions` (per tensor: file index and byte offset of the master weights, exp_avg, exp_avg_sq,
// exp_avg_scale, exp_avg_sq_scale; the scales only for int8), streamed through `buffers` chunks
// of `chunk_elements` with `io_threads` requests in flight (optim/disk_state.h). The same bits as
// adam_step on the same state in memory. Increments steps; writes the new weights into
// lowp_params where given. A failed read or write throws optim::DiskError naming the file.
StreamedStats adam_step_streamed(const std::vector<std::pair<int, std::string>>& files,
                                 const std::vector<std::vector<std::int64_t>>& regions,
                                 const TensorList& grads, const TensorList& steps,
                                 const OptionalTensorList& lowp_params, at::ScalarType state_dtype,
                                 double lr, double beta1, double beta2, double eps,
                                 double weight_decay, bool maximize, bool decoupled_weight_decay,
                                 double grad_scale_inv, std::int64_t chunk_elements, int buffers,
                                 int io_threads, std::optional<int> num_threads);

// `nbytes` bytes of the file open as `fd` (named `path` in errors) from `offset`, a multiple of
// the page size, mapped shared as a uint8 tensor, unmapped when the last tensor of it is freed.
// Unlike Python's mmap it keeps no descriptor of its own: a model's hundreds of offloaded tensors
// cost none of the process's open-file limit. A failed mapping throws optim::DiskError.
at::Tensor map_file_region(int fd, const std::string& path, std::int64_t offset,
                           std::int64_t nbytes);

// dsts[k] (fp32) = srcs[k] cast to fp32 (`overwrite`), or += it; without `overwrite` (nullopt)
// only the check. True iff every src is finite.
bool grad_pass(const TensorList& dsts, const TensorList& srcs, std::optional<bool> overwrite,
               std::optional<int> num_threads);

// Encodes fp32 moments `values` as 8-bit `codes` (int8 for exp_avg, uint8 for exp_avg_sq) and
// block `scales` (round to nearest), in place; with `given_scales`, against the `scales` passed
// in (left as they are).
void quantize_moment(bool is_exp_avg, const at::Tensor& values, const at::Tensor& codes,
                     const at::Tensor& scales, bool given_scales);

// Decodes 8-bit moment `codes` and block `scales` into the fp32 `values`, in place.
void dequantize_moment(bool is_exp_avg, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& values);

// The threads the host optimizer kernels use when not told (ValueError for a malformed
// ROUNDPIPE_OPTIMIZER_THREADS).
int default_threads();

// Fixes the host optimizer's threads; 0 returns to the default (ValueError below 0).
void set_threads(int threads);

// Worker threads the host optimizer pool has started so far (it starts them lazily).
int started_threads();

}  // namespace roundpipe::optim::host_ops
