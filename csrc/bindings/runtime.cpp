// Bindings of the runtime's native parts: host arenas, events and the per-device copy engines.
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <optional>

#include "bindings/bindings.h"
#include "executor/copy_engine.h"
#include "executor/event.h"
#include "executor/jobs.h"
#include "executor/optimizer_thread.h"
#include "memory/host_arena.h"

namespace py = pybind11;

namespace roundpipe::bindings {
namespace {

// A Python exception raised inside a job on a native thread. Events re-raise their error on every
// wait, and pybind11 may restore an error_already_set only once, so the exception object itself is
// kept (released under the GIL) and raised afresh by the translator registered below.
struct PythonJobError : std::exception {
  explicit PythonJobError(std::shared_ptr<py::object> value) : exception(std::move(value)) {}
  std::shared_ptr<py::object> exception;
  const char* what() const noexcept override { return "Python exception in a RoundPipe job"; }
};

std::exception_ptr capture_python_error(const py::error_already_set& error) {
  std::shared_ptr<py::object> exception(new py::object(error.value()), [](py::object* object) {
    py::gil_scoped_acquire gil;
    delete object;
  });
  return std::make_exception_ptr(PythonJobError(std::move(exception)));
}

// Between slices of a wait on an event: lets Python run its signal handlers (Ctrl-C raises
// KeyboardInterrupt out of the wait). Called without the GIL.
void check_signals() {
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
}

// Thrown by a wait's check once its time is up.
struct WaitTimedOut {};

// A Ctrl-C that interrupted a wait before fork() (roundpipe.step's hooks): an exception in a fork
// hook is only printed and the fork goes ahead, so the parent raises it once fork() returned.
std::atomic<bool> fork_interrupted{false};

// drain_workers(timeout_s): true once every native worker ran the jobs queued before the call;
// false if `timeout_s` passed first. Ctrl-C interrupts it. Called without the GIL.
bool drain_workers(std::optional<double> timeout_s) {
  if (timeout_s && !(std::isfinite(*timeout_s) && *timeout_s >= 0)) {
    throw py::value_error("drain_workers: timeout_s must be a finite number >= 0 or None, got " +
                          std::to_string(*timeout_s));
  }
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_s.value_or(0)));
  try {
    executor::drain_all_workers([&] {
      check_signals();
      if (timeout_s && std::chrono::steady_clock::now() >= deadline) throw WaitTimedOut{};
    });
  } catch (const WaitTimedOut&) {
    return false;
  }
  return true;
}

executor::Lane parse_lane(const std::string& lane) {
  if (lane == "activation") return executor::Lane::kActivation;
  if (lane == "gradient") return executor::Lane::kGradient;
  if (lane == "parameter") return executor::Lane::kParameter;
  throw py::value_error("lane must be 'activation', 'gradient' or 'parameter', got '" + lane + "'");
}

}  // namespace

