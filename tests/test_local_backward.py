"""The backward passes of recomputed segments that run on the calling thread
(csrc/torch_internals/torch_internals.h): they compute what torch's engine computes, bitwise, and
every graph off their allow-list goes to the engine, which then computes what plain PyTorch
does."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import pytest
import roundpipe
import torch
from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe._native import _C
from torch import nn
from torch.utils.checkpoint import checkpoint

WIDTH, MICROBATCHES = 6, 2
# Passes run on the calling thread only where torch has graph exec groups, on a torch release
# they were checked on, and unless ROUNDPIPE_LOCAL_BACKWARD=0 (see BackwardScope).
RUNS_HERE = _C.local_backward_enabled()


def _loss(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((output - label) ** 2).mean()


def _counts() -> tuple[int, int]:
    """(passes run on the calling thread, passes run by torch's engine) so far."""
    here, engine = _C.backward_counts()
    return int(here), int(engine)


@pytest.fixture(params=[1, 3], ids=["1dev", "3dev"])
def devices(request: pytest.FixtureRequest) -> Iterator[int]:
    roundpipe.configure_devices(kind="cpu", num_cpu_devices=request.param)
    yield request.param
    roundpipe.configure_devices(kind="cpu", num_cpu_devices=1)


def _plan(layers: int) -> roundpipe.ModelExecutePlan:
    """Stages of two layers (the last two fused): every backward stage is recomputed."""
    plan = roundpipe.ModelExecutePlan()
    plan.fwd_plan = [range(i, min(i + 2, layers - 2)) for i in range(0, layers - 2, 2)]
    plan.bwd_plan = [range(layers - 2, layers), *plan.fwd_plan[::-1]]
    return plan


def _config(grain: str, layers: int) -> RoundPipeRunConfig:
    return RoundPipeRunConfig(
        num_microbatch=MICROBATCHES, recompute_grain=grain, execute_plan=_plan(layers)
    )


def _train_and_compare(
    plain: nn.Sequential,
    wrapped: RoundPipe,
    grain: str,
    context: Callable[[], AbstractContextManager[object]] | None = None,
) -> tuple[int, int]:
    """One forward_backward of ``wrapped`` and the per-microbatch loop of ``plain`` from no
    gradients (under ``context`` when given): the losses and gradients must be bitwise equal.
    Returns how many backward passes of the wrapped call ran on the calling thread and how many
    in torch's engine."""
    for p in plain.parameters():
        p.grad = None
    x, y = torch.randn(4 * MICROBATCHES, WIDTH), torch.randn(4 * MICROBATCHES, WIDTH)
    with context() if context is not None else contextlib.nullcontext():
        torch.manual_seed(1)
        losses = []
        for xm, ym in zip(x.tensor_split(MICROBATCHES), y.tensor_split(MICROBATCHES), strict=True):
            loss = _loss(plain(xm), ym)
            loss.backward()
            losses.append(loss.detach())
        torch.manual_seed(1)
        before = _counts()
        loss = wrapped.forward_backward(
            input_args=(x,), label=y, loss_fn=_loss, run_config=_config(grain, len(plain))
        )
        wrapped.synchronize()
        after = _counts()
    assert torch.equal(loss, torch.stack(losses).sum())
    for ours, theirs in zip(wrapped.model.parameters(), plain.parameters(), strict=True):
        assert (ours.grad is None) == (theirs.grad is None)
        if theirs.grad is not None:
            assert torch.equal(ours.grad, theirs.grad)
        ours.grad = None
    return after[0] - before[0], after[1] - before[1]


def _check_against_plain(
    make: Callable[[], nn.Sequential],
    grain: str,
    context: Callable[[], AbstractContextManager[object]] | None = None,
    prepare: Callable[[nn.Module], object] | None = None,
) -> tuple[int, int]:
    """:func:`_train_and_compare` on ``make()`` and a wrapped copy of it (after ``prepare`` of
    each, when given)."""
    torch.manual_seed(0)
    plain = make()
    wrapped = RoundPipe(copy.deepcopy(plain))
    if prepare is not None:
        prepare(plain)
        prepare(wrapped.model)
    return _train_and_compare(plain, wrapped, grain, context)


class _Residual(nn.Module):
    """The input's gradient is the sum of two paths."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.linear(x))


class _SharedWeight(nn.Module):
    """One parameter used twice: its AccumulateGrad sums two gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.tanh(self.linear(x)))


