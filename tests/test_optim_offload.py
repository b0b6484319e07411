"""Optimizer state on disk (RoundPipe's ``optim_offload``): the same bits as the same model and
``roundpipe.optim.Adam`` with their state in host memory (itself checked against torch's Adam in
test_adam.py and test_fused_path.py), the folder's faults, and who may step the copies."""

from __future__ import annotations

import copy
import errno
import fcntl
import gc
import io
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import roundpipe
import torch
from reference import MICROBATCHES
from roundpipe import OptimOffload, RoundPipe, RoundPipeRunConfig
from torch import nn

CONFIG = RoundPipeRunConfig(num_microbatch=MICROBATCHES)
WORKER = Path(__file__).with_name("dp_worker.py")
# Small chunks and buffers, so that the wide layer's state streams in several chunks.
SMALL = {"chunk_elements": 1, "buffers": 3, "io_threads": 2}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def model() -> nn.Sequential:
    """bf16; its first weight (700 x 600) spans two chunks of 262,144 elements."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(600, 700), nn.Tanh(), nn.Linear(700, 4)).to(torch.bfloat16)


def data(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch, ``count`` times (the loss falls)."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(4, 600, generator=generator).to(torch.bfloat16)
    return [(x, torch.randn(4, 4, generator=generator).to(torch.bfloat16))] * count


def mse(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((output.float() - label.float()) ** 2).mean()


def train(
    rp: RoundPipe, optimizer: torch.optim.Optimizer, steps: int, is_async: bool
) -> list[torch.Tensor]:
    losses = []
    for x, y in data(steps):
        loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=CONFIG)
        losses.append(loss.detach().clone())
        rp.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=is_async)
    rp.synchronize()
    return losses


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1), b.view(-1))


def assert_same_state(ours: torch.optim.Optimizer, theirs: torch.optim.Optimizer) -> None:
    for p, q in zip(ours.param_groups[0]["params"], theirs.param_groups[0]["params"], strict=True):
        assert same_bits(p.detach(), q.detach())
        mine, other = ours.state[p], theirs.state[q]
        assert mine.keys() == other.keys()
        for key, value in mine.items():
            assert same_bits(value, other[key]), key


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_same_bits_as_in_memory(
    num_devices: int, tmp_path: Path, state_dtype: torch.dtype, is_async: bool
) -> None:
    reference = model()
    in_memory = RoundPipe(copy.deepcopy(reference), optim_dtype=torch.float32)
    on_disk = RoundPipe(
        copy.deepcopy(reference),
        optim_dtype=torch.float32,
        optim_offload=OptimOffload(tmp_path, **SMALL),
    )
    theirs = roundpipe.optim.Adam(
        in_memory.optim_parameters(), lr=0.001, weight_decay=0.1, state_dtype=state_dtype
    )
    ours = roundpipe.optim.Adam(
        on_disk.optim_parameters(), lr=0.001, weight_decay=0.1, state_dtype=state_dtype
    )
    expected = train(in_memory, theirs, 4, is_async)
    got = train(on_disk, ours, 4, is_async)
    assert [float(v) for v in got] == [float(v) for v in expected]
    if not is_async:  # (the stale steps of this tiny run overshoot at first)
        assert float(got[-1]) < float(got[0])
    for p, q in zip(on_disk.model.parameters(), in_memory.model.parameters(), strict=True):
        assert same_bits(p.detach(), q.detach())
    assert_same_state(ours, theirs)
    # The state is on disk: one lock file is all the folder shows (the data files are unlinked).
    assert sorted(os.listdir(tmp_path)) == ["roundpipe-rank0.lock"]


def test_checkpoint_resumes_bit_exactly(tmp_path: Path) -> None:
    """A checkpoint of offloaded state resumes, in a new model on a new folder, as the run that
    never stopped (its own state on disk too)."""
    reference = model()
    folders = [tmp_path / name for name in ("a", "b")]
    for folder in folders:
        folder.mkdir()
    straight = RoundPipe(
        copy.deepcopy(reference),
        optim_dtype=torch.float32,
        optim_offload=OptimOffload(folders[0], **SMALL),
    )
    adam = roundpipe.optim.Adam(straight.optim_parameters(), lr=0.01, state_dtype=torch.int8)
    train(straight, adam, 2, is_async=True)
    path = tmp_path / "checkpoint.pt"
    roundpipe.save_checkpoint(path, straight, adam)
    expected = train(straight, adam, 2, is_async=True)

    resumed = RoundPipe(
        model(), optim_dtype=torch.float32, optim_offload=OptimOffload(folders[1], **SMALL)
    )
    adam2 = roundpipe.optim.Adam(resumed.optim_parameters(), lr=0.01, state_dtype=torch.int8)
    roundpipe.load_checkpoint(path, resumed, adam2)
    got = train(resumed, adam2, 2, is_async=True)
    assert [float(v) for v in got] == [float(v) for v in expected]
    for p, q in zip(resumed.model.parameters(), straight.model.parameters(), strict=True):
        assert same_bits(p.detach(), q.detach())
    assert_same_state(adam2, adam)


def test_trace_shows_the_disk_requests(tmp_path: Path) -> None:
    """Every read and write of the step is a span on the host's disk lane, within the step, and
    their bytes add up to the state's: masters and fp32 moments, read once and written once."""
    folder = tmp_path / "state"
    folder.mkdir()
    rp = RoundPipe(model(), optim_dtype=torch.float32, optim_offload=OptimOffload(folder, **SMALL))
    adam = roundpipe.optim.Adam(rp.optim_parameters(), lr=0.001)
    path = tmp_path / "trace.json"
    with roundpipe.trace(str(path)):
        train(rp, adam, 2, is_async=False)
    events = json.loads(path.read_text())["traceEvents"]
    disk = [e for e in events if e["ph"] == "X" and e["cat"] in ("disk_read", "disk_write")]
    steps = [e for e in events if e["ph"] == "X" and e["cat"] == "optimizer_step"]
    assert len(steps) == 2
    for step in steps:
        inside = [e for e in disk if step["ts"] <= e["ts"] <= step["ts"] + step["dur"]]
        for phase in ("disk_read", "disk_write"):
            nbytes = sum(e["args"]["bytes"] for e in inside if e["cat"] == phase)
            numels = [p.numel() for p in rp.optim_parameters()]
            # Each tensor's regions are padded to whole 4 KiB pages.
            assert nbytes == sum(3 * (-(-4 * n // 4096) * 4096) for n in numels), phase


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_gradients_after_the_step(tmp_path: Path, is_async: bool) -> None:
    """A synchronous step leaves the gradients, as torch's Adam does; an asynchronous one writes
    the new weights over them, so they are gone (None, as after zero_grad())."""
    rp = RoundPipe(model(), optim_dtype=torch.float32, optim_offload=tmp_path)
    adam = roundpipe.optim.Adam(rp.optim_parameters(), lr=0.001)
    x, y = data(1)[0]
    rp.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=CONFIG)
    rp.step(adam.step, is_async=is_async)
    rp.synchronize()
    grads = [p.grad for p in rp.optim_parameters()]
    if is_async:
        assert all(g is None for g in grads)
    else:
        assert all(g is not None and bool(g.abs().sum() > 0) for g in grads)


def _copied(optimizer: torch.optim.Optimizer, how: str) -> torch.optim.Optimizer:
    if how == "deepcopy":
        return copy.deepcopy(optimizer)
    if how == "pickle":
        return pickle.loads(pickle.dumps(optimizer))
    buffer = io.BytesIO()
    torch.save(optimizer, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_copied_optimizer_steps_in_memory(tmp_path: Path, how: str) -> None:
    """A copy of an optimizer over offloaded copies (deepcopy, pickle, torch.save + load) holds
    its parameters and state in memory: it steps like the copy of the same optimizer trained in
    memory, and leaves the model's copies on disk alone."""
    copies = []
    for folder in (tmp_path, None):
        rp = RoundPipe(model(), optim_dtype=torch.float32, optim_offload=folder)
        adam = roundpipe.optim.Adam(rp.optim_parameters(), lr=0.01, state_dtype=torch.int8)
        train(rp, adam, 2, is_async=False)
        originals = [p.detach().clone() for p in rp.optim_parameters()]
        copied = _copied(adam, how)
        generator = torch.Generator().manual_seed(5)
        for p in copied.param_groups[0]["params"]:
            p.grad = torch.randn(p.shape, generator=generator)
        copied.step()
        on_disk = zip(rp.optim_parameters(), originals, strict=True)
        assert all(same_bits(p.detach(), o) for p, o in on_disk)
        copies.append(copied)
    assert_same_state(*copies)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.int8])
def test_two_optimizers_over_the_same_copies_keep_their_own_moments(
    tmp_path: Path, state_dtype: torch.dtype
) -> None:
    """A second Adam over the same offloaded copies has moments of its own, as in memory: the
    first one's state is not overwritten by the second one's (it was: both used one region)."""
    results = []
    for offload in (None, OptimOffload(tmp_path, **SMALL)):
        rp = RoundPipe(model(), optim_dtype=torch.float32, optim_offload=offload)
        first = roundpipe.optim.Adam(rp.optim_parameters(), state_dtype=state_dtype)
        train(rp, first, 2, is_async=False)
        second = roundpipe.optim.Adam(rp.optim_parameters(), lr=0.01, state_dtype=state_dtype)
        train(rp, second, 1, is_async=False)
        train(rp, first, 1, is_async=False)
        results.append((first, second))
    (memory_first, memory_second), (disk_first, disk_second) = results
    assert_same_state(disk_first, memory_first)
    assert_same_state(disk_second, memory_second)


def test_a_step_that_cannot_create_the_moments_file_can_be_retried(tmp_path: Path) -> None:
    """The folder removed before the first step: that step raises naming the file, and once
    the folder is back the next step runs as in memory after a failed step (it raised "regions
    names no file" for ever: the failed step left a state with a step count and no moments)."""
    results = []
    for offload in (None, tmp_path / "scratch"):
        if offload is not None:
            offload.mkdir()
        rp = RoundPipe(model(), optim_dtype=torch.float32, optim_offload=offload)
        adam = roundpipe.optim.Adam(rp.optim_parameters())
        x, y = data(1)[0]
        rp.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=CONFIG)

        def first_step(offload: Path | None = offload, adam: torch.optim.Optimizer = adam) -> None:
            if offload is None:
                raise FileNotFoundError("the in-memory run fails its first step too")
            adam.step()

        if offload is not None:
            shutil.rmtree(offload)
        with pytest.raises(FileNotFoundError, match="moments" if offload else "in-memory"):
            rp.step(first_step, is_async=False)
        if offload is not None:
            offload.mkdir()
        train(rp, adam, 2, is_async=False)
        results.append(adam)
    assert_same_state(results[1], results[0])


