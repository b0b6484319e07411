"""roundpipe 0.1.1's split/merge surface as its code uses it: ``Batch``,
``FullRoundPipeRunConfig``, ``RoundPipePackedData(data, transfer_event)`` with event pairs,
``guess_split_spec``, ``AvgReducer`` / ``avg_reducer``, the automatic split of keyword-only calls
one microbatch neither split nor merged (the contract's rule), and ``torch.cuda.Event()`` on a torch
built without CUDA (an event of the virtual CPU devices)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import roundpipe
import torch
from roundpipe.batch import (
    Batch,
    BatchRows,
    RoundPipePackedData,
    guess_split_spec,
    merge_output,
    split_input,
    split_label,
)
from roundpipe.device import HostEvent
from roundpipe.run_config import FullRoundPipeRunConfig, RoundPipeRunConfig, resolve_run_config
from torch import nn
from torch.distributed.pipelining.microbatch import (
    TensorChunkSpec,
    _CustomReducer,
    _Replicate,
    split_args_kwargs_into_chunks,
)
from torch.testing import assert_close


def full(**fields: object) -> FullRoundPipeRunConfig:
    return FullRoundPipeRunConfig(RoundPipeRunConfig(**fields), RoundPipeRunConfig())


def test_full_config_is_the_resolved_one() -> None:
    call = RoundPipeRunConfig(num_microbatch=3, merge_output=False)
    model = RoundPipeRunConfig(recompute_grain="layer")
    resolved = dataclasses.asdict(resolve_run_config(call, model))
    assert dataclasses.asdict(FullRoundPipeRunConfig(call, model)) == resolved
    assert full().num_microbatch == roundpipe.device_count() + 1


def test_full_config_takes_0_1_1_parameter_names_and_order() -> None:
    # 0.1.1: FullRoundPipeRunConfig(function_run_config, model_run_config), the call's config
    # first; each field from the call, else the model, else its default.
    call = RoundPipeRunConfig(num_microbatch=3, merge_output=False)
    model = RoundPipeRunConfig(num_microbatch=5, recompute_grain="layer")
    named = FullRoundPipeRunConfig(function_run_config=call, model_run_config=model)
    assert (named.num_microbatch, named.recompute_grain, named.merge_output) == (3, "layer", False)
    assert named.preserve_rng_state is True and named.output_device == torch.device("cpu")
    assert dataclasses.asdict(FullRoundPipeRunConfig(call, model)) == dataclasses.asdict(named)
    assert FullRoundPipeRunConfig(model, call).num_microbatch == 5  # positions mean the same
    with pytest.raises(TypeError):
        FullRoundPipeRunConfig(call_config=call)  # type: ignore[call-arg]


# ----------------------------------------------------------------------------------------------
# Automatic split of a keyword-only call (seed 000: every tensor with ndim > 0 is cut along dim 0)


class AddsExtraRows(nn.Module):
    """``linear(x)`` plus the sum of the rows of ``extra`` it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)

    def forward(self, *, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + extra.sum(0)


def test_keyword_only_call_cuts_a_tensor_of_other_rows_on_its_own(num_devices: int) -> None:
    # 8 rows of x beside 3 of extra, 2 microbatches: extra gives 2 and 1 rows (0.1.1 too), and
    # the model computes what plain PyTorch's loop over those microbatches computes.
    torch.manual_seed(0)
    reference = AddsExtraRows()
    model = roundpipe.RoundPipe(copy.deepcopy(reference))
    x, extra = torch.randn(8, 2), torch.randn(3, 2)
    out = model(x=x, extra=extra, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=2))
    expected = torch.cat(
        [
            reference(x=x_part, extra=extra_part)
            for x_part, extra_part in zip(x.tensor_split(2), extra.tensor_split(2), strict=True)
        ]
    )
    assert [len(part) for part in extra.tensor_split(2)] == [2, 1]
    assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    model.synchronize()
    for got, want in zip(model.model.parameters(), reference.parameters(), strict=True):
        assert_close(got.grad, want.grad)


