"""Data-parallel RoundPipe over torch.distributed (gloo on loopback), in spawned processes.

Each case runs ``tests/dp_worker.py`` once per rank (and once more as the reference: one process,
no torch.distributed, the whole batch) and compares what they saved: N ranks training on
``batch / N`` each must end with the reference's parameters and optimizer copies (fp64: within
summation-order rounding; bf16 weights with fp32 copies: allclose), the global gradient norms
must be the reference's, GradScaler must skip the same steps, and failures must surface as
errors within the process group's timeout.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import roundpipe
import torch
import torch.distributed as dist

WORKER = Path(__file__).with_name("dp_worker.py")
PYTHON_PATH = str(Path(roundpipe.__file__).resolve().parent.parent)
PROCESS_TIMEOUT = 120

_spec = importlib.util.spec_from_file_location("dp_worker", WORKER)
assert _spec is not None and _spec.loader is not None
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launch(cfg: dict[str, Any]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": PYTHON_PATH, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, str(WORKER), json.dumps(cfg)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def run(
    tmp_path: Path, world: int, reference: bool = True, **cfg: Any
) -> tuple[list[dict[str, Any] | None], dict[str, Any] | None, list[int]]:
    """Run ``world`` ranks and, meanwhile, the reference in this process; wait for the ranks
    (bounded). Returns what each rank saved (None if it saved nothing), the reference's, and
    the exit codes."""
    base = {"dtype": "float64", "is_async": True, "scenario": "plain", "out": str(tmp_path)}
    base.update(cfg)
    port = _free_port()
    procs = [_launch({**base, "rank": r, "world": world, "port": port}) for r in range(world)]
    ref: dict[str, Any] | None = None
    if reference:
        ref = {"norms": [], "scales": []}
        worker.train(base, 0, 1, None, ref)
    codes, logs = [], []
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=PROCESS_TIMEOUT)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            pytest.fail("a data-parallel rank hung past the test's bound")
        codes.append(proc.returncode)
        logs.append(output.decode(errors="replace"))

    def load(name: str) -> dict[str, Any] | None:
        path = tmp_path / name
        return torch.load(path) if path.exists() else None

    results = [load(f"rank{r}.pt") for r in range(world)]
    for result, code, log in zip(results, codes, logs, strict=False):
        if result is None and code == 0:
            pytest.fail(f"a rank exited without a result:\n{log}")
    return results, ref, codes


def _full_copies(results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The optimizer copies reassembled from every rank's shard pieces."""
    full: dict[str, torch.Tensor] = {}
    for result in results:
        for name, shape, start, stop, copy in result["shard"]:
            flat = full.setdefault(name, torch.full((torch.Size(shape).numel(),), float("nan")))
            flat = flat.to(copy.dtype) if flat.dtype != copy.dtype else flat
            flat[start:stop] = copy.reshape(-1)
            full[name] = flat
    return full


