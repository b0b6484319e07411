"""``roundpipe.grad_scaler``, roundpipe 0.1.1's module path of :class:`GradScaler`; the scaler
lives with the optimizer's parts in :mod:`roundpipe.optim.grad_scaler`."""

from roundpipe.optim.grad_scaler import GradScaler

__all__ = ["GradScaler"]