def test_keyword_only_split_is_torch_s_split_of_the_guessed_spec() -> None:
    # 0.1.1 guessed the kwargs spec with guess_split_spec and split with torch's
    # split_args_kwargs_into_chunks: the automatic split gives the same microbatches.
    kwargs = {"ids": torch.arange(16).reshape(8, 2), "extra": torch.randn(3, 4), "n": 5}
    spec, batch_size = guess_split_spec(kwargs)
    assert batch_size is None  # 8 and 3 rows: no size they agree on
    _, expected = split_args_kwargs_into_chunks((), kwargs, 2, None, spec)
    _, kwargs_list = split_input((), kwargs, 2, None)
    assert [sorted(k) for k in kwargs_list] == [sorted(k) for k in expected]
    for got, want in zip(kwargs_list, expected, strict=True):
        assert torch.equal(got["ids"], want["ids"]) and torch.equal(got["extra"], want["extra"])
        assert got["n"] == want["n"] == 5
    # A tensor of fewer rows than microbatches lowers the count to its rows, as torch's split.
    short = {"ids": kwargs["ids"], "pos": torch.arange(4).reshape(1, 4)}
    _, expected = split_args_kwargs_into_chunks((), short, 3, None, guess_split_spec(short)[0])
    _, kwargs_list = split_input((), short, 3, None)
    assert len(kwargs_list) == len(expected) == 1
    assert torch.equal(kwargs_list[0]["pos"], short["pos"])
    # With the batch from the args, kwargs of another size stay whole (0.1.1 passed the args'
    # batch size to guess_split_spec): the args' rule of 0.1.1 as well.
    _, kwargs_list = split_input((torch.randn(8, 1),), kwargs, 2, None)
    assert all(k["extra"] is kwargs["extra"] for k in kwargs_list)
    assert [len(k["ids"]) for k in kwargs_list] == [4, 4]


def test_keyword_only_call_label_follows_the_first_kwarg() -> None:
    ids, extra, label = torch.arange(7), torch.randn(3), torch.arange(7) * 10
    batch = BatchRows()
    _, kwargs_list = split_input((), {"ids": ids, "extra": extra}, 3, None, batch)
    labels = split_label(label, 3, None, batch)
    for kwargs, part in zip(kwargs_list, labels, strict=True):
        assert torch.equal(part, kwargs["ids"] * 10)
    assert [len(k["extra"]) for k in kwargs_list] == [1, 1, 1]


def test_guess_split_spec_marks_what_0_1_1_marks() -> None:
    x, mask, table, scalar = torch.randn(6, 2), torch.ones(6), torch.randn(4, 2), torch.tensor(1.0)
    packed = RoundPipePackedData([torch.randn(2, 3) for _ in range(3)])
    spec, size = guess_split_spec({"x": x, "table": table, "n": 3, "s": scalar})
    assert isinstance(spec["x"], TensorChunkSpec) and spec["x"].split_dim == 0
    assert isinstance(spec["table"], TensorChunkSpec)
    assert spec["n"] is _Replicate and spec["s"] is _Replicate and size is None
    spec, size = guess_split_spec((x, [mask, table], packed), 6)
    assert isinstance(spec[0], TensorChunkSpec) and isinstance(spec[1][0], TensorChunkSpec)
    assert spec[1][1] is _Replicate and spec[2] is _Replicate and isinstance(spec[1], list)
    assert size == 6  # x, mask and the packed leaf's 3 x 2 rows agree
    assert guess_split_spec((packed,)) == ((_Replicate,), 6)
    assert guess_split_spec(("text", None)) == ((_Replicate, _Replicate), None)


# ----------------------------------------------------------------------------------------------
# Merging: AvgReducer, merge functions, and one microbatch


class WithLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.linear(x)
        return hidden, hidden.square().mean()


def test_avg_reducer_merges_the_mean_of_the_microbatch_losses(num_devices: int) -> None:
    from roundpipe.batch import AvgReducer, avg_reducer

    assert isinstance(avg_reducer, AvgReducer) and isinstance(avg_reducer, _CustomReducer)
    assert repr(AvgReducer()) == "AvgReducer"
    torch.manual_seed(0)
    reference = WithLoss()
    merge = (TensorChunkSpec(0), AvgReducer())
    model = roundpipe.RoundPipe(
        copy.deepcopy(reference), model_run_config=RoundPipeRunConfig(merge_output=merge)
    )
    x = torch.randn(7, 4)
    for _ in range(2):  # a reduction starts afresh each call
        hidden, loss = model(x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=3))
        outputs = [reference(part) for part in x.tensor_split(3)]
        expected = torch.stack([part_loss for _, part_loss in outputs]).mean()
        assert_close(hidden, torch.cat([part_hidden for part_hidden, _ in outputs]))
        assert_close(loss, expected)
        loss.backward()
        expected.backward()
    model.synchronize()
    for got, want in zip(model.model.parameters(), reference.parameters(), strict=True):
        assert_close(got.grad, want.grad)
    assert_close(
        merge_output([torch.tensor(1.0), torch.tensor(4.0)], avg_reducer), torch.tensor(2.5)
    )


