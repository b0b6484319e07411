"""Microbatch split/merge and RoundPipePackedData, checked against tensor_split / cat references."""

from __future__ import annotations

import subprocess
import sys
from collections import namedtuple
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from roundpipe.batch import (
    BatchRows,
    RoundPipePackedData,
    merge_output,
    pack_output,
    packed_events,
    split_input,
    split_label,
)
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _CustomReducer, _Replicate
from torch.testing import assert_close
from torch.utils._pytree import register_pytree_node

Pair = namedtuple("Pair", ["first", "second"])


class Registered:
    """A custom container the tests register as a pytree node."""

    def __init__(self, tensor: torch.Tensor, tag: str):
        self.tensor, self.tag = tensor, tag


register_pytree_node(
    Registered,
    lambda node: ([node.tensor], node.tag),
    lambda children, tag: Registered(children[0], tag),
)


class Opaque:
    """A custom type that is not registered: a leaf even though it holds a tensor."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


@dataclass
class Holder:
    """Unregistered; its generated ``==`` compares tensors, which have no single truth value."""

    tensor: torch.Tensor


class Output:
    """A model output with attributes (like a Hugging Face ModelOutput)."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits


class CountingEvent:
    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1


def _chunks(tensor: torch.Tensor, n: int, dim: int = 0) -> list[torch.Tensor]:
    return list(torch.tensor_split(tensor, n, dim))


def _assert_tensor_lists_equal(actual: list[Any], expected: list[Any]) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        assert torch.equal(a, e)


# ----------------------------------------------------------------------------------------------
# Seed 000 examples


def test_seed_split_input_spec() -> None:
    images, table = torch.randn(10, 3), torch.randn(4, 4)
    spec = ((TensorChunkSpec(0), _Replicate), None)
    args_list, kwargs_list = split_input((images, table), {}, 3, spec)
    _assert_tensor_lists_equal([a[0] for a in args_list], _chunks(images, 3))
    assert all(a[1] is table for a in args_list)
    assert kwargs_list == [{}, {}, {}]


def test_seed_custom_split() -> None:
    def custom_split(args, kwargs, num_microbatch):
        images, masks = args
        chunks_images = images.chunk(num_microbatch)
        chunks_masks = masks.chunk(num_microbatch)
        args_list = [(img, mask) for img, mask in zip(chunks_images, chunks_masks, strict=True)]
        kwargs_list = [kwargs] * num_microbatch
        return args_list, kwargs_list

    images, masks = torch.randn(8, 3), torch.rand(8) > 0.5
    args_list, kwargs_list = split_input((images, masks), {"scale": 2.0}, 4, custom_split)
    _assert_tensor_lists_equal([a[0] for a in args_list], list(images.chunk(4)))
    _assert_tensor_lists_equal([a[1] for a in args_list], list(masks.chunk(4)))
    assert kwargs_list == [{"scale": 2.0}] * 4


def test_seed_split_label_spec() -> None:
    scalar, sequence, count = torch.tensor(0.5), torch.randn(3, 12, 4), 7
    spec = (_Replicate, TensorChunkSpec(1), _Replicate)
    labels = split_label((scalar, sequence, count), 4, spec)
    assert all(label[0] is scalar and label[2] == count for label in labels)
    _assert_tensor_lists_equal([label[1] for label in labels], _chunks(sequence, 4, dim=1))
    assert all(label[1].shape == (3, 3, 4) for label in labels)


def test_seed_custom_split_label() -> None:
    def custom_split_label(label, num_microbatch):
        targets, weights = label
        chunks_targets = targets.chunk(num_microbatch)
        chunks_weights = weights.chunk(num_microbatch)
        return [(t, w) for t, w in zip(chunks_targets, chunks_weights, strict=True)]

    targets, weights = torch.arange(6), torch.rand(6)
    labels = split_label((targets, weights), 3, custom_split_label)
    _assert_tensor_lists_equal([t for t, _ in labels], list(targets.chunk(3)))
    _assert_tensor_lists_equal([w for _, w in labels], list(weights.chunk(3)))


