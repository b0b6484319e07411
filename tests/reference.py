"""Plain-PyTorch reference training for the optimizer-side tests.

Data, loss and the per-microbatch gradient loop that ``forward_backward`` is defined by, and a
model of RoundPipe's asynchronous step (staleness 1): ``live`` is the model the iterations train
on, ``master`` what the optimizer holds.
"""

from __future__ import annotations

import torch
from roundpipe import ModelExecutePlan
from torch import nn

MICROBATCHES = 2


def batches(
    count: int, dtype: torch.dtype = torch.float64
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` (input, label) pairs: 6 samples of 5 features, labels of 3."""
    generator = torch.Generator().manual_seed(7)
    return [
        (
            torch.randn(6, 5, generator=generator).to(dtype),
            torch.randn(6, 3, generator=generator).to(dtype),
        )
        for _ in range(count)
    ]


def mse(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((output.float() - label.float()) ** 2).sum()


def plain_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """Accumulate the gradients of ``MICROBATCHES`` microbatches into ``model``."""
    for xm, ym in zip(x.tensor_split(MICROBATCHES), y.tensor_split(MICROBATCHES), strict=True):
        mse(model(xm), ym).backward()


def stale_step(live: nn.Module, master: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """After an iteration left its gradients in ``live``: the previous step's weights arrive in
    ``live``, then ``optimizer`` steps ``master`` with those gradients."""
    live.load_state_dict(master.state_dict())
    for p, q in zip(master.parameters(), live.parameters(), strict=True):
        p.grad, q.grad = q.grad, None
    optimizer.step()
    optimizer.zero_grad()


def master_step(
    model: nn.Module, masters: list[torch.Tensor], optimizer: torch.optim.Optimizer
) -> None:
    """Mixed precision: the fp32 ``masters`` take ``model``'s low-precision gradients,
    ``optimizer`` steps them, and ``model`` gets the new weights cast to its dtype."""
    with torch.no_grad():
        for master, p in zip(masters, model.parameters(), strict=True):
            master.grad, p.grad = p.grad.float(), None
        optimizer.step()
        for master, p in zip(masters, model.parameters(), strict=True):
            p.copy_(master)


def make_plan(fwd: list[range], bwd: list[range]) -> ModelExecutePlan:
    plan = ModelExecutePlan()
    plan.fwd_plan, plan.bwd_plan = fwd, bwd
    return plan


def mlp(layers: int = 4, width: int = 6, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)]
    )


def assert_same_grads(model: nn.Module, reference: nn.Module, exact: bool = False) -> None:
    for (name, p), (_, q) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert p.grad is not None, name
        if exact:
            assert torch.equal(p.grad, q.grad), name
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