def test_other_optimizers_are_refused(tmp_path: Path) -> None:
    rp = RoundPipe(model(), optim_dtype=torch.float32, optim_offload=tmp_path)
    sgd = torch.optim.SGD(rp.optim_parameters(), lr=0.1)
    x, y = data(1)[0]
    rp.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=CONFIG)
    with pytest.raises(TypeError, match=r"roundpipe\.optim\.Adam"):
        rp.step(sgd.step, is_async=False)
    # In-memory parameters stay any optimizer's.
    plain = nn.Linear(2, 2)
    torch.optim.SGD(plain.parameters(), lr=0.1).step()


def test_needs_float32_copies(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"optim_dtype=torch\.float32"):
        RoundPipe(model(), optim_offload=tmp_path)
    with pytest.raises(TypeError, match="optim_offload"):
        RoundPipe(model(), optim_dtype=torch.float32, optim_offload=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="buffers"):
        OptimOffload(tmp_path, buffers=2)


def test_amsgrad_is_refused(tmp_path: Path) -> None:
    rp = RoundPipe(model(), optim_dtype=torch.float32, optim_offload=tmp_path)
    adam = roundpipe.optim.Adam(rp.optim_parameters(), amsgrad=True)
    x, y = data(1)[0]
    rp.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=CONFIG)
    with pytest.raises(ValueError, match="amsgrad"):
        rp.step(adam.step, is_async=False)