def assert_matches(
    results: list[dict[str, Any] | None],
    ref: dict[str, Any] | None,
    rtol: float,
    atol: float,
    norm_rtol: float = 1e-9,
) -> None:
    assert ref is not None and "error" not in ref, ref
    world = len(results)
    for rank, result in enumerate(results):
        assert result is not None and "error" not in result, result
        assert result["rank_world"] == (rank, world)
        for name, value in ref["params"].items():
            torch.testing.assert_close(result["params"][name], value, rtol=rtol, atol=atol)
        assert result["norms"] == pytest.approx(ref["norms"], rel=norm_rtol)
        assert result["scales"] == ref["scales"]
    copies = _full_copies(results)  # type: ignore[arg-type]
    ref_copies = {name: copy.reshape(-1) for name, _, _, _, copy in ref["shard"]}
    assert copies.keys() == ref_copies.keys()
    for name, value in ref_copies.items():
        torch.testing.assert_close(copies[name], value, rtol=rtol, atol=atol)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "is_async", "chunk", "delay", "reduce"),
    [
        (2, False, 0, False, "host"),
        (3, True, 128, True, "host"),
        (2, False, 0, False, "stage"),
        (3, True, 0, True, "stage"),
    ],
    ids=[
        "2ranks-sync",
        "3ranks-async-chunked-delayed",
        "2ranks-sync-stage-reduce",
        "3ranks-async-delayed-stage-reduce",
    ],
)
def test_fp64_ranks_equal_one_process(
    tmp_path: Path, world: int, is_async: bool, chunk: int, delay: bool, reduce: str
):
    # torch.optim.Adam on the shards, a StepLR schedule and model.clip_grad_norm_ every step.
    # 3 ranks: pieces straddle parameters and the last shard is padded; chunks of 128 bytes;
    # random pauses before every collective, different per rank, while the next iteration
    # computes (a transport wrapper that shakes out overlap races). "stage": the gradients are
    # reduced at the end of each backward stage (each rank downloads its own shard only), on
    # the main thread while the previous step's all-gather runs on the optimizer thread.
    trace = reduce == "stage" and not is_async
    results, ref, _ = run(
        tmp_path, world, is_async=is_async, chunk=chunk, delay=delay, reduce=reduce, trace=trace
    )
    assert_matches(results, ref, rtol=1e-10, atol=1e-12)
    assert all(ref["norms"]), "clipping must have seen nonzero gradients"
    for result in results:
        assert "data_parallel_group" in result["auto_error"]  # type: ignore[index]
    if trace:  # every backward stage of every call shows its reduce in the timeline
        for rank in range(world):
            events = json.loads((tmp_path / f"trace{rank}.json").read_text())["traceEvents"]
            events.sort(key=lambda e: e.get("ts", 0))
            reduced = [e["args"]["layers"] for e in events if e.get("cat") == "grad_reduce"]
            stages = [
                e["args"]["layers"]
                for e in events
                if e.get("cat") in ("backward", "fused") and e["args"]["microbatch"] == 0
            ]
            assert len(stages) >= worker.ITERATIONS and reduced == stages, (reduced, stages)


@pytest.mark.slow
@pytest.mark.parametrize("reduce", ["host", "stage"])
def test_bf16_weights_fp32_copies_equal_one_process(tmp_path: Path, reduce: str):
    # bf16 Linear weights and an fp32 LayerNorm (two gradient dtypes, in one shard),
    # fp32 copies stepped by roundpipe.optim.Adam (fused bf16 write-back into the staging).
    results, ref, _ = run(tmp_path, 2, dtype="bf16", reduce=reduce)
    assert_matches(results, ref, rtol=0.0, atol=2e-3, norm_rtol=1e-3)
    copies = _full_copies(results)  # type: ignore[arg-type]
    ref_copies = {name: copy.reshape(-1) for name, _, _, _, copy in ref["shard"]}  # type: ignore[index]
    for name, value in ref_copies.items():
        assert copies[name].dtype == torch.float32
        torch.testing.assert_close(copies[name], value, rtol=1e-3, atol=1e-3)


@pytest.mark.slow
def test_grad_scaler_overflow_on_one_rank_skips_everywhere(tmp_path: Path):
    # The last rank alone sees an inf in its shard at iteration 1: every rank must skip that step
    # (else rank 0 steps its shard and its weights leave the reference's) and back off alike.
    results, ref, _ = run(tmp_path, 2, dtype="fp16", scenario="scaler", is_async=False)
    assert ref is not None and ref["scales"] == [1024.0, 1024.0, 512.0, 512.0]
    assert_matches(results, ref, rtol=1e-3, atol=1e-3)