def test_avg_reducer_refuses_two_reductions_at_once() -> None:
    from roundpipe.batch import AvgReducer

    reducer = AvgReducer()
    first = reducer.reduce(None, torch.tensor(1.0))
    reducer.reduce(None, torch.tensor(5.0))  # another reduction starts on the same instance
    with pytest.raises(AssertionError, match="in use by another reduction") as caught:
        reducer.reduce(first, torch.tensor(2.0))
    assert isinstance(caught.value, RuntimeError)


class Logits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 5)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        return {"logits": self.linear(x), "rows": torch.tensor(float(len(x)))}


def test_one_microbatch_is_neither_split_nor_merged(num_devices: int) -> None:
    # The contract (and 0.1.1): num_microbatch == 1 means no split and no merge. Split and
    # merge functions and reducers are not called; the layer's own output comes back as it is.
    torch.manual_seed(0)
    reference = Logits()
    model = roundpipe.RoundPipe(copy.deepcopy(reference))
    x = torch.randn(6, 3)

    def refuse(*_: object) -> None:
        raise AssertionError("a split or merge function ran for one microbatch")

    one = RoundPipeRunConfig(
        num_microbatch=1,
        split_input=refuse,
        merge_output={"logits": None, "rows": _CustomReducer(0, refuse)},
    )
    with torch.no_grad():
        out = model(x, roundpipe_run_config=one)
        plain = model(
            x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=1, merge_output=refuse)
        )
    expected = reference(x)
    assert out.keys() == expected.keys() and plain.keys() == expected.keys()
    assert_close(out["logits"], expected["logits"])
    assert_close(plain["logits"], expected["logits"])
    assert out["rows"] == plain["rows"] == 6  # the whole batch in its one microbatch
    loss = model.forward_backward(
        (x,),
        label=torch.ones(6, 5),
        loss_fn=lambda out, label: ((out["logits"] - label) ** 2).mean(),
        run_config=RoundPipeRunConfig(num_microbatch=1, split_input=refuse, split_label=refuse),
    )
    assert_close(loss, ((expected["logits"] - 1) ** 2).mean().detach())


@pytest.mark.parametrize("num_microbatch", [2, 3])
def test_merge_functions_and_reducers_merge_several_microbatches(
    num_devices: int, num_microbatch: int
) -> None:
    # Seed 000: a merge function receives the list of microbatch outputs and returns the merged
    # output; a _CustomReducer folds them from its initial value.
    torch.manual_seed(0)
    reference = Logits()
    model = roundpipe.RoundPipe(copy.deepcopy(reference))
    x = torch.randn(6, 3)
    logits_only = RoundPipeRunConfig(
        num_microbatch=num_microbatch,
        merge_output=lambda outputs: torch.cat([out["logits"] for out in outputs]),
    )
    counting = RoundPipeRunConfig(
        num_microbatch=num_microbatch,
        merge_output={"logits": None, "rows": _CustomReducer(0, lambda count, _: count + 1)},
    )
    with torch.no_grad():
        assert_close(model(x, roundpipe_run_config=logits_only), reference(x)["logits"])
        merged = model(x, roundpipe_run_config=counting)
    assert merged["rows"] == num_microbatch
    assert_close(merged["logits"], reference(x)["logits"])


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="torch's own events with CUDA")
def test_cuda_events_without_cuda_are_host_events() -> None:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    assert isinstance(start, HostEvent)
    with pytest.raises(RuntimeError, match="recorded"):
        start.elapsed_time(end)
    start.record()
    end.record()
    assert start.query() and start.elapsed_time(end) >= 0.0
    start.synchronize()