def test_missing_or_read_only_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        RoundPipe(model(), optim_dtype=torch.float32, optim_offload=tmp_path / "missing")
    plain_file = tmp_path / "file"
    plain_file.write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        RoundPipe(model(), optim_dtype=torch.float32, optim_offload=plain_file)
    read_only = tmp_path / "read_only"
    read_only.mkdir()
    read_only.chmod(0o555)
    try:
        if os.access(read_only, os.W_OK):
            pytest.skip("this user writes into read-only folders (root)")
        with pytest.raises(ValueError, match="not writable"):
            RoundPipe(model(), optim_dtype=torch.float32, optim_offload=read_only)
    finally:
        read_only.chmod(0o755)


def test_one_model_per_folder_and_files_removed(tmp_path: Path) -> None:
    first = RoundPipe(model(), optim_dtype=torch.float32, optim_offload=tmp_path)
    adam = roundpipe.optim.Adam(first.optim_parameters())
    train(first, adam, 1, is_async=False)
    with pytest.raises(ValueError, match="in use by another model or process"):
        RoundPipe(model(), optim_dtype=torch.float32, optim_offload=tmp_path)
    script = textwrap.dedent(
        f"""
        import torch, roundpipe
        try:
            roundpipe.RoundPipe(torch.nn.Linear(2, 2).bfloat16(), optim_dtype=torch.float32,
                                optim_offload={str(tmp_path)!r})
        except ValueError as error:
            print("refused:", error)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert "refused:" in out.stdout and "in use" in out.stdout
    del first, adam
    gc.collect()
    assert os.listdir(tmp_path) == []
    second = RoundPipe(model(), optim_dtype=torch.float32, optim_offload=tmp_path)
    assert second.optim_parameters() is not None


def test_the_files_are_closed_when_the_model_is_gone(tmp_path: Path) -> None:
    """Once a model is gone, the process holds no file of its folder open, so the unlinked
    files' disk space is freed (their descriptors stayed open until the process ended: every
    model built in a process kept its whole state's space on the disk)."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd")

    def open_in_folder() -> list[str]:
        names = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith(str(tmp_path)):
                names.append(target)
        return names

    rp = RoundPipe(
        model(), optim_dtype=torch.float32, optim_offload=OptimOffload(tmp_path, **SMALL)
    )
    adam = roundpipe.optim.Adam(rp.optim_parameters())
    train(rp, adam, 1, is_async=True)
    assert open_in_folder()  # the masters, the moments and the lock
    del rp, adam
    gc.collect()
    assert open_in_folder() == []


def test_a_lock_released_while_it_is_taken_is_taken_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model gone (its lock file removed) between a new model's open of the lock file and its
    flock: the new model locks the file now in the folder, so a third one is refused (the new
    model held the removed file's lock, and the third took the folder as well)."""
    first = RoundPipe(model(), optim_dtype=torch.float32, optim_offload=tmp_path)
    real_flock = fcntl.flock
    gone = []

    def flock_after_the_first_is_gone(fd: int, operation: int) -> None:
        if not gone:  # the first model goes right after the second opened the lock file
            gone.append(True)
            del first_holder[:]
            gc.collect()
        real_flock(fd, operation)

    first_holder = [first]
    del first
    monkeypatch.setattr(fcntl, "flock", flock_after_the_first_is_gone)
    second = RoundPipe(model(), optim_dtype=torch.float32, optim_offload=tmp_path)
    monkeypatch.undo()
    assert gone
    with pytest.raises(ValueError, match="in use by another model or process"):
        RoundPipe(model(), optim_dtype=torch.float32, optim_offload=tmp_path)
    del second


def test_relative_folder_stays_where_it_was_when_the_directory_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative folder is the one under the working directory at construction, as with
    open(): the moments' file, created at the first step, and the lock go there even after a
    chdir (they went to the new directory, or the step raised FileNotFoundError)."""
    (tmp_path / "scratch").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    rp = RoundPipe(
        model(), optim_dtype=torch.float32, optim_offload=OptimOffload("scratch", **SMALL)
    )
    adam = roundpipe.optim.Adam(rp.optim_parameters())
    monkeypatch.chdir(tmp_path / "elsewhere")
    train(rp, adam, 2, is_async=False)
    assert os.listdir(tmp_path / "elsewhere") == []
    del rp, adam
    gc.collect()
    assert os.listdir(tmp_path / "scratch") == []


def test_offload_arguments_out_of_range_are_refused_at_construction(tmp_path: Path) -> None:
    """An empty folder (which would silently be the working directory) and values the native
    step cannot take raise ValueError naming the field when the config is built, not a
    TypeError from the binding at the first step."""
    with pytest.raises(ValueError, match=r"OptimOffload\.folder"):
        OptimOffload("")
    for name in ("buffers", "io_threads"):
        with pytest.raises(ValueError, match=rf"OptimOffload\.{name}"):
            OptimOffload(tmp_path, **{name: 1 << 40})
    with pytest.raises(ValueError, match=r"OptimOffload\.chunk_elements"):
        OptimOffload(tmp_path, chunk_elements=1 << 62)


_FORK = """
import os, subprocess, sys, torch, roundpipe
folder = sys.argv[1]
model = roundpipe.RoundPipe(torch.nn.Linear(2, 2).bfloat16(), optim_dtype=torch.float32,
                            optim_offload=folder)
pid = os.fork()
if pid == 0:
    sys.exit(0)  # the child ends as a Python program does, running its exit handlers
os.waitpid(pid, 0)
print("files", sorted(os.listdir(folder)))
other = (
    "import sys, torch, roundpipe\\n"
    "try:\\n"
    "    roundpipe.RoundPipe(torch.nn.Linear(2, 2).bfloat16(), optim_dtype=torch.float32,\\n"
    "                        optim_offload=sys.argv[1])\\n"
    "    print('taken')\\n"
    "except ValueError as error:\\n"
    "    print('refused:', error)\\n"
)
print(subprocess.run([sys.executable, "-c", other, folder], capture_output=True, text=True).stdout)
"""


def _run_on_scratch(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    """Runs the script ``source`` in a fresh interpreter with a new folder as its argument."""
    script = tmp_path / "script.py"
    script.write_text(source)
    folder = tmp_path / "scratch"
    folder.mkdir()
    return subprocess.run(
        [sys.executable, str(script), str(folder)], capture_output=True, text=True, timeout=300
    )


def test_a_forked_child_leaves_the_parents_lock(tmp_path: Path) -> None:
    """A child forked from a process that holds a folder shares its lock: when the child exits,
    the lock file stays, and another process is still refused (the child removed the file, and
    the other process then took the folder in use)."""
    out = _run_on_scratch(tmp_path, _FORK)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "files ['roundpipe-rank0.lock']" in out.stdout, out.stdout + out.stderr
    assert "refused:" in out.stdout and "in use" in out.stdout, out.stdout + out.stderr


_MANY_TENSORS = """
import copy, resource, sys, torch, roundpipe
from torch import nn
# Far fewer descriptors than the state's 1,500 tensors (300 copies, their moments and scales).
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
torch.manual_seed(0)
net = nn.Sequential(*[nn.Linear(8, 8) for _ in range(150)]).to(torch.bfloat16)
x, y = torch.randn(4, 8).bfloat16(), torch.randn(4, 8).bfloat16()
loss_fn = lambda out, label: ((out.float() - label.float()) ** 2).mean()
results = []
for offload in (None, sys.argv[1]):
    rp = roundpipe.RoundPipe(copy.deepcopy(net), optim_dtype=torch.float32, optim_offload=offload)
    adam = roundpipe.optim.Adam(rp.optim_parameters(), lr=0.01, state_dtype=torch.int8)
    for _ in range(2):
        rp.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
        rp.step(lambda: (adam.step(), adam.zero_grad()))
    rp.synchronize()
    results.append([p.detach().clone() for p in rp.model.parameters()])
print("same", all(torch.equal(a, b) for a, b in zip(*results, strict=True)))
"""


def test_a_model_of_many_tensors_needs_no_descriptor_per_tensor(tmp_path: Path) -> None:
    """Each offloaded tensor is a memory map that keeps no descriptor: a model whose copies,
    moments and scales number far more than the process's open-file limit trains as in memory
    (Python's mmap kept one per tensor: a 7B model's ~300 tensors with 8-bit moments passed a
    limit of 1,024 and its first step raised 'Too many open files')."""
    out = _run_on_scratch(tmp_path, _MANY_TENSORS)
    assert "same True" in out.stdout, out.stdout + out.stderr


def test_a_region_past_the_files_end_is_refused_not_mapped(tmp_path: Path) -> None:
    """The native mapping refuses bytes past the file's end (touching them would kill the
    process with SIGBUS) and a closed descriptor, with errors naming the file."""
    from roundpipe._native import _C

    fd = os.open(tmp_path / "state.bin", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(ValueError, match=r"past the end of state\.bin"):
            _C.map_file_region(fd, "state.bin", 0, 4096)
        os.ftruncate(fd, 8192)
        mapped = _C.map_file_region(fd, "state.bin", 4096, 4096)
        mapped.fill_(7)
        assert os.pread(fd, 4, 4096) == bytes([7] * 4)
    finally:
        os.close(fd)
    with pytest.raises(OSError, match=r"closed\.bin"):
        _C.map_file_region(fd, "closed.bin", 0, 4096)


_FULL_DISK = """
import errno, sys, torch, roundpipe
from torch import nn
folder = sys.argv[1]
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(600, 700), nn.Tanh(), nn.Linear(700, 4)).to(torch.bfloat16)
rp = roundpipe.RoundPipe(net, optim_dtype=torch.float32, optim_offload=folder)
adam = roundpipe.optim.Adam(rp.optim_parameters(), lr=0.01)
x = torch.randn(4, 600).bfloat16()
y = torch.randn(4, 4).bfloat16()
loss_fn = lambda out, label: ((out.float() - label.float()) ** 2).mean()
rp.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn)
try:
    rp.step(adam.step, is_async=sys.argv[2] == "async")
    rp.synchronize()
