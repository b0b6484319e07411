// Bindings of the runtime's native parts: host arenas, events and the per-device copy engines.
#include <torch/csrc/utils/pybind.h>

#include "bindings/bindings.h"
#include "executor/copy_engine.h"
#include "executor/event.h"
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
      .def("synchronize", &Event::synchronize, py::call_guard<py::gil_scoped_release>(),
           "Block until the job finished; re-raise its error.")
      .def("query", &Event::query, "True once the job finished.")
      .def(
          "block_current_stream",
          [](Event& event, int device_index) {
            event.block(executor::current_stream(device_index));
          },
          py::arg("device_index"), py::call_guard<py::gil_scoped_release>(),
          "Make later work on the device's current stream wait for the job.");

  m.def(
      "record_event",
      [](int device_index) {
        c10::Stream stream = executor::current_stream(device_index);
        return stream.device_type() == c10::DeviceType::CPU ? Event::completed()
                                                            : Event::recorded_on(stream);
      },
      py::arg("device_index"),
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
      "accumulate_async",
      [](int device_index, const at::Tensor& dst, const at::Tensor& src, const EventPtr& after) {
        return executor::copy_engine(device_index).accumulate(dst, src, after);
      },
      py::arg("device_index"), py::arg("dst"), py::arg("src"), py::arg("after") = nullptr,
      py::call_guard<py::gil_scoped_release>(),
      "dst += src (dst on the host) on the device's copy engine once `after` completed.");
  m.def(
      "submit_optimizer_job",
      [](py::function job) {
        auto done = std::make_shared<Event>();
        // The callable is released on the worker with the GIL held, never without it.
        auto holder = std::make_shared<py::object>(std::move(job));
        executor::optimizer_thread().submit(0, [done, holder] {
          std::exception_ptr error;
          {
            py::gil_scoped_acquire gil;
            try {
              (*holder)();
            } catch (const py::error_already_set& python_error) {
              error = capture_python_error(python_error);
            } catch (...) {
              error = std::current_exception();
            }
            *holder = py::object();
          }
          done->complete(error);
        });
        return done;
      },
      py::arg("job"),
      "Run job() on the optimizer thread (FIFO); the event re-raises its exception.");
  m.def(
      "writeback_async",
      [](std::vector<at::Tensor> dsts, std::vector<at::Tensor> srcs) {
        TORCH_CHECK(dsts.size() == srcs.size(), "writeback_async: ", dsts.size(),
                    " destinations for ", srcs.size(), " sources");
        auto done = std::make_shared<Event>();
        executor::writeback_thread().submit(
            0, [done, dsts = std::move(dsts), srcs = std::move(srcs)]() mutable {
              std::exception_ptr error;
              try {
                for (std::size_t i = 0; i < dsts.size(); ++i) dsts[i].copy_(srcs[i]);
              } catch (...) {
                error = std::current_exception();
              }
              dsts.clear();  // released before the caller can move on (see WorkQueue::submit)
              srcs.clear();
              done->complete(error);
            });
        return done;
      },
      py::arg("dsts"), py::arg("srcs"), py::call_guard<py::gil_scoped_release>(),
      "dsts[i].copy_(srcs[i]) (casting) on the weight writer, first in first out.");
  m.def(
      "drain_workers",
      [] {
        executor::drain_copy_engines();
        executor::writeback_thread().drain();
        executor::optimizer_thread().drain();
      },
      py::call_guard<py::gil_scoped_release>(),
      "Wait until every native worker ran the jobs submitted so far (called at exit).");
  m.def(
      "allocate_host_arena",
      [](std::int64_t bytes, const std::string& pin_model) {
        return memory::allocate_host_arena(bytes, memory::parse_pin_mode(pin_model));
      },
      py::arg("bytes"), py::arg("pin_model"),
      "A zeroed uint8 host tensor of exactly `bytes` bytes, pinned per `pin_model`.");
  m.def("is_page_locked", &memory::is_page_locked, py::arg("tensor"));
}

}  // namespace roundpipe::bindings
