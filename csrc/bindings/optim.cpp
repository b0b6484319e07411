// roundpipe._C's host optimizer part (csrc/optim/host_ops.h): each call checks its tensors and
// runs the kernels without the GIL.
#include <torch/csrc/utils/pybind.h>

#include <optional>

#include "bindings/bindings.h"
#include "optim/adam.h"
#include "optim/disk_state.h"
#include "optim/host_ops.h"

namespace py = pybind11;

namespace roundpipe::bindings {

void bind_optim(py::module_& m) {
  using optim::host_ops::TensorList;
  using no_gil = py::call_guard<py::gil_scoped_release>;
  m.def("adam_step", &optim::host_ops::adam_step, py::arg("params"), py::arg("grads"),
        py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("max_exp_avg_sqs"), py::arg("steps"),
        py::kw_only(), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("amsgrad"), py::arg("maximize"),
        py::arg("decoupled_weight_decay"), py::arg("grad_scale_inv") = 1.0,
        py::arg("lowp_params") = py::none(), py::arg("num_threads") = py::none(),
        py::arg("exp_avg_scales") = py::none(), py::arg("exp_avg_sq_scales") = py::none(), no_gil(),
        "One Adam/AdamW step over a param group, in place, multi-threaded over chunks of all "
        "tensors. Increments steps; reads grads (fp32/bf16/fp16) times grad_scale_inv; writes "
        "the new weights also into lowp_params (bf16/fp16) where given. Moments are fp32, bf16 "
        "(stochastically rounded) or 8-bit codes (int8 exp_avg, uint8 exp_avg_sq) with one "
        "float32 scale per block of state_block elements in exp_avg_scales/exp_avg_sq_scales.");
  m.def("adam_step_streamed", &optim::host_ops::adam_step_streamed, py::arg("files"),
        py::arg("regions"), py::arg("grads"), py::arg("steps"), py::arg("lowp_params"),
        py::kw_only(), py::arg("state_dtype"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("weight_decay"), py::arg("maximize"),
        py::arg("decoupled_weight_decay"), py::arg("grad_scale_inv"), py::arg("chunk_elements"),
        py::arg("buffers"), py::arg("io_threads"), py::arg("num_threads") = py::none(), no_gil(),
        "One Adam/AdamW step over tensors whose master weights and moments lie in files, "
        "streamed through a few aligned buffers (roundpipe.optim.offload). Returns bytes read, "
        "bytes written and the I/O threads' seconds reading and writing. A failed read or write "
        "raises OSError with its errno and file.");
  m.def("map_file_region", &optim::host_ops::map_file_region, py::arg("fd"), py::arg("path"),
        py::arg("offset"), py::arg("nbytes"),
        "nbytes bytes of the open file fd from offset (a multiple of the page size), mapped "
        "shared as a uint8 tensor and unmapped when the last tensor of it is freed; keeps no "
        "descriptor of its own. A failed mapping raises OSError naming path.");
  m.def(
      "disk_grain", [] { return optim::kDiskGrain; },
      "Elements on whose multiples an offloaded tensor's chunks start.");
  m.def(
      "disk_align", [] { return optim::kDiskAlign; },
      "Alignment in bytes of every offloaded region, request and buffer.");
  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const optim::DiskError& disk_error) {
      py::object os_error =
          py::module_::import("builtins")
              .attr("OSError")(disk_error.error_number(), disk_error.what(), disk_error.path());
      PyErr_SetObject(PyExc_OSError, os_error.ptr());
    }
  });
  m.def("quantize_moment", &optim::host_ops::quantize_moment, py::arg("is_exp_avg"),
        py::arg("values"), py::arg("codes"), py::arg("scales"), py::arg("given_scales") = false,
        no_gil(),
        "Encodes fp32 moments as 8-bit codes and block scales (round to nearest), in place; with "
        "given_scales, against the scales passed in (left as they are).");
  m.def("dequantize_moment", &optim::host_ops::dequantize_moment, py::arg("is_exp_avg"),
        py::arg("codes"), py::arg("scales"), py::arg("values"), no_gil(),
        "Decodes 8-bit moment codes and block scales into fp32 values, in place.");
  m.def("state_block", [] { return optim::kStateBlock; }, "Elements per scale of 8-bit moments.");
  m.def("optimizer_threads", &optim::host_ops::default_threads,
        "Threads the host optimizer kernels use when not told (see set_optimizer_threads).");
  m.def("set_optimizer_threads", &optim::host_ops::set_threads, py::arg("threads"),
        "Fixes the host optimizer's threads; 0 returns to the default: the CPUs of this process's "
        "affinity divided by LOCAL_WORLD_SIZE, or ROUNDPIPE_OPTIMIZER_THREADS.");
  m.def(
      "grad_accumulate",
      [](const TensorList& dsts, const TensorList& srcs, bool overwrite,
         std::optional<int> num_threads) {
        return optim::host_ops::grad_pass(dsts, srcs, overwrite, num_threads);
      },
      py::arg("dsts"), py::arg("srcs"), py::arg("overwrite"), py::arg("num_threads") = py::none(),
      no_gil(),
      "dsts[k] (fp32) = or += srcs[k] cast to fp32, in one pass; True iff every src is finite.");
  m.def(
      "grad_accumulate",
      [](const at::Tensor& dst, const at::Tensor& src, bool overwrite,
         std::optional<int> num_threads) {
        return optim::host_ops::grad_pass({dst}, {src}, overwrite, num_threads);
      },
      py::arg("dst"), py::arg("src"), py::arg("overwrite"), py::arg("num_threads") = py::none(),
      no_gil());
  m.def(
      "all_finite",
      [](const TensorList& tensors, std::optional<int> num_threads) {
        return optim::host_ops::grad_pass({}, tensors, std::nullopt, num_threads);
      },
      py::arg("tensors"), py::arg("num_threads") = py::none(), no_gil(),
      "True iff no element of the (fp32/bf16/fp16 CPU) tensors is inf or NaN.");
  m.def("optimizer_threads_started", &optim::host_ops::started_threads,
        "Worker threads the host optimizer pool has started so far (it starts them lazily).");
}

}  // namespace roundpipe::bindings