@pytest.mark.slow
def test_replicas_start_from_rank_0s_weights_as_ddp_makes_them(tmp_path: Path):
    # Rank 1 builds its model from another seed: as DistributedDataParallel broadcasts rank
    # 0's parameters and buffers at construction, ours does, and training equals one process
    # that built rank 0's model.
    results, ref, _ = run(tmp_path, 2, scenario="seed", is_async=False)
    assert_matches(results, ref, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_world_size_one_group_is_no_group(tmp_path: Path):
    # The same training as without a group (only thread counts differ: rounding-level bounds).
    results, ref, _ = run(tmp_path, 1)
    assert_matches(results, ref, rtol=1e-12, atol=1e-14)


@pytest.mark.slow
def test_mismatched_models_raise_on_every_rank(tmp_path: Path):
    results, _, _ = run(tmp_path, 2, reference=False, scenario="mismatch")
    for result in results:
        assert result is not None
        error = result["error"]
        assert error.startswith("ValueError") and "on rank 1" in error, error
        assert "parameters[0]" in error and "(11, 6)" in error, error


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["raise", "exit"])
def test_failed_rank_makes_the_others_raise(tmp_path: Path, scenario: str):
    # Rank 1 raises in step_fn (and stays alive) or exits: rank 0 must raise a clear error
    # within the group's timeout (5 s here), not hang.
    results, _, codes = run(tmp_path, 2, reference=False, scenario=scenario, timeout=5)
    error = results[0]["error"] if results[0] is not None else ""
    assert "RoundPipe model 'dp': optimizer step (" in error, error
    phases = (
        "data-parallel gradient reduce",
        "weight all-gather",
        "data-parallel gradient norm",
        "data-parallel agreement",  # the ranks agree on each step before its collectives
    )
    assert any(phase in error for phase in phases), error
    if scenario == "raise":
        assert results[1] is not None and "rank 1 fails on purpose" in results[1]["error"]
    else:
        assert codes[1] == 3


@pytest.mark.slow
def test_dead_rank_during_stage_reduces_makes_the_others_raise(tmp_path: Path):
    # Rank 1 exits before its second call: rank 0 waits in that call's first reduce and must
    # raise a clear error within the group's timeout (5 s here), naming the phase.
    results, _, codes = run(
        tmp_path, 2, reference=False, scenario="exit", reduce="stage", timeout=5
    )
    error = results[0]["error"] if results[0] is not None else ""
    assert "RoundPipe model 'dp'" in error and "data-parallel gradient reduce" in error, error
    assert codes[1] == 3


@pytest.mark.slow
def test_stage_reduce_refuses_ranks_out_of_step(tmp_path: Path):
    # Rank 1 runs one backward call more before its step: reducing it with rank 0's next
    # iteration would train on mixed-up gradients. Both ranks must raise instead, rank 0 naming
    # the disagreement (rank 1 may instead time out in a collective rank 0 left).
    results, _, _ = run(
        tmp_path, 2, reference=False, scenario="extra_call", reduce="stage", timeout=5
    )
    errors = [result["error"] if result is not None else "" for result in results]
    assert "must run the same backward calls" in errors[0], errors
    assert "differs on rank 1 from rank 0's" in errors[0], errors
    # Rank 0 meets rank 1's extra call at its step's agreement (or, had it got there first,
    # at the next call's reduce).
    assert "RoundPipe model 'dp'" in errors[0], errors
    assert "optimizer step (data-parallel agreement)" in errors[0] or (
        "data-parallel gradient reduce" in errors[0]
    ), errors
    assert errors[1], "rank 1 must fail too"


def test_invalid_group_arguments():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="data_parallel_group must be"):
        roundpipe.RoundPipe(model, data_parallel_group="world")
    with pytest.raises(ValueError, match="data_parallel_reduce must be one of"):
        roundpipe.RoundPipe(model, data_parallel_reduce="gpu")
    with pytest.raises(TypeError, match="data_parallel_reduce must be a str"):
        roundpipe.RoundPipe(model, data_parallel_reduce=None)  # type: ignore[arg-type]
    if not dist.is_initialized():
        group = dist.ProcessGroup(dist.HashStore(), 0, 1)
        with pytest.raises(ValueError, match="init_process_group"):
            roundpipe.RoundPipe(model, data_parallel_group=group)


