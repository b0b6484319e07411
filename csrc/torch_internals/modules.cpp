#include "torch_internals/modules.h"

#include "torch_internals/torch_internals.h"

namespace py = pybind11;

namespace roundpipe::torch_internals {
namespace {

bool empty_dict(PyObject* value) {
  return value != nullptr && PyDict_Check(value) && PyDict_Size(value) == 0;
}

// Not plain, with no Python error left behind by the look-ups (a missing attribute or key only
// means the module is called as Python would).
bool fail() {
  PyErr_Clear();
  return false;
}

}  // namespace

PlainCall::PlainCall()
    : call_key_("__call__"),
      call_impl_key_("_call_impl"),
      compiled_key_("_compiled_call_impl"),
      hook_keys_{py::str("_backward_hooks"), py::str("_backward_pre_hooks"),
                 py::str("_forward_hooks"), py::str("_forward_pre_hooks")} {
  const py::module_ module = py::module_::import("torch.nn.modules.module");
  module_call_ = module.attr("Module").attr(call_key_);
  module_call_impl_ = module.attr("Module").attr(call_impl_key_);
  const std::array<const char*, 4> global_hooks = {
      "_global_backward_pre_hooks", "_global_backward_hooks", "_global_forward_hooks",
      "_global_forward_pre_hooks"};
  for (std::size_t i = 0; i < global_hooks.size(); ++i)
    global_hooks_[i] = module.attr(global_hooks[i]);
}

bool PlainCall::operator()(py::handle module) const {
  if (jit_tracing()) return false;
  // nn.Module's __call__ and _call_impl.
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

py::object parameter_slots(py::handle module) {
  // Never destroyed: a Python object must not outlive the interpreter's finalization.
  static const auto* key = new py::str("_parameters");
  return module.attr(*key);
}

}  // namespace roundpipe::torch_internals