void bind_runtime(py::module_& m) {
  using executor::Event;
  using executor::EventPtr;

  py::register_exception_translator([](std::exception_ptr error) {
    try {
      if (error) std::rethrow_exception(error);
    } catch (const PythonJobError& job_error) {
      PyObject* exception = job_error.exception->ptr();
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exception)), exception);
    }
  });

  py::class_<Event, EventPtr>(m, "Event",
                              "Completion of an asynchronous copy, accumulation or compute step.")
      .def(
          "synchronize", [](Event& event) { event.synchronize(&check_signals); },
          py::call_guard<py::gil_scoped_release>(),
          "Block until the job finished (Ctrl-C interrupts the wait); re-raise its error.")
      .def("query", &Event::query, "True once the job finished.")
      .def(
          "block_current_stream",
          [](Event& event, int device_index) {
            event.block(executor::current_stream(device_index), &check_signals);
          },
          py::arg("device_index"), py::call_guard<py::gil_scoped_release>(),
          "Make later work on the device's current stream wait for the job.");

  m.def("record_event", &executor::record_event, py::arg("device_index"),
        "An event that completes when the work issued so far to the device's current stream has.");
  m.def(
      "copy_async",
      [](int device_index, const at::Tensor& dst, const at::Tensor& src, const std::string& lane,
         const EventPtr& after) {
        return executor::copy_engine(device_index).copy(dst, src, parse_lane(lane), after);
      },
      py::arg("device_index"), py::arg("dst"), py::arg("src"), py::arg("lane"),
      py::arg("after") = nullptr, py::call_guard<py::gil_scoped_release>(),
      "dst.copy_(src) on the device's copy engine once `after` completed.");
  m.def(
      "upload_pageable",
      [](int device_index, const std::vector<at::Tensor>& dsts, const std::vector<at::Tensor>& srcs,
         const EventPtr& after) {
        return executor::copy_engine(device_index).upload_pageable(dsts, srcs, after);
      },
      py::arg("device_index"), py::arg("dsts"), py::arg("srcs"), py::arg("after") = nullptr,
      py::call_guard<py::gil_scoped_release>(),
      "dsts[i].copy_(srcs[i]) from pageable host bytes to a CUDA device's bytes on its parameter "
      "lane once `after` completed, staged by the engine's worker through its page-locked bounce "
      "buffers.");
  m.def(
      "accumulate_async",
      [](int device_index, const at::Tensor& dst, const at::Tensor& src, const EventPtr& after,
         const std::optional<at::Tensor>& staging) {
        return executor::copy_engine(device_index).accumulate(dst, src, after, staging);
      },
      py::arg("device_index"), py::arg("dst"), py::arg("src"), py::arg("after") = nullptr,
      py::arg("staging") = py::none(), py::call_guard<py::gil_scoped_release>(),
      "dst += src (dst on the host) on the device's copy engine once `after` completed; a CUDA "
      "src is downloaded through `staging` when given.");
  m.def("set_inline_copy_bytes", &executor::set_inline_copy_bytes, py::arg("bytes"),
        "Virtual CPU devices: copies and accumulations of at most `bytes` bytes run on the calling "
        "thread when the engine's worker is idle and nothing they wait for is pending; 0 sends "
        "all of them to the worker.");
  m.def("inline_copy_bytes", &executor::inline_copy_bytes,
        "The threshold of set_inline_copy_bytes (default 64 KiB).");
  m.def(
      "submit_optimizer_job",
      [](py::function job) {
        // Released with the GIL held wherever the last reference goes (normally on the worker
        // right after the call; a job that never runs is released with its queue).
        std::shared_ptr<py::object> holder(new py::object(std::move(job)), [](py::object* object) {
          py::gil_scoped_acquire gil;
          delete object;
        });
        return executor::submit_job(executor::optimizer_thread(), 0, [holder](Event&) {
          py::gil_scoped_acquire gil;
          try {
            (*holder)();
          } catch (const py::error_already_set& python_error) {
            *holder = py::object();
            std::rethrow_exception(capture_python_error(python_error));
          }
          *holder = py::object();
        });
      },
      py::arg("job"),
      "Run job() on the optimizer thread (FIFO); the event re-raises its exception.");
  m.def("writeback_async", &executor::write_back, py::arg("dsts"), py::arg("srcs"),
        py::call_guard<py::gil_scoped_release>(),
        "dsts[i].copy_(srcs[i]) (casting) on the weight writer, first in first out.");
  m.def(
      "note_fork_interrupt", [](bool interrupted) { fork_interrupted.store(interrupted); },
      py::arg("interrupted"),
      "Note (True) or forget (False) a Ctrl-C that came during a wait before fork().");
  m.def(
      "fork_interrupted", [] { return fork_interrupted.load(); },
      "Whether a wait before the fork() under way was interrupted by Ctrl-C.");
  m.def(
      "raise_fork_interrupt",
      [] {
        if (fork_interrupted.exchange(false)) PyErr_SetInterrupt();
      },
      "fork()'s after_in_parent hook: the noted Ctrl-C, raised as KeyboardInterrupt in the "
      "main thread. A native function, so that it runs no Python code that would raise it "
      "inside the hook (printed and lost there): it surfaces where fork() returns.");
  m.def("drain_workers", &drain_workers, py::arg("timeout_s") = py::none(),
        py::call_guard<py::gil_scoped_release>(),
        "Wait until every native worker ran the jobs submitted so far (called at exit and before "
        "fork): True, or False once timeout_s seconds passed first; Ctrl-C interrupts the wait.");
  m.def(
      "allocate_host_arena",
      [](std::int64_t bytes, const std::string& pin_model, bool zero) {
        return memory::allocate_host_arena(bytes, memory::parse_pin_mode(pin_model), zero);
      },
      py::arg("bytes"), py::arg("pin_model"), py::kw_only(), py::arg("zero") = true,
      "A uint8 host tensor of exactly `bytes` bytes, pinned per `pin_model` ('off': pageable on "
      "every device kind); zero-filled unless zero=False.");
  m.def("allocate_pinned_staging", &memory::allocate_pinned_staging, py::arg("bytes"),
        "An uninitialised uint8 host tensor of exactly `bytes` bytes, page-locked when CUDA "
        "devices are in use: a download staging area.");
  m.def("is_page_locked", &memory::is_page_locked, py::arg("tensor"));
  m.def("zero_host_memory", &memory::zero_host_memory, py::arg("tensor"),
        py::call_guard<py::gil_scoped_release>(),
        "Zero a contiguous CPU tensor; whole pages of an arena mapping go back to the OS.");
  m.def("trim_host_heap", &memory::trim_host_heap, py::call_guard<py::gil_scoped_release>(),
        "Return the C heap's free memory to the OS (glibc); False where unsupported.");
}

}  // namespace roundpipe::bindings
