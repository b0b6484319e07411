"""roundpipe.save_checkpoint / load_checkpoint: a resumed run continues exactly, a save killed at
any moment leaves the previous checkpoint loadable, corrupt or truncated files and files that
would run code are refused before the model changes, and bad arguments fail up front."""

from __future__ import annotations

import copy
import json
import os
import random
import select
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
import roundpipe
import roundpipe.checkpoints.checkpoint
import torch
from roundpipe import (
    CheckpointError,
    RoundPipe,
    RoundPipeRunConfig,
    load_checkpoint,
    save_checkpoint,
    wrap_model_to_roundpipe,
)
from torch import nn

WIDTH = 12
CONFIG = RoundPipeRunConfig(num_microbatch=2)


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)


class Trainer:
    """A bf16 RoundPipe with fp32 copies, roundpipe.optim.Adam and a GradScaler, stepping
    asynchronously."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)]).bfloat16()
        self.model = RoundPipe(net, optim_dtype=torch.float32)
        self.optimizer = roundpipe.optim.Adam(self.model.optim_parameters(), lr=1e-2)
        self.scaler = roundpipe.GradScaler(init_scale=2.0**8, growth_interval=2)

    def train(self, iterations: range) -> list[float]:
        losses = []
        for i in iterations:
            x, y = batch(i)
            loss = self.model.forward_backward(
                input_args=(x.bfloat16(),),
                label=y,
                loss_fn=lambda out, label: self.scaler.scale(((out.float() - label) ** 2).mean()),
                run_config=CONFIG,
            )
            losses.append(float(loss))
            self.model.step(
                lambda: (
                    self.scaler.step(self.optimizer),
                    self.scaler.update(),
                    self.optimizer.zero_grad(),
                )
            )
        return losses

    def snapshot(self) -> dict[str, Any]:
        self.model.synchronize()
        return {
            "weights": {n: p.detach().clone() for n, p in self.model.named_parameters()},
            "copies": [c.detach().clone() for c in self.model.optim_parameters()],
            "adam": {
                i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                for i, s in self.optimizer.state_dict()["state"].items()
            },
            "scale": self.scaler.get_scale(),
        }


def assert_same(a: Any, b: Any, where: str = "") -> None:
    if torch.is_tensor(a):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for n, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{n}]")
    else:
        assert a == b, where


def test_resumed_run_matches_uninterrupted_run(tmp_path: Path, num_devices: int) -> None:
    path = tmp_path / "ckpt.rp"
    run = Trainer()
    run.train(range(3))
    rng = torch.get_rng_state()
    save_checkpoint(path, run.model, run.optimizer, run.scaler, extra={"step": 3, "rng": rng})
    expected_losses = run.train(range(3, 7))
    expected = run.snapshot()

    resumed = Trainer()
    resumed.train(range(1))  # its own progress is overwritten by the load
    extra = load_checkpoint(path, resumed.model, resumed.optimizer, resumed.scaler)
    assert extra["step"] == 3 and torch.equal(extra["rng"], rng)
    assert resumed.train(range(3, 7)) == expected_losses
    assert_same(resumed.snapshot(), expected)


def test_auto_roundpipe_and_plain_module_round_trip(tmp_path: Path) -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(3)
            )
            self.head = nn.Linear(WIDTH, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    def build(wrap: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        if not wrap:
            model = Net()
            return model, torch.optim.Adam(model.parameters(), lr=0.01)
        wrapped = wrap_model_to_roundpipe(Net(), lower_threshold=300, optim_dtype=torch.float64)
        assert type(wrapped).__name__ == "AutoRoundPipe"
        return wrapped, torch.optim.Adam(wrapped.optim_parameters(), lr=0.01)

    def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
        def step() -> None:
            optimizer.step()
            optimizer.zero_grad()

        losses = []
        for i in steps:
            x, y = batch(i)
            loss = ((model(x) - y[:, :1]) ** 2).mean()
            loss.backward()
            losses.append(loss.item())
            if isinstance(model, Net):
                step()
            else:
                model.step(step)
        return losses

    for wrap in (False, True):
        path = tmp_path / f"wrap{wrap}.rp"
        model, optimizer = build(wrap)
        train(model, optimizer, range(2))
        save_checkpoint(path, model, optimizer)
        expected = train(model, optimizer, range(2, 5))
        resumed, resumed_optimizer = build(wrap)
        load_checkpoint(path, resumed, resumed_optimizer)
        assert train(resumed, resumed_optimizer, range(2, 5)) == expected
        assert_same(resumed.state_dict(), model.state_dict())


def test_chunked_checksums_match_the_payload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small chunks, so torch.save's writes straddle chunk boundaries; each chunk's CRC-32 is
    checked against the file's own bytes, and a flipped byte names its chunk's range."""
    monkeypatch.setattr(roundpipe.checkpoints.checkpoint, "CHUNK_BYTES", 1000)
    model = nn.Sequential(nn.Linear(40, 40), nn.Linear(40, 3))
    path = tmp_path / "small-chunks.rp"
    save_checkpoint(path, model, extra=list(range(300)))
    data = path.read_bytes()
    length = struct.unpack("<Q", data[-24:-16])[0]
    manifest = json.loads(data[-24 - length : -24])
    payload = data[: manifest["payload_bytes"]]
    assert manifest["chunk_bytes"] == 1000 and len(manifest["chunks"]) > 10
    assert manifest["chunks"] == [
        zlib.crc32(payload[i : i + 1000]) for i in range(0, len(payload), 1000)
    ]
    assert load_checkpoint(path, nn.Sequential(nn.Linear(40, 40), nn.Linear(40, 3))) == list(
        range(300)
    )
    corrupt = bytearray(data)
    corrupt[2500] ^= 0x01
    path.write_bytes(corrupt)
    with pytest.raises(CheckpointError, match=r"bytes 2000\.\.3000"):
        load_checkpoint(path, model)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_file_is_refused_before_the_model_changes(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "ckpt.rp"
    source = Trainer()
    source.train(range(2))
    save_checkpoint(path, source.model, source.optimizer, source.scaler)
    good = path.read_bytes()
    target = Trainer()
    target.train(range(1))
    before = target.snapshot()
    size = len(good)
    rng = random.Random(0)
    if damage == "flip":
        cases = [
            0,
            size // 3,
            size // 2,
            size - 300,
            size - 64,
            *(rng.randrange(size - 64) for _ in range(6)),
        ]
    else:
        cases = [0, 10, size // 2, size - 25, size - 1]
    for where in cases:
        damaged = bytearray(good)
        if damage == "flip":
            damaged[where : where + 64] = bytes(b ^ 0xA5 for b in damaged[where : where + 64])
        else:
            del damaged[where:]
        path.write_bytes(damaged)
        with pytest.raises(CheckpointError, match=rf"{path.name}.*(corrupt|truncated)"):
            load_checkpoint(path, target.model, target.optimizer, target.scaler)
        assert_same(target.snapshot(), before, f"{damage} at {where}")
    path.write_bytes(good)
    load_checkpoint(path, target.model, target.optimizer, target.scaler)
    assert_same(target.snapshot(), source.snapshot())


@pytest.mark.parametrize("groups", ["two groups", "fewer parameters"])
def test_an_optimizer_of_other_groups_is_refused_before_the_model_changes(
    tmp_path: Path, groups: str
) -> None:
    """optimizer.load_state_dict would refuse it only after the model had been replaced."""
    path = tmp_path / "ckpt.rp"
    source = Trainer()
    source.train(range(2))
    save_checkpoint(path, source.model, source.optimizer, source.scaler)
    target = Trainer()
    target.train(range(1))
    copies = list(target.model.optim_parameters())
    if groups == "two groups":
        params: Any = [{"params": copies[:2]}, {"params": copies[2:]}]
    else:
        params = copies[:3]
    target.optimizer = roundpipe.optim.Adam(params, lr=1e-2)
    before = target.snapshot()
    with pytest.raises(CheckpointError, match="optimizer parameter group"):
        load_checkpoint(path, target.model, target.optimizer, target.scaler)
    assert_same(target.snapshot(), before)


def test_a_missing_path_is_file_not_found(tmp_path: Path) -> None:
    target = Trainer()
    with pytest.raises(FileNotFoundError, match="no checkpoint file or folder"):
        load_checkpoint(tmp_path / "nothing-here", target.model, target.optimizer)


def test_file_that_would_run_code_is_refused(tmp_path: Path) -> None:
    """A file in the documented format, checksums right, whose payload pickles a call."""
    marker = tmp_path / "code-ran"

    class Exploit:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (exec, (f"open({str(marker)!r}, 'w').close()",))

    path = tmp_path / "evil.rp"
    torch.save({"model": {}, "extra": Exploit()}, path)
    payload = path.read_bytes()
    chunk = 64 << 20
    manifest = json.dumps(
        {
            "format": "roundpipe.checkpoints.checkpoint",
            "format_version": 1,
            "roundpipe_version": roundpipe.__version__,
            "torch_version": torch.__version__,
            "entries": ["model", "extra"],
            "payload_bytes": len(payload),
            "checksum": "crc32",
            "chunk_bytes": chunk,
            "chunks": [zlib.crc32(payload[i : i + chunk]) for i in range(0, len(payload), chunk)],
        }
    ).encode()
    trailer = struct.pack("<QII8s", len(manifest), zlib.crc32(manifest), 0, b"RPCKPT01")
    path.write_bytes(payload + manifest + trailer)
    torch.load(path, weights_only=False)  # the file does run code when loaded unsafely
    assert marker.exists()
    marker.unlink()
    model = nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match="weights_only"):
        load_checkpoint(path, model, strict=False)
    assert not marker.exists()

    # save_checkpoint refuses to write such a file in the first place
    good = tmp_path / "good.rp"
    save_checkpoint(good, model, extra={"epoch": 1})
    before = good.read_bytes()
    with pytest.raises(ValueError, match="extra must be loadable"):
        save_checkpoint(good, model, extra={"epoch": 2, "fn": Exploit()})
    assert not marker.exists()
    assert good.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil.rp", "good.rp"]


def test_bad_arguments_fail_up_front(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    path = tmp_path / "c.rp"
    with pytest.raises(TypeError, match="path"):
        save_checkpoint(3, model)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model"):
        save_checkpoint(path, {"w": torch.zeros(1)})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="optimizer"):
        save_checkpoint(path, model, optimizer={"lr": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="scaler"):
        save_checkpoint(path, model, scaler=2.0)
    with pytest.raises(ValueError, match="folder"):
        save_checkpoint(tmp_path, model)
    with pytest.raises(FileNotFoundError, match="missing"):
        save_checkpoint(tmp_path / "missing" / "c.rp", model)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError, match=r"c\.rp"):
        load_checkpoint(path, model)
    with pytest.raises(TypeError, match="strict"):
        load_checkpoint(path, model, strict="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model"):
        load_checkpoint(path, None)  # type: ignore[arg-type]

    save_checkpoint(path, model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1)
    changed = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="no optimizer state"):
        load_checkpoint(path, model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert_same(model.state_dict(), changed)
    load_checkpoint(path, model)
    assert_same(model.state_dict(), before)

    plain = tmp_path / "plain.pt"
    torch.save({"model": model.state_dict()}, plain)
    with pytest.raises(CheckpointError, match=r"plain torch\.save file"):
        load_checkpoint(plain, model)


KILLED_SAVER = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    import roundpipe
    path = sys.argv[1]
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(12)])  # 50 MB of fp32
    generation = 0
    while True:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(generation)
        roundpipe.save_checkpoint(path, model, extra={"generation": generation})
        print(generation, flush=True)
        generation += 1
    """
)


@pytest.mark.slow
def test_killed_save_leaves_previous_checkpoint(tmp_path: Path) -> None:
    script = tmp_path / "saver.py"
    script.write_text(KILLED_SAVER)
    path = tmp_path / "ckpt[1].rp"  # glob characters: the clean-up must match names literally
    env = {**os.environ, "PYTHONPATH": str(Path(roundpipe.__file__).parents[1])}
    rng = random.Random(1)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(12)])
    for trial in range(6):  # SIGKILL at a random moment of repeated saves
        child = subprocess.Popen(
            [sys.executable, str(script), str(path)], stdout=subprocess.PIPE, text=True, env=env
        )
        try:
            assert child.stdout is not None
            ready, _, _ = select.select([child.stdout], [], [], 120)
            assert ready, "the saver wrote no checkpoint within 120 s"
            first = child.stdout.readline()  # a complete checkpoint exists from here on
            assert first.strip().isdigit(), first
            time.sleep(rng.uniform(0.0, 1.5))
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
        finally:
            child.kill()
        generation = load_checkpoint(path, model)["generation"]
        assert generation >= 0
        for p in model.parameters():
            assert torch.all(p == generation), trial
    # a later save works whatever the killed ones left, and clears their temporary files
    save_checkpoint(path, model, extra={"generation": -1})
    assert load_checkpoint(path, model)["generation"] == -1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt[1].rp", "saver.py"]


def test_saves_leave_torchs_crc_setting_to_other_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save turns torch's record CRCs off for its own torch.save only: another thread's setting
    is untouched while it writes, and the saving thread's is restored afterwards. Where torch's
    config overrides are process-wide (torch 2.11), the save leaves the CRCs on instead."""
    seen: list[tuple[bool, bool]] = []
    real_save = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if str(f).startswith(str(tmp_path / ".ckpt")):  # the checkpoint's temporary file
            other: list[bool] = []
            thread = threading.Thread(
                target=lambda: other.append(torch.serialization.get_crc32_options())
            )
            thread.start()
            thread.join(60)
            seen.append((torch.serialization.get_crc32_options(), other[0]))
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    save_checkpoint(tmp_path / "ckpt", nn.Linear(2, 2))
    per_thread = roundpipe.checkpoints.checkpoint._config_overrides_per_thread()
    assert per_thread or torch.__version__ < "2.13", "torch 2.13's overrides are per thread"
    assert seen == [(not per_thread, True)]
    assert torch.serialization.get_crc32_options() is True
    load_checkpoint(tmp_path / "ckpt", nn.Linear(2, 2))


