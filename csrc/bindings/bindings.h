// roundpipe._C is assembled from one registration function per runtime part; each lives in its
// own file under csrc/bindings/ so that heavy torch headers stay out of the light parts.
#pragma once

#include <pybind11/pybind11.h>

namespace roundpipe::bindings {

void bind_devices(pybind11::module_& m);
void bind_runtime(pybind11::module_& m);
void bind_planner(pybind11::module_& m);
void bind_optim(pybind11::module_& m);
void bind_stage_io(pybind11::module_& m);
void bind_typed_views(pybind11::module_& m);
void bind_transfers(pybind11::module_& m);
void bind_call_state(pybind11::module_& m);
void bind_layer_loop(pybind11::module_& m);
void bind_backward(pybind11::module_& m);

}  // namespace roundpipe::bindings
