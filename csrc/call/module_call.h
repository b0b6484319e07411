// Calling a layer (an nn.Module) the way `module(value)` does, without the two Python frames of
// nn.Module.__call__ when they would do nothing but call `module.forward(value)`.
//
// nn.Module.__call__ (`_wrapped_call_impl`, then `_call_impl`) calls `forward` directly when the
// module is not compiled (`_compiled_call_impl` is None), no tracer is running, and neither the
// module nor the process has hooks registered. ModuleCall checks exactly that, natively, and
// otherwise leaves the module to be called as Python would. A module whose class or instance
// replaces
// `__call__` or `_call_impl` is always called through them. Its two frames are about a microsecond
// per layer call, and a pipeline calls each layer twice per microbatch (forward and recompute).
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <array>

#include "torch_internals/torch_internals.h"

namespace roundpipe::call {

// Hidden, as pybind11's own types are: it holds Python objects.
class __attribute__((visibility("hidden"))) ModuleCall {
 public:
  // Looks up nn.Module's `__call__` and the process-wide hook dictionaries once (the caller holds
  // the GIL).
  ModuleCall() {
    namespace py = pybind11;
    const py::module_ module = py::module_::import("torch.nn.modules.module");
    module_call_ = module.attr("Module").attr("__call__");
    module_call_impl_ = module.attr("Module").attr("_call_impl");
    for (std::size_t i = 0; i < kGlobalHooks.size(); ++i)
      global_hooks_[i] = module.attr(kGlobalHooks[i]);
  }

  // What `module(value)` comes down to calling: the bound `module.forward` where
  // nn.Module.__call__ would only call it, else the module itself.
  pybind11::object callee(const pybind11::handle& module) const {
    if (!plain(module)) return pybind11::reinterpret_borrow<pybind11::object>(module);
    auto forward = pybind11::reinterpret_steal<pybind11::object>(
        PyObject_GetAttr(module.ptr(), forward_key_.ptr()));
    if (!forward) throw pybind11::error_already_set();
    return forward;
  }

 private:
  static constexpr std::array<const char*, 4> kGlobalHooks = {
      "_global_backward_pre_hooks", "_global_backward_hooks", "_global_forward_hooks",
      "_global_forward_pre_hooks"};

  // Whether nn.Module.__call__ would only call module.forward: nn.Module's own __call__, not
  // compiled, no tracer, and no hook of the module's or the process's.
  bool plain(const pybind11::handle& module) const {
    namespace py = pybind11;
    if (torch_internals::jit_tracing()) return false;
    // nn.Module's __call__ and _call_impl (torch._dynamo can replace a class's _call_impl).
    auto* type = reinterpret_cast<PyObject*>(Py_TYPE(module.ptr()));
    const auto call = py::reinterpret_steal<py::object>(PyObject_GetAttr(type, call_key_.ptr()));
    if (!call || !call.is(module_call_)) return fail();
    const auto call_impl =
        py::reinterpret_steal<py::object>(PyObject_GetAttr(type, call_impl_key_.ptr()));
    if (!call_impl || !call_impl.is(module_call_impl_)) return fail();
    for (const py::object& hooks : global_hooks_) {
      if (!empty_dict(hooks.ptr())) return false;
    }
    const auto dict =
        py::reinterpret_steal<py::object>(PyObject_GenericGetDict(module.ptr(), nullptr));
    if (!dict || !PyDict_Check(dict.ptr())) return fail();
    // None unless module.compile() set it (nn.Module's class attribute otherwise).
    const auto compiled =
        py::reinterpret_steal<py::object>(PyObject_GetAttr(module.ptr(), compiled_key_.ptr()));
    if (!compiled || !compiled.is_none()) return fail();
    if (PyDict_GetItemWithError(dict.ptr(), call_impl_key_.ptr()) != nullptr) return fail();
    for (const py::str& key : hook_keys_) {
      if (!empty_dict(PyDict_GetItemWithError(dict.ptr(), key.ptr()))) return fail();
    }
    return true;
  }

  static bool empty_dict(PyObject* value) {
    return value != nullptr && PyDict_Check(value) && PyDict_Size(value) == 0;
  }

  // Not plain, with no Python error left behind by the look-ups (a missing attribute or key
  // only means the module is called as Python would).
  static bool fail() {
    PyErr_Clear();
    return false;
  }

  pybind11::object module_call_, module_call_impl_;
  std::array<pybind11::object, kGlobalHooks.size()> global_hooks_;
  pybind11::str call_key_{"__call__"}, call_impl_key_{"_call_impl"}, forward_key_{"forward"},
      compiled_key_{"_compiled_call_impl"};
  std::array<pybind11::str, 4> hook_keys_{
      pybind11::str("_backward_hooks"), pybind11::str("_backward_pre_hooks"),
      pybind11::str("_forward_hooks"), pybind11::str("_forward_pre_hooks")};
};

}  // namespace roundpipe::call
