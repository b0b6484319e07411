// roundpipe._C is assembled from one registration function per runtime part (module.cpp calls
// them in order); each converts arguments and calls into its part (csrc/<part>/), and nothing
// else.
#pragma once

#include <pybind11/pybind11.h>

namespace roundpipe::bindings {

void bind_devices(pybind11::module_& m);    // device.cpp: csrc/device/
void bind_runtime(pybind11::module_& m);    // runtime.cpp: csrc/executor/, csrc/memory/
void bind_scheduler(pybind11::module_& m);  // scheduler.cpp: csrc/scheduler/
void bind_optim(pybind11::module_& m);      // optim.cpp: csrc/optim/
void bind_gradients(pybind11::module_& m);  // gradients.cpp: csrc/gradients/
void bind_call(pybind11::module_& m);       // call.cpp: csrc/call/

}  // namespace roundpipe::bindings