def test_clip_grad_norm_without_data_parallel_is_torchs():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 3))
    reference = [p.detach().clone() for p in model.parameters()]
    rp = roundpipe.RoundPipe(model, name="clip")
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    rp.forward_backward(input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).sum())
    plain = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 3))
    with torch.no_grad():
        for param, value in zip(plain.parameters(), reference, strict=True):
            param.copy_(value)
    ((plain(x) - y) ** 2).sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
    got: list[torch.Tensor] = []
    rp.step(lambda: got.append(rp.clip_grad_norm_(0.1)), is_async=False)
    torch.testing.assert_close(got[0], expected)
    for copy, param in zip(rp.optim_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(copy.grad, param.grad)


@pytest.mark.slow
@pytest.mark.parametrize("is_async", [True, False], ids=["async", "sync"])
def test_sharded_checkpoint_resumes_at_other_world_sizes(tmp_path: Path, is_async: bool):
    # 2 ranks save a checkpoint folder after iteration 1 (an asynchronous step in flight: the
    # copies are a step ahead of the weights) and train on: saving must not change training.
    # 3 ranks, then one process without torch.distributed, resume from it and must end where
    # an uninterrupted run ends (fp64: summation-order rounding only).
    ckpt = str(tmp_path / "ckpt")
    _, ref, _ = run(_folder(tmp_path, "ref"), 0, is_async=is_async)
    saved, _, _ = run(
        _folder(tmp_path, "save"), 2, reference=False, is_async=is_async, save_at=1, ckpt=ckpt
    )
    assert_matches(saved, ref, rtol=1e-10, atol=1e-12)
    resumed, _, _ = run(
        _folder(tmp_path, "resume3"), 3, reference=False, is_async=is_async, resume=True, ckpt=ckpt
    )
    alone: dict[str, Any] = {"norms": [], "scales": []}
    cfg = {"dtype": "float64", "is_async": is_async, "scenario": "plain", "resume": True}
    worker.train({**cfg, "ckpt": ckpt}, 0, 1, None, alone)
    assert ref is not None
    ref = {**ref, "norms": ref["norms"][2:]}  # the resumed runs clip iterations 2 and 3 only
    assert_matches(resumed, ref, rtol=1e-10, atol=1e-12)
    assert_matches([alone], ref, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
def test_one_process_checkpoint_file_gives_each_rank_its_pieces(tmp_path: Path):
    # A model state of one process (whole optimizer copies) loads into 3 ranks, each keeping
    # its piece; load_checkpoint of that file refuses clearly (its optimizer state is whole).
    ckpt = tmp_path / "one.pt"
    alone: dict[str, Any] = {"norms": [], "scales": []}
    cfg = {"dtype": "float64", "is_async": True, "scenario": "plain", "save_at": 1}
    worker.train({**cfg, "ckpt": str(ckpt)}, 0, 1, None, alone)
    whole = torch.load(ckpt, weights_only=True)["model"]
    results, _, _ = run(_folder(tmp_path, "ranks"), 3, reference=False, from_file=str(ckpt))
    copies = _full_copies(results)  # type: ignore[arg-type]
    for name, value in copies.items():
        torch.testing.assert_close(value, whole[f"_roundpipe.optim.{name}"].reshape(-1))
    for result in results:
        assert (
            result is not None
            and "data-parallel model loads checkpoint folders" in (result["file_error"])
        )


def _folder(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    return folder


def test_reduce_mode_resolution():
    # "auto" reduces on the device only for a pool on one GPU with NCCL; never on CPU devices.
    cpu, gpu0, gpu1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    nccl = dist.is_nccl_available()
    assert roundpipe.distributed.resolve_reduce_mode("auto", [cpu, cpu]) == "host"
    one_gpu = roundpipe.distributed.resolve_reduce_mode("auto", [gpu0, gpu0])
    assert one_gpu == ("stage" if nccl else "host")
    assert roundpipe.distributed.resolve_reduce_mode("auto", [gpu0, gpu1]) == "host"
    assert roundpipe.distributed.resolve_reduce_mode("stage", [cpu]) == "stage"
    assert roundpipe.distributed.resolve_reduce_mode("host", [gpu0]) == "host"
    if not nccl:
        with pytest.raises(ValueError, match="needs NCCL"):
            roundpipe.distributed.resolve_reduce_mode("stage", [gpu0])


def test_example_runs_under_torchrun_on_cpu():
    # The guide's command for examples/train_distributed.py, on this CPU-only machine.
    example = Path(__file__).resolve().parents[1] / "examples" / "train_distributed.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(example)]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=PROCESS_TIMEOUT, env=os.environ.copy()
    )
    assert done.returncode == 0, done.stdout + done.stderr
    first, last = done.stdout.strip().splitlines()[-1].removeprefix("loss ").split(" -> ")
    assert float(last) < float(first), done.stdout


# -- shared parameters and buffers -----------------------------------------------------------


def plain_tied_training() -> dict[str, torch.Tensor]:
    """dp_worker's "tied" training with synchronous steps, in plain PyTorch (one process, the
    whole batch in the worker's two microbatches)."""
    model = worker.build({"scenario": "tied"}, 0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for iteration in range(worker.ITERATIONS):
        x, y = worker.data(torch.float64, iteration, tokens=True)
        for xs, ys in zip(x.tensor_split(2), y.tensor_split(2), strict=True):
            loss = torch.nn.functional.cross_entropy(model(xs), ys, reduction="sum")
            (loss / worker.GLOBAL_BATCH).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return {name: param.detach() for name, param in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "reduce", "is_async"),
    [
        (2, "host", False),
        (2, "stage", False),
        (2, "stage", True),
        (3, "host", True),
        (3, "stage", False),
        (3, "stage", True),
    ],
)
def test_tied_weights_train_as_one_process(tmp_path: Path, world: int, reduce: str, is_async: bool):
    # An embedding tied to the output head: the head's use of the weight is an alias in the
    # last layer, whose gradient must reach the embedding's on every rank, whichever rank's
    # shard holds either ("stage": each rank downloads only its shard). At 3 ranks the last
    # shard lies inside the alias: that rank steps an empty piece and still takes part.
    results, ref, _ = run(tmp_path, world, scenario="tied", reduce=reduce, is_async=is_async)
    assert_matches(results, ref, rtol=1e-10, atol=1e-12)
    assert ref is not None
    if not is_async:
        for name, value in plain_tied_training().items():
            torch.testing.assert_close(ref["params"][name], value, rtol=1e-10, atol=1e-12)
    if world == 3:
        empty = [r for r in results if r is not None and all(p[2] == p[3] for p in r["shard"])]
        assert len(empty) == 1, [r["shard"] for r in results if r is not None]


@pytest.mark.slow
def test_empty_shard_rank_saves_and_resumes(tmp_path: Path):
    # 3 ranks with a rank whose shard holds no trainable element save a checkpoint folder;
    # 2 ranks resume from it and end where an uninterrupted run ends.
    ckpt = str(tmp_path / "ckpt")
    _, ref, _ = run(_folder(tmp_path, "ref"), 0, scenario="tied", is_async=False)
    saved, _, _ = run(
        _folder(tmp_path, "save"),
        3,
        reference=False,
        scenario="tied",
        is_async=False,
        save_at=1,
        ckpt=ckpt,
    )
    assert_matches(saved, ref, rtol=1e-10, atol=1e-12)
    resumed, _, _ = run(
        _folder(tmp_path, "resume"),
        2,
        reference=False,
        scenario="tied",
        is_async=False,
        resume=True,
        ckpt=ckpt,
    )
    assert ref is not None
    assert_matches(resumed, {**ref, "norms": ref["norms"][2:]}, rtol=1e-10, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "reduce"), [(2, "host"), (3, "stage")])
def test_buffers_follow_rank_0_as_under_ddp(tmp_path: Path, world: int, reduce: str):
    # BatchNorm statistics: every rank computes with rank 0's, as DistributedDataParallel
    # (broadcast_buffers=True) makes them, and holds rank 0's after every training call, so the
    # replicas and the checkpoint agree. Compared with DDP itself on the same data.
    ckpt = tmp_path / "ckpt"
    ours, _, _ = run(
        _folder(tmp_path, "ours"),
        world,
        reference=False,
        scenario="batchnorm",
        reduce=reduce,
        is_async=False,
        final_ckpt=str(ckpt),
    )
    ddp, _, _ = run(
        _folder(tmp_path, "ddp"), world, reference=False, scenario="batchnorm", ddp=True
    )
    assert all(r is not None and "error" not in r for r in ours + ddp), (ours, ddp)
    rank0 = ddp[0]
    assert rank0 is not None
    assert not torch.equal(ddp[1]["buffers"]["1.running_mean"], rank0["buffers"]["1.running_mean"])  # type: ignore[index]
    for result in ours:
        assert result is not None
        for name, value in rank0["buffers"].items():
            torch.testing.assert_close(result["buffers"][name], value, rtol=1e-9, atol=1e-12)
        for name, value in rank0["params"].items():
            torch.testing.assert_close(result["params"][name], value, rtol=1e-9, atol=1e-12)
    assert result["norms"] == pytest.approx(rank0["norms"], rel=1e-9)
    alone = roundpipe.RoundPipe(worker.build({"scenario": "batchnorm"}, 0), name="alone")
    roundpipe.load_checkpoint(str(ckpt), alone)
    for name, value in alone.model.named_buffers():
        torch.testing.assert_close(value, rank0["buffers"][name], rtol=1e-9, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["buffer_mismatch", "buffer_shape"])
def test_mismatched_buffers_raise_on_every_rank(tmp_path: Path, scenario: str):
    # Rank 1 keeps no BatchNorm statistics, or has a buffer of another size: the construction
    # check names it on every rank (it used to wait out the group timeout, or half-overwrite).
    results, _, _ = run(tmp_path, 2, reference=False, scenario=scenario, timeout=20)
    for result in results:
        assert result is not None
        error = result["error"]
        assert error.startswith("ValueError") and "on rank 1" in error and "buffers" in error


# -- misuse: a clear error on every rank, quickly, instead of a hang or an abort -------------


def test_group_read_before_init_process_group_is_refused(monkeypatch: pytest.MonkeyPatch):
    # dist.group.WORLD is None before init_process_group: under a launcher (WORLD_SIZE > 1)
    # passing it would have every rank train alone. Leaving the argument out still means that.
    if dist.is_initialized():
        pytest.skip("needs torch.distributed uninitialised")
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"init_process_group.*before creating the RoundPipe"):
        roundpipe.RoundPipe(model, data_parallel_group=dist.group.WORLD)
    assert roundpipe.RoundPipe(model).data_parallel_size == 1
    monkeypatch.setenv("WORLD_SIZE", "1")
    other = torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert roundpipe.RoundPipe(other, data_parallel_group=None).data_parallel_size == 1


