#include "optim/host_ops.h"

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <stdexcept>
#include <string>
#include <utility>

#include "common/cpu_features.h"
#include "common/host_threads.h"
#include "common/thread_pool.h"
#include "optim/adam.h"
#include "optim/disk_state.h"
#include "torch_internals/torch_internals.h"

namespace roundpipe::optim::host_ops {
namespace {

std::string item_name(const char* list, std::size_t index) {
  return std::string(list) + "[" + std::to_string(index) + "]";
}

// The kernels read and write raw memory in place, so a tensor must be on the host and dense.
void check_host_dense(const at::Tensor& tensor, const std::string& name) {
  TORCH_CHECK_VALUE(tensor.device().is_cpu(), name, " must be a CPU tensor, got one on ",
                    tensor.device(), "; the optimizer runs on the host");
  TORCH_CHECK_VALUE(tensor.is_contiguous(), name,
                    " must be contiguous: the optimizer kernels work on its memory directly and "
                    "never on a hidden copy, so pass a dense tensor rather than a strided view");
}

DType dtype_of(const at::Tensor& tensor, const std::string& name, bool allow_float32) {
  switch (tensor.scalar_type()) {
    case at::kFloat:
      if (allow_float32) return DType::kFloat32;
      break;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kHalf:
      return DType::kFloat16;
    default:
      break;
  }
  C10_THROW_ERROR(TypeError,
                  c10::str(name, " must be ",
                           allow_float32 ? "float32, bfloat16 or float16" : "bfloat16 or float16",
                           ", got ", tensor.scalar_type()));
}

void check_float32(const at::Tensor& tensor, const std::string& name) {
  TORCH_CHECK_TYPE(tensor.scalar_type() == at::kFloat, name, " must be float32, got ",
                   tensor.scalar_type(),
                   "; roundpipe.optim.Adam keeps fp32 master weights and "
                   "moments (use optim_dtype=torch.float32 for a low-precision model)");
  check_host_dense(tensor, name);
}

void check_same_numel(const at::Tensor& tensor, const std::string& name, const at::Tensor& param,
                      const std::string& param_name) {
  TORCH_CHECK_VALUE(tensor.numel() == param.numel(), name, " has ", tensor.numel(),
                    " elements but ", param_name, " has ", param.numel());
}

void check_length(std::size_t length, const char* name, std::size_t expected,
                  const char* expected_name = "params") {
  TORCH_CHECK_VALUE(length == expected, name, " has ", length, " tensors but ", expected_name,
                    " has ", expected, "; pass one per tensor of ", expected_name);
}

int resolve_threads(std::optional<int> num_threads) {
  const int threads = num_threads ? *num_threads : default_threads();
  TORCH_CHECK_VALUE(threads >= 1, "num_threads must be at least 1, got ", threads);
  return threads;
}

// The form of one tensor's moments, from its exp_avg, after checking both moments (and the
// scales of 8-bit ones) against it.
StateDType check_moments(const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                         const std::optional<TensorList>& exp_avg_scales,
                         const std::optional<TensorList>& exp_avg_sq_scales, std::size_t k,
                         const at::Tensor& param, const std::string& param_name) {
  const std::string exp_avg_name = item_name("exp_avgs", k);
  const std::string exp_avg_sq_name = item_name("exp_avg_sqs", k);
  for (const auto& [tensor, name] :
       {std::pair{&exp_avg, &exp_avg_name}, std::pair{&exp_avg_sq, &exp_avg_sq_name}}) {
    check_host_dense(*tensor, *name);
    check_same_numel(*tensor, *name, param, param_name);
  }
  const at::ScalarType kind = exp_avg.scalar_type();
  const at::ScalarType expected_sq = kind == at::kChar ? at::kByte : kind;
  TORCH_CHECK_TYPE(kind == at::kFloat || kind == at::kBFloat16 || kind == at::kChar, exp_avg_name,
                   " must be float32, bfloat16 or int8 (8-bit codes), got ", kind);
  TORCH_CHECK_TYPE(exp_avg_sq.scalar_type() == expected_sq, exp_avg_sq_name, " must be ",
                   expected_sq, " like ", exp_avg_name, " (", kind, "), got ",
                   exp_avg_sq.scalar_type());
  if (kind != at::kChar) return kind == at::kFloat ? StateDType::kFloat32 : StateDType::kBFloat16;
  TORCH_CHECK_VALUE(exp_avg_scales && exp_avg_sq_scales,
                    "exp_avg_scales and exp_avg_sq_scales are required with int8 moments");
  const std::int64_t blocks = state_blocks(param.numel());
  for (const auto& [list, name] : {std::pair{&*exp_avg_scales, "exp_avg_scales"},
                                   std::pair{&*exp_avg_sq_scales, "exp_avg_sq_scales"}}) {
    const at::Tensor& scale = (*list)[k];
    const std::string scale_name = item_name(name, k);
    TORCH_CHECK_TYPE(scale.scalar_type() == at::kFloat, scale_name, " must be float32, got ",
                     scale.scalar_type());
    check_host_dense(scale, scale_name);
    TORCH_CHECK_VALUE(scale.numel() == blocks, scale_name, " has ", scale.numel(), " elements but ",
                      param_name, " needs ", blocks, " (one per ", kStateBlock, " elements)");
  }
  return StateDType::kInt8;
}

void check_step(const at::Tensor& step, std::size_t k) {
  TORCH_CHECK_VALUE(step.device().is_cpu() && step.numel() == 1 &&
                        (step.scalar_type() == at::kFloat || step.scalar_type() == at::kDouble),
                    item_name("steps", k), " must be a one-element float32 or float64 CPU tensor");
}

// Increments a step count and returns it: in float32 like torch's state["step"] += 1, so long
// runs count identically.
double advance_step(const at::Tensor& step) {
  if (step.scalar_type() == at::kFloat) {
    float* count = step.data_ptr<float>();
    *count += 1.0f;
    return *count;
  }
  double* count = step.data_ptr<double>();
  *count += 1.0;
  return *count;
}

// In-place writes through raw pointers bypass ATen, so bump the version counters ATen would have
// bumped; autograd then still detects a tensor it saved being modified.
void bump_versions(const TensorList& tensors) {
  for (const at::Tensor& tensor : tensors) torch_internals::bump_version(tensor);
}

// Checks a moment's codes and scales against the fp32 values they stand for.
void check_codes(bool is_exp_avg, const at::Tensor& values, const at::Tensor& codes,
                 const at::Tensor& scales) {
  check_float32(values, "values");
  const at::ScalarType code_type = is_exp_avg ? at::kChar : at::kByte;
  TORCH_CHECK_TYPE(codes.scalar_type() == code_type, "codes must be ", code_type, " for ",
                   is_exp_avg ? "exp_avg" : "exp_avg_sq", ", got ", codes.scalar_type());
  check_host_dense(codes, "codes");
  check_same_numel(codes, "codes", values, "values");
  TORCH_CHECK_TYPE(scales.scalar_type() == at::kFloat, "scales must be float32, got ",
                   scales.scalar_type());
  check_host_dense(scales, "scales");
  TORCH_CHECK_VALUE(scales.numel() == state_blocks(values.numel()), "scales has ", scales.numel(),
                    " elements but values needs ", state_blocks(values.numel()), " (one per ",
                    kStateBlock, " elements)");
}

}  // namespace

int default_threads() {
  try {
    return optimizer_threads();
  } catch (const std::invalid_argument& error) {
    C10_THROW_ERROR(ValueError, error.what());
  }
}

void set_threads(int threads) {
  TORCH_CHECK_VALUE(threads >= 0, "threads must be at least 1, or 0 for the default, got ",
                    threads);
  set_optimizer_threads(threads);
}

int started_threads() { return ThreadPool::global().started_workers(); }

void adam_step(const TensorList& params, const TensorList& grads, const TensorList& exp_avgs,
               const TensorList& exp_avg_sqs, const std::optional<TensorList>& max_exp_avg_sqs,
               const TensorList& steps, double lr, double beta1, double beta2, double eps,
               double weight_decay, bool amsgrad, bool maximize, bool decoupled_weight_decay,
               double grad_scale_inv, const std::optional<OptionalTensorList>& lowp_params,
               std::optional<int> num_threads, const std::optional<TensorList>& exp_avg_scales,
               const std::optional<TensorList>& exp_avg_sq_scales) {
  const std::size_t n = params.size();
  check_length(grads.size(), "grads", n);
  check_length(exp_avgs.size(), "exp_avgs", n);
  check_length(exp_avg_sqs.size(), "exp_avg_sqs", n);
  check_length(steps.size(), "steps", n);
  TORCH_CHECK_VALUE(!amsgrad || max_exp_avg_sqs.has_value(),
                    "max_exp_avg_sqs is required when amsgrad=True");
  if (amsgrad) check_length(max_exp_avg_sqs->size(), "max_exp_avg_sqs", n);
  if (lowp_params) check_length(lowp_params->size(), "lowp_params", n);
  if (exp_avg_scales) check_length(exp_avg_scales->size(), "exp_avg_scales", n);
  if (exp_avg_sq_scales) check_length(exp_avg_sq_scales->size(), "exp_avg_sq_scales", n);
  const int threads = resolve_threads(num_threads);

  std::vector<AdamBuffers> buffers(n);
  for (std::size_t k = 0; k < n; ++k) {
    const std::string param_name = item_name("params", k);
    check_float32(params[k], param_name);
    const StateDType state_dtype = check_moments(exp_avgs[k], exp_avg_sqs[k], exp_avg_scales,
                                                 exp_avg_sq_scales, k, params[k], param_name);
    TORCH_CHECK_VALUE(!amsgrad || state_dtype == StateDType::kFloat32,
                      "amsgrad=True needs float32 moments, got ", exp_avgs[k].scalar_type(),
                      " for ", item_name("exp_avgs", k));
    const std::string grad_name = item_name("grads", k);
    const DType grad_dtype = dtype_of(grads[k], grad_name, true);
    check_host_dense(grads[k], grad_name);
    check_same_numel(grads[k], grad_name, params[k], param_name);
    check_step(steps[k], k);
    AdamBuffers& b = buffers[k];
    b = {params[k].data_ptr<float>(),
         grads[k].data_ptr(),
         grad_dtype,
         exp_avgs[k].data_ptr(),
         exp_avg_sqs[k].data_ptr(),
         nullptr,
         nullptr,
         DType::kBFloat16,
         params[k].numel(),
         state_dtype};
    if (state_dtype == StateDType::kInt8) {
      b.exp_avg_scale = (*exp_avg_scales)[k].data_ptr<float>();
      b.exp_avg_sq_scale = (*exp_avg_sq_scales)[k].data_ptr<float>();
    }
    if (amsgrad) {
      const at::Tensor& max_sq = (*max_exp_avg_sqs)[k];
      check_float32(max_sq, item_name("max_exp_avg_sqs", k));
      check_same_numel(max_sq, item_name("max_exp_avg_sqs", k), params[k], param_name);
      b.max_exp_avg_sq = max_sq.data_ptr<float>();
    }
    if (lowp_params && (*lowp_params)[k].has_value()) {
      const at::Tensor& lowp = *(*lowp_params)[k];
      const std::string lowp_name = item_name("lowp_params", k);
      b.lowp_dtype = dtype_of(lowp, lowp_name, false);
      check_host_dense(lowp, lowp_name);
      check_same_numel(lowp, lowp_name, params[k], param_name);
      b.lowp_param = lowp.data_ptr();
    }
  }

  // Every argument is valid: from here on nothing fails, so a step is never half applied.
  const AdamHyper hyper{lr,           beta1,   beta2,    eps,
                        weight_decay, amsgrad, maximize, decoupled_weight_decay};
  std::vector<AdamCoefficients> coefficients(n);
  for (std::size_t k = 0; k < n; ++k) {
    coefficients[k] =
        adam_coefficients(hyper, advance_step(steps[k]), static_cast<float>(grad_scale_inv));
  }
  for (const TensorList* list : {&params, &exp_avgs, &exp_avg_sqs, &steps}) bump_versions(*list);
  if (amsgrad) bump_versions(*max_exp_avg_sqs);
  for (const auto* scales : {&exp_avg_scales, &exp_avg_sq_scales}) {
    if (*scales) bump_versions(**scales);
  }
  if (lowp_params) {
    for (const auto& lowp : *lowp_params) {
      if (lowp) torch_internals::bump_version(*lowp);
    }
  }
  optim::adam_step(ThreadPool::global(), threads, active_simd_level(), coefficients, buffers);
}

bool grad_pass(const TensorList& dsts, const TensorList& srcs, std::optional<bool> overwrite,
               std::optional<int> num_threads) {
  const int threads = resolve_threads(num_threads);
  if (overwrite) check_length(dsts.size(), "dsts", srcs.size(), "srcs");
  std::vector<GradBuffers> buffers(srcs.size());
  for (std::size_t k = 0; k < srcs.size(); ++k) {
    const std::string src_name = item_name("srcs", k);
    buffers[k] = {nullptr, srcs[k].data_ptr(), dtype_of(srcs[k], src_name, true), srcs[k].numel()};
    check_host_dense(srcs[k], src_name);
    if (overwrite) {
      const std::string dst_name = item_name("dsts", k);
      check_float32(dsts[k], dst_name);
      check_same_numel(dsts[k], dst_name, srcs[k], src_name);
      buffers[k].dst = dsts[k].data_ptr<float>();
    }
  }
  const GradMode mode = !overwrite   ? GradMode::kCheck
                        : *overwrite ? GradMode::kCopy
                                     : GradMode::kAccumulate;
  if (overwrite) bump_versions(dsts);
  return optim::grad_pass(ThreadPool::global(), threads, active_simd_level(), mode, buffers);
}

void quantize_moment(bool is_exp_avg, const at::Tensor& values, const at::Tensor& codes,
                     const at::Tensor& scales, bool given_scales) {
  check_codes(is_exp_avg, values, codes, scales);
  const int threads = default_threads();
  torch_internals::bump_version(codes);
  if (!given_scales) torch_internals::bump_version(scales);
  optim::quantize_moment(ThreadPool::global(), threads, is_exp_avg, values.data_ptr<float>(),
                         codes.data_ptr(), scales.data_ptr<float>(), values.numel(), given_scales);
}

void dequantize_moment(bool is_exp_avg, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& values) {
  check_codes(is_exp_avg, values, codes, scales);
  const int threads = default_threads();
  torch_internals::bump_version(values);
  optim::dequantize_moment(ThreadPool::global(), threads, is_exp_avg, codes.data_ptr(),
                           scales.data_ptr<float>(), values.data_ptr<float>(), values.numel());
}

StreamedStats adam_step_streamed(const std::vector<std::pair<int, std::string>>& files,
                                 const std::vector<std::vector<std::int64_t>>& regions,
                                 const TensorList& grads, const TensorList& steps,
                                 const OptionalTensorList& lowp_params, at::ScalarType state_dtype,
                                 double lr, double beta1, double beta2, double eps,
                                 double weight_decay, bool maximize, bool decoupled_weight_decay,
                                 double grad_scale_inv, std::int64_t chunk_elements, int buffers,
                                 int io_threads, std::optional<int> num_threads) {
  const std::size_t n = grads.size();
  check_length(regions.size(), "regions", n, "grads");
  check_length(steps.size(), "steps", n, "grads");
  check_length(lowp_params.size(), "lowp_params", n, "grads");
  TORCH_CHECK_TYPE(
      state_dtype == at::kFloat || state_dtype == at::kBFloat16 || state_dtype == at::kChar,
      "state_dtype must be torch.float32, torch.bfloat16 or torch.int8, got ", state_dtype);
  TORCH_CHECK_VALUE(chunk_elements >= 1 && buffers >= 1 && io_threads >= 1,
                    "chunk_elements, buffers and io_threads must be at least 1");
  const int threads = resolve_threads(num_threads);
  std::vector<DiskFile> disk_files;
  for (const auto& [fd, path] : files) disk_files.push_back({fd, path});
  std::vector<StreamedTensor> tensors(n);
  for (std::size_t k = 0; k < n; ++k) {
    const std::string grad_name = item_name("grads", k);
    check_host_dense(grads[k], grad_name);
    check_step(steps[k], k);
    TORCH_CHECK_VALUE(regions[k].size() == 10, item_name("regions", k),
                      " must hold (file, offset) of the master weights, exp_avg, exp_avg_sq, "
                      "exp_avg_scale and exp_avg_sq_scale");
    StreamedTensor& t = tensors[k];
    t.numel = grads[k].numel();
    FileRegion* parts[] = {&t.param, &t.exp_avg, &t.exp_avg_sq, &t.exp_avg_scale,
                           &t.exp_avg_sq_scale};
    for (std::size_t part = 0; part < 5; ++part) {
      const std::int64_t file = regions[k][2 * part];
      const std::int64_t offset = regions[k][2 * part + 1];
      const bool needed = t.numel > 0 && (part < 3 || state_dtype == at::kChar);
      TORCH_CHECK_VALUE(!needed || (file >= 0 && file < static_cast<std::int64_t>(files.size()) &&
                                    offset >= 0 && offset % kDiskAlign == 0),
                        item_name("regions", k), " names no file or an unaligned offset");
      *parts[part] = {static_cast<int>(file), offset};
    }
    t.grad = grads[k].data_ptr();
    t.grad_dtype = dtype_of(grads[k], grad_name, true);
    t.lowp_param = nullptr;
    t.lowp_dtype = DType::kBFloat16;
    if (lowp_params[k].has_value()) {
      const at::Tensor& lowp = *lowp_params[k];
      const std::string lowp_name = item_name("lowp_params", k);
      t.lowp_dtype = dtype_of(lowp, lowp_name, false);
      check_host_dense(lowp, lowp_name);
      TORCH_CHECK_VALUE(lowp.numel() == t.numel, lowp_name, " has ", lowp.numel(), " elements but ",
                        grad_name, " has ", t.numel);
      t.lowp_param = lowp.data_ptr();
    }
  }
  const AdamHyper hyper{lr,           beta1, beta2,    eps,
                        weight_decay, false, maximize, decoupled_weight_decay};
  for (std::size_t k = 0; k < n; ++k) {
    tensors[k].coefficients =
        adam_coefficients(hyper, advance_step(steps[k]), static_cast<float>(grad_scale_inv));
  }
  bump_versions(steps);
  for (const auto& lowp : lowp_params) {
    if (lowp) torch_internals::bump_version(*lowp);
  }
  StreamOptions options;
  options.state_dtype = state_dtype == at::kFloat      ? StateDType::kFloat32
                        : state_dtype == at::kBFloat16 ? StateDType::kBFloat16
                                                       : StateDType::kInt8;
  options.chunk_elements = chunk_elements;
  options.buffers = buffers;
  options.io_threads = io_threads;
  options.compute_threads = threads;
  options.level = active_simd_level();
  const StreamStats stats =
      optim::adam_step_streamed(ThreadPool::global(), disk_files, tensors, options);
  std::vector<std::tuple<bool, std::int64_t, std::int64_t, std::int64_t>> spans;
  spans.reserve(stats.spans.size());
  for (const IoSpan& span : stats.spans) {
    spans.emplace_back(span.write, span.start_ns, span.end_ns, span.bytes);
  }
  return {stats.bytes_read, stats.bytes_written, stats.read_seconds, stats.write_seconds,
          std::move(spans)};
}

at::Tensor map_file_region(int fd, const std::string& path, std::int64_t offset,
                           std::int64_t nbytes) {
  const std::int64_t page = sysconf(_SC_PAGESIZE);
  TORCH_CHECK_VALUE(fd >= 0, "map_file_region: fd must be an open descriptor, got ", fd);
  TORCH_CHECK_VALUE(offset >= 0 && offset % page == 0,
                    "map_file_region: offset must be a non-negative multiple of the page size (",
                    page, "), got ", offset);
  TORCH_CHECK_VALUE(nbytes > 0, "map_file_region: nbytes must be positive, got ", nbytes);
  // A page of the map past the file's end would kill the process (SIGBUS) when touched.
  struct stat file{};
  if (fstat(fd, &file) != 0) {
    const int error = errno;
    throw DiskError(error, path, "fstat of " + path + " failed: " + std::strerror(error));
  }
  TORCH_CHECK_VALUE(offset + nbytes <= file.st_size, "map_file_region: bytes ", offset, " to ",
                    offset + nbytes, " lie past the end of ", path, " (", file.st_size,
                    " bytes); allocate them first");
  void* data = mmap(nullptr, static_cast<std::size_t>(nbytes), PROT_READ | PROT_WRITE, MAP_SHARED,
                    fd, static_cast<off_t>(offset));
  if (data == MAP_FAILED) {
    const int error = errno;
    throw DiskError(error, path,
                    "mapping " + std::to_string(nbytes) + " bytes of " + path + " at offset " +
                        std::to_string(offset) + " failed: " + std::strerror(error));
  }
  const auto length = static_cast<std::size_t>(nbytes);
  return at::from_blob(
      data, {nbytes}, [length](void* mapped) { munmap(mapped, length); },
      at::TensorOptions().dtype(at::kByte));
}

}  // namespace roundpipe::optim::host_ops