except OSError as error:
    cause = error.__cause__ if isinstance(error.__cause__, OSError) else error
    print("errno", errno.errorcode.get(cause.errno), "file", cause.filename)
    print("message", error)
out = rp.forward(x)
print("usable", bool(torch.isfinite(out.float()).all()))
roundpipe.save_checkpoint(sys.argv[3], rp, adam)  # elsewhere: only the scratch folder is full
saved = torch.load(sys.argv[3], weights_only=True)["optimizer"]["state"]
print("saved", all(bool(v.isfinite().all()) for state in saved.values() for v in state.values()))
"""


def test_read_only_filesystem_is_refused_at_construction(tmp_path: Path) -> None:
    """A folder on a filesystem mounted read-only (in a user and mount namespace of its own, so
    that even root cannot write there): ValueError when the model is built."""
    unshare = shutil.which("unshare")
    if unshare is None or shutil.which("mount") is None:
        pytest.skip("needs unshare and mount for a read-only filesystem")
    folder = tmp_path / "ro"
    folder.mkdir()
    script = (
        "import torch, roundpipe\n"
        "try:\n"
        f"    roundpipe.RoundPipe(torch.nn.Linear(2, 2).bfloat16(), optim_dtype=torch.float32,"
        f" optim_offload={str(folder)!r})\n"
        "except ValueError as error:\n"
        "    print('refused:', error)\n"
    )
    command = f'mount -t tmpfs -o size=1m,ro tmpfs {folder} && exec {sys.executable} -c "$0"'
    out = subprocess.run(
        [unshare, "--user", "--map-root-user", "--mount", "sh", "-c", command, script],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if out.returncode != 0 and "refused" not in out.stdout:
        pytest.skip(f"cannot mount a read-only tmpfs here: {out.stderr.strip()}")
    assert "refused:" in out.stdout and "not writable" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_full_disk_raises_naming_the_file(tmp_path: Path, mode: str) -> None:
    """A 3 MiB tmpfs (mounted in a user and mount namespace of its own) holds the masters
    (1.7 MB) but not the fp32 moments the first step writes (3.4 MB): ENOSPC. A checkpoint saved
    elsewhere afterwards reads the moments: it works (it died of SIGBUS on a hole of the full
    filesystem's file)."""
    unshare, mount = shutil.which("unshare"), shutil.which("mount")
    if unshare is None or mount is None:
        pytest.skip("needs unshare and mount for a small filesystem")
    folder = tmp_path / "small"
    folder.mkdir()
    script = tmp_path / "full_disk.py"
    script.write_text(_FULL_DISK)
    command = (
        f"mount -t tmpfs -o size=3m tmpfs {folder} && "
        f"exec {sys.executable} {script} {folder} {mode} {tmp_path / 'checkpoint.pt'}"
    )
    env = dict(os.environ)
    out = subprocess.run(
        [unshare, "--user", "--map-root-user", "--mount", "sh", "-c", command],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    if "mount" in out.stderr and out.returncode != 0 and "errno" not in out.stdout:
        pytest.skip(f"cannot mount a small tmpfs here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    assert f"errno {errno.errorcode[errno.ENOSPC]} file {folder}" in out.stdout, out.stdout
    assert "optimizer step" in out.stdout  # the message names the model's phase
    assert "usable True" in out.stdout
    assert "saved True" in out.stdout


def _run_ranks(tmp_path: Path, tag: str, **cfg: Any) -> list[dict[str, Any]]:
    """tests/dp_worker.py's bf16 training at 2 gloo ranks; what each rank saved."""
    out = tmp_path / tag
    out.mkdir()
    base = {"dtype": "bf16", "is_async": True, "scenario": "plain", "out": str(out)}
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(roundpipe.__file__).resolve().parent.parent)}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                json.dumps({**base, **cfg, "rank": r, "world": 2, "port": port}),
            ],
            env={**env, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(2)
    ]
    logs = [proc.communicate(timeout=300)[0].decode(errors="replace") for proc in procs]
    results = []
    for rank, log in enumerate(logs):
        path = out / f"rank{rank}.pt"
        assert path.exists(), log
        result = torch.load(path)
        assert "error" not in result, result["error"]
        results.append(result)
    return results