@pytest.mark.slow
def test_stage_reduce_refuses_an_extra_call_before_a_synchronous_step(tmp_path: Path):
    # Rank 1 runs one forward_backward more, rank 0 steps synchronously: both raise the
    # ValueError of the asynchronous case within seconds (they used to wait out the timeout).
    results, _, _ = run(
        tmp_path,
        2,
        reference=False,
        scenario="extra_call",
        reduce="stage",
        is_async=False,
        timeout=60,
    )
    for result in results:
        assert result is not None
        error = result["error"]
        assert error.startswith("ValueError") and "out of step" in error, error
        assert "must run the same backward calls" in error, error


@pytest.mark.slow
@pytest.mark.parametrize("reduce", ["host", "stage"])
def test_save_on_rank_0_alone_raises_on_every_rank(tmp_path: Path, reduce: str):
    # DDP's habit, `if rank == 0: save`: gloo aborted rank 0 (its save's collectives met rank
    # 1's gradient reduce). Now both ranks raise, naming the rule, and nobody aborts.
    results, _, codes = run(
        tmp_path,
        2,
        reference=False,
        scenario="save_rank0",
        reduce=reduce,
        misuse_at=1,
        ckpt=str(tmp_path / "ckpt"),
        timeout=60,
    )
    assert codes == [0, 0]
    for result in results:
        assert result is not None
        error = result["error"]
        assert error.startswith("ValueError") and "every rank calls them" in error, error