def test_seed_custom_reducer_sums() -> None:
    sum_reducer = _CustomReducer(torch.tensor(0.0), lambda x, y: x + y)
    losses = [torch.tensor(1.5), torch.tensor(2.0), torch.tensor(-0.25)]
    assert_close(merge_output(losses, sum_reducer), torch.tensor(3.25))
    merged = merge_output([(loss, i) for i, loss in enumerate(losses)], (sum_reducer, sum_reducer))
    assert_close(merged[0], torch.tensor(3.25))
    assert merged[1] == 3


def test_seed_custom_merge_logits() -> None:
    def custom_merge(outputs):
        return torch.cat([out.logits for out in outputs], dim=0)

    logits = torch.randn(7, 5)
    outputs = [Output(chunk) for chunk in _chunks(logits, 3)]
    assert torch.equal(merge_output(outputs, custom_merge), logits)
    # A function defines the merged form, so it applies to a single microbatch too.
    assert torch.equal(merge_output([Output(logits)], custom_merge), logits)


# ----------------------------------------------------------------------------------------------
# Automatic split


@pytest.mark.parametrize(("rows", "n"), [(10, 3), (7, 4), (8, 8), (9, 2), (5, 5)])
def test_auto_split_matches_tensor_split(rows: int, n: int) -> None:
    x = torch.randn(rows, 2)
    y = torch.arange(rows * 3).reshape(rows, 3)
    args_list, _ = split_input((x, [y, {"z": x * 2}]), {}, n, None)
    assert len(args_list) == n
    _assert_tensor_lists_equal([a[0] for a in args_list], _chunks(x, n))
    _assert_tensor_lists_equal([a[1][0] for a in args_list], _chunks(y, n))
    _assert_tensor_lists_equal([a[1][1]["z"] for a in args_list], _chunks(x * 2, n))
    assert all(isinstance(a[1], list) and isinstance(a[1][1], dict) for a in args_list)


def test_auto_split_replicates_scalars_and_non_tensors() -> None:
    x, scalar = torch.randn(6, 2), torch.tensor(3.0)
    args_list, _ = split_input((x, scalar, "mode", None, 4.5), {}, 3, None)
    for a in args_list:
        assert a[1] is scalar and a[2] == "mode" and a[3] is None and a[4] == 4.5


def test_auto_split_namedtuple_and_registered_node_recurse() -> None:
    x, y = torch.randn(6, 2), torch.randn(6)
    args_list, _ = split_input((Pair(x, 1), Registered(y, "tag")), {}, 3, None)
    for a, x_chunk, y_chunk in zip(args_list, _chunks(x, 3), _chunks(y, 3), strict=True):
        assert isinstance(a[0], Pair) and torch.equal(a[0].first, x_chunk) and a[0].second == 1
        assert isinstance(a[1], Registered) and a[1].tag == "tag"
        assert torch.equal(a[1].tensor, y_chunk)


def test_auto_split_replicates_unregistered_custom_types_whole() -> None:
    opaque = Opaque(torch.randn(6, 2))
    args_list, _ = split_input((torch.randn(6), opaque), {}, 3, None)
    assert all(a[1] is opaque for a in args_list)


def test_auto_split_kwargs_follow_the_batch_size() -> None:
    x = torch.randn(10, 4)
    mask, bias, scalar = torch.ones(10, 7), torch.randn(4), torch.tensor(2.0)
    one_row = torch.randn(1, 7)
    _, kwargs_list = split_input(
        (x,), {"mask": mask, "bias": bias, "s": scalar, "b": one_row, "flag": True}, 3, None
    )
    _assert_tensor_lists_equal([k["mask"] for k in kwargs_list], _chunks(mask, 3))
    for k in kwargs_list:
        assert k["bias"] is bias and k["s"] is scalar and k["b"] is one_row and k["flag"] is True


def test_auto_split_kwargs_only_call_cuts_every_tensor_on_its_own() -> None:
    """Without a batch from the args, seed 000's rule: every tensor with ndim > 0 is cut along
    dim 0 into num_microbatch chunks of its own (3 rows beside 7: one each); the first one is
    the batch the label follows."""
    input_ids, attention_mask = torch.arange(14).reshape(7, 2), torch.ones(7, 2)
    table, scalar = torch.randn(3, 2), torch.tensor(2.0)
    batch = BatchRows()
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "table": table, "s": scalar}
    args_list, kwargs_list = split_input((), kwargs, 3, None, batch)
    assert args_list == [(), (), ()]
    for name in ("input_ids", "attention_mask", "table"):
        _assert_tensor_lists_equal([k[name] for k in kwargs_list], _chunks(kwargs[name], 3))
    assert all(k["s"] is scalar for k in kwargs_list)
    labels = split_label(input_ids * 10, 3, None, batch)
    _assert_tensor_lists_equal(labels, [k["input_ids"] * 10 for k in kwargs_list])


