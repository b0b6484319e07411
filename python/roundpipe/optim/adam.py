"""Host optimizers compiled ahead of time in ``roundpipe._C``.

:class:`Adam` is a drop-in replacement for :class:`torch.optim.Adam` (and for
:class:`torch.optim.AdamW` with ``decoupled_weight_decay=True``) on CPU parameters: same
arguments, same ``state`` keys and ``state_dict`` layout (interchangeable with torch's), results
within float rounding of torch. Dense float32 parameters are updated by one native pass per
parameter group with SIMD (scalar, AVX2 or AVX-512, picked for the CPU in use;
``ROUNDPIPE_SIMD`` lowers it) on a native thread pool, with the GIL released. Every other
parameter torch's Adam takes (complex, bf16/fp16/fp64, strided, or with a strided gradient) is
updated by torch's own single-tensor Adam, so its results are torch's bit for bit.
``Adam(..., state_dtype=torch.bfloat16 | torch.int8)`` keeps the moments compact (bf16, or
block-wise 8-bit codes): 20 or 16 bytes moved per parameter and step instead of 28, 4 or 2 bytes
of host memory per parameter instead of 8. The kernels run on :func:`get_num_threads` threads.

For the RoundPipe runtime, the same pass reads low-precision gradients, unscales them
(:meth:`Adam.unscaling`, which ``roundpipe.GradScaler.step`` uses), and writes the new weights as
bf16/fp16 into the model's parameter buffers (:func:`fused_writeback`, which the step pipeline
activates around ``step_fn``). The pending gradients of RoundPipe's optimizer copies are read
straight from the model's gradient arena, never cast into ``.grad`` first. :meth:`Adam.step_fused`
offers all of it explicitly, on gradients passed in.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.optim.adam import adam as torch_adam

from roundpipe._native import _C
from roundpipe.optim import adam_state, offload
from roundpipe.optim.copies import OptimizerCopy, gradient_of
from roundpipe.torch_internals import version_of

__all__ = ["Adam", "adam", "fused_writeback", "get_num_threads", "set_num_threads"]

# One update per param group: (group, params, grads, low-precision targets).
_GroupCall = tuple[dict[str, Any], list[Tensor], list[Tensor], list["Tensor | None"]]

_warned: set[str] = set()
_writeback = threading.local()


def _warn_once(option: str) -> None:
    if option in _warned:
        return
    _warned.add(option)
    warnings.warn(
        f"roundpipe.optim.Adam ignores {option}=: it always runs its own fused multi-threaded "
        "SIMD kernel on the host",
        UserWarning,
        stacklevel=3,
    )


def get_num_threads() -> int:
    """Threads of the host optimizer's kernels (Adam's step, gradient checks and casts).

    By default the CPUs this process may run on (its CPU affinity) divided by the ranks that
    share the machine (``LOCAL_WORLD_SIZE``, which torchrun sets), at least one; not torch's
    intra-op setting, which torchrun lowers to 1 (``OMP_NUM_THREADS=1``) when it starts several
    processes per machine. ``ROUNDPIPE_OPTIMIZER_THREADS=<n>`` or :func:`set_num_threads`
    overrides it."""
    return int(_C.optimizer_threads())


def set_num_threads(num_threads: int | None) -> None:
    """Fixes the host optimizer's threads (a positive int) for this process; ``None`` returns
    to the default of :func:`get_num_threads`."""
    if num_threads is None:
        _C.set_optimizer_threads(0)
        return
    if isinstance(num_threads, bool) or not isinstance(num_threads, int):
        raise TypeError(f"num_threads must be an int or None, got {type(num_threads).__name__}")
    if num_threads < 1:
        raise ValueError(
            f"num_threads must be at least 1 (None for the default), got {num_threads}"
        )
    _C.set_optimizer_threads(num_threads)


def _as_float(value: Any, name: str) -> float:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element")
        return float(value.item())
    return float(value)


_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LOWP_DTYPES = (torch.bfloat16, torch.float16)


def _check_companion(
    tensor: Tensor, param: Tensor, name: str, dtypes: tuple[torch.dtype, ...]
) -> None:
    """Checks a tensor read or written beside ``param``, so no group is updated before an error."""
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must be {allowed}, got {tensor.dtype}")
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous CPU tensor, got {tensor.device} "
            f"(contiguous={tensor.is_contiguous()})"
        )
    if tensor.numel() != param.numel():
        raise ValueError(
            f"{name} has {tensor.numel()} elements but its parameter has {param.numel()}"
        )


def _scalar_dtype() -> torch.dtype:
    # torch.optim keeps `step` in float64 only when that is the default dtype.
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _unscaled(grad: Tensor, dtype: torch.dtype, grad_scale_inv: float) -> Tensor:
    """``grad`` in ``dtype``, multiplied by ``grad_scale_inv`` in the wider of the two dtypes and
    at least float32 (as torch's unscale kernel computes), so that neither a bf16/fp16 product
    underflows nor a scaled float32 gradient overflows in a cast to bf16/fp16 before it; for a
    gradient no wider than ``dtype``, the same bits as casting it first and unscaling that."""
    if grad_scale_inv == 1.0:
        return grad.to(dtype)
    opmath = torch.promote_types(torch.promote_types(grad.dtype, dtype), torch.float32)
    return (grad.to(opmath) * grad_scale_inv).to(dtype)


@contextmanager
def fused_writeback(targets: Mapping[Tensor, Tensor]) -> Iterator[dict[Tensor, int]]:
    """Makes :meth:`Adam.step` on this thread also write the new weights into ``targets``.

    ``targets`` maps an fp32 parameter (an optimizer master copy) to a bf16/fp16 tensor with the
    same number of elements (a view of the model's flat parameter buffer). The context yields a
    dict that receives every parameter whose low-precision copy was written, with the
    parameter's version counter right after, so the caller needs to cast back only the others
    (and those changed again since, say by a clamp after ``step()``). Contexts nest; the
    innermost one applies.
    """
    written: dict[Tensor, int] = {}
    previous = getattr(_writeback, "active", None)
    _writeback.active = (targets, written)
    try:
        yield written
    finally:
        _writeback.active = previous


class Adam(torch.optim.Optimizer):
    """Adam / AdamW on CPU parameters, with the arguments of :class:`torch.optim.Adam`.

    Dense float32 parameters take the native kernel; any other parameter torch's Adam accepts
    (complex, another floating dtype, strided) is updated by torch's own Adam code, exactly as
    ``torch.optim.Adam`` would. Parameters on another device raise ``ValueError``.
    ``foreach`` and ``fused`` are accepted for compatibility, warned about once and ignored.
    ``capturable=True`` and ``differentiable=True`` are not supported on the host (ValueError).
    ``lr`` and ``betas`` may be floats or one-element tensors (read at every step).

    ``state_dtype`` (keyword only; a group option like ``lr``, so a param group may set its
    own) is how the moments of dense float32 parameters are kept (the master weights stay
    float32): ``torch.float32`` (default: torch's state, bit for bit as before),
    ``torch.bfloat16`` (4 bytes per parameter instead of 8, stochastically rounded) or
    ``torch.int8`` (2 bytes plus one float32 scale per 256 elements: block-wise 8-bit codes,
    stochastically rounded; see :mod:`roundpipe.optim.adam_state`). Compact moments move fewer bytes
    per step (the step is memory-bound) and need ``amsgrad=False``. A group whose
    ``state_dtype`` is changed converts its moments at its next step. ``state_dict`` is what
    torch's Adam loads: bf16 moments as they are, 8-bit ones decoded into float32 values beside
    their block scales (``exp_avg_scale``, ``exp_avg_sq_scale``, which torch ignores).
    ``load_state_dict`` takes a state of any form (torch's included) and converts it into each
    group's ``state_dtype`` (this optimizer's, not the saved one's); a state saved by an
    optimizer of the same ``state_dtype`` comes back bit for bit. Parameters that torch's code
    updates keep torch's state.
    """

    # Steps the optimizer copies RoundPipe keeps on disk (optim_offload) by streaming them.
    streams_offloaded_state = True

    def __init__(
        self,
        params: Any,
        lr: float | Tensor = 1e-3,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        adam_state.check_state_dtype(state_dtype)
        if not 0.0 <= _as_float(lr, "lr"):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        for index, beta in enumerate(betas):
            if not 0.0 <= _as_float(beta, f"betas[{index}]") < 1.0:
                raise ValueError(f"Invalid beta parameter at index {index}: {beta}")
        if isinstance(betas[0], Tensor) != isinstance(betas[1], Tensor):
            raise ValueError("betas must be either both floats or both Tensors")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        for option, value in (("capturable", capturable), ("differentiable", differentiable)):
            if value:
                raise ValueError(
                    f"roundpipe.optim.Adam does not support {option}=True: it updates fp32 "
                    f"parameters on the host outside autograd; use torch.optim.Adam for that"
                )
        if foreach and fused:
            raise ValueError(
                "`fused` and `foreach` cannot be `True` together (as in torch.optim.Adam); both "
                "are ignored here: pass at most one"
            )
        for option, choice in (("foreach", foreach), ("fused", fused)):
            if choice is not None:
                _warn_once(option)
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": amsgrad,
            "maximize": maximize,
            "foreach": foreach,
            "capturable": capturable,
            "differentiable": differentiable,
            "fused": fused,
            "decoupled_weight_decay": decoupled_weight_decay,
            "state_dtype": state_dtype,
        }
        super().__init__(params, defaults)

    @property
    def state_dtype(self) -> torch.dtype:
        """The ``state_dtype`` of groups that do not set their own (the constructor's)."""
        dtype: torch.dtype = self.defaults["state_dtype"]
        return dtype

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group after checking its parameters live on the host (see torch)."""
        params = param_group["params"]
        params = [params] if isinstance(params, Tensor) else list(params)
        for item in params:
            param = item[1] if isinstance(item, tuple) else item
            if isinstance(param, Tensor) and param.device.type != "cpu":
                raise ValueError(
                    f"roundpipe.optim.Adam updates CPU parameters, got one on {param.device}; "
                    f"use torch.optim.Adam for device parameters, or for a RoundPipe model "
                    f"optimize model.optim_parameters() (host copies)"
                )
        _check_group({**self.defaults, **param_group})
        super().add_param_group({**param_group, "params": params})

    def state_dict(self) -> dict[str, Any]:
        """As torch's, in the form torch's Adam loads: 8-bit moments decoded into float32 values
        (new tensors), beside their block scales, which torch ignores and :meth:`load_state_dict`
        encodes the values against again, giving back the same codes. State-dict post hooks see
        (and may replace) that form, as they see what torch's Adam returns."""

        def export(_: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
            state_dict["state"] = {
                index: adam_state.exported(entry) if isinstance(entry, Mapping) else entry
                for index, entry in state_dict["state"].items()
            }
            return state_dict

        handle = self.register_state_dict_post_hook(export, prepend=True)
        try:
            return super().state_dict()
        finally:
            handle.remove()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, and the saved moments, in whatever form they were saved (fp32 as torch's
        Adam saves them, bf16, 8-bit codes with their scales, or :meth:`state_dict`'s decoded
        8-bit moments), are converted into each group's ``state_dtype``: this optimizer's, which
        the saved groups' do not replace. A state already in that form (or saved by
        :meth:`state_dict` from it) is taken bit for bit. Load pre hooks see the state as given
        (what they return is loaded), post hooks the loaded moments, as with torch's Adam."""
        forms = [group["state_dtype"] for group in self.param_groups]
        moment_keys = (
            *adam_state.MOMENT_KEYS,
            *adam_state.SCALE_KEYS.values(),
            adam_state.CODE_KEY,
        )
        moments: dict[Any, dict[str, Any]] = {}
        saved_ids: list[Any] = []

        def strip(_: torch.optim.Optimizer, given: dict[str, Any]) -> dict[str, Any]:
            # The last pre hook: torch would cast 8-bit codes to the parameter's dtype.
            saved = given["state"]
            moments.update(
                (index, {key: value for key, value in entry.items() if key in moment_keys})
                for index, entry in saved.items()
                if isinstance(entry, Mapping)
            )
            saved_ids.extend(index for group in given["param_groups"] for index in group["params"])
            rest = {
                index: (
                    {key: value for key, value in entry.items() if key not in moment_keys}
                    if isinstance(entry, Mapping)
                    else entry
                )
                for index, entry in saved.items()
            }
            return {**given, "state": rest}

        def convert(_: torch.optim.Optimizer) -> None:
            # The first post hook: the moments go in before any other post hook sees the state.
            for group, form in zip(self.param_groups, forms, strict=True):
                group["state_dtype"] = form
            params = [(param, group) for group in self.param_groups for param in group["params"]]
            for index, (param, group) in zip(saved_ids, params, strict=True):
                if moments.get(index):
                    form = self._form_of(param, group)
                    self.state[param].update(
                        adam_state.convert_moments(moments[index], param, form)
                    )

        handles = [
            self.register_load_state_dict_pre_hook(strip),
            self.register_load_state_dict_post_hook(convert, prepend=True),
        ]
        try:
            super().load_state_dict(state_dict)
        finally:
            for handle in handles:
                handle.remove()

    def __setstate__(self, state: dict[str, Any]) -> None:
        """As ``torch.optim.Adam.__setstate__`` (which ``load_state_dict`` runs): missing group
        options get their defaults, and a ``step`` saved as a Python number (torch < 1.12)
        becomes a tensor. A parameter's non-empty state without ``step`` (another optimizer's,
        such as SGD's momentum) raises ``KeyError: 'step'`` there, as torch's does."""
        super().__setstate__(state)
        # Pickled before state_dtype was a group option: the form its moments are in.
        for group in self.param_groups:
            group.setdefault("state_dtype", self._held_form(group))
        self.defaults.setdefault("state_dtype", self.param_groups[0]["state_dtype"])
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("capturable", False)
            group.setdefault("differentiable", False)
            group.setdefault("decoupled_weight_decay", False)
            fused = group.setdefault("fused", None)
            for param in group["params"]:
                param_state = self.state.get(param, [])
                if len(param_state) != 0 and not torch.is_tensor(param_state["step"]):
                    # torch keeps it in float32 for fused/capturable groups, which we ignore.
                    dtype = torch.float32 if fused or group["capturable"] else _scalar_dtype()
                    param_state["step"] = torch.tensor(float(param_state["step"]), dtype=dtype)

    def _held_form(self, group: Mapping[str, Any]) -> torch.dtype:
        """The form the moments of ``group``'s dense float32 parameters are in (float32 where
        none has moments yet)."""
        for param in group["params"]:
            exp_avg = self.state.get(param, {}).get("exp_avg")
            if self._takes_compact(param) and isinstance(exp_avg, Tensor):
                return torch.int8 if exp_avg.dtype == torch.int8 else exp_avg.dtype
        return torch.float32

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Performs one optimization step (``closure`` re-evaluates the loss, as in torch)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step(None, getattr(self, "_grad_scale_inv", 1.0), None, check_finite=False)
        return loss

    @contextmanager
    def unscaling(self, grad_scale_inv: float) -> Iterator[None]:
        """Within the context, :meth:`step` multiplies every gradient by ``grad_scale_inv`` as
        it reads it (the gradients themselves are left scaled). ``GradScaler.step`` uses it so
        that unscaling costs no pass of its own; the result is bit-identical to unscaling the
        fp32 gradients first."""
        previous = getattr(self, "_grad_scale_inv", 1.0)
        self._grad_scale_inv = float(grad_scale_inv)
        try:
            yield
        finally:
            self._grad_scale_inv = previous

    @torch.no_grad()
    def step_fused(
        self,
        grads: Sequence[Tensor | None] | None = None,
        *,
        grad_scale_inv: float = 1.0,
        lowp_params: Sequence[Tensor | None] | None = None,
        check_finite: bool = True,
    ) -> bool:
        """One step that unscales and checks the gradients and may write low-precision weights.

        Args:
            grads: one gradient (fp32, bf16 or fp16, same number of elements) or ``None`` per
                parameter, in ``param_groups`` order; ``None`` for the list means each
                parameter's own gradient (a RoundPipe optimizer copy's pending gradient is read
                as it is, without casting it into ``.grad``). A parameter whose gradient is
                ``None`` is skipped, as in :meth:`step`.
            grad_scale_inv: every gradient is multiplied by it as it is read (a GradScaler's
                ``1 / scale``); the result is bit-identical to unscaling an fp32 copy first.
                The gradients themselves are left as they are (still scaled).
            lowp_params: one bf16/fp16 tensor (or ``None``) per parameter that receives the
                updated weight in the same pass, bit-identical to ``param.to(dtype)``. ``None``
                means the targets of an active :func:`fused_writeback`, if any.
            check_finite: when true, first check every gradient for inf/NaN (a read-only
                pass) and skip the whole step if one is found.

        Returns:
            ``False`` if the step was skipped because a gradient was not finite, else ``True``.
        """
        params = [p for group in self.param_groups for p in group["params"]]
        for name, values in (("grads", grads), ("lowp_params", lowp_params)):
            if values is not None and len(values) != len(params):
                raise ValueError(
                    f"{name} has {len(values)} entries but the optimizer has {len(params)} "
                    f"parameters; pass one (or None) per parameter in param_groups order"
                )
        return self._step(grads, grad_scale_inv, lowp_params, check_finite)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's; pending gradients of RoundPipe optimizer copies are dropped uncast."""
        if set_to_none:
            for group in self.param_groups:
                for param in group["params"]:
                    if isinstance(param, OptimizerCopy):
                        param.drop_grad()
        super().zero_grad(set_to_none)

    def _step(
        self,
        grads: Sequence[Tensor | None] | None,
        grad_scale_inv: float,
        lowp_params: Sequence[Tensor | None] | None,
        check_finite: bool,
    ) -> bool:
        written: dict[Tensor, int] | None = None
        active = getattr(_writeback, "active", None)
        if lowp_params is None and active is not None:
            targets, written = active
            lowp_params = [targets.get(p) for group in self.param_groups for p in group["params"]]
        native, other = self._collect(grads, lowp_params)
        if check_finite and not self._all_finite(native, other):
            return False
        for group, params, group_grads, lowp in native:
            self._update_group(group, params, group_grads, grad_scale_inv, lowp)
        for group, params, group_grads, lowp in other:
            self._update_with_torch(group, params, group_grads, grad_scale_inv, lowp)
        if written is not None:
            for _, params, _, group_lowp in native + other:
                written.update(
                    (p, version_of(p))
                    for p, t in zip(params, group_lowp, strict=True)
                    if t is not None
                )
        return True

    @staticmethod
    def _all_finite(native: list[_GroupCall], other: list[_GroupCall]) -> bool:
        present = [grad for _, _, group_grads, _ in native for grad in group_grads]
        if not _C.all_finite(present):
            return False
        others = [grad for _, _, group_grads, _ in other for grad in group_grads]
        return all(bool(torch.isfinite(grad).all()) for grad in others)

    def _collect(
        self,
        grads: Sequence[Tensor | None] | None,
        lowp_params: Sequence[Tensor | None] | None,
    ) -> tuple[list[_GroupCall], list[_GroupCall]]:
        """Pairs every parameter that has a gradient with its inputs, validating all of them
        before any group is updated. Returns the native kernel's calls and the others'."""
        native: list[_GroupCall] = []
        other: list[_GroupCall] = []
        index = 0
        for group in self.param_groups:
            _check_group(group)
            split: dict[bool, _GroupCall] = {fast: (group, [], [], []) for fast in (True, False)}
            for param in group["params"]:
                grad = gradient_of(param) if grads is None else grads[index]
                target = None if lowp_params is None else lowp_params[index]
                index += 1
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise RuntimeError(
                        "Adam does not support sparse gradients, please consider SparseAdam instead"
                    )
                name = f"the gradient of parameter {index - 1}"
                if grads is not None:
                    # Gradients handed to step_fused are read as they lie in memory.
                    _check_companion(grad, param, name, _GRAD_DTYPES)
                elif grad.numel() != param.numel():
                    raise ValueError(
                        f"{name} has {grad.numel()} elements but its parameter has {param.numel()}"
                    )
                if target is not None:
                    _check_companion(target, param, f"lowp_params[{index - 1}]", _LOWP_DTYPES)
                if group["amsgrad"] and offload.store_of(param) is not None:
                    raise ValueError(
                        "amsgrad=True is not supported on optimizer copies kept on disk "
                        "(RoundPipe's optim_offload): drop amsgrad or optim_offload"
                    )
                form = self._form_of(param, group)
                self._convert_state(param, form)
                fits = self._native_fits(param, grad, form)
                if not fits and form != torch.float32:
                    # Compact moments have no torch path: the kernel reads a dense fp32 copy.
                    grad = grad.to(torch.float32).contiguous()
                    fits = self._native_fits(param, grad, form)
                _, params, group_grads, lowp = split[fits]
                params.append(param)
                group_grads.append(grad)
                lowp.append(target)
            if split[True][1]:
                native.append(split[True])
            if split[False][1]:
                other.append(split[False])
        return native, other

    def _native_fits(self, param: Tensor, grad: Tensor, form: torch.dtype) -> bool:
        """Whether the native kernel, which works on dense fp32 memory in place, takes
        ``param``: else torch's own Adam updates it."""
        dense = (
            param.dtype == torch.float32
            and param.is_contiguous()
            and grad.dtype in _GRAD_DTYPES
            and grad.device.type == "cpu"
            and grad.is_contiguous()
        )
        state = self.state.get(param, {})
        max_sq = state.get("max_exp_avg_sq")
        return (
            dense
            and adam_state.in_form(state, param, form)
            and (max_sq is None or (max_sq.dtype == torch.float32 and max_sq.is_contiguous()))
        )

    @staticmethod
    def _takes_compact(param: Tensor) -> bool:
        """Whether ``param``'s moments are kept in its group's ``state_dtype`` (else in torch's
        form): the native kernel's dense float32 host parameters."""
        return param.dtype == torch.float32 and param.is_contiguous() and param.device.type == "cpu"

    def _form_of(self, param: Tensor, group: Mapping[str, Any]) -> torch.dtype:
        """The form of ``param``'s moments: its group's ``state_dtype``, or torch's (float32
        for a float32 parameter) for parameters that torch's code updates."""
        return group["state_dtype"] if self._takes_compact(param) else torch.float32

    def _convert_state(self, param: Tensor, form: torch.dtype) -> None:
        """Converts ``param``'s moments into ``form`` where they are in another one (its group's
        ``state_dtype`` was changed, or an optimizer pickled before it was a group option)."""
        state = self.state.get(param)
        if not state or not self._takes_compact(param) or adam_state.in_form(state, param, form):
            return
        converted = adam_state.convert_moments(state, param, form)
        for key in (*adam_state.SCALE_KEYS.values(), adam_state.CODE_KEY):
            state.pop(key, None)
        state.update(converted)

    def _state_of(self, param: Tensor, group: Mapping[str, Any]) -> dict[str, Any]:
        """``param``'s state, created as torch's Adam creates it on first use (the moments in
        its group's ``state_dtype`` where the native kernel updates ``param``)."""
        state: dict[str, Any] = self.state[param]
        amsgrad = bool(group["amsgrad"])
        if len(state) == 0:
            store = offload.store_of(param)
            form = self._form_of(param, group)
            # The moments first: a failure (the offload folder's file cannot be created) leaves
            # no state, not a lone step that later steps would take as a state without moments.
            if store is None:
                moments = adam_state.fresh_moments(param, form)
            else:
                moments = store.fresh_moments(param, form, self)
            state["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
            state.update(moments)
            if amsgrad:
                state["max_exp_avg_sq"] = torch.zeros_like(
                    param, memory_format=torch.preserve_format
                )
        return state

    def _update_with_torch(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        grad_scale_inv: float,
        lowp: list[Tensor | None],
    ) -> None:
        """torch's single-tensor Adam (what torch.optim.Adam runs on CPU) on the parameters the
        native kernel does not take, so their results are torch's bit for bit."""
        amsgrad = bool(group["amsgrad"])
        states = [self._state_of(param, group) for param in params]
        # Unscaled as GradScaler.unscale_ unscales .grad (in the parameter's dtype, computed in
        # at least float32), leaving the gradients themselves as they are.
        ready = [
            _unscaled(grad, param.dtype, grad_scale_inv)
            for param, grad in zip(params, grads, strict=True)
        ]
        beta1, beta2 = group["betas"]
        torch_adam(
            params,
            ready,
            [state["exp_avg"] for state in states],
            [state["exp_avg_sq"] for state in states],
            [state["max_exp_avg_sq"] for state in states] if amsgrad else [],
            [state["step"] for state in states],
            foreach=False,
            capturable=False,
            differentiable=False,
            fused=False,
            has_complex=any(torch.is_complex(param) for param in params),
            decoupled_weight_decay=bool(group["decoupled_weight_decay"]),
            amsgrad=amsgrad,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=bool(group["maximize"]),
        )
        for param, target in zip(params, lowp, strict=True):
            if target is not None:
                target.copy_(param.reshape(target.shape))

    def _update_group(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        grad_scale_inv: float,
        lowp: list[Tensor | None],
    ) -> None:
        params, grads, lowp = self._update_offloaded(group, params, grads, grad_scale_inv, lowp)
        if not params:
            return
        exp_avgs: list[Tensor] = []
        exp_avg_sqs: list[Tensor] = []
        max_exp_avg_sqs: list[Tensor] = []
        steps: list[Tensor] = []
        scales: dict[str, list[Tensor]] = {key: [] for key in adam_state.SCALE_KEYS.values()}
        for param in params:
            state = self._state_of(param, group)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            if group["amsgrad"]:
                max_exp_avg_sqs.append(state["max_exp_avg_sq"])
            steps.append(state["step"])
            if group["state_dtype"] == torch.int8:
                for key in scales:
                    scales[key].append(state[key])
        beta1, beta2 = group["betas"]
        _C.adam_step(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs if group["amsgrad"] else None,
            steps,
            lr=_as_float(group["lr"], "lr"),
            beta1=_as_float(beta1, "betas[0]"),
            beta2=_as_float(beta2, "betas[1]"),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            amsgrad=bool(group["amsgrad"]),
            maximize=bool(group["maximize"]),
            decoupled_weight_decay=bool(group["decoupled_weight_decay"]),
            grad_scale_inv=float(grad_scale_inv),
            lowp_params=lowp if any(t is not None for t in lowp) else None,
            exp_avg_scales=scales["exp_avg_scale"] or None,
            exp_avg_sq_scales=scales["exp_avg_sq_scale"] or None,
        )

    def _update_offloaded(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        grad_scale_inv: float,
        lowp: list[Tensor | None],
    ) -> tuple[list[Tensor], list[Tensor], list[Tensor | None]]:
        """Streams the step of the parameters kept on disk (RoundPipe's optim_offload), store by
        store; returns the others."""
        rest: tuple[list[Tensor], list[Tensor], list[Tensor | None]] = ([], [], [])
        by_store: dict[int, tuple[offload.OffloadStore, list[int]]] = {}
        for k, param in enumerate(params):
            store = offload.store_of(param)
            if store is None:
                rest[0].append(param)
                rest[1].append(grads[k])
                rest[2].append(lowp[k])
            else:
                by_store.setdefault(id(store), (store, []))[1].append(k)
        beta1, beta2 = group["betas"]
        hyper = {
            "lr": _as_float(group["lr"], "lr"),
            "beta1": _as_float(beta1, "betas[0]"),
            "beta2": _as_float(beta2, "betas[1]"),
            "eps": float(group["eps"]),
            "weight_decay": float(group["weight_decay"]),
            "maximize": bool(group["maximize"]),
            "decoupled_weight_decay": bool(group["decoupled_weight_decay"]),
        }
        for store, indices in by_store.values():
            store.adam_step(
                group,
                [params[k] for k in indices],
                [grads[k] for k in indices],
                [self._state_of(params[k], group) for k in indices],
                [lowp[k] for k in indices],
                grad_scale_inv,
                hyper,
                self,
            )
        return rest


def _check_group(group: Mapping[str, Any]) -> None:
    """Checks a param group's ``state_dtype`` and that ``amsgrad`` goes with it."""
    state_dtype = adam_state.check_state_dtype(group["state_dtype"])
    if group["amsgrad"] and state_dtype != torch.float32:
        raise ValueError(
            f"amsgrad=True needs state_dtype=torch.float32 (its running maximum is kept in fp32), "
            f"got state_dtype={state_dtype}; drop amsgrad or the compact state"
        )


def _native_takes(
    param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, max_sq: Tensor | None
) -> bool:
    """Whether the native kernel updates this functional call's tensor (else torch's code)."""
    dense = [param, grad, exp_avg, exp_avg_sq, *([] if max_sq is None else [max_sq])]
    return (
        param.dtype == torch.float32
        and grad.dtype in _GRAD_DTYPES
        and exp_avg.dtype in (torch.float32, torch.bfloat16)
        and exp_avg_sq.dtype == exp_avg.dtype
        and (max_sq is None or (max_sq.dtype == exp_avg.dtype == torch.float32))
        and all(t.device.type == "cpu" and t.is_contiguous() for t in dense)
        and all(t.numel() == param.numel() for t in dense)
    )


def adam(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor],
    state_steps: list[Tensor],
    foreach: bool | None = None,
    capturable: bool = False,
    differentiable: bool = False,
    fused: bool | None = None,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    has_complex: bool = False,
    decoupled_weight_decay: bool = False,
    *,
    amsgrad: bool,
    beta1: float | Tensor,
    beta2: float | Tensor,
    lr: float | Tensor,
    weight_decay: float,
    eps: float,
    maximize: bool,
) -> None:
    """Functional Adam, as :func:`torch.optim.adam.adam`: one step over the given tensors, in
    place, each ``state_steps`` tensor incremented (see :class:`Adam` for the algorithm).

    Tensors that :class:`Adam` updates natively (a contiguous float32 CPU parameter; its
    gradient float32, bf16 or fp16; ``exp_avgs``/``exp_avg_sqs`` float32, or bf16 for a compact
    state, stochastically rounded; ``max_exp_avg_sqs`` float32) take the same native kernel, in
    one multi-threaded pass; any other tensors torch's Adam accepts are updated by torch's own
    single-tensor Adam, bit for bit as torch. ``foreach`` and ``fused`` are accepted for
    compatibility, warned about once and ignored; ``has_complex`` is inferred.

    Raises:
        ValueError: ``capturable=True`` or ``differentiable=True`` (not supported on the host),
            ``grad_scale`` or ``found_inf`` given (unscale the gradients first, or use
            :meth:`Adam.step_fused`), ``max_exp_avg_sqs`` missing with ``amsgrad``, or lists
            of different lengths.
    """
    for option, value in (("capturable", capturable), ("differentiable", differentiable)):
        if value:
            raise ValueError(
                f"roundpipe.optim.adam.adam does not support {option}=True: it updates "
                f"parameters on the host outside autograd; use torch.optim.adam.adam for that"
            )
    for name, tensor in (("grad_scale", grad_scale), ("found_inf", found_inf)):
        if tensor is not None:
            raise ValueError(
                f"roundpipe.optim.adam.adam does not take {name}: unscale the gradients first "
                f"(GradScaler.unscale_), or use roundpipe.optim.Adam.step_fused(grad_scale_inv=...)"
            )
    for option, choice in (("foreach", foreach), ("fused", fused)):
        if choice is not None:
            _warn_once(option)
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    lists["state_steps"] = state_steps
    if amsgrad:
        lists["max_exp_avg_sqs"] = max_exp_avg_sqs
    for name, values in lists.items():
        if len(values) != len(params):
            raise ValueError(
                f"{name} has {len(values)} tensors but params has {len(params)}; pass one per "
                f"parameter{' (max_exp_avg_sqs is needed with amsgrad=True)' if amsgrad else ''}"
            )
    if not all(isinstance(step, Tensor) for step in state_steps):
        raise RuntimeError(
            "API has changed, `state_steps` argument must contain a list of singleton tensors"
        )
    native: list[int] = []
    other: list[int] = []
    for k, param in enumerate(params):
        max_sq = max_exp_avg_sqs[k] if amsgrad else None
        step = state_steps[k]
        takes = _native_takes(param, grads[k], exp_avgs[k], exp_avg_sqs[k], max_sq) and (
            step.device.type == "cpu"
            and step.numel() == 1
            and step.dtype in (torch.float32, torch.float64)
        )
        (native if takes else other).append(k)
    if native:
        _C.adam_step(
            [params[k] for k in native],
            [grads[k] for k in native],
            [exp_avgs[k] for k in native],
            [exp_avg_sqs[k] for k in native],
            [max_exp_avg_sqs[k] for k in native] if amsgrad else None,
            [state_steps[k] for k in native],
            lr=_as_float(lr, "lr"),
            beta1=_as_float(beta1, "beta1"),
            beta2=_as_float(beta2, "beta2"),
            eps=float(eps),
            weight_decay=float(weight_decay),
            amsgrad=bool(amsgrad),
            maximize=bool(maximize),
            decoupled_weight_decay=bool(decoupled_weight_decay),
        )
    if other:
        torch_adam(
            [params[k] for k in other],
            [grads[k] for k in other],
            [exp_avgs[k] for k in other],
            [exp_avg_sqs[k] for k in other],
            [max_exp_avg_sqs[k] for k in other] if amsgrad else [],
            [state_steps[k] for k in other],
            foreach=False,
            capturable=False,
            differentiable=False,
            fused=False,
            has_complex=any(torch.is_complex(params[k]) for k in other),
            decoupled_weight_decay=decoupled_weight_decay,
            amsgrad=amsgrad,
            beta1=beta1,
            beta2=beta2,
            lr=lr,
            weight_decay=weight_decay,
            eps=eps,
            maximize=maximize,
        )
