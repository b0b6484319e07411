"""An optimizer step queued on a RoundPipe's optimizer thread, for frameworks that step on the
calling thread.

A training loop such as ``transformers.Trainer``'s calls ``optimizer.step()`` and then
``lr_scheduler.step()`` on its own thread. With RoundPipe the real step runs on the optimizer
thread, possibly while the loop goes on (staleness 1), so the loop's objects must not touch the
real optimizer. :class:`QueuedOptimizer` is what the loop holds: its parameter groups are a copy
of the real optimizer's, which the scheduler changes on the loop's thread; each ``step()``
hands a snapshot of their hyperparameters (learning rate, ...) to the queued step, which applies
it to the real optimizer before stepping. The real optimizer is ``.optimizer``.
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable
from typing import Any

import torch

Hyperparameters = list[dict[str, Any]]


class PendingNorm:
    """The gradient norm of a queued step, known once the optimizer thread computed it."""

    def __init__(self, finish: Callable[[], None]) -> None:
        self._done = threading.Event()
        self._value: float | None = None
        self._finish = finish

    def set(self, value: float) -> None:
        """Record the norm (optimizer thread)."""
        self._value = value

    def done(self) -> None:
        """Mark the step over, whether it computed the norm or failed (optimizer thread)."""
        self._done.set()

    def result(self) -> float:
        """Wait for the step and return its norm; a failed step's error is raised here."""
        self._done.wait()
        if self._value is None:
            self._finish()  # raises the step's error
            return math.nan
        return self._value


def _hyperparameters(groups: list[dict[str, Any]]) -> Hyperparameters:
    """The groups without their parameters, deep-copied (a tensor learning rate is changed in
    place by schedulers)."""
    return [{k: copy.deepcopy(v) for k, v in group.items() if k != "params"} for group in groups]


class QueuedOptimizer(torch.optim.Optimizer):
    """Stands for ``optimizer`` on the calling thread; ``step()`` queues the real step.

    Args:
        optimizer: the real optimizer, built over a RoundPipe's optimizer copies.
        submit: queues one step given the hyperparameters of every parameter group.
        wait: waits until no step is in flight (before reading or replacing the real state).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        submit: Callable[[Hyperparameters], None],
        wait: Callable[[], None],
    ) -> None:
        groups = [
            {**hyper, "params": list(group["params"])}
            for hyper, group in zip(
                _hyperparameters(optimizer.param_groups), optimizer.param_groups, strict=True
            )
        ]
        super().__init__(groups, dict(optimizer.defaults))
        self.optimizer = optimizer
        self._submit = submit
        self._wait = wait

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Queue the real step with the current hyperparameters (a closure is refused: the
        gradients are computed by the pipeline, not by re-evaluating the model here)."""
        if closure is not None:
            raise ValueError("QueuedOptimizer.step() takes no closure")
        self._submit(self.hyperparameters())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing: the queued step clears the real optimizer's gradients after stepping."""

    def hyperparameters(self) -> Hyperparameters:
        """A snapshot of every group's hyperparameters, as the next step will use them."""
        return _hyperparameters(self.param_groups)

    def set_hyperparameters(self, values: Hyperparameters) -> None:
        """Replace every group's hyperparameters (restoring a checkpoint)."""
        if len(values) != len(self.param_groups):
            raise ValueError(
                f"the checkpoint has {len(values)} parameter groups, the optimizer "
                f"{len(self.param_groups)}: build the optimizer with the same arguments"
            )
        for group, hyper in zip(self.param_groups, values, strict=True):
            group.update(hyper)

    def state_dict(self) -> dict[str, Any]:
        """The real optimizer's state, after the step in flight."""
        self._wait()
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the real optimizer's state (after the step in flight) and its hyperparameters."""
        self._wait()
        self.optimizer.load_state_dict(state_dict)
        self.set_hyperparameters(_hyperparameters(self.optimizer.param_groups))


def apply_hyperparameters(optimizer: torch.optim.Optimizer, values: Hyperparameters) -> None:
    """Give the real optimizer's groups the hyperparameters a step was queued with."""
    for group, hyper in zip(optimizer.param_groups, values, strict=True):
        group.update(hyper)


__all__ = ["Hyperparameters", "PendingNorm", "QueuedOptimizer", "apply_hyperparameters"]