def test_auto_split_cuts_a_flattened_label_along_the_samples() -> None:
    """A label of k rows per sample (token labels flattened from (batch, tokens)) is cut with
    its samples: what 0.1.1's even cut of it gives when the batch splits evenly, and the same
    samples' rows when it does not."""
    tokens = 5
    for rows, n in [(8, 4), (7, 3)]:
        ids = torch.arange(rows * tokens).reshape(rows, tokens)
        label = ids.reshape(-1) * 10
        batch = BatchRows()
        args_list, _ = split_input((ids,), {}, n, None, batch)
        labels = split_label(label, n, None, batch)
        for args, part in zip(args_list, labels, strict=True):
            assert torch.equal(part, args[0].reshape(-1) * 10)
        if rows % n == 0:
            _assert_tensor_lists_equal(labels, _chunks(label, n))


def test_auto_split_refuses_leaves_not_cut_along_the_batch() -> None:
    """A leaf whose dim 0 is neither the batch size nor a whole multiple of it would pair rows
    of other samples if cut into chunks of its own: a ValueError naming both leaves and the
    split specs that say what is meant."""
    x = torch.randn(8, 4)
    fix = r"TensorChunkSpec\(0\).*_Replicate"
    with pytest.raises(ValueError, match=rf"args\[1\] has 4 rows .* args\[0\] has 8.*{fix}"):
        split_input((x, torch.randn(4, 4)), {}, 2, None)
    batch = BatchRows()
    split_input((x,), {}, 2, None, batch)
    with pytest.raises(ValueError, match=rf"label has 12 rows .* args\[0\] has 8.*{fix}"):
        split_label(torch.randn(12), 2, None, batch)
    args_list, _ = split_input((x, torch.randn(4, 4)), {}, 2, ((None, TensorChunkSpec(0)), None))
    assert [a[1].size(0) for a in args_list] == [2, 2]


def test_auto_split_without_any_batched_tensor_replicates_everything() -> None:
    scalar = torch.tensor(1.0)
    args_list, kwargs_list = split_input((3, scalar), {"name": "x"}, 2, None)
    assert all(a[0] == 3 and a[1] is scalar for a in args_list)
    assert kwargs_list == [{"name": "x"}] * 2


def test_kwargs_auto_part_follows_the_spec_split_of_args() -> None:
    table, x = torch.randn(5, 5), torch.randn(9, 2)
    mask = torch.ones(9)
    spec = ((_Replicate, TensorChunkSpec(0)), None)
    args_list, kwargs_list = split_input((table, x), {"mask": mask, "other": table}, 3, spec)
    assert all(a[0] is table for a in args_list)
    _assert_tensor_lists_equal([a[1] for a in args_list], _chunks(x, 3))
    _assert_tensor_lists_equal([k["mask"] for k in kwargs_list], _chunks(mask, 3))
    assert all(k["other"] is table for k in kwargs_list)


def test_spec_none_and_prefix_markers() -> None:
    x, y = torch.randn(6, 2), torch.randn(6, 4)
    spec = (({"a": TensorChunkSpec(1), "b": None}, _Replicate), {"k": TensorChunkSpec(0)})
    args_list, kwargs_list = split_input(({"a": y, "b": x}, [x, y]), {"k": [x, y]}, 2, spec)
    _assert_tensor_lists_equal([a[0]["a"] for a in args_list], _chunks(y, 2, dim=1))
    _assert_tensor_lists_equal([a[0]["b"] for a in args_list], _chunks(x, 2))
    assert all(a[1][0] is x and a[1][1] is y for a in args_list)
    _assert_tensor_lists_equal([k["k"][1] for k in kwargs_list], _chunks(y, 2))


