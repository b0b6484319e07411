"""Loss scaling for fp16 training with an asynchronous optimizer.

Same interface as ``torch.amp.GradScaler``, made thread-aware for RoundPipe's pipeline: with
staleness 1 the main thread already scales iteration ``i + 1``'s losses while the optimizer thread
unscales iteration ``i``'s gradients. Each iteration's scale is fixed at its first ``scale()`` call
and remembered, and ``unscale_``/``step`` on the optimizer thread use the scale of the iteration
whose gradients they hold, so the two always match. Steps whose gradients hold inf/NaN are
skipped and the scale backs off; ``growth_interval`` clean steps in a row grow it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeVar

import torch

from roundpipe._native import _C
from roundpipe.distributed import any_rank
from roundpipe.optim.adam import Adam
from roundpipe.optim.copies import grad_dtype, gradient_of
from roundpipe.optim.step_thread import (
    current_iteration,
    drain_optimizer_thread,
    in_step_job,
    raise_detached_errors,
    restored_iteration,
    settled_iteration,
    submit_detached,
    wait_optimizer_thread,
)
from roundpipe.torch_internals import tree_leaves, tree_map

_T = TypeVar("_T")


def _positive(name: str, value: Any, above_one: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if value <= (1.0 if above_one else 0.0):
        bound = "> 1" if above_one else "> 0"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return float(value)


_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _all_finite(grads: list[torch.Tensor]) -> bool:
    """One native multi-threaded pass for the usual dtypes, torch for the rest."""
    native = [g for g in grads if g.dtype in _NATIVE_DTYPES and g.is_contiguous()]
    others = [g for g in grads if not (g.dtype in _NATIVE_DTYPES and g.is_contiguous())]
    if native and not _C.all_finite(native):
        return False
    return all(bool(torch.isfinite(g).all()) for g in others)


def _scalar(value: Any) -> Any:
    """``value``, or the number in a one-element floating tensor without grad."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.numel() != 1 or not value.is_floating_point() or value.requires_grad:
        raise ValueError(
            "new_scale as a tensor must have one floating-point element and no grad, got "
            f"shape {tuple(value.shape)}, dtype {value.dtype}, requires_grad={value.requires_grad}"
        )
    return float(value.item())


