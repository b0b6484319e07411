"""wrap_model_to_roundpipe's recursive strategy and AutoRoundPipe, against the plain model."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from roundpipe import RoundPipe, RoundPipeRunConfig, wrap_model_to_roundpipe
from roundpipe.roundpipe import AutoRoundPipe
from torch import nn

HIDDEN = 16  # a Linear(16, 16) has 272 parameters (1088 bytes in float32)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x))) * scale


class Net(nn.Module):
    """Not a Sequential: glue parameters and code on the host around a ModuleList."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Sequential(
            nn.Linear(HIDDEN, 2 * HIDDEN), nn.Tanh(), nn.Linear(2 * HIDDEN, 4)
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        scale = torch.linspace(0.5, 1.0, tokens.size(0)).view(-1, 1, 1)
        for block in self.blocks:
            x = block(x, scale=scale)
        return self.head(self.norm(x)).mean(dim=1)


def make_pair(
    configure: Callable[[Net], dict[str, Any]] | None = None, **kwargs: Any
) -> tuple[Net, AutoRoundPipe]:
    """A Net and its wrapped copy; ``configure(copy)`` adds arguments naming the copy's modules."""
    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference)
    kwargs.setdefault("lower_threshold", 500)
    if configure is not None:
        kwargs.update(configure(model))
    wrapped = wrap_model_to_roundpipe(
        model, model_run_config=RoundPipeRunConfig(num_microbatch=3), **kwargs
    )
    assert isinstance(wrapped, AutoRoundPipe)
    return reference, wrapped


def skip_norm(model: Net) -> dict[str, Any]:
    """Keep the LayerNorm on the host: its parameters become the AutoRoundPipe's glue."""
    return {"skip_modules": [model.norm]}


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return torch.randint(0, 32, (6, 5), generator=generator), torch.randn(6, 4, generator=generator)


def loss_of(model: nn.Module) -> torch.Tensor:
    tokens, target = batch()
    return nn.functional.mse_loss(model(tokens), target)


def assert_same_grads(reference: nn.Module, wrapped: AutoRoundPipe) -> None:
    wrapped.synchronize()
    expected = {name.replace(".model.", "."): p for name, p in reference.named_parameters()}
    ours = {name.replace(".model.", "."): p for name, p in wrapped.model.named_parameters()}
    assert ours.keys() == expected.keys()
    for name, param in expected.items():
        torch.testing.assert_close(ours[name].grad, param.grad, msg=name)


def part_paths(wrapped: AutoRoundPipe) -> list[str]:
    return [path for path, _ in wrapped.parts]


def test_recursive_wrapping_matches_the_plain_model(num_devices: int) -> None:
    reference, wrapped = make_pair()
    # Sizes in bytes (0.1.1): embed's own 2048 >= 500 makes it a part, the blocks are chained
    # ModuleList elements, the head a Sequential; the norm (128 bytes < 500) is a part that runs
    # as one microbatch.
    assert part_paths(wrapped) == ["embed", "blocks.0", "blocks.1", "blocks.2", "norm", "head"]
    assert isinstance(wrapped.model.blocks[0], RoundPipe)
    assert wrapped.model.norm.model_run_config.num_microbatch == 1
    assert wrapped.model.embed.model_run_config.num_microbatch == 3
    loss = loss_of(wrapped)
    loss.backward()
    expected = loss_of(reference)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    assert_same_grads(reference, wrapped)


def test_chained_elements_pass_packed_outputs() -> None:
    _, wrapped = make_pair()
    parts = dict(wrapped.parts)
    assert parts["blocks.0"].model_run_config.merge_output is False
    assert parts["blocks.1"].model_run_config.merge_output is False
    assert parts["blocks.2"].model_run_config.merge_output is None  # the parent gets a tensor


def test_thresholds_decide_what_is_wrapped(num_devices: int) -> None:
    # Own sizes below lower and totals above upper: only the Sequential and the ModuleList
    # elements (always wrapped) become parts; embed and norm stay on the host.
    _, coarse = make_pair(lower_threshold=10**6, upper_threshold=100)
    assert part_paths(coarse) == ["blocks.0", "blocks.1", "blocks.2", "head"]
    assert isinstance(coarse.model.embed, nn.Embedding)
    # A root whose total size is within upper_threshold is wrapped whole, as one RoundPipe.
    whole = wrap_model_to_roundpipe(Net(), upper_threshold=10**6)
    assert isinstance(whole, RoundPipe) and isinstance(whole.model, Net)
    # The default upper_threshold (size / (devices + 1)) splits the root.
    assert isinstance(wrap_model_to_roundpipe(Net()), AutoRoundPipe)
    with pytest.raises(ValueError, match="lower_threshold"):
        make_pair(lower_threshold=-1)
    with pytest.raises(TypeError, match="upper_threshold"):
        make_pair(upper_threshold=1.5)