def test_spec_matches_dict_keys_in_any_order_and_negative_dims() -> None:
    x = torch.randn(2, 3, 8)
    spec = (None, {"b": _Replicate, "a": TensorChunkSpec(-1)})
    _, kwargs_list = split_input((), {"a": x, "b": 1}, 4, spec)
    _assert_tensor_lists_equal([k["a"] for k in kwargs_list], _chunks(x, 4, dim=-1))
    assert [list(k) for k in kwargs_list] == [["a", "b"]] * 4


def test_single_microbatch_passes_inputs_through() -> None:
    x, mask = torch.randn(3, 2), torch.ones(3)
    args_list, kwargs_list = split_input((x, "s"), {"mask": mask}, 1, None)
    assert len(args_list) == 1 and args_list[0][0] is x and args_list[0][1] == "s"
    assert kwargs_list[0]["mask"] is mask
    args_list, _ = split_input((x,), {}, 1, ((TensorChunkSpec(1),), None))
    assert args_list[0][0] is x
    (label,) = split_label({"y": x}, 1, None)
    assert label["y"] is x


# ----------------------------------------------------------------------------------------------
# Split errors


def test_a_batch_of_fewer_rows_than_microbatches_runs_one_row_each() -> None:
    # As torch.distributed.pipelining splits (and 0.1.1 with it): a short last batch.
    from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

    ids = torch.arange(2)
    args_list, kwargs_list = split_input(("s", {"ids": ids}), {"mask": ids * 2}, 3, None)
    expected, _ = split_args_kwargs_into_chunks(("s", {"ids": ids}), {"mask": ids * 2}, 3)
    assert len(args_list) == len(expected) == 2
    assert [a[1]["ids"].tolist() for a in args_list] == [[0], [1]]
    assert [k["mask"].tolist() for k in kwargs_list] == [[0], [2]]
    args_list, _ = split_input((torch.randn(4, 3),), {}, 5, ((TensorChunkSpec(1),), None))
    assert [a[0].shape[1] for a in args_list] == [1, 1, 1]
    # A split function may return fewer, as it splits a short batch.
    args_list, kwargs_list = split_input(
        (ids,), {}, 3, lambda a, k, n: ([(t,) for t in a[0].split(1)], [k, k])
    )
    assert len(args_list) == len(kwargs_list) == 2
    with pytest.raises(ValueError, match=r"label\[1\] holds 3 rows .* 4 microbatches"):
        split_label((1, torch.randn(9, 3)), 4, (None, TensorChunkSpec(1)))


@pytest.mark.parametrize(
    ("args", "spec", "message"),
    [
        ((torch.randn(4), 1), ((TensorChunkSpec(0),), None), r"args: the spec has 1 elements"),
        (({"a": 1},), (({"b": _Replicate},), None), r"args\[0\]: the spec has keys \{'b'\}"),
        ((torch.randn(4),), (([_Replicate],), None), r"args\[0\]: the spec is a list"),
        (([1, 2],), (({"a": None},), None), r"args\[0\]: the spec is a dict but the input"),
        ((Pair(1, 2),), (((None,),), None), r"args\[0\]: the spec has 1 elements"),
        ((1,), ((TensorChunkSpec(0),), None), r"args\[0\]: TensorChunkSpec needs a tensor"),
        ((torch.tensor(1.0),), ((TensorChunkSpec(0),), None), r"args\[0\]: TensorChunkSpec"),
        ((torch.randn(4, 4),), ((TensorChunkSpec(2),), None), r"TensorChunkSpec\(2\) is out"),
    ],
)
def test_spec_mismatch_names_the_path(args: tuple, spec: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message) as raised:
        split_input(args, {}, 2, spec)
    assert str(raised.value).startswith("split_input: "), "names the configuration field"