class _Halves(nn.Module):
    """A node with two outputs (chunk) and a cast to float64 and back."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH // 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=-1)
        wide = (b.double().sin() * 3).float()
        return torch.cat([wide * self.scale, a * 2], dim=-1)


class _InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        h.add_(0.5)
        return h.relu_()


def _locally_eligible_layers() -> nn.Sequential:
    return nn.Sequential(
        _Residual(),
        _SharedWeight(),
        _Halves(),
        nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH)),
        _InPlace(),
        _Residual(),
        nn.Linear(WIDTH, WIDTH),
        nn.Linear(WIDTH, WIDTH),
    )


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_plain_graphs_run_on_the_calling_thread_and_match_pytorch(devices: int, grain: str) -> None:
    """Sums where gradients meet, a parameter used twice, multi-output nodes, casts, in-place
    ops, a norm: every recomputed segment's backward runs on the calling thread, and the
    gradients are plain PyTorch's, bitwise."""
    here, engine = _check_against_plain(_locally_eligible_layers, grain)
    # A pass per recomputed stage of two layers (three of them) and microbatch; in layer grain one
    # per layer. The fused stage's backward from the loss is torch.autograd.backward's, as in
    # plain PyTorch.
    segments = 3 * (2 if grain == "layer" else 1) * MICROBATCHES
    assert (here, engine) == ((segments, 0) if RUNS_HERE else (0, segments))


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad * 3  # not the true derivative: only a Python node computes this