def test_skip_modules_and_override_config(num_devices: int) -> None:
    last_block_config = RoundPipeRunConfig(num_microbatch=3, preserve_rng_state=False)

    def configure(model: Net) -> dict[str, Any]:
        return {
            "skip_modules": [model.norm, "head", nn.Embedding],
            "override_config": {
                "blocks.0": {"name": "first-block"},
                model.blocks[2]: last_block_config,  # 0.1.1's form: {module: run config}
            },
        }

    reference, wrapped = make_pair(configure)
    assert part_paths(wrapped) == ["blocks.0", "blocks.1", "blocks.2"]
    assert wrapped.model.blocks[0].name == "first-block"
    assert repr(wrapped.model.blocks[2].model_run_config) == repr(last_block_config)
    assert isinstance(wrapped.model.norm, nn.LayerNorm)
    assert isinstance(wrapped.model.head, nn.Sequential)
    assert isinstance(wrapped.model.embed, nn.Embedding)
    loss = loss_of(wrapped)
    loss.backward()
    loss_of(reference).backward()
    assert_same_grads(reference, wrapped)
    with pytest.raises(ValueError, match="never reached"):
        make_pair(override_config={"nope": {}})
    with pytest.raises(TypeError, match="skip_modules"):
        make_pair(skip_modules=[3])
    with pytest.raises(TypeError, match="override_config"):
        make_pair(override_config={"norm": 3})


def test_attribute_forwarding_and_original_model_as_on_a_roundpipe() -> None:
    _, wrapped = make_pair()
    inner = wrapped.model
    wrapped.custom = "set"
    assert inner.custom == "set" and wrapped.custom == "set"
    original = nn.Module()
    original.config = {"hidden": 6}
    wrapped.set_original_model(original)
    assert wrapped.config == {"hidden": 6}
    wrapped.flag = True
    assert original.flag is True and inner.flag is True
    del wrapped.flag
    assert not hasattr(original, "flag") and not hasattr(inner, "flag")
    wrapped.eval()
    assert not inner.training and not wrapped.training


def test_parts_built_without_a_run_config_do_not_share_one() -> None:
    torch.manual_seed(0)
    wrapped = wrap_model_to_roundpipe(Net(), lower_threshold=500)
    assert isinstance(wrapped, AutoRoundPipe)
    configs = [part.model_run_config for path, part in wrapped.parts if path != "norm"]
    assert len(configs) >= 2
    configs[0].num_microbatch = 2
    assert all(config.num_microbatch is None for config in configs[1:])


def test_sequential_root_becomes_one_roundpipe() -> None:
    wrapped = wrap_model_to_roundpipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    assert isinstance(wrapped, RoundPipe) and len(wrapped.layers) == 2


def test_a_weight_tied_across_parts_is_the_glues() -> None:
    # Both parts borrow the tied weight (shared_parameters); the host glue holds its one
    # optimizer copy, and each part's gradient of it reaches it (tests/test_shared_parameters.py
    # trains such models against plain PyTorch).
    model = nn.Module()
    model.a = nn.Linear(HIDDEN, HIDDEN)
    model.b = nn.Linear(HIDDEN, HIDDEN)
    model.b.weight = model.a.weight
    wrapped = wrap_model_to_roundpipe(model, lower_threshold=1)
    assert isinstance(wrapped, AutoRoundPipe)
    parts = dict(wrapped.parts)
    assert [p is model.a.weight for p in parts["a"].shared_parameters] == [True]
    assert [p is model.a.weight for p in parts["b"].shared_parameters] == [True]
    names = [name for name, _ in wrapped.optim_named_parameters()]
    assert sorted(names) == ["a.model.bias", "a.model.weight", "b.model.bias"]


def _structure(model: nn.Module) -> list[tuple[str, type[nn.Module], int]]:
    return [(name, type(module), id(module)) for name, module in model.named_modules()]