def test_kwargs_spec_mismatch_names_the_path() -> None:
    with pytest.raises(ValueError, match=r"kwargs: the spec has keys \{'a'\}.*\{'a', 'b'\}"):
        split_input((), {"a": 1, "b": 2}, 2, (None, {"a": _Replicate}))
    with pytest.raises(ValueError, match=r"^split_label: label\.second: the spec is a tuple"):
        split_label(Pair(1, 2), 2, (None, (None,)))
    with pytest.raises(ValueError, match=r"^merge_output: output: the spec is a tuple"):
        merge_output([torch.ones(2), torch.ones(2)], (TensorChunkSpec(0),))


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (([(1,)] * 3, [{}] * 3), "args_list must be a list of num_microbatch=2 items, got 3 items"),
        (
            ([(1,)], [{}, {}]),
            r"kwargs_list must be as long as args_list \(1; num_microbatch is 2\), got 2 items",
        ),
        (([(1,), (2,)], {}), "kwargs_list must be a list of num_microbatch=2"),
        (([(1,), (2,)],), r"must return \(args_list, kwargs_list\)"),
        (([(1,), 2], [{}, {}]), r"microbatch 1 must be \(tuple, dict\), got \(a int, a dict\)"),
        (([(1,), (2,)], [{}, [1]]), r"microbatch 1 must be \(tuple, dict\)"),
    ],
)
def test_split_input_function_result_is_validated(result: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_input((1,), {}, 2, lambda args, kwargs, n: result)


def test_split_input_function_result_is_normalised() -> None:
    args_list, kwargs_list = split_input((1,), {}, 2, lambda a, k, n: ([[1], [2]], ({}, {})))
    assert args_list == [(1,), (2,)] and kwargs_list == [{}, {}]


def test_split_label_function_result_is_validated() -> None:
    with pytest.raises(ValueError, match="split_label's result must be a list of num_microbatch=3"):
        split_label(torch.arange(6), 3, lambda label, n: list(label.chunk(2)))
    with pytest.raises(ValueError, match="got a Tensor"):
        split_label(torch.arange(6), 3, lambda label, n: label)


def test_reducer_is_rejected_in_split_spec() -> None:
    with pytest.raises(ValueError, match=r"label: _CustomReducer only applies to merge_output"):
        split_label(torch.arange(4), 2, _CustomReducer(0, max))


@pytest.mark.parametrize("n", [0, -1, True, 2.0])
def test_invalid_num_microbatch(n: Any) -> None:
    with pytest.raises(ValueError, match="num_microbatch must be an int >= 1"):
        split_input((torch.randn(4),), {}, n, None)


# ----------------------------------------------------------------------------------------------
# Merging


def test_auto_merge_concatenates_and_averages() -> None:
    x, y = torch.randn(10, 3), torch.randn(10)
    losses = [torch.tensor(0.5), torch.tensor(1.0), torch.tensor(3.0)]
    outputs = [
        {"h": xc, "aux": [yc, loss], "name": "block", "shape": (3,), "none": None}
        for xc, yc, loss in zip(_chunks(x, 3), _chunks(y, 3), losses, strict=True)
    ]
    merged = merge_output(outputs, None)
    assert torch.equal(merged["h"], x) and torch.equal(merged["aux"][0], y)
    assert_close(merged["aux"][1], torch.stack(losses).mean())
    assert merged["name"] == "block" and merged["shape"] == (3,) and merged["none"] is None
    assert merge_output(outputs, True)["name"] == "block"


def test_tensors_that_do_not_concatenate_are_a_value_error_naming_the_leaf() -> None:
    concatenate = r": cannot concatenate the microbatches' tensors"
    with pytest.raises(ValueError, match=r"output\['h'\]" + concatenate + r".* \(2, 4\)"):
        merge_output([{"h": torch.zeros(2, 3)}, {"h": torch.zeros(2, 4)}], None)
    with pytest.raises(ValueError, match=r"output\[0\]" + concatenate + " along dim 1"):
        merge_output([(torch.zeros(2, 3),), (torch.zeros(3, 3),)], (TensorChunkSpec(1),))


def test_auto_merge_averages_integer_scalars_in_floating_point() -> None:
    merged = merge_output([torch.tensor(1), torch.tensor(2)], None)
    assert merged.is_floating_point() and merged.item() == 1.5


def test_auto_merge_recurses_registered_nodes_and_compares_unregistered_ones() -> None:
    outputs = [Registered(torch.ones(2), "t"), Registered(torch.zeros(3), "t")]
    merged = merge_output(outputs, None)
    assert isinstance(merged, Registered) and merged.tag == "t"
    assert torch.equal(merged.tensor, torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0]))
    opaque = Opaque(torch.ones(2))
    assert merge_output([opaque, opaque], None) is opaque
    with pytest.raises(ValueError, match=r"output\[1\]: microbatch 1 returned <.*Opaque"):
        merge_output([(1, opaque), (1, Opaque(torch.ones(2)))], None)
    with pytest.raises(ValueError, match=r"output\[1\]: cannot compare a Holder"):
        merge_output([(1, Holder(torch.ones(2))), (1, Holder(torch.ones(2)))], None)


