"""Training throughput of a decoder-only transformer on one GPU: ours vs 0.1.1 vs GPU-resident.

The model is a plain ``nn.Sequential`` (embedding, N pre-norm blocks with causal attention and an
MLP, final norm + head), bf16 weights, so the pure-Python ``roundpipe==0.1.1`` wraps the identical
model. Three systems, each in a fresh subprocess per run (its own peak host RSS and GPU memory):

* ``ours``: ``RoundPipe(model, optim_dtype=torch.float32)``, ``roundpipe.optim.Adam``, async step;
* ``rp011``: the same code with ``roundpipe==0.1.1`` first on ``PYTHONPATH`` (``--peer-path``);
* ``resident``: the GPU-resident bound: the model wholly on the GPU, plain PyTorch, every block
  checkpointed, the same microbatches, fp32 master copies stepped by torch's fused Adam.

Runs alternate between the systems (``--rounds``) so drift cancels; the median is kept. With
``--fit-search`` the sequence length doubles until a run fails, per RoundPipe system.
``--cpu-smoke`` runs the whole flow on virtual CPU devices with a tiny model (CI and
``benchmarks/gpu/run.sh --cpu-smoke``); 0.1.1 needs CUDA, so its column then says why it is empty.

    python benchmarks/train_gpu.py --params 1G --seq 1024,4096,16384 --peer-path build/peer

``--record`` rewrites ``results/train_gpu.md`` with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from results import parse_count, write_result
from torch import nn
from torch.utils.checkpoint import checkpoint

SYSTEMS = ("ours", "rp011", "resident")
GIB = 2**30


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then a GELU MLP, both residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width, bias=False)
        self.proj = nn.Linear(width, width, bias=False)
        self.mlp_norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width, bias=False)
        self.down = nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        qkv = self.qkv(self.attn_norm(x)).view(batch, tokens, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, tokens, width))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


def block_count(params: int, width: int, vocab: int) -> int:
    """Blocks that bring the model nearest ``params`` (12 width^2 per block, embedding + head)."""
    return max(1, round((params - 2 * vocab * width) / (12 * width * width)))


def build_model(params: int, width: int, heads: int, vocab: int) -> nn.Sequential:
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no fp32 copy of 1B parameters
    try:
        blocks = [Block(width, heads) for _ in range(block_count(params, width, vocab))]
        head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, vocab, bias=False))
        return nn.Sequential(nn.Embedding(vocab, width), *blocks, head)
    finally:
        torch.set_default_dtype(previous)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    labels = labels.to(logits.device)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


Iteration = Callable[[torch.Tensor, torch.Tensor], None]


def roundpipe_runner(model: nn.Sequential) -> tuple[Iteration, Callable[[], None]]:
    """One training iteration of ``roundpipe`` (ours or 0.1.1: the same public API), and the
    call that waits for all of its work."""
    import roundpipe

    wrapped = roundpipe.RoundPipe(model, optim_dtype=torch.float32)
    optimizer = roundpipe.optim.Adam(wrapped.optim_parameters(), lr=1e-5)

    def step_fn() -> None:
        optimizer.step()
        optimizer.zero_grad()

    def iteration(x: torch.Tensor, y: torch.Tensor) -> None:
        wrapped.forward_backward(input_args=(x,), label=y, loss_fn=lm_loss)
        wrapped.step(step_fn)

    return iteration, wrapped.synchronize


def resident_runner(
    model: nn.Sequential, device: torch.device, microbatches: int
) -> tuple[Iteration, Callable[[], None]]:
    """The GPU-resident bound: same model, checkpointing, microbatches; fused fp32 Adam."""
    model = model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float() for p in params]
    fused = device.type == "cuda"
    optimizer = torch.optim.Adam(masters, lr=1e-5, fused=fused, foreach=None if fused else True)
    layers = list(model)

    def iteration(x: torch.Tensor, y: torch.Tensor) -> None:
        for xm, ym in zip(x.tensor_split(microbatches), y.tensor_split(microbatches), strict=True):
            h = xm.to(device, non_blocking=True)
            for layer in layers:
                h = checkpoint(layer, h, use_reentrant=False)
            lm_loss(h, ym.to(device, non_blocking=True)).backward()
        grads = [p.grad for p in params]
        for master, grad in zip(masters, grads, strict=True):
            master.grad = grad.float()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            torch._foreach_copy_(params, masters)
        for p in params:
            p.grad = None

    return iteration, (torch.cuda.synchronize if device.type == "cuda" else lambda: None)


def worker(args: argparse.Namespace) -> dict[str, object]:
    """One run of one system at one sequence length; returns its measurements."""
    on_cuda = not args.cpu_smoke
    if args.system == "rp011":
        import roundpipe

        where = Path(roundpipe.__file__).resolve()
        if args.peer_path is None or Path(args.peer_path).resolve() not in where.parents:
            raise RuntimeError(f"expected roundpipe 0.1.1 from {args.peer_path}, got {where}")
    model = build_model(parse_count(args.params), args.width, args.heads, args.vocab)
    n_params = sum(p.numel() for p in model.parameters())
    device = torch.device("cuda" if on_cuda else "cpu")
    if args.system == "resident":
        run, finish = resident_runner(model, device, args.microbatches)
    else:
        run, finish = roundpipe_runner(model)
    del model
    batch = max(args.tokens // args.seq, args.microbatches)
    generator = torch.Generator().manual_seed(1)
    data = torch.randint(0, args.vocab, (batch, args.seq + 1), generator=generator)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    for _ in range(args.warmup):
        run(x, y)
    finish()
    if on_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.iters):
        run(x, y)
    finish()
    if on_cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return {
        "tokens_per_s": args.iters * batch * args.seq / elapsed,
        "peak_rss": peak_rss_bytes(),
        "peak_gpu": torch.cuda.max_memory_allocated() if on_cuda else 0,
        "params": n_params,
        "batch": batch,
    }


def run_worker(
    system: str, seq: int, args: argparse.Namespace, deadline: float = float("inf")
) -> dict[str, object] | str:
    """Runs one worker subprocess, for at most ``--timeout`` seconds and never past
    ``deadline`` (``time.monotonic()``); its measurements, or a one-line reason it has none."""
    timeout = min(args.timeout, deadline - time.monotonic())
    if timeout <= 1:
        return "not run: the budget was spent"
    env = dict(os.environ)
    if system == "rp011":
        if not args.peer_path or not (Path(args.peer_path) / "roundpipe").is_dir():
            return f"not installed in --peer-path {args.peer_path} (tools/fetch_gpu_wheels.sh)"
        env["PYTHONPATH"] = str(Path(args.peer_path).resolve())
    command = [sys.executable, __file__, "--worker", "--system", system, "--seq", str(seq)]
    for name in ("params", "width", "heads", "vocab", "tokens", "iters", "warmup", "microbatches"):
        command += [f"--{name}", str(getattr(args, name))]
    if args.peer_path:
        command += ["--peer-path", args.peer_path]
    if args.cpu_smoke:
        command.append("--cpu-smoke")
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    if args.log_dir:
        log = Path(args.log_dir) / f"train_{system}_{seq}.log"
        with log.open("a") as handle:
            handle.write(done.stdout + done.stderr)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    reason = lines[-1] if lines else f"exit status {done.returncode}"
    if "OutOfMemory" in reason or "out of memory" in reason:
        return "OOM"
    if system == "rp011" and args.cpu_smoke:
        return f"0.1.1 cannot run without CUDA: {reason[:120]}"
    return reason[:160]


def fit_search(system: str, args: argparse.Namespace, deadline: float) -> str:
    """Doubles the sequence length from the largest asked-for one until a run fails."""
    seq, fits = max(args.seqs), "none"
    while seq <= args.fit_max and time.monotonic() < deadline:
        quick = argparse.Namespace(**{**vars(args), "iters": 1, "warmup": 1})
        result = run_worker(system, seq, quick, deadline)
        if isinstance(result, str):
            return fits if fits != "none" else f"none ({result})"
        fits, seq = str(seq), seq * 2
    return f">= {fits}" if fits != "none" else fits


def cell(value: float | None, scale: float = 1.0, digits: int = 0) -> str:
    return "—" if value is None else f"{value / scale:,.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", default="1G", help="model size, e.g. 1G, 300M (default 1G)")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", default="1024,4096,16384", help="comma-separated lengths")
    parser.add_argument("--tokens", type=int, default=32768, help="tokens per iteration")
    parser.add_argument("--iters", type=int, default=3, help="timed iterations per run")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs per system")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--microbatches", type=int, default=0, help="0: devices + 1 (default)")
    parser.add_argument("--peer-path", default=None, help="folder holding roundpipe==0.1.1")
    parser.add_argument("--fit-search", action="store_true", help="largest length that fits")
    parser.add_argument("--fit-max", type=int, default=262144)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--budget", type=float, default=0.0, help="seconds in all; 0: no limit")
    parser.add_argument("--log-dir", default=None, help="folder for each run's output")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU devices")
    parser.add_argument("--record", action="store_true", help="write results/train_gpu.md")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    # Ctrl-C (a caller's deadline) ends the runs with the table of what was measured, also when
    # this process was started in the background with SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.worker:
        args.seq = int(args.seq)
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    if args.cpu_smoke:
        os.environ["ROUNDPIPE_DEVICE_KIND"] = "cpu"
        os.environ.setdefault("ROUNDPIPE_CPU_DEVICES", "2")
    elif not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU machine, or pass --cpu-smoke")
    if args.microbatches <= 0:
        devices = (
            int(os.environ["ROUNDPIPE_CPU_DEVICES"])
            if args.cpu_smoke
            else torch.cuda.device_count()
        )
        args.microbatches = devices + 1
    args.seqs = [parse_count(s) for s in args.seq.split(",")]
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + (args.budget or float("inf"))

    runs: dict[tuple[str, int], list[dict[str, object]]] = {}
    notes: dict[tuple[str, int], str] = {}
    # Round-major, so a budget that runs out still leaves every length measured once.
    try:
        for round_index in range(args.rounds):
            for seq in args.seqs:
                order = systems if round_index % 2 == 0 else systems[::-1]  # A/B then B/A
                for system in order:
                    if (system, seq) in notes or time.monotonic() > deadline:
                        continue
                    result = run_worker(system, seq, args, deadline)
                    print(f"  seq {seq} round {round_index} {system}: {result}", flush=True)
                    if isinstance(result, str):
                        notes[(system, seq)] = result
                    else:
                        runs.setdefault((system, seq), []).append(result)
    except KeyboardInterrupt:
        print("interrupted: the table holds the runs that finished", flush=True)
        deadline = float("-inf")  # no fit search either

    def median(system: str, seq: int, key: str) -> float | None:
        values = [float(r[key]) for r in runs.get((system, seq), [])]  # type: ignore[arg-type]
        return statistics.median(values) if values else None

    device_name = "CPU devices" if args.cpu_smoke else torch.cuda.get_device_name(0)
    params = next((r[0]["params"] for r in runs.values()), None)
    rows = [
        f"{device_name}; model {params:,} parameters (width {args.width}, bf16, fp32 optimizer "
        f"copies); {args.tokens} tokens/iteration, {args.microbatches} microbatches, "
        f"median of {args.rounds} alternating runs x {args.iters} iterations",
        "",
        "| seq | system | tokens/s | vs 0.1.1 | vs resident | peak host RSS GiB | "
        "peak GPU GiB | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for seq in args.seqs:
        peer = median("rp011", seq, "tokens_per_s")
        bound = median("resident", seq, "tokens_per_s")
        for system in systems:
            rate = median(system, seq, "tokens_per_s")
            ratio_peer = f"{rate / peer:.2f}" if rate and peer and system != "rp011" else ""
            ratio_bound = f"{rate / bound:.2f}" if rate and bound and system != "resident" else ""
            rows.append(
                f"| {seq} | {system} | {cell(rate)} | {ratio_peer} | {ratio_bound} | "
                f"{cell(median(system, seq, 'peak_rss'), GIB, 2)} | "
                f"{cell(median(system, seq, 'peak_gpu'), GIB, 2)} | "
                f"{notes.get((system, seq), '')} |"
            )
    if args.fit_search:
        rows.append("")
        for system in (s for s in systems if s != "resident"):
            rows.append(f"- largest sequence length that fits, {system}: "
                        f"{fit_search(system, args, deadline)}")  # fmt: skip
    table = "\n".join(rows)
    print(table)
    if args.record:
        import roundpipe

        path = write_result(
            "train_gpu.py",
            "Training throughput on one GPU: ours, roundpipe 0.1.1 and the GPU-resident bound",
            f"roundpipe {roundpipe.__version__}, device {device_name}",
            table,
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