def test_extra_as_a_callable_is_read_after_the_step_in_flight(tmp_path: Path) -> None:
    # An LR scheduler stepped in step_fn changes while the asynchronous step runs: an object
    # built before the call misses that step, a callable is read after it.
    model = RoundPipe(nn.Sequential(nn.Linear(4, 4)), name="extra", model_run_config=CONFIG)
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    def step_fn() -> None:
        time.sleep(0.3)
        optimizer.step()
        scheduler.step()

    model.forward_backward(input_args=(torch.randn(4, 4),), loss_fn=lambda out, _: out.sum())
    model.step(step_fn)
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model, optimizer, extra=lambda: {"scheduler": scheduler.state_dict()})
    saved = torch.load(path, weights_only=True)
    assert saved["extra"]["scheduler"]["last_epoch"] == 1
    assert saved["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.05)

    with pytest.raises(ValueError, match="weights_only"):
        save_checkpoint(path, model, optimizer, extra=lambda: {"bad": object()})
    assert torch.load(path, weights_only=True)["extra"]["scheduler"]["last_epoch"] == 1


def live_state(trainer: Trainer) -> dict[str, Any]:
    """What a failed load must leave as it was, read without changing the training (unlike
    ``snapshot``, whose synchronize() writes the step in flight back): the model's state_dict
    (with ``_roundpipe.pending_writeback`` while a step is in flight), the optimizer's and the
    scaler's."""
    return {
        "model": {key: value.clone() for key, value in trainer.model.state_dict().items()},
        "optimizer": copy.deepcopy(trainer.optimizer.state_dict()),
        "scaler": trainer.scaler.state_dict(),
    }


def test_a_load_that_fails_changes_nothing_not_even_the_step_in_flight(tmp_path: Path) -> None:
    """Every refusal (a corrupt file, a model of other entries, optimizer or scaler state that
    the file lacks or that is another optimizer's) comes before the asynchronous step in flight
    is drained: draining writes its weights back, and the next iteration would then train on
    fresh weights instead of the one-step-stale ones of a run that never tried the load."""
    source = Trainer()
    source.train(range(2))
    good = tmp_path / "good.rp"
    save_checkpoint(good, source.model, source.optimizer, source.scaler)
    damaged = bytearray(good.read_bytes())
    damaged[100:164] = bytes(b ^ 0xA5 for b in damaged[100:164])
    (tmp_path / "corrupt.rp").write_bytes(damaged)
    save_checkpoint(tmp_path / "no-scaler.rp", source.model, source.optimizer)
    disabled = roundpipe.GradScaler(enabled=False)
    save_checkpoint(tmp_path / "disabled-scaler.rp", source.model, source.optimizer, disabled)
    torch.manual_seed(1)
    shallower = RoundPipe(
        nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(3)]).bfloat16(),
        optim_dtype=torch.float32,
    )
    shallow_adam = roundpipe.optim.Adam(shallower.optim_parameters())
    save_checkpoint(tmp_path / "other-model.rp", shallower, shallow_adam, source.scaler)
    sgd = torch.optim.SGD(source.model.optim_parameters(), lr=0.1, momentum=0.9)
    x, y = batch(0)
    source.model.forward_backward(
        input_args=(x.bfloat16(),),
        label=y,
        loss_fn=lambda out, label: ((out.float() - label) ** 2).mean(),
        run_config=CONFIG,
    )
    source.model.step(lambda: (sgd.step(), sgd.zero_grad()), is_async=False)
    save_checkpoint(tmp_path / "sgd.rp", source.model, sgd, source.scaler)

    target, twin = Trainer(), Trainer()
    assert target.train(range(3)) == twin.train(range(3))
    before = live_state(target)
    assert "_roundpipe.pending_writeback" in before["model"]  # a step is in flight
    cases = [
        ("corrupt.rp", CheckpointError, "corrupt"),
        ("no-scaler.rp", CheckpointError, "holds no scaler state"),
        ("disabled-scaler.rp", CheckpointError, r"disabled GradScaler \(enabled=False\)"),
        ("other-model.rp", RuntimeError, "Missing key"),
        ("sgd.rp", CheckpointError, "exp_avg"),
    ]
    for name, error, match in cases:
        with pytest.raises(error, match=match):
            load_checkpoint(tmp_path / name, target.model, target.optimizer, target.scaler)
        assert_same(live_state(target), before, name)
    assert target.train(range(3, 6)) == twin.train(range(3, 6))
    assert_same(target.snapshot(), twin.snapshot())
    load_checkpoint(good, target.model, target.optimizer, target.scaler)  # still loads