def test_auto_merge_unequal_non_tensors_name_the_leaf() -> None:
    with pytest.raises(ValueError, match=r"output\['meta'\]\[1\]: microbatch 2 returned 'b'"):
        merge_output([{"meta": (1, "a")}, {"meta": (1, "a")}, {"meta": (1, "b")}], None)


def test_auto_merge_structure_mismatch_names_the_path() -> None:
    with pytest.raises(ValueError, match=r"output: microbatch 1's output has keys"):
        merge_output([{"a": 1}, {"b": 1}], None)
    with pytest.raises(ValueError, match=r"output\[0\]: microbatch 1's output is a int"):
        merge_output([([1],), (1,)], None)
    with pytest.raises(ValueError, match=r"output: automatic merge needs tensors"):
        merge_output([torch.ones(1), 1.0], None)
    with pytest.raises(ValueError, match="0-d tensors and others did not"):
        merge_output([torch.ones(1), torch.tensor(1.0)], None)


def test_merge_keeps_autograd_connected() -> None:
    weight = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(7, 3)
    outputs = [(chunk @ weight, (chunk @ weight).sum()) for chunk in _chunks(x, 3)]
    merged, mean_sum = merge_output(outputs, None)
    (merged.square().sum() + mean_sum).backward()
    expected_weight = weight.detach().clone().requires_grad_()
    full = x @ expected_weight
    sums = torch.stack([c.sum() for c in _chunks(full, 3)])
    (full.square().sum() + sums.mean()).backward()
    assert_close(weight.grad, expected_weight.grad)


def test_merge_spec_chunk_replicate_and_reducer() -> None:
    x, table = torch.randn(2, 9), torch.randn(4)
    reducer = _CustomReducer(torch.tensor(0.0), lambda acc, v: acc + v)
    outputs = [
        (chunk, table.clone(), {"loss": torch.tensor(float(i)), "step": 5})
        for i, chunk in enumerate(_chunks(x, 3, dim=1))
    ]
    spec = (TensorChunkSpec(1), _Replicate, {"loss": reducer, "step": None})
    merged = merge_output(outputs, spec)
    assert torch.equal(merged[0], x) and torch.equal(merged[1], table)
    assert_close(merged[2]["loss"], torch.tensor(3.0))
    assert merged[2]["step"] == 5
    with pytest.raises(ValueError, match=r"output\[1\]: microbatch 1 returned"):
        merge_output([(x, table), (x, table + 1)], (TensorChunkSpec(0), _Replicate))
    with pytest.raises(ValueError, match=r"output\[0\]: TensorChunkSpec needs tensors"):
        merge_output([(1,), (1,)], (TensorChunkSpec(0),))
    with pytest.raises(ValueError, match=r"output: the spec is a tuple but the output is a leaf"):
        merge_output([x, x], (TensorChunkSpec(0),))


def test_merge_single_microbatch_returns_the_output_unchanged() -> None:
    output = {"h": torch.randn(2), "meta": Opaque(torch.ones(1))}
    assert merge_output([output], None) is output
    merged = merge_output([output], {"h": TensorChunkSpec(0), "meta": _Replicate})
    assert merged["h"] is output["h"] and merged["meta"] is output["meta"]
    reducer = _CustomReducer(torch.tensor(10.0), lambda acc, v: acc + v)
    assert_close(merge_output([torch.tensor(1.0)], reducer), torch.tensor(11.0))


def test_merge_rejects_empty_and_false() -> None:
    with pytest.raises(ValueError, match="at least one"):
        merge_output([], None)
    with pytest.raises(ValueError, match="use pack_output"):
        merge_output([1], False)


# ----------------------------------------------------------------------------------------------
# Packed data