@pytest.mark.slow
def test_per_rank_folders_raise_on_every_rank_and_keep_the_checkpoint(tmp_path: Path):
    # Every rank saves to a folder of its own at iteration 1; each rank must see the others'
    # files, so all raise, and no folder keeps this save's files or gets a manifest.
    ckpt = tmp_path / "ckpt"
    results, _, _ = run(
        _folder(tmp_path, "ranks"),
        2,
        reference=False,
        scenario="save_per_rank_folder",
        misuse_at=1,
        ckpt=str(ckpt),
        timeout=60,
    )
    for result in results:
        assert result is not None
        error = result["error"]
        assert error.startswith("ValueError") and "cannot see" in error, error
        assert "every rank must save to the same folder" in error, error
    for rank in range(2):
        folder = Path(f"{ckpt}_{rank}")
        assert not (folder / "MANIFEST.json").exists()
        assert not list(folder.glob("data-*")), list(folder.iterdir())


@pytest.mark.slow
def test_per_rank_extra_is_refused_on_every_rank(tmp_path: Path):
    ckpt = tmp_path / "ckpt"
    results, _, _ = run(
        _folder(tmp_path, "ranks"),
        2,
        reference=False,
        scenario="save_per_rank_extra",
        misuse_at=1,
        ckpt=str(ckpt),
        timeout=60,
    )
    for result in results:
        assert result is not None
        error = result["error"]
        assert error.startswith("ValueError") and "extra differs on rank 1" in error, error
    assert not (ckpt / "MANIFEST.json").exists()


