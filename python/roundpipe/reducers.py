"""roundpipe 0.1.1's averaging reducer for ``merge_output`` specs: ``AvgReducer`` and the shared
instance ``avg_reducer``.

Served lazily by :mod:`roundpipe.batch` (``roundpipe.batch.AvgReducer``, its 0.1.1 path): a
reducer is a ``torch.distributed.pipelining.microbatch._CustomReducer``, and importing that module
costs over a second, which ``import roundpipe`` does not pay.
"""

from __future__ import annotations

import torch
from torch.distributed.pipelining.microbatch import _CustomReducer


class AvgReducerInUseError(RuntimeError, AssertionError):
    """An ``AvgReducer`` was handed a running value that is not its own latest: one instance
    used by two reductions at the same time. Both a ``RuntimeError`` and an ``AssertionError``
    (what roundpipe 0.1.1 raised)."""


class AvgReducer(_CustomReducer):
    """A ``_CustomReducer`` whose reduction is the mean of the microbatches' values (scalar
    losses, typically): as a ``merge_output`` spec leaf, the merged value is their average, kept
    in the autograd graph.

    Attributes:
        sum: the running sum of the values reduced so far.
        count: how many values that is.
        previous_output: the running mean returned last; a reduction continues only from it.

    The initial value is ``None``: each reduction starts afresh, so one instance serves one
    call after another, but not two reductions at once (``AvgReducerInUseError``).
    """

    def __init__(self) -> None:
        super().__init__(None, self.reduce)  # type: ignore[no-untyped-call]
        self.sum: torch.Tensor = torch.tensor(0)
        self.count: int = 0
        self.previous_output: torch.Tensor = self.sum

    def __repr__(self) -> str:
        return "AvgReducer"

    def reduce(self, reduced_val: torch.Tensor | None, new_val: torch.Tensor) -> torch.Tensor:
        """Fold ``new_val`` into the running mean ``reduced_val`` (``None``: start a new one).

        Raises:
            AvgReducerInUseError: ``reduced_val`` is not this reducer's latest output.
        """
        if reduced_val is None:
            self.sum, self.count = new_val.clone(), 1
        else:
            if reduced_val is not self.previous_output:
                raise AvgReducerInUseError(
                    "this AvgReducer is in use by another reduction: give each merge_output "
                    "spec that runs at the same time an AvgReducer() of its own"
                )
            self.sum, self.count = self.sum + new_val, self.count + 1
        self.previous_output = self.sum / self.count
        return self.previous_output


#: The shared instance (roundpipe 0.1.1's ``avg_reducer``).
avg_reducer: AvgReducer = AvgReducer()

__all__ = ["AvgReducer", "AvgReducerInUseError", "avg_reducer"]