@pytest.mark.parametrize("kind", ["roundpipe", "torch"])
def test_a_disabled_scalers_checkpoint_loads_nothing_into_an_enabled_scaler(
    tmp_path: Path, kind: str
) -> None:
    """A disabled scaler saves ``{}``; an enabled one asked to load it is refused before the
    model and the optimizer are loaded (it raised only after both had been replaced)."""

    def scaler(enabled: bool) -> Any:
        if kind == "roundpipe":
            return roundpipe.GradScaler(init_scale=8.0, enabled=enabled)
        return torch.amp.GradScaler("cpu", init_scale=8.0, enabled=enabled)

    def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = nn.Linear(3, 3)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        model(torch.randn(2, 3)).sum().backward()
        optimizer.step()
        return model, optimizer

    path = tmp_path / "ckpt.rp"
    save_checkpoint(path, *trained(0), scaler(enabled=False))
    model, optimizer = trained(1)
    target = scaler(enabled=True)
    before = copy.deepcopy((model.state_dict(), optimizer.state_dict(), target.state_dict()))
    with pytest.raises(CheckpointError, match=r"saved with a disabled GradScaler"):
        load_checkpoint(path, model, optimizer, target)
    assert_same((model.state_dict(), optimizer.state_dict(), target.state_dict()), before)
    load_checkpoint(path, model, optimizer)  # without the scaler it loads
    load_checkpoint(path, model, optimizer, scaler(enabled=False))  # a disabled one ignores it


