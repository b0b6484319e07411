"""Plain-PyTorch model of RoundPipe's asynchronous step (staleness 1), for the tests.

``live`` is the model the iterations train on, ``master`` what the optimizer holds.
"""

from __future__ import annotations

import torch
from torch import nn


def stale_step(live: nn.Module, master: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """After an iteration left its gradients in ``live``: the previous step's weights arrive in
    ``live``, then ``optimizer`` steps ``master`` with those gradients."""
    live.load_state_dict(master.state_dict())
    for p, q in zip(master.parameters(), live.parameters(), strict=True):
        p.grad, q.grad = q.grad, None
    optimizer.step()
    optimizer.zero_grad()
