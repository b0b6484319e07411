"""The runtime on CUDA devices against plain PyTorch on the same GPU (float32 tolerances).

Skipped without CUDA; run them on a GPU machine after building with CUDA.
"""

from __future__ import annotations

import copy

import pytest
import roundpipe
import torch
from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe._native import _C
from torch import nn

pytestmark = pytest.mark.requires_cuda


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(6)])


def mse(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((output - label.to(output.device)) ** 2).sum()


def plain_on_gpu(model: nn.Module, x: torch.Tensor, y: torch.Tensor, n: int) -> torch.Tensor:
    total = torch.zeros((), device="cuda")
    for xm, ym in zip(x.cuda().tensor_split(n), y.cuda().tensor_split(n), strict=True):
        loss = mse(model(xm), ym)
        loss.backward()
        total += loss.detach()
    return total.cpu()


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("pin_model", ["alloc", "register", "off"])
def test_forward_backward_on_cuda_matches_pytorch(grain: str, pin_model: str) -> None:
    roundpipe.configure_devices(kind="cuda")
    reference = mlp().cuda()
    model = RoundPipe(copy.deepcopy(reference).cpu(), pin_model=pin_model)
    for param in model.model.parameters():
        assert _C.is_page_locked(param.detach()) == (pin_model != "off")
    x, y = torch.randn(10, 32), torch.randn(10, 32)
    config = RoundPipeRunConfig(num_microbatch=3, recompute_grain=grain)
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    model.synchronize()
    expected = plain_on_gpu(reference, x, y, 3)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    for p, q in zip(model.model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad.cpu(), rtol=1e-4, atol=1e-5)


def test_forward_then_backward_and_chaining_on_cuda() -> None:
    roundpipe.configure_devices(kind="cuda")
    first_ref, second_ref = mlp(1).cuda(), mlp(2).cuda()
    first = RoundPipe(copy.deepcopy(first_ref).cpu())
    second = RoundPipe(copy.deepcopy(second_ref).cpu())
    x, y = torch.randn(8, 32), torch.randn(8, 32)
    packed = first(x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=2, merge_output=False))
    second.forward_backward(
        input_args=(packed,), label=y, loss_fn=mse, run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    first.synchronize()
    second.synchronize()
    plain_on_gpu(nn.Sequential(first_ref, second_ref), x, y, 2)
    for model, reference in ((first, first_ref), (second, second_ref)):
        for p, q in zip(model.model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad.cpu(), rtol=1e-4, atol=1e-5)