def test_pack_output_round_trip_into_the_next_model() -> None:
    x = torch.randn(7, 2)
    events = [CountingEvent(), None, CountingEvent()]
    outputs = [(chunk * 2, {"n": i}) for i, chunk in enumerate(_chunks(x, 3))]
    packed = pack_output(outputs, events)
    hidden, extra = packed[0], packed[1]["n"]
    assert isinstance(hidden, RoundPipePackedData) and isinstance(extra, RoundPipePackedData)
    assert list(extra) == [0, 1, 2]
    assert hidden.events == events and extra.events == events
    assert packed_events(packed, 3) == [[events[0], events[0]], [], [events[2], events[2]]]

    mask = torch.ones(7, 5)
    args_list, kwargs_list = split_input((hidden,), {"mask": mask, "n": extra}, 3, None)
    _assert_tensor_lists_equal([a[0] for a in args_list], [c * 2 for c in _chunks(x, 3)])
    _assert_tensor_lists_equal([k["mask"] for k in kwargs_list], _chunks(mask, 3))
    assert [k["n"] for k in kwargs_list] == [0, 1, 2]

    assert hidden.synchronize() is hidden
    assert [e.waits if e else None for e in events] == [1, None, 1]
    assert hidden.events == [None, None, None]
    assert packed_events(hidden, 3) == [[], [], []]
    _assert_tensor_lists_equal(list(hidden), [c * 2 for c in _chunks(x, 3)])


def test_packed_rows_drive_the_kwargs_batch_split() -> None:
    # Upstream split 6 rows unevenly as 1/5: kwargs rows of the batch must follow, not tensor_split.
    hidden = RoundPipePackedData([torch.randn(1, 2), torch.randn(5, 2)])
    mask = torch.arange(6)
    args_list, kwargs_list = split_input((hidden, torch.arange(6)), {"mask": mask}, 2, None)
    assert [k["mask"].tolist() for k in kwargs_list] == [[0], [1, 2, 3, 4, 5]]
    assert [a[1].tolist() for a in args_list] == [[0], [1, 2, 3, 4, 5]]


def test_packed_leaf_of_another_length() -> None:
    # Fewer microbatches than asked for: 0.1.1 warned and ran as many as the packed value holds.
    packed = RoundPipePackedData([1, 2])
    with pytest.warns(UserWarning, match=r"downsizing batch size to 2\. \(args\[0\] holds 2"):
        args_list, _ = split_input((packed,), {}, 3, None)
    assert args_list == [(1,), (2,)]
    # More: microbatch m takes element m, as in 0.1.1, and ours says the rest is unused.
    unused = r"RoundPipePackedData holds 2 microbatches but the call runs 1; using its first 1"
    with pytest.warns(UserWarning, match=r"args\[0\]: " + unused):
        args_list, _ = split_input((packed,), {}, 1, None)
    assert args_list == [(1,)]
    with pytest.warns(UserWarning, match=r"label: " + unused):
        assert split_label(packed, 1, None) == [1]


def test_packed_data_single_microbatch_yields_its_element() -> None:
    packed = RoundPipePackedData([torch.ones(2)])
    args_list, _ = split_input((packed,), {}, 1, None)
    assert args_list[0][0] is packed[0]


def test_packed_data_is_a_list_and_checks_events() -> None:
    packed = RoundPipePackedData([1, 2, 3])
    assert packed == [1, 2, 3] and packed.events == [None, None, None]
    assert "pending_events=0" in repr(packed)
    with pytest.raises(ValueError, match="3 values but 1 events"):
        RoundPipePackedData([1, 2, 3], [None])
    with pytest.raises(ValueError, match="one event per microbatch output"):
        pack_output([1, 2], [None])


def test_pack_output_rejects_mismatched_structures() -> None:
    with pytest.raises(ValueError, match=r"output: microbatch 1's output has 1 elements"):
        pack_output([(1, 2), (1,)], [None, None])


@pytest.mark.slow
def test_importing_the_api_does_not_import_torch_pipelining() -> None:
    # torch.distributed.pipelining takes over a second to import; markers are looked up lazily.
    code = (
        "import sys, torch, roundpipe.batch, roundpipe.run_config\n"
        "from roundpipe.batch import split_input\n"
        "args, _ = split_input((torch.arange(4),), {}, 2, None)\n"
        "assert [a[0].tolist() for a in args] == [[0, 1], [2, 3]]\n"
        "assert 'torch.distributed.pipelining' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