def test_packed_data_takes_0_1_1_event_pairs() -> None:
    forward, backward = HostEvent(), HostEvent()
    packed = RoundPipePackedData([torch.ones(2), torch.zeros(2)], [(forward, backward)] * 2)
    assert packed.transfer_event == [(forward, backward)] * 2
    assert packed.events == [forward, forward]
    assert packed.synchronize() is packed  # was AttributeError: 'tuple' has no synchronize
    assert packed.transfer_event == [(None, backward)] * 2
    single = RoundPipePackedData([1, 2], [forward, None])
    assert single.transfer_event == [(forward, None), (None, None)]
    with pytest.raises(ValueError, match=r"one .* per value"):
        RoundPipePackedData([1, 2], [forward])
    with pytest.raises(ValueError, match="pairs are"):
        RoundPipePackedData([1], [(forward, backward, forward)])


def test_batch_splits_and_merges_as_the_public_functions() -> None:
    events = [HostEvent() for _ in range(3)]
    packed = RoundPipePackedData(
        [torch.full((2, 4), float(m)) for m in range(3)], list(zip(events, events, strict=True))
    )
    x, scalar = torch.randn(6, 4), torch.tensor(5.0)
    args, kwargs, label = (x, packed, "text"), {"scale": scalar}, torch.arange(6)
    config = full(num_microbatch=3)
    batch = Batch(args, kwargs, config, label)
    assert batch.num_microbatch == 3
    expected_args, expected_kwargs = split_input(args, kwargs, 3, None)
    for m in range(3):
        assert batch.forward_events[m] == [events[m]] and batch.backward_events[m] == [events[m]]
        state = torch.utils._pytree.tree_unflatten(batch.flatten_states[m], batch.flatten_specs[m])
        assert torch.equal(state[0][0], expected_args[m][0])
        assert torch.equal(state[0][1], packed[m]) and state[0][2] == "text"
        assert torch.equal(batch.label_list[m], label.tensor_split(3)[m])
    merged_args, merged_kwargs = batch.dump(config)
    assert torch.equal(merged_args[0], x) and torch.equal(merged_args[1], torch.cat(list(packed)))
    assert merged_args[2] == "text" and torch.equal(merged_kwargs["scale"], scalar)
    assert merged_kwargs == merge_output([expected_kwargs[m] for m in range(3)], None)


def test_batch_packs_with_each_microbatchs_events() -> None:
    events = [(HostEvent(), HostEvent()) for _ in range(2)]
    packed = RoundPipePackedData([torch.ones(1, 3), torch.zeros(1, 3)], events)
    config = full(num_microbatch=2, merge_output=False)
    batch = Batch((torch.randn(2, 3), packed), {}, config)
    (first, second), kwargs = batch.dump(config)
    assert isinstance(first, RoundPipePackedData) and first.transfer_event == events
    assert second.transfer_event == events and torch.equal(second[1], packed[1])
    assert kwargs == {}


def test_packed_inputs_of_different_lengths_run_the_shortest() -> None:
    # 0.1.1's rule: a warning naming the new count, and the longer input's extra microbatches
    # unused (ours used to raise).
    three = RoundPipePackedData([torch.full((2, 1), float(m)) for m in range(3)])
    four = RoundPipePackedData([torch.full((2, 1), float(m)) for m in range(4)])
    with pytest.warns(UserWarning, match=r"downsizing batch size to 3\."):
        batch = Batch((three, four), {}, full(num_microbatch=6))
    assert batch.num_microbatch == 3
    (a, b), _ = batch.dump(full(num_microbatch=6))
    assert torch.equal(a, torch.cat(list(three))) and torch.equal(b, torch.cat(list(four)[:3]))


def test_a_model_consumes_0_1_1_style_packed_inputs(num_devices: int) -> None:
    # Packed data built with 0.1.1's event pairs feeds a model (its forward waits on the events).
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    model = roundpipe.RoundPipe(nn.Sequential(layer))
    chunks = [torch.randn(2, 3) for _ in range(3)]
    pairs = [(torch.cuda.Event(), torch.cuda.Event()) for _ in range(3)]
    if torch.backends.cuda.is_built():
        pairs = [(HostEvent(), HostEvent()) for _ in range(3)]
    packed = RoundPipePackedData(chunks, pairs)
    with torch.no_grad():
        out = model(packed, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=3))
        expected = layer(torch.cat(chunks))
    torch.testing.assert_close(out, expected)