class _CustomFunction(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = _Twice.apply(super().forward(x))
        return result


class _TensorHook(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if out.requires_grad:
            out.register_hook(lambda grad: grad * 0.5)
        return out.tanh()


class _RetainsGrad(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if out.requires_grad:
            out.retain_grad()
        return out.tanh()


def _special_layer_goes_to_the_engine(special: type[nn.Linear], grain: str) -> None:
    """Layer 3 of eight is ``special``: its segment (its stage's, or its own) goes to torch's
    engine, the others still run on the calling thread, and the gradients are plain PyTorch's."""

    def make() -> nn.Sequential:
        return nn.Sequential(
            *[nn.Linear(WIDTH, WIDTH) for _ in range(3)],
            special(WIDTH, WIDTH),
            *[nn.Linear(WIDTH, WIDTH) for _ in range(4)],
        )

    here, engine = _check_against_plain(make, grain)
    if RUNS_HERE:
        assert engine == MICROBATCHES  # layer 3's segment (its stage's, or its own)
        assert here > 0


@pytest.mark.parametrize("special", [_CustomFunction, _TensorHook, _RetainsGrad])
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_a_segment_with_python_nodes_or_hooks_goes_to_the_engine(
    devices: int, grain: str, special: type[nn.Linear]
) -> None:
    """A custom autograd.Function, a tensor hook or retain_grad() inside a layer: that layer's
    segment is backpropagated by torch's engine (the others still on the calling thread), and the
    gradients are plain PyTorch's, bitwise."""

    _special_layer_goes_to_the_engine(special, grain)


def _parameter_hook(model: nn.Module) -> object:
    return model[3].weight.register_hook(lambda grad: grad * 2)


def _module_backward_hook(model: nn.Module) -> object:
    return model[3].register_full_backward_hook(lambda module, grad_in, grad_out: None)


@pytest.mark.parametrize("prepare", [_parameter_hook, _module_backward_hook])
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_hooks_on_a_layers_parameters_or_module_go_to_the_engine(
    devices: int, grain: str, prepare: Callable[[nn.Module], object]
) -> None:
    """A hook on the gradient of a parameter of layer 3, or a full backward hook on the layer:
    the passes through it go to torch's engine, and the gradients are plain PyTorch's,
    bitwise."""
    here, engine = _check_against_plain(
        lambda: nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(8)]),
        grain,
        prepare=prepare,
    )
    if RUNS_HERE:
        assert engine >= MICROBATCHES  # layer 3's segment, at least (its stage's, or its own)
        assert here > 0


class _NodePreHook(nn.Linear):
    """A pre hook on a node of the layer's graph, changing the gradient it receives."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if out.grad_fn is not None:
            out.grad_fn.register_prehook(lambda grads: tuple(g * 0.5 for g in grads))
        return out.tanh()


class _NodePostHook(nn.Linear):
    """A post hook on a node of the layer's graph, changing the gradients it hands on."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if out.grad_fn is not None:
            out.grad_fn.register_hook(
                lambda grad_inputs, grad_outputs: tuple(
                    None if g is None else g * 2 for g in grad_inputs
                )
            )
        return out.tanh()


class _AccumulatorHook(nn.Linear):
    """A post hook on the AccumulateGrad node of the layer's weight, beside the flag the stage puts
    there: the one post hook the local backward runs is that flag."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.requires_grad:
            node = torch.autograd.graph.get_gradient_edge(self.weight).node
            node.register_hook(lambda grad_inputs, grad_outputs: None)
        return super().forward(x).tanh()


class _PostAccumulateHook(nn.Linear):
    """A post-accumulate-grad hook on the layer's weight (it reads the summed gradient)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.requires_grad:
            self.weight.register_post_accumulate_grad_hook(lambda weight: None)
        return super().forward(x).tanh()


class _MultiGradHook(nn.Linear):
    """A hook over several tensors' gradients (torch.autograd.graph.register_multi_grad_hook)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if out.requires_grad:
            torch.autograd.graph.register_multi_grad_hook((out,), lambda grads: None)
        return out.tanh()


@pytest.mark.parametrize(
    "special",
    [_NodePreHook, _NodePostHook, _AccumulatorHook, _PostAccumulateHook, _MultiGradHook],
)
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_hook_kinds_off_the_allow_list_go_to_the_engine(
    devices: int, grain: str, special: type[nn.Linear]
) -> None:
    """The local backward runs only what its allow-list names (no hook but the stage's own
    flag): a node's pre or post hooks, another post hook beside the flag on a weight's
    AccumulateGrad, a post-accumulate-grad hook or a multi-grad hook send the layer's segment to
    torch's engine, which runs them; the gradients are plain PyTorch's, bitwise (the pre and post
    hooks change them, so a pass that skipped them would differ)."""

    _special_layer_goes_to_the_engine(special, grain)


class _Square(torch.autograd.Function):
    """A Python node computing its true derivative: nothing but its kind sends it to the
    engine."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * 2 * x


class _PythonNode(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = _Square.apply(super().forward(x))
        return result


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_a_python_node_is_not_on_the_allow_list(devices: int, grain: str) -> None:
    """A custom autograd.Function's node (a Python node, whose type torch's own C++ library does
    not define) is not a node kind the local backward knows: its segment goes to torch's engine,
    and the gradients are plain PyTorch's, bitwise."""

    def make() -> nn.Sequential:
        return nn.Sequential(
            *[nn.Linear(WIDTH, WIDTH) for _ in range(5)],
            _PythonNode(WIDTH, WIDTH),
            *[nn.Linear(WIDTH, WIDTH) for _ in range(2)],
        )

    here, engine = _check_against_plain(make, grain)
    if RUNS_HERE:
        assert engine == MICROBATCHES  # layer 5's segment (its stage's, or its own)
        assert here > 0


@contextlib.contextmanager
def _unreadable_compiled_autograd_state() -> Iterator[None]:
    """torch._dynamo.compiled_autograd without its ``compiled_autograd_enabled`` global, as a
    torch release that renamed it would be."""
    import torch._dynamo.compiled_autograd as compiled_autograd

    saved = compiled_autograd.compiled_autograd_enabled
    del compiled_autograd.compiled_autograd_enabled
    try:
        yield
    finally:
        compiled_autograd.compiled_autograd_enabled = saved


def test_an_unreadable_compiled_autograd_state_sends_every_pass_to_the_engine(
    devices: int,
) -> None:
    """The local backward reads whether compiled autograd is on from torch._dynamo's globals;
    where it cannot read them it takes compiled autograd as on, and torch's engine runs every
    pass (which then computes plain PyTorch's gradients, bitwise)."""
    here, engine = _check_against_plain(
        lambda: nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(6)]),
        "layer",
        _unreadable_compiled_autograd_state,
    )
    assert here == 0 and engine > 0


class _CountUnpacks:
    def __init__(self) -> None:
        self.unpacked = 0

    def __call__(self) -> AbstractContextManager[object]:
        def unpack(tensor: torch.Tensor) -> torch.Tensor:
            self.unpacked += 1
            return tensor

        return torch.autograd.graph.saved_tensors_hooks(lambda tensor: tensor, unpack)


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
@pytest.mark.parametrize(
    "context",
    [_CountUnpacks(), torch.autograd.detect_anomaly, torch.profiler.profile],
    ids=["saved_tensors_hooks", "anomaly", "profiler"],
)
def test_process_wide_state_sends_every_pass_to_the_engine(
    devices: int, context: Callable[[], AbstractContextManager[object]]
) -> None:
    """Saved-tensor hooks around the call (their unpack hooks are user code that may ask for the
    engine's graph task), anomaly mode and a running profiler (which record what the engine does
    per node): every backward pass goes to torch's engine."""
    here, engine = _check_against_plain(
        lambda: nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(6)]), "layer", context
    )
    assert here == 0 and engine > 0
    if isinstance(context, _CountUnpacks):
        assert context.unpacked > 0