class GradScaler:
    """Dynamic loss scaling whose scales stay consistent under the staleness-1 pipeline.

    Typical use::

        loss_fn = lambda out, y: scaler.scale(criterion(out, y))
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        model.step(lambda: (scaler.step(optimizer), scaler.update(), optimizer.zero_grad()))
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
        self._scale = _float32(_positive("init_scale", init_scale))
        self._growth_factor = _positive("growth_factor", growth_factor, above_one=True)
        backoff_factor = _positive("backoff_factor", backoff_factor)
        if backoff_factor >= 1.0:
            raise ValueError(f"backoff_factor must be < 1, got {backoff_factor}")
        self._backoff_factor = backoff_factor
        self._growth_interval = self._check_interval(growth_interval)
        self._enabled = enabled
        self._growth_tracker = 0
        self._lock = threading.Lock()
        self._iteration_scales: dict[int, float] = {}
        # The scale new iterations use: `_settled_scale` after every update of a step the
        # program has waited for; `_updates` holds (step iteration, scale after it) of the others.
        # So an iteration's scale never depends on whether an asynchronous step (and its update)
        # happened to finish before the iteration's first scale() call.
        self._settled_scale = self._scale
        self._updates: list[tuple[float, float]] = []
        self._unscaled: dict[int, bool] = {}  # id(optimizer) -> found inf/NaN
        self._stepped: set[int] = set()  # id(optimizer) of the steps since update()

    @staticmethod
    def _check_interval(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"growth_interval must be a positive int, got {value!r}")
        return value

    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def enabled(self) -> bool:
        """Whether scaling is on (roundpipe 0.1.1's read-only attribute; ``is_enabled()``)."""
        return self._enabled

    # -- main thread ---------------------------------------------------------------------------

    def scale(self, outputs: Any) -> Any:
        """Multiply ``outputs`` (a tensor or any pytree of tensors) by this iteration's scale.

        As ``torch.amp.GradScaler.scale``, each tensor is multiplied by the scale held as a
        0-dim float32 tensor, so type promotion is torch's: a 0-dim fp16/bf16 loss gives a
        float32 product (no fp16 overflow), an n-dim one keeps its dtype. A leaf that is not a
        tensor (``scale(1.0)``) raises ``ValueError`` before the iteration's scale is fixed."""
        if not self._enabled:
            return outputs
        leaves = tree_leaves(outputs, is_leaf=lambda leaf: leaf is None)
        if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
            raise ValueError("outputs must be a Tensor or an iterable of Tensors")
        with self._lock:
            scale = self._iteration_scales.setdefault(current_iteration(), self._usable_scale())
        # On the host, whatever the outputs' device: a CPU 0-dim tensor enters a device
        # kernel as a scalar, promoted as torch's device-resident scale tensor.
        factor = torch.tensor(scale, dtype=torch.float32)
        return tree_map(lambda t: t * factor, outputs)

    def _usable_scale(self) -> float:
        """The scale a new iteration takes now: after the updates of the settled steps (the
        lock held)."""
        settled = settled_iteration()
        while self._updates and self._updates[0][0] <= settled:
            self._settled_scale = self._updates.pop(0)[1]
        return self._settled_scale

    # -- optimizer thread ----------------------------------------------------------------------

    def _scale_of_gradients(self) -> float:
        """The scale the gradients now being stepped were produced with."""
        iteration = current_iteration()
        with self._lock:
            used = [i for i in self._iteration_scales if i <= iteration]
            return self._iteration_scales[max(used)] if used else self._scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients of ``optimizer``'s parameters by their scale, in place, and note
        whether any is inf/NaN. At most once per optimizer between ``update()`` calls.

        As ``torch.amp.GradScaler``, fp16 gradients are refused (``ValueError``, nothing
        unscaled): unscaled in fp16 the small ones would underflow. Keep fp32 optimizer copies
        (``optim_dtype=torch.float32``) for an fp16 model."""
        if not self._enabled:
            return
        self._settle_outside_step_fn()
        if id(optimizer) in self._unscaled:
            raise RuntimeError("unscale_() was already called on this optimizer since update()")
        inverse = 1.0 / self._scale_of_gradients()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads = [grad for grad in (p.grad for p in params) if grad is not None]
        _refuse_fp16([grad.dtype for grad in grads])
        with torch.no_grad():
            for grad in grads:
                grad.mul_(inverse)
        # With data parallelism each rank holds a shard: all skip if any shard overflowed.
        self._unscaled[id(optimizer)] = any_rank(not _all_finite(grads))

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step(*args, **kwargs)`` on unscaled gradients, skipped on inf/NaN.

        With :class:`roundpipe.optim.Adam` the gradients are unscaled inside its update pass,
        after a read-only inf/NaN check, as torch's fused optimizers do: ``.grad`` then stays
        scaled. Call :meth:`unscale_` first to get unscaled ``.grad``. fp16 gradients raise
        ``ValueError`` as in :meth:`unscale_`."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:  # as torch.amp.GradScaler: its loss would not be scaled
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        self._settle_outside_step_fn()
        if id(optimizer) in self._stepped:  # as torch: the same gradients stepped twice
            raise RuntimeError("step() has already been called since the last update().")
        result = self._step(optimizer, *args, **kwargs)
        self._stepped.add(id(optimizer))  # as torch, once the step ran (not after an error)
        return result

    def _step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if isinstance(optimizer, Adam) and id(optimizer) not in self._unscaled:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            grads = [gradient_of(p) for p in params]
            # What unscale_ would refuse, judged by the dtype .grad has (a pending gradient
            # becomes one of its copy's dtype).
            _refuse_fp16([dtype for dtype in map(grad_dtype, params) if dtype is not None])
            _check_some_gradient(grads)
            found_inf = any_rank(not _all_finite([g for g in grads if g is not None]))
            self._unscaled[id(optimizer)] = found_inf
            if found_inf:
                return None
            with optimizer.unscaling(1.0 / self._scale_of_gradients()):
                return optimizer.step(*args, **kwargs)
        if id(optimizer) not in self._unscaled:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            _check_some_gradient([p.grad for p in params])
            self.unscale_(optimizer)
        if self._unscaled[id(optimizer)]:
            return None
        return optimizer.step(*args, **kwargs)

    def _settle_outside_step_fn(self) -> None:
        """Called on the main thread (a plain module's training loop, not ``step_fn``), a step
        follows the updates queued before it: their inf checks are cleared first."""
        if not in_step_job():
            drain_optimizer_thread()

    def update(self, new_scale: float | torch.Tensor | None = None, is_async: bool = True) -> None:
        """Adjust the scale for later iterations: back off after inf/NaN, grow after
        ``growth_interval`` clean steps, or set ``new_scale`` (a number, or a one-element
        floating tensor without grad, read now as ``torch.amp.GradScaler`` does).

        Inside ``step_fn`` it applies at once. Called elsewhere, ``is_async=True`` queues it on
        the optimizer thread behind the steps already submitted (an error it raises there is
        raised by the next ``step()``, ``synchronize()``, forward or getter of this class);
        ``is_async=False`` waits for them and applies now."""
        if not self._enabled:
            return
        scale = None if new_scale is None else _positive("new_scale", _scalar(new_scale))
        iteration = current_iteration()
        if in_step_job():
            self._update(scale, iteration, iteration)
        else:
            # Outside step_fn an update belongs to the step submitted last.
            step = iteration - 1
            if is_async:
                submit_detached(lambda: self._update(scale, iteration, step))
            else:
                drain_optimizer_thread()
                self._update(scale, iteration, step)

    def _update(self, new_scale: float | None, iteration: int, step: float) -> None:
        if new_scale is None and not self._unscaled:
            # torch.amp.GradScaler's own check: a step_fn that calls optimizer.step() instead
            # of scaler.step(optimizer) would otherwise train on scaled gradients unnoticed.
            raise AssertionError("No inf checks were recorded prior to update.")
        found_inf = any(self._unscaled.values())
        with self._lock:
            # In float32 as torch.amp.GradScaler keeps it (a growth that overflows is skipped).
            if new_scale is not None:
                self._scale = _float32(new_scale)
            elif found_inf:
                self._scale = _float32(self._scale * self._backoff_factor)
                self._growth_tracker = 0
            else:
                self._growth_tracker += 1
                if self._growth_tracker == self._growth_interval:
                    grown = _float32(self._scale * self._growth_factor)
                    if math.isfinite(grown):
                        self._scale = grown
                    self._growth_tracker = 0
            self._unscaled.clear()
            self._stepped.clear()
            self._updates.append((step, self._scale))
            # Scales of earlier iterations are no longer needed: their steps have run.
            for done in [i for i in self._iteration_scales if i < iteration]:
                del self._iteration_scales[done]

    # -- getters and setters -------------------------------------------------------------------

    def _read(self, value: Callable[[], _T], up_to_date: bool) -> _T:
        """``value()``, after the queued steps and updates with ``up_to_date``; raises the error
        of an asynchronous update that failed."""
        if up_to_date:
            drain_optimizer_thread()
        else:
            raise_detached_errors()
        return value()

    def get_scale(self, up_to_date: bool = False) -> float:
        """The current scale; ``up_to_date=True`` first waits for queued steps and updates."""
        return self._read(lambda: self._scale if self._enabled else 1.0, up_to_date)

    def get_growth_factor(self, up_to_date: bool = False) -> float:
        return self._read(lambda: self._growth_factor, up_to_date)

    def set_growth_factor(self, new_factor: float) -> None:
        self._growth_factor = _positive("new_factor", new_factor, above_one=True)

    def get_backoff_factor(self, up_to_date: bool = False) -> float:
        return self._read(lambda: self._backoff_factor, up_to_date)

    def set_backoff_factor(self, new_factor: float) -> None:
        factor = _positive("new_factor", new_factor)
        if factor >= 1.0:
            raise ValueError(f"new_factor must be < 1, got {factor}")
        self._backoff_factor = factor

    def get_growth_interval(self, up_to_date: bool = False) -> int:
        return self._read(lambda: self._growth_interval, up_to_date)

    def set_growth_interval(self, new_interval: int) -> None:
        self._growth_interval = self._check_interval(new_interval)

    def state_dict(self) -> dict[str, Any]:
        """Scale and growth state after the queued steps and updates (waited for, raising the
        error of an update that failed). Saving settles nothing (see ``RoundPipe.state_dict``):
        ``_iteration_scale`` is the scale a new iteration takes now, which lags behind ``scale``
        while a step is in flight, and ``_current_scale`` the one the iteration in progress
        fixed (its gradients may be in the checkpoint), if any."""
        wait_optimizer_thread()
        if not self._enabled:
            return {}
        with self._lock:
            usable = self._usable_scale()
            current = self._iteration_scales.get(current_iteration())
        state = {
            "scale": self._scale,
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._growth_tracker,
            "_iteration_scale": usable,
        }
        if current is not None:
            state["_current_scale"] = current
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a ``state_dict()`` (of this class or of ``torch.amp.GradScaler``), checked
        before anything changes. The resumed run's iterations take the scales the saving run's
        took: ``_iteration_scale`` until the loaded model's pending write-back is applied (its
        first ``step()``), ``scale`` after it, and the iteration in progress ``_current_scale``.

        Raises (a disabled scaler ignores ``state_dict``, as torch's does):
            RuntimeError: ``state_dict`` is empty (saved by a disabled scaler), as torch's.
            KeyError / TypeError / ValueError: an entry is missing or invalid."""
        if not self._enabled:
            return
        loaded = self._checked_state(state_dict)
        drain_optimizer_thread()
        with self._lock:
            self._scale, self._growth_tracker = loaded.scale, loaded.growth_tracker
            self._growth_factor, self._backoff_factor = loaded.growth, loaded.backoff
            self._growth_interval = loaded.interval
            self._settled_scale, self._updates = loaded.iteration_scale, []
            if loaded.scale != loaded.iteration_scale:
                self._updates.append((restored_iteration(), loaded.scale))
            self._iteration_scales = (
                {} if loaded.current is None else {current_iteration(): loaded.current}
            )
            self._unscaled.clear()
            self._stepped.clear()

    def check_state_dict(self, state_dict: Any) -> None:
        """Raise what :meth:`load_state_dict` would raise for ``state_dict``; changes nothing
        (``roundpipe.load_checkpoint`` checks a file's scaler state with it before loading
        anything)."""
        self._checked_state(state_dict)

    def _checked_state(self, state_dict: Any) -> _LoadedState:
        """What :meth:`load_state_dict` would restore from ``state_dict``, or the error it would
        raise; changes nothing."""
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        if not state_dict:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled "
                "instance of GradScaler."
            )
        scale = _float32(_positive("scale", state_dict["scale"]))
        iteration_scale = _float32(
            _positive("_iteration_scale", state_dict.get("_iteration_scale", scale))
        )
        current = state_dict.get("_current_scale")
        if current is not None:
            current = _positive("_current_scale", current)
        growth = _positive("growth_factor", state_dict["growth_factor"], above_one=True)
        backoff = _positive("backoff_factor", state_dict["backoff_factor"])
        if backoff >= 1.0:
            raise ValueError(f"backoff_factor must be < 1, got {backoff}")
        interval = self._check_interval(state_dict["growth_interval"])
        tracker = int(state_dict["_growth_tracker"])
        return _LoadedState(scale, iteration_scale, current, growth, backoff, interval, tracker)


class _LoadedState(NamedTuple):
    """A scaler state checked by ``GradScaler._checked_state``."""

    scale: float
    iteration_scale: float
    current: float | None
    growth: float
    backoff: float
    interval: int
    growth_tracker: int


def _float32(value: float) -> float:
    """``value`` rounded to float32, in which ``torch.amp.GradScaler`` keeps its scale."""
    return float(torch.tensor(value, dtype=torch.float32))


def _refuse_fp16(dtypes: list[torch.dtype]) -> None:
    """``torch.amp.GradScaler.unscale_``'s check, before any gradient is unscaled."""
    if torch.float16 in dtypes:
        raise ValueError("Attempting to unscale FP16 gradients.")


def _check_some_gradient(grads: list[torch.Tensor | None]) -> None:
    """``torch.amp.GradScaler.step``'s check: an optimizer without any gradient records no
    inf/NaN check, and its step would go unchecked."""
    if all(grad is None for grad in grads):
        raise AssertionError("No inf checks were recorded for this optimizer.")


__all__ = ["GradScaler"]
