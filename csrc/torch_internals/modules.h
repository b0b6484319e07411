// nn.Module's private attributes, read from C++: the native side of torch_internals.py's
// "modules" wrappers, and part of the one door to torch's private API (torch_internals.h states
// the rule). Everything here needs the GIL.
#pragma once

#include <pybind11/pybind11.h>

#include <array>

namespace roundpipe::torch_internals {

// Tells whether calling a module as `module(value)` would do nothing but call `module.forward`.
// nn.Module.__call__ (_wrapped_call_impl, then _call_impl) calls forward directly when the
// module is not compiled (_compiled_call_impl is None), no tracer is running, and neither the
// module nor the process has hooks registered; a module whose class or instance replaces __call__
// or _call_impl (torch._dynamo can replace a class's _call_impl) is never plain. What is the same
// for every module (nn.Module's own __call__ and _call_impl, the process-wide hook dictionaries,
// the attribute names) is looked up once, at construction; the module's own state at each call.
// Checked on torch 2.11, 2.12, 2.13 (nn.Module._wrapped_call_impl and _call_impl, the module's
// _compiled_call_impl and _{forward,backward}{,_pre}_hooks, torch.nn.modules.module's
// _global_{forward,backward}{,_pre}_hooks).
// Hidden, as pybind11's own types are: it holds Python objects.
class __attribute__((visibility("hidden"))) PlainCall {
 public:
  // Looks up what is the same for every module (the caller holds the GIL).
  PlainCall();

  // Whether `module(value)` would only call module.forward(value). A failed look-up only means
  // the module is called as Python would: it leaves no Python error behind.
  bool operator()(pybind11::handle module) const;

 private:
  pybind11::object module_call_, module_call_impl_;
  std::array<pybind11::object, 4> global_hooks_;
  pybind11::str call_key_, call_impl_key_, compiled_key_;
  std::array<pybind11::str, 4> hook_keys_;
};

// `module`'s own parameters by attribute name, as the mapping it keeps them in (writing to it
// rebinds one without register_parameter's checks): nn.Module._parameters. Checked on torch 2.11,
// 2.12, 2.13.
pybind11::object parameter_slots(pybind11::handle module);

}  // namespace roundpipe::torch_internals