@pytest.mark.parametrize("state_dtype", ["float32", "int8"])
def test_data_parallel_ranks_match_in_memory(tmp_path: Path, state_dtype: str) -> None:
    """2 ranks, each with its shard's state in its own files of one shared folder: the same
    bits as 2 ranks with their state in memory."""
    folder = tmp_path / "offload"
    folder.mkdir()
    expected = _run_ranks(tmp_path, "memory", state_dtype=state_dtype)
    got = _run_ranks(tmp_path, "disk", state_dtype=state_dtype, offload=str(folder))
    for mine, theirs in zip(got, expected, strict=True):
        assert mine["params"].keys() == theirs["params"].keys()
        for name, value in mine["params"].items():
            assert same_bits(value, theirs["params"][name]), name
        for piece, other in zip(mine["shard"], theirs["shard"], strict=True):
            assert piece[:4] == other[:4]
            assert same_bits(piece[4], other[4]), piece[0]
        assert mine["norms"] == theirs["norms"]
    # Each rank's data files are gone with it (the ranks leave by os._exit, which runs no exit
    # hook, so a released lock file may stay, as after kill -9).
    assert all(name.endswith(".lock") for name in os.listdir(folder)), os.listdir(folder)


def test_data_parallel_sharded_checkpoint_resumes_bit_exactly(tmp_path: Path) -> None:
    """2 ranks with offloaded state save a sharded checkpoint folder with a step in flight; 2 new
    ranks (new offload folder) load it and end with the uninterrupted run's bits."""
    folders = [tmp_path / "first", tmp_path / "second"]
    for folder in folders:
        folder.mkdir()
    ckpt = str(tmp_path / "ckpt")
    common = {"state_dtype": "int8", "ckpt": ckpt}
    straight = _run_ranks(tmp_path, "straight", **common, save_at=1, offload=str(folders[0]))
    resumed = _run_ranks(tmp_path, "resumed", **common, resume=True, offload=str(folders[1]))
    for mine, theirs in zip(resumed, straight, strict=True):
        for name, value in mine["params"].items():
            assert same_bits(value, theirs["params"][name]), name
        for piece, other in zip(mine["shard"], theirs["shard"], strict=True):
            assert same_bits(piece[4], other[4]), piece[0]