class _Checkpointed(nn.Module):
    """Checkpoints part of itself (torch.utils.checkpoint without reentry), counting the runs."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(WIDTH, WIDTH)
        self.runs = 0

    def _part(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return torch.tanh(self.inner(x)) * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._part, x, use_reentrant=False) + x


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_a_checkpointed_part_of_a_layer_is_recomputed_once_per_pass(
    devices: int, grain: str
) -> None:
    """torch.utils.checkpoint recomputes its region once per backward pass, telling passes apart
    by the engine's graph task, which passes on the calling thread have none of: they run in a
    graph exec group of their own. The region runs three times per microbatch (the forward, the
    pipeline's recompute, checkpoint's recompute), as under the engine, and the gradients are
    plain PyTorch's."""
    torch.manual_seed(0)
    plain = nn.Sequential(*[_Checkpointed() for _ in range(6)])
    wrapped = RoundPipe(copy.deepcopy(plain))
    here, engine = _train_and_compare(plain, wrapped, grain)
    assert engine == 0 if RUNS_HERE else here == 0
    layer = wrapped.model[1]
    assert isinstance(layer, _Checkpointed)
    assert layer.runs == 3 * MICROBATCHES
    if RUNS_HERE:
        assert torch._C._get_graph_exec_group() is None  # the pass's group is gone


class _BreaksItsGraph(nn.Module):
    """Changes in place a tensor its backward needs, unless told not to."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.breaks = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.sigmoid(self.linear(x))
        out = y * 2
        if self.breaks:
            y.add_(1)
        return out


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_an_error_in_a_pass_on_the_calling_thread_is_torchs_and_the_model_stays_usable(
    devices: int, grain: str
) -> None:
    """A saved tensor changed in place: the pass raises torch's error, as plain PyTorch's
    backward does, naming the layer and phase; the model then trains as plain PyTorch does."""
    torch.manual_seed(0)
    plain = nn.Sequential(
        *[nn.Linear(WIDTH, WIDTH) for _ in range(2)],
        _BreaksItsGraph(),
        *[nn.Linear(WIDTH, WIDTH) for _ in range(3)],
    )
    x = torch.randn(4 * MICROBATCHES, WIDTH)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as theirs:
        _loss(plain(x), x).backward()
    wrapped = RoundPipe(copy.deepcopy(plain))
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as ours:
        wrapped.forward_backward(
            input_args=(x,), label=x, loss_fn=_loss, run_config=_config(grain, len(plain))
        )
    # The layer itself in layer grain; in stage grain the stage's layers, its among them.
    layer_named = "layer 2 (_BreaksItsGraph)" if grain == "layer" else "layers 2-3 (_BreaksItsGraph"
    assert layer_named in str(ours.value) and "failed in backward" in str(ours.value)
    assert type(ours.value) is type(theirs.value)
    for model in (plain, wrapped.model):
        layer = model[2]
        assert isinstance(layer, _BreaksItsGraph)
        layer.breaks = False
    _train_and_compare(plain, wrapped, grain)


@pytest.mark.slow
def test_the_switch_sends_every_pass_to_the_engine() -> None:
    # ROUNDPIPE_LOCAL_BACKWARD=0 (read at import) switches the calling-thread passes off; the
    # training is then torch's engine's, and still plain PyTorch's numbers (checked above, and
    # by the whole suite, which CI also runs that way).
    import os
    import subprocess
    import sys

    code = """
import torch, roundpipe
from roundpipe._native import _C
from torch import nn
model = roundpipe.RoundPipe(nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]))
model.forward_backward(input_args=(torch.randn(4, 4),), label=torch.randn(4, 4),
                       loss_fn=lambda o, y: ((o - y) ** 2).sum())
print(_C.local_backward_enabled(), *_C.backward_counts())
"""
    env = {**os.environ, "ROUNDPIPE_LOCAL_BACKWARD": "0"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    enabled, here, engine = done.stdout.split()
    assert enabled == "False" and here == "0" and int(engine) > 0, done.stdout
