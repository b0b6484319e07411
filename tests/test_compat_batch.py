"""roundpipe 0.1.1's split/merge surface as its code uses it: ``Batch``,
``FullRoundPipeRunConfig``, ``RoundPipePackedData(data, transfer_event)`` with event pairs, and
``torch.cuda.Event()`` on a torch built without CUDA (an event of the virtual CPU devices)."""

from __future__ import annotations

import dataclasses

import pytest
import roundpipe
import torch
from roundpipe.batch import Batch, RoundPipePackedData, merge_output, split_input
from roundpipe.device import HostEvent
from roundpipe.run_config import FullRoundPipeRunConfig, RoundPipeRunConfig, resolve_run_config
from torch import nn


def full(**fields: object) -> FullRoundPipeRunConfig:
    return FullRoundPipeRunConfig(RoundPipeRunConfig(**fields), RoundPipeRunConfig())


def test_full_config_is_the_resolved_one() -> None:
    call = RoundPipeRunConfig(num_microbatch=3, merge_output=False)
    model = RoundPipeRunConfig(recompute_grain="layer")
    resolved = dataclasses.asdict(resolve_run_config(call, model))
    assert dataclasses.asdict(FullRoundPipeRunConfig(call, model)) == resolved
    assert full().num_microbatch == roundpipe.device_count() + 1


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