@pytest.mark.parametrize("failure", ["override never reached", "bad part argument"])
def test_a_failed_wrap_leaves_the_model_as_it_came(failure: str) -> None:
    torch.manual_seed(0)
    model = Net()
    kwargs: dict[str, Any] = {"lower_threshold": 500}
    error: type[Exception] = ValueError
    if failure == "override never reached":
        kwargs["override_config"] = {"blocks.9": {}}
        match = "never reached"
    else:
        # The last part's RoundPipe refuses its arguments after the others were built.
        kwargs["override_config"] = {"head": {"pin_model": "sometimes"}}
        match = "pin_model"
    before = _structure(model)
    tokens, _ = batch()
    with torch.no_grad():
        expected = model(tokens)
    with pytest.raises(error, match=match):
        wrap_model_to_roundpipe(model, **kwargs)
    assert _structure(model) == before  # no module replaced by a RoundPipe
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), expected, rtol=0, atol=0)
    loss_of(model).backward()  # still trains as a plain model
    assert all(p.grad is not None for p in model.parameters())


def test_loss_chunk_size_without_a_preset_is_refused_by_name() -> None:
    model = Net()
    before = _structure(model)
    with pytest.raises(TypeError, match=r"loss_chunk_size.*presets"):
        wrap_model_to_roundpipe(model, loss_chunk_size=4)
    assert _structure(model) == before


def test_forward_backward_explains_what_to_do() -> None:
    _, wrapped = make_pair()
    with pytest.raises(NotImplementedError, match=r"loss.backward\(\)"):
        wrapped.forward_backward(input_args=batch()[:1])


def sgd_reference_steps(reference: Net, steps: int) -> None:
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(steps):
        loss_of(reference).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.slow
@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_step_updates_parts_and_host_glue_as_one_model(num_devices: int, is_async: bool) -> None:
    reference, wrapped = make_pair(skip_norm)
    optim_names = [name for name, _ in wrapped.optim_named_parameters()]
    assert "norm.weight" in optim_names and "blocks.1.model.up.weight" in optim_names
    optimizer = torch.optim.SGD(wrapped.optim_parameters(), lr=0.1)

    def step_fn() -> None:
        optimizer.step()
        optimizer.zero_grad()

    loss_of(wrapped).backward()
    wrapped.step(step_fn, is_async=is_async)
    if is_async:
        # Staleness 1: the second iteration trains on the first weights, like the reference's
        # first iteration; compare after one step there.
        wrapped.synchronize()
    loss_of(wrapped).backward()
    wrapped.step(step_fn, is_async=is_async)
    wrapped.synchronize()
    sgd_reference_steps(reference, 2)
    expected = {n.replace(".model.", "."): p for n, p in reference.named_parameters()}
    for name, param in wrapped.model.named_parameters():
        torch.testing.assert_close(param, expected[name.replace(".model.", ".")], msg=name)


@pytest.mark.slow
def test_checkpoint_mid_async_training_continues_exactly(num_devices: int) -> None:
    """fp64 optimizer copies of an fp32 model: the parts' and the glue's copies hold more than
    the parameters, so a resumed run matches only if the checkpoint carries them."""

    def build() -> tuple[AutoRoundPipe, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = Net()
        wrapped = wrap_model_to_roundpipe(
            model,
            lower_threshold=500,
            skip_modules=[model.norm],
            optim_dtype=torch.float64,
            model_run_config=RoundPipeRunConfig(num_microbatch=3),
        )
        assert isinstance(wrapped, AutoRoundPipe)
        return wrapped, torch.optim.Adam(wrapped.optim_parameters(), lr=0.01)

    def train(wrapped: AutoRoundPipe, optimizer: torch.optim.Optimizer, iterations: int) -> None:
        for _ in range(iterations):
            loss_of(wrapped).backward()
            wrapped.step(lambda: (optimizer.step(), optimizer.zero_grad()))

    wrapped, optimizer = build()
    train(wrapped, optimizer, 3)
    checkpoint = copy.deepcopy({"model": wrapped.state_dict(), "optim": optimizer.state_dict()})
    assert any(key.startswith("_roundpipe.glue.") for key in checkpoint["model"])
    train(wrapped, optimizer, 2)

    resumed, resumed_optimizer = build()
    resumed.load_state_dict(checkpoint["model"])
    resumed_optimizer.load_state_dict(checkpoint["optim"])
    train(resumed, resumed_optimizer, 2)
    expected, ours = wrapped.state_dict(), resumed.state_dict()
    assert ours.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(ours[name], value), name