_KILLED = """
import os, signal, sys, torch, roundpipe
sys.path.insert(0, sys.argv[1])
from test_optim_offload import CONFIG, data, model, mse
folder, checkpoint, phase = sys.argv[2], sys.argv[3], sys.argv[4]
rp = roundpipe.RoundPipe(model(), optim_dtype=torch.float32, optim_offload=folder)
adam = roundpipe.optim.Adam(rp.optim_parameters(), lr=0.001, state_dtype=torch.int8)

def step_fn(kill):
    adam.step()
    adam.zero_grad()
    if kill:  # the step's state is on disk, its job not finished
        os.kill(os.getpid(), signal.SIGKILL)

if phase == "resume":
    roundpipe.load_checkpoint(checkpoint, rp, adam)
for i, (x, y) in enumerate(data(2)):
    loss = rp.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=CONFIG)
    print("loss", float(loss), flush=True)
    rp.step(step_fn, False, phase == "first" and i == 1)
    if phase == "first" and i == 0:
        roundpipe.save_checkpoint(checkpoint, rp, adam)
"""


def test_kill_9_during_a_step_then_resume_from_the_checkpoint(tmp_path: Path) -> None:
    """A process killed by SIGKILL in a step leaves no state files and a free folder; another
    process loads the last checkpoint and goes on as a run that was never killed."""
    folder = tmp_path / "state"
    folder.mkdir()
    script = tmp_path / "killed.py"
    script.write_text(_KILLED)
    tests = str(Path(__file__).parent)

    def run(phase: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, str(script), tests, str(folder), str(tmp_path / "ck"), phase]
        return subprocess.run(command, capture_output=True, text=True, timeout=300)

    first = run("first")
    assert first.returncode == -9, first.stderr
    assert all(name.endswith(".lock") for name in os.listdir(folder))
    resumed = run("resume")
    assert resumed.returncode == 0, resumed.stderr
    got = [float(line.split()[1]) for line in resumed.stdout.splitlines()]

    in_memory = RoundPipe(model(), optim_dtype=torch.float32)
    adam = roundpipe.optim.Adam(in_memory.optim_parameters(), lr=0.001, state_dtype=torch.int8)
    expected = [float(v) for v in train(in_memory, adam, 3, is_async=False)]
    assert got == expected[1:]
