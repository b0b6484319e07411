// Calling a layer (an nn.Module) the way `module(value)` does, without the two Python frames of
// nn.Module.__call__ when they would do nothing but call `module.forward(value)`
// (torch_internals::PlainCall tells when). Those two frames are about a microsecond per layer
// call, and a pipeline calls each layer twice per microbatch (forward and recompute).
#pragma once

#include <pybind11/pybind11.h>

#include "torch_internals/modules.h"

namespace roundpipe::call {

// Hidden, as pybind11's own types are: it holds Python objects.
class __attribute__((visibility("hidden"))) ModuleCall {
 public:
  // What `module(value)` comes down to calling: the bound `module.forward` where
  // nn.Module.__call__ would only call it, else the module itself.
  pybind11::object callee(const pybind11::handle& module) const {
    if (!plain_(module)) return pybind11::reinterpret_borrow<pybind11::object>(module);
    auto forward = pybind11::reinterpret_steal<pybind11::object>(
        PyObject_GetAttr(module.ptr(), forward_key_.ptr()));
    if (!forward) throw pybind11::error_already_set();
    return forward;
  }

 private:
  torch_internals::PlainCall plain_;
  pybind11::str forward_key_{"forward"};
};

}  // namespace roundpipe::call