def test_a_plain_modules_mismatched_entry_is_refused_before_any_layer_loads(
    tmp_path: Path,
) -> None:
    """nn.Module.load_state_dict loads the layers that fit before it raises; load_checkpoint
    raises the same error before any layer changes (and before the optimizer or scaler)."""
    torch.manual_seed(0)
    path = tmp_path / "ckpt.rp"
    save_checkpoint(path, nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 2)))
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.Linear(2, 3))
    plain = copy.deepcopy(model)
    with pytest.raises(RuntimeError) as theirs:
        plain.load_state_dict(torch.load(path, weights_only=True)["model"])
    assert not torch.equal(plain[0].weight, model[0].weight)  # torch loaded layer 0
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(RuntimeError) as ours:
        load_checkpoint(path, model)
    assert str(ours.value) == str(theirs.value)
    assert_same(model.state_dict(), before)
    # Extra and missing keys under strict, as torch words them too.
    save_checkpoint(path, nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    with pytest.raises(RuntimeError) as theirs:
        copy.deepcopy(model).load_state_dict(torch.load(path, weights_only=True)["model"])
    with pytest.raises(RuntimeError) as ours:
        load_checkpoint(path, model)
    assert str(ours.value) == str(theirs.value)
    assert_same(model.state_dict(), before)


def test_an_extra_that_cannot_be_pickled_is_a_value_error_before_writing(tmp_path: Path) -> None:
    """A lambda, a generator or a lock inside ``extra`` is refused as a numpy array is."""
    model = nn.Linear(2, 2)
    path = tmp_path / "ckpt.rp"
    save_checkpoint(path, model, extra={"epoch": 1})
    before = path.read_bytes()
    for extra in (
        {"fn": lambda: 1},
        {"numbers": (i for i in range(2))},
        {"lock": threading.Lock()},
        lambda: {"lock": threading.Lock()},  # a callable's result is checked alike
    ):
        with pytest.raises(ValueError, match="extra must be loadable"):
            save_checkpoint(path, model, extra=extra)
        assert path.read_bytes() == before
        assert [p.name for p in tmp_path.iterdir()] == ["ckpt.rp"]
