"""A parameter that several layers use (tied weights), wherever the layers fall: one stage, several
stages, a recompute stage, several microbatches, forward() + backward(), inference calls, both
recompute grains, and across the parts of a wrapped Hugging Face model. Every gradient and every
trained weight is compared with plain PyTorch on the unwrapped model.

Where every use of the parameter is in one stage, autograd sums the uses there as plain PyTorch
does, and a ``forward_backward`` in stage grain is bitwise equal to plain PyTorch (layer grain
backpropagates each layer on its own, adding the uses' parts in turn). Where the uses fall in
different stages, each stage accumulates its use's part over the microbatches and the parts are
added once, before the gradient is published or stepped: equal up to the summation order.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from roundpipe import RoundPipe, RoundPipeRunConfig, wrap_model_to_roundpipe
from roundpipe.scheduler import ModelExecutePlan
from torch import nn

MICROBATCHES = 3
BATCH = 6


def one_module_twice() -> nn.Sequential:
    """One Linear used as layers 0 and 2: the same module, bound twice."""
    torch.manual_seed(0)
    lin = nn.Linear(8, 8)
    return nn.Sequential(lin, nn.Tanh(), lin, nn.Tanh())


def two_modules_one_weight() -> nn.Sequential:
    """Two Linears sharing one weight, as tied input and output embeddings do."""
    torch.manual_seed(1)
    first, last = nn.Linear(8, 8, bias=False), nn.Linear(8, 8)
    last.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), last, nn.Tanh())


MODELS = {"one_module_twice": one_module_twice, "two_modules": two_modules_one_weight}


def plan(fwd: list[range], bwd: list[range]) -> ModelExecutePlan:
    result = ModelExecutePlan()
    result.fwd_plan, result.bwd_plan = fwd, bwd
    return result


# forward_backward plans: both uses in the fused stage, both in one recompute stage, apart.
FUSED_PLANS = {
    "fused_stage": (plan([], [range(0, 4)]), True),
    "recompute_stage": (plan([range(0, 3)], [range(3, 4), range(0, 3)]), True),
    "apart": (plan([range(0, 2)], [range(2, 4), range(0, 2)]), False),
    "auto": (None, False),
}
# forward() + backward() plans.
TRAIN_PLANS = {
    "one_stage": plan([range(0, 4)], [range(0, 4)]),
    "apart": plan([range(0, 2), range(2, 4)], [range(2, 4), range(0, 2)]),
    "auto": None,
}


def data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, 8, generator=generator), torch.randn(BATCH, 8, generator=generator)


def mse(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, label, reduction="sum")


def plain_microbatches(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """What forward_backward is equivalent to: one backward per microbatch."""
    for xs, ys in zip(x.tensor_split(MICROBATCHES), y.tensor_split(MICROBATCHES), strict=True):
        mse(model(xs), ys).backward()


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_grads(ours: nn.Module, reference: nn.Module, exact: bool) -> None:
    expected, got = grads(reference), grads(ours)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert value.norm() > 0, name  # a gradient to compare, not zeros
        if exact:
            assert torch.equal(got[name], value), (name, (got[name] - value).abs().max())
        else:
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("plan_name", sorted(FUSED_PLANS))
@pytest.mark.parametrize("build", sorted(MODELS))
def test_forward_backward_matches_pytorch(
    num_devices: int, build: str, plan_name: str, grain: str
) -> None:
    reference = MODELS[build]()
    model = RoundPipe(copy.deepcopy(reference))
    execute_plan, exact = FUSED_PLANS[plan_name]
    config = RoundPipeRunConfig(
        num_microbatch=MICROBATCHES, execute_plan=execute_plan, recompute_grain=grain
    )
    ours = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    theirs = torch.optim.SGD(reference.parameters(), lr=0.1)
    for iteration in range(3):
        x, y = data(iteration)
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
        model.synchronize()
        plain_microbatches(reference, x, y)
        # Layer grain backpropagates each layer on its own: the uses' parts are added in turn.
        assert_grads(model.model, reference, exact and grain == "stage")
        model.step(lambda: (ours.step(), ours.zero_grad()), is_async=False)
        theirs.step()
        theirs.zero_grad()
    for (name, p), q in zip(model.model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    # The uses stay one parameter.
    assert model.model[0].weight is model.model[2].weight


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("plan_name", sorted(TRAIN_PLANS))
@pytest.mark.parametrize("build", sorted(MODELS))
def test_forward_then_backward_matches_pytorch(
    num_devices: int, build: str, plan_name: str, grain: str
) -> None:
    reference = MODELS[build]()
    model = RoundPipe(copy.deepcopy(reference))
    config = RoundPipeRunConfig(
        num_microbatch=MICROBATCHES, execute_plan=TRAIN_PLANS[plan_name], recompute_grain=grain
    )
    for iteration in range(2):  # the second accumulates onto the first, as .grad does
        x, y = data(iteration)
        mse(model(x, roundpipe_run_config=config), y).backward()
        mse(reference(x), y).backward()
    model.synchronize()
    assert_grads(model.model, reference, exact=False)


def test_inference_after_a_step_uses_the_new_shared_weight(num_devices: int) -> None:
    reference = two_modules_one_weight()
    model = RoundPipe(copy.deepcopy(reference))
    config = RoundPipeRunConfig(num_microbatch=MICROBATCHES, execute_plan=FUSED_PLANS["apart"][0])
    ours = torch.optim.SGD(model.optim_parameters(), lr=0.5)
    theirs = torch.optim.SGD(reference.parameters(), lr=0.5)
    x, y = data(7)
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    model.step(lambda: (ours.step(), ours.zero_grad()), is_async=False)
    plain_microbatches(reference, x, y)
    theirs.step()
    with torch.no_grad():
        expected = reference(x)
        got = model(x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=MICROBATCHES))
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert not torch.equal(expected, copy.deepcopy(two_modules_one_weight())(x))  # it moved


def test_unbound_after_a_stage_that_uses_a_module_twice(num_devices: int) -> None:
    # A module bound twice in one stage must get its own parameter back afterwards (it was once
    # left bound to a device copy, and every gradient after that was lost).
    reference = one_module_twice()
    model = RoundPipe(copy.deepcopy(reference))
    config = RoundPipeRunConfig(num_microbatch=1, execute_plan=FUSED_PLANS["fused_stage"][0])
    x, y = data(3)
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    assert isinstance(model.model[0].weight, nn.Parameter)
    assert model.model[0].weight is model.model[2].weight


def test_chained_models_sharing_a_weight(num_devices: int) -> None:
    # Two RoundPipes chained (the first's packed outputs feed the second's forward_backward):
    # the first holds the weight, the second borrows it (shared_parameters) and hands its
    # gradient to .grad, which the first takes in as it does any gradient found in .grad.
    reference = two_modules_one_weight()
    first = RoundPipe(copy.deepcopy(reference)[:2])
    weight = first.model[0].weight
    head = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    head[0].weight = weight
    with torch.no_grad():
        head[0].bias.copy_(reference[2].bias)
    second = RoundPipe(head, shared_parameters=[weight])
    chained = RoundPipeRunConfig(num_microbatch=MICROBATCHES, merge_output=False)
    ours = torch.optim.SGD(first.optim_parameters(), lr=0.5)
    ours_head = torch.optim.SGD(second.optim_parameters(), lr=0.5)
    theirs = torch.optim.SGD(reference.parameters(), lr=0.5)
    for iteration in range(2):
        x, y = data(iteration)
        hidden = first(x, roundpipe_run_config=chained)
        second.forward_backward(
            input_args=(hidden,),
            label=y,
            loss_fn=mse,
            run_config=RoundPipeRunConfig(num_microbatch=MICROBATCHES),
        )
        plain_microbatches(reference, x, y)
        # The borrower steps first: that hands its part of the shared weight's gradient over.
        second.step(lambda: (ours_head.step(), ours_head.zero_grad()), is_async=False)
        first.step(lambda: (ours.step(), ours.zero_grad()), is_async=False)
        theirs.step()
        theirs.zero_grad()
    first.synchronize()
    second.synchronize()
    torch.testing.assert_close(weight, reference[0].weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(second.model[0].bias, reference[2].bias, rtol=1e-5, atol=1e-6)


# -- A module with buffers that several layers use -------------------------------------------


def batchnorm_twice() -> nn.Sequential:
    """One Linear + BatchNorm used as layers 0-1 and 3-4: the statistics advance at each use."""
    torch.manual_seed(2)
    linear, norm = nn.Linear(8, 8, bias=False), nn.BatchNorm1d(8)
    return nn.Sequential(linear, norm, nn.Tanh(), linear, norm, nn.Tanh())


def batchnorm_twice_in_a_layer() -> nn.Sequential:
    """One BatchNorm used twice inside one layer."""
    torch.manual_seed(3)
    norm = nn.BatchNorm1d(8)
    return nn.Sequential(
        nn.Linear(8, 8, bias=False), nn.Sequential(norm, nn.Tanh(), norm), nn.Tanh()
    )


def assert_buffers_and_grads(ours: nn.Module, reference: nn.Module) -> None:
    """Buffers bitwise; gradients to rounding, relative to their largest element (a Linear
    before a BatchNorm has gradients of every size)."""
    for name, value in reference.named_buffers():
        assert torch.equal(ours.get_buffer(name), value), name
    for (name, param), expected in zip(
        ours.named_parameters(), reference.parameters(), strict=True
    ):
        assert param.grad is not None and expected.grad is not None, name
        scale = float(expected.grad.abs().max())
        assert scale > 0, name
        torch.testing.assert_close(
            param.grad, expected.grad, rtol=1e-5, atol=1e-6 * scale, msg=name
        )


# Both uses in one stage, or apart (the second use's stage runs after every microbatch went
# through the first's).
BUFFER_PLANS = {
    "one_stage": plan([], [range(0, 6)]),
    "apart": plan([range(0, 3)], [range(3, 6), range(0, 3)]),
}


@pytest.mark.slow
@pytest.mark.parametrize("microbatches", [1, MICROBATCHES])
@pytest.mark.parametrize("plan_name", sorted(BUFFER_PLANS))
def test_shared_module_buffers_advance_at_every_use(
    num_devices: int, plan_name: str, microbatches: int
) -> None:
    # Each use updates the statistics in turn, none is lost, and the module keeps its own
    # buffers (a module bound twice in one stage was once left bound to a working copy).
    reference = batchnorm_twice()
    model = RoundPipe(copy.deepcopy(reference))
    buffers = [model.model[1].running_mean, model.model[1].running_var]
    config = RoundPipeRunConfig(num_microbatch=microbatches, execute_plan=BUFFER_PLANS[plan_name])
    for iteration in range(2):
        x, y = data(iteration)
        x, y = torch.cat([x, x.flip(0)]), torch.cat([y, y.flip(0)])  # two rows per microbatch
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
        pieces = list(zip(x.tensor_split(microbatches), y.tensor_split(microbatches), strict=True))
        if plan_name == "one_stage":  # as plain PyTorch: microbatch by microbatch
            for xs, ys in pieces:
                mse(reference(xs), ys).backward()
        else:  # the first use over every microbatch, then the second
            hidden = [reference[:3](xs) for xs, _ in pieces]
            for h, (_, ys) in zip(hidden, pieces, strict=True):
                mse(reference[3:](h), ys).backward()
    model.synchronize()
    assert [model.model[1].running_mean, model.model[1].running_var] == buffers
    assert model.model[1] is model.model[4]
    assert_buffers_and_grads(model.model, reference)


def test_module_used_twice_in_a_layer_keeps_its_buffers(num_devices: int) -> None:
    reference = batchnorm_twice_in_a_layer()
    model = RoundPipe(copy.deepcopy(reference))
    norm = model.model[1][0]
    buffers = [norm.running_mean, norm.running_var, norm.num_batches_tracked]
    config = RoundPipeRunConfig(num_microbatch=MICROBATCHES)
    for iteration in range(2):
        x, y = data(iteration)
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
        plain_microbatches(reference, x, y)
        with torch.no_grad():  # in train mode, an inference call updates them too
            model(x, roundpipe_run_config=config)
            for xs in x.tensor_split(MICROBATCHES):
                reference(xs)
    model.synchronize()
    assert [norm.running_mean, norm.running_var, norm.num_batches_tracked] == buffers
    assert_buffers_and_grads(model.model, reference)


# -- Hugging Face: tied input and output embeddings ------------------------------------------

transformers = pytest.importorskip("transformers", reason="the Hugging Face cases need it")

FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
}


def tied_causal_lm(family: str) -> nn.Module:
    config_name, model_name = FAMILIES[family]
    config = getattr(transformers, config_name)(
        vocab_size=96,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        tie_word_embeddings=True,
        use_cache=False,
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def lm_batch(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (4, 7), generator=generator)
    return {"input_ids": ids, "labels": ids}


@pytest.mark.slow
@pytest.mark.parametrize("preset", [True, False], ids=["preset", "plain_wrapping"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tied_embeddings_train_like_pytorch(num_devices: int, family: str, preset: bool) -> None:
    """Through the preset (one RoundPipe: embedding and head are layers of one model) and
    through plain wrapping (an AutoRoundPipe whose embedding and head parts share the weight:
    its host glue steps it), three SGD steps at a learning rate large enough that a lost
    gradient would show, against the unwrapped model."""
    reference = tied_causal_lm(family)
    wrapped: Any = wrap_model_to_roundpipe(copy.deepcopy(reference), use_sequential_preset=preset)
    assert type(wrapped).__name__ == ("RoundPipe" if preset else "AutoRoundPipe")
    tied = wrapped.original_model if preset else wrapped.model
    ours = torch.optim.SGD(wrapped.optim_parameters(), lr=1.0)
    theirs = torch.optim.SGD(reference.parameters(), lr=1.0)
    assert len(list(wrapped.optim_parameters())) == len(list(reference.parameters()))
    for iteration in range(3):
        batch = lm_batch(iteration)
        expected = reference(**batch).loss
        expected.backward()
        loss = wrapped(**batch).loss
        loss.backward()
        torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
        wrapped.synchronize()
        got = tied.model.embed_tokens.weight.grad
        want = reference.model.embed_tokens.weight.grad
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        wrapped.step(lambda: (ours.step(), ours.zero_grad()), is_async=False)
        theirs.step()
        theirs.zero_grad()
    for name, param in reference.named_parameters():  # parts forward attribute reads
        ours = functools.reduce(getattr, name.split("."), tied)
        torch.testing.assert_close(ours, param, rtol=1e-4, atol=1e-5, msg=name)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_shared_parameters_is_checked() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="shared_parameters must be an iterable"):
        RoundPipe(model, shared_parameters=model[0].weight)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not one of the model's"):
        RoundPipe(model, shared_parameters=[nn.Parameter(torch.zeros(2))])
