"""Checkpoints taken in the middle of asynchronous training continue bit-identically in a fresh
process: weights, optimizer copies, optimizer state and not-yet-stepped gradients."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

TRAIN = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    import roundpipe
    from roundpipe import RoundPipe, RoundPipeRunConfig

    def build():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
        model = RoundPipe(net.to(torch.bfloat16), optim_dtype=torch.float32)
        optimizer = roundpipe.optim.Adam(model.optim_parameters(), lr=1e-2)
        return model, optimizer

    def batch(i):
        g = torch.Generator().manual_seed(100 + i)
        return torch.randn(6, 5, generator=g).bfloat16(), torch.randn(6, 3, generator=g).bfloat16()

    def loss_fn(out, label):
        return ((out.float() - label.float()) ** 2).mean()

    config = RoundPipeRunConfig(num_microbatch=3)

    def train(model, optimizer, iterations, step_last=True):
        for n, i in enumerate(iterations):
            x, y = batch(i)
            model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, run_config=config)
            if step_last or n + 1 < len(iterations):
                model.step(lambda: (optimizer.step(), optimizer.zero_grad()))

    mode, path = sys.argv[1], sys.argv[2]
    model, optimizer = build()
    if mode == "save":
        train(model, optimizer, range(3))
        train(model, optimizer, [3], step_last=False)  # gradients pending, a step in flight
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
        model.step(lambda: (optimizer.step(), optimizer.zero_grad()))
        train(model, optimizer, range(4, 7))
    else:
        state = torch.load(path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        model.step(lambda: (optimizer.step(), optimizer.zero_grad()))
        train(model, optimizer, range(4, 7))
    model.synchronize()
    weights = {n: p.detach().clone() for n, p in model.model.named_parameters()}
    torch.save(weights, path + "." + mode)
    """
)


def run(mode: str, path: Path, script: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(script), mode, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "ROUNDPIPE_DEVICE_KIND": "cpu", "ROUNDPIPE_CPU_DEVICES": "3"},
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_checkpoint_mid_async_training_continues_bit_identically(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    checkpoint = tmp_path / "ckpt.pt"
    run("save", checkpoint, script)
    state = torch.load(checkpoint)
    assert any(key.startswith("_roundpipe.optim.") for key in state["model"])
    assert "_roundpipe.grads" in state["model"]
    run("load", checkpoint, script)
    saved = torch.load(f"{checkpoint}.save")
    loaded = torch.load(f"{checkpoint}.load")
    assert saved.keys() == loaded.keys()
    for name in saved:
        assert torch.equal(saved[name], loaded[name]), name


def test_plain_checkpoint_loads_and_refreshes_optimizer_copies() -> None:
    from roundpipe import RoundPipe
    from torch import nn

    model = RoundPipe(nn.Sequential(nn.Linear(3, 3)), optim_dtype=torch.float64)
    copies = list(model.optim_parameters())
    source = nn.Sequential(nn.Linear(3, 3))
    model.load_state_dict({f"model.{k}": v for k, v in source.state_dict().items()})
    for copy, param in zip(copies, source.parameters(), strict=True):
        assert torch.equal(copy, param.double())
    with pytest.raises(ValueError, match="assign=True"):
        model.load_state_dict(model.state_dict(), assign=True)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        model.load_state_dict({**model.state_dict(), "bogus": torch.zeros(1)})


def test_model_of_mixed_dtypes_saves_and_loads(tmp_path: Path) -> None:
    # bf16 weights beside an fp32 norm are views of one host arena as two dtypes, which
    # torch.save refuses for one storage; the file must still hold every value exactly.
    import roundpipe
    from torch import nn

    def build(seed: int) -> tuple[roundpipe.RoundPipe, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        net = nn.Sequential(nn.Linear(4, 6).bfloat16(), nn.LayerNorm(6), nn.Linear(6, 2).bfloat16())
        model = roundpipe.RoundPipe(net, optim_dtype=torch.float32)
        return model, roundpipe.optim.Adam(model.optim_parameters(), lr=0.1)

    model, optimizer = build(0)
    with torch.no_grad():
        model.model[1].weight.add_(0.5)  # not the default, so a load that drops it shows
    roundpipe.save_checkpoint(tmp_path / "mixed.pt", model, optimizer)
    other, other_optimizer = build(1)
    roundpipe.load_checkpoint(tmp_path / "mixed.pt", other, other_optimizer)
    for (name, value), loaded in zip(
        model.model.state_dict().items(), other.model.state_dict().values(), strict=True
    ):
        assert loaded.dtype == value.dtype and torch.equal(loaded, value), name


def test_pending_gradients_load_by_value_into_a_model_of_another_dtype() -> None:
    # As torch casts a checkpoint's bf16 parameters into an fp16 model, the gradients a bf16
    # model accumulated but did not step load into an fp16 model by value (they were copied as
    # bytes: bf16 bits read as fp16, wrong gradients and no error).
    from roundpipe import RoundPipe
    from torch import nn

    def build(dtype: torch.dtype) -> RoundPipe:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).to(dtype)
        return RoundPipe(net, optim_dtype=torch.float32)

    def stepped_grads(model: RoundPipe) -> list[torch.Tensor]:
        grads: list[torch.Tensor] = []
        model.step(lambda: grads.extend(p.grad.clone() for p in model.optim_parameters()), False)
        return grads

    x, y = torch.randn(4, 4), torch.randn(4, 2)
    source = build(torch.bfloat16)
    source.forward_backward(
        input_args=(x.bfloat16(),),
        label=y.bfloat16(),
        loss_fn=lambda out, label: ((out.float() - label.float()) ** 2).mean(),
    )
    state = source.state_dict()
    expected = stepped_grads(source)
    for dtype in (torch.bfloat16, torch.float16):
        target = build(dtype)
        target.load_state_dict(state)
        for got, saved in zip(stepped_grads(target), expected, strict=True):
            # fp32 copies: the bf16 values survive fp16 (their range here is small)
            torch.testing.assert_close(got, saved, rtol=1e-2, atol=1e-3)


def test_a_batchnorm_entry_torch_fills_in_is_not_missing() -> None:
    # nn.Module.load_state_dict loads a state without BatchNorm's num_batches_tracked (a dict
    # without version metadata); RoundPipe's strict load refused it as a missing key.
    from roundpipe import RoundPipe
    from torch import nn

    def net() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))

    state = {k: v + 1 for k, v in net().state_dict().items() if "num_batches" not in k}
    plain = nn.Sequential()
    plain.add_module("model", net())
    model = RoundPipe(net())
    assert str(model.load_state_dict({f"model.{k}": v for k, v in state.items()})) == str(
        plain.load_state_dict({f"model.{k}": v for k, v in state.items()})
    )
    loaded, expected = model.model.state_dict(), plain.model.state_dict()
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key
    # With BatchNorm's version in the metadata (a state_dict() as saved) torch refuses it.
    saved = plain.state_dict()
    del saved["model.1.num_batches_tracked"]
    with pytest.raises(RuntimeError, match=r'Missing key.*"model\.1\.num_batches_tracked"'):
        plain.load_state_dict(saved)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    saved["model.0.weight"] = saved["model.0.weight"] + 1
    with pytest.raises(RuntimeError, match=r'Missing key.*"model\.1\.num_batches_tracked"'):
        model.load_state_dict(saved)  # refused before anything changed
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