def misuse_errors(tmp_path: Path, scenario: str) -> list[str]:
    """Run ``scenario`` of dp_worker's misuse_checkpoint at 2 ranks (checkpoint folder
    ``tmp_path/ckpt``); each rank's error, in rank order ("" where a rank raised none)."""
    results, _, codes = run(
        _folder(tmp_path, "ranks"),
        2,
        reference=False,
        scenario=scenario,
        misuse_at=1,
        ckpt=str(tmp_path / "ckpt"),
        timeout=60,
    )
    assert codes == [0, 0]
    assert all(result is not None for result in results), results
    return [result.get("error", "") for result in results]


@pytest.mark.slow
def test_a_rank_whose_extra_raises_makes_every_rank_raise(tmp_path: Path):
    # Rank 1's extra() raises before anything is written: rank 1 raises its own error, rank 0
    # hears of it at once (not at the group timeout), and nothing is written.
    errors = misuse_errors(tmp_path, "save_extra_raises_on_rank1")
    assert errors[1].startswith("KeyError") and "fails on rank 1" in errors[1], errors
    assert errors[0].startswith("RuntimeError") and "rank 1 failed" in errors[0], errors
    assert "KeyError" in errors[0] and "nothing was written" in errors[0], errors
    assert not (tmp_path / "ckpt" / "MANIFEST.json").exists()


@pytest.mark.slow
def test_a_checkpoint_folder_rank_0_cannot_create_makes_every_rank_raise(tmp_path: Path):
    # The ranks see different filesystems: the folder's parent exists on rank 1's only. Rank 0
    # refuses the path; rank 1, waiting at the save's agreement, hears of it at once.
    errors = misuse_errors(tmp_path, "save_folder_uncreatable_on_rank0")
    assert errors[0].startswith("FileNotFoundError"), errors
    assert errors[1].startswith("ValueError") and "rank 0 refused its arguments" in errors[1]
    assert not list((tmp_path / "present").glob("**/data-*"))


@pytest.mark.slow
def test_a_checkpoint_folder_rank_1_cannot_see_makes_every_rank_raise_on_load(tmp_path: Path):
    errors = misuse_errors(tmp_path, "load_folder_missing_on_rank1")
    assert errors[1].startswith("FileNotFoundError"), errors
    assert errors[0].startswith("ValueError") and "rank 1 refused its arguments" in errors[0]
    assert "load_checkpoint" in errors[0], errors


@pytest.mark.slow
def test_equal_extras_built_in_another_key_order_are_saved(tmp_path: Path):
    assert misuse_errors(tmp_path, "save_extra_in_another_key_order") == ["", ""]
    assert (tmp_path / "ckpt" / "MANIFEST.json").exists()
