"""Splitting a batch into microbatches and merging the microbatch outputs back.

Values are walked as ``torch.utils._pytree`` trees: tuples, lists, dicts, namedtuples and nodes the
user registered with ``register_pytree_node`` are recursed into; everything else is a leaf, kept
whole even when it holds tensors. A :class:`RoundPipePackedData` is always a leaf: it is already
split, so microbatch ``m`` takes its element ``m``.

Automatic split (spec ``None``):

* args and labels: every tensor with ``ndim > 0`` is chunked along dim 0 with
  ``torch.tensor_split`` semantics (uneven sizes give the first chunks one extra row); 0-d tensors
  and non-tensors are replicated.
* kwargs, when ``args`` sets the *batch* (its first leaf chunked along dim 0, or a packed leaf
  of such tensors): only tensors whose dim-0 size equals the batch size are chunked, into the
  same row counts as the batch; every other kwarg is replicated.
* kwargs, when ``args`` sets none (keyword-only calls such as
  ``model(input_ids=..., attention_mask=...)``): every tensor with ``ndim > 0`` is chunked along
  dim 0 on its own, as seed 000 (and roundpipe 0.1.1) cut every tensor: 3 rows beside 8 give 2
  and 1 rows to 2 microbatches. The first such leaf is the batch the label follows. When neither
  has one there is nothing to split and every microbatch receives the whole input.

Specs are trees shaped like the value (or a prefix of it) whose leaves are
``torch.distributed.pipelining.microbatch`` markers: ``TensorChunkSpec(dim)`` (chunk / concatenate
along ``dim``), ``_Replicate`` (replicate / require equal values) and, for merging only,
``_CustomReducer(init, fn)`` (fold ``fn(acc, x)`` from ``init``). A marker placed on a container
applies to every leaf below it; ``None`` anywhere in a spec means "automatic" for that subtree.

Automatic merge: tensors with ``ndim > 0`` are concatenated along dim 0, 0-d tensors are averaged,
non-tensors (including unregistered custom types) must be equal in every microbatch.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from typing_extensions import TypeIs

from roundpipe.packed_data import Event, RoundPipePackedData
from roundpipe.torch_internals import TreeSpec, tree_flatten, tree_unflatten

# Importing torch.distributed.pipelining costs over a second, so it is never imported here: a spec
# can only hold its markers if the user imported this module already, and otherwise none is one.
_MICROBATCH_MODULE = "torch.distributed.pipelining.microbatch"

MarkerKind = Literal["chunk", "replicate", "reduce"]
SplitInputFn = Callable[
    [tuple[Any, ...], dict[str, Any], int], tuple[list[tuple[Any, ...]], list[dict[str, Any]]]
]
SplitLabelFn = Callable[[Any, int], list[Any]]
MergeOutputFn = Callable[[list[Any]], Any]
#: How an automatically split tensor leaf is cut: ``"batch"`` (args and labels) along the batch,
#: which the first one sets (a whole multiple of the batch size: with its samples; any other
#: size: ``ValueError``); ``"matching"`` (kwargs, when the args set the batch) only when its
#: size is the batch's, else replicated; ``"each"`` (kwargs, when the args set none) into
#: ``num_microbatch`` chunks of its own, as seed 000 cuts every tensor, the first one setting the
#: batch the label follows.
SplitRule = Literal["batch", "matching", "each"]


def marker_kind(obj: Any) -> MarkerKind | None:
    """Which ``torch.distributed.pipelining.microbatch`` marker ``obj`` is, or ``None``."""
    module = sys.modules.get(_MICROBATCH_MODULE)
    if module is None:
        return None
    if isinstance(obj, module.TensorChunkSpec):
        return "chunk"
    replicate = module._Replicate
    if isinstance(obj, replicate) or (isinstance(obj, type) and issubclass(obj, replicate)):
        return "replicate"
    if isinstance(obj, module._CustomReducer):
        return "reduce"
    return None


def is_user_function(obj: Any) -> TypeIs[Callable[..., Any]]:
    """True for a user's split/merge function (``_Replicate`` is a class, hence callable)."""
    return callable(obj) and marker_kind(obj) is None


@dataclass(frozen=True)
class _Node:
    """One expanded pytree container: its children, their path suffixes and how to rebuild it."""

    children: list[Any]
    keys: list[Any]  # dict keys for mappings, positions otherwise: children are matched on these
    labels: list[str]  # path suffix of each child, for messages
    kind: Literal["sequence", "mapping", "other"]
    treespec: TreeSpec
    type_name: str

    def rebuild(self, children: list[Any]) -> Any:
        return tree_unflatten(children, self.treespec)


def _expand(value: Any) -> _Node | None:
    """The container ``value`` as a node, or ``None`` when ``value`` is a leaf."""
    if isinstance(value, RoundPipePackedData):
        return None
    children, treespec = tree_flatten(value, is_leaf=lambda child: child is not value)
    if treespec.is_leaf():
        return None
    if isinstance(value, dict):
        keys = list(value.keys())
        labels = [f"[{key!r}]" for key in keys]
        return _Node(children, keys, labels, "mapping", treespec, type(value).__name__)
    positions = list(range(len(children)))
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        labels = [f".{field}" for field in value._fields]
    else:
        labels = [f"[{i}]" for i in positions]
    kind: Literal["sequence", "other"] = "sequence" if isinstance(value, (list, tuple)) else "other"
    return _Node(children, positions, labels, kind, treespec, type(value).__name__)


def _describe(value: Any) -> str:
    return f"a {type(value).__name__}"


def _align(node: _Node, other: Any, path: str, what: str, reference: str) -> list[Any]:
    """The children of ``other`` in the order of ``node``'s, or a ValueError naming ``path``.

    Tuples, lists and namedtuples match each other by position, dicts by key, other registered
    nodes only their own type. ``what`` and ``reference`` name ``other`` and ``node`` in messages.
    """
    other_node = _expand(other)
    mismatch = (
        other_node is None
        or other_node.kind != node.kind
        or (
            node.kind == "other"
            and (
                other_node.treespec.type is not node.treespec.type
                or other_node.treespec.context != node.treespec.context
            )
        )
    )
    if mismatch or other_node is None:
        raise ValueError(
            f"{path}: {what} is {_describe(other)} but {reference} is a {node.type_name}; "
            "make the structures match"
        )
    if node.kind == "mapping":
        if set(other_node.keys) != set(node.keys):
            theirs, ours = (", ".join(sorted(map(repr, n.keys))) for n in (other_node, node))
            raise ValueError(
                f"{path}: {what} has keys {{{theirs}}} but {reference} has keys {{{ours}}}; "
                "give both the same keys"
            )
        by_key = dict(zip(other_node.keys, other_node.children, strict=True))
        return [by_key[key] for key in node.keys]
    if len(other_node.children) != len(node.children):
        raise ValueError(
            f"{path}: {what} has {len(other_node.children)} elements but {reference} has "
            f"{len(node.children)}; give both the same length"
        )
    return other_node.children


def _iter_leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    node = _expand(value)
    if node is None:
        yield path, value
        return
    for child, label in zip(node.children, node.labels, strict=True):
        yield from _iter_leaves(child, path + label)


def check_spec(spec: Any, field: str, allow_reduce: bool) -> None:
    """Raise TypeError/ValueError unless every leaf of ``spec`` is ``None`` or a valid marker.

    ``field`` names the spec in messages (for example ``"split_label"``).
    """
    allowed = "TensorChunkSpec(dim), _Replicate" + (", _CustomReducer" if allow_reduce else "")
    for path, leaf in _iter_leaves(spec, field):
        kind = marker_kind(leaf)
        if leaf is None or kind == "replicate":
            continue
        if kind == "chunk":
            dim = leaf.split_dim
            if isinstance(dim, bool) or not isinstance(dim, int):
                raise TypeError(f"{path}: TensorChunkSpec dim must be an int, got {dim!r}")
        elif kind == "reduce":
            if not allow_reduce:
                raise ValueError(
                    f"{path}: _CustomReducer only applies to merge_output; use {allowed} here"
                )
            if not callable(leaf.reduce_fn):
                raise TypeError(f"{path}: _CustomReducer reduce_fn must be callable")
        else:
            raise TypeError(f"{path}: {leaf!r} is not a spec; use {allowed} or None (automatic)")


def guess_split_spec(data: Any, expected_batchsize: int | None = None) -> tuple[Any, int | None]:
    """roundpipe 0.1.1's guess of a split spec, kept as compatibility surface: the automatic
    kwargs rule of :func:`split_input` written out as a spec.

    Returns ``(spec, batch_size)``: ``spec`` is shaped like ``data``, ``TensorChunkSpec(0)`` for
    every tensor with ``ndim > 0`` whose dim 0 is ``expected_batchsize`` (any size when it is
    ``None``) and ``_Replicate`` for every other leaf; ``batch_size`` is the dim-0 size those
    tensors agree on (a :class:`RoundPipePackedData` of such tensors counts with its total
    rows), or ``None`` when there are none or they disagree. (Importing the markers costs over a
    second the first time.)
    """
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

    leaves, treespec = tree_flatten(data)
    spec: list[Any] = []
    sizes: list[int] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            if expected_batchsize is None or leaf.size(0) == expected_batchsize:
                spec.append(TensorChunkSpec(0))  # type: ignore[no-untyped-call]
                sizes.append(leaf.size(0))
                continue
        rows = _packed_rows(leaf) if isinstance(leaf, RoundPipePackedData) else None
        if rows is not None:
            sizes.append(sum(rows))
        spec.append(_Replicate)
    agreed = sizes[0] if sizes and all(size == sizes[0] for size in sizes) else None
    return tree_unflatten(spec, treespec), agreed


# ----------------------------------------------------------------------------------------------
# Splitting


class BatchRows:
    """Row counts of the batch the automatic rules follow, set by the first dim-0 split, and the
    path of the leaf that set them. Shared by a call's inputs and label, so every automatically
    split leaf of both must have the batch's size, or a whole multiple of it (so many rows per
    sample)."""

    def __init__(self) -> None:
        self.rows: list[int] | None = None
        self.path: str | None = None

    def set(self, rows: list[int] | None, path: str) -> None:
        if self.rows is None and rows is not None:
            self.rows, self.path = rows, path

    def matches(self, tensor: torch.Tensor) -> bool:
        return self.rows is not None and tensor.size(0) == sum(self.rows)

    def per_row(self, tensor: torch.Tensor) -> int | None:
        """How many rows ``tensor`` has per row of the batch, when its dim 0 is a whole multiple
        (2 or more) of the batch size; None otherwise."""
        if self.rows is None:
            return None
        per_row, rest = divmod(tensor.size(0), sum(self.rows))
        return per_row if per_row >= 2 and rest == 0 else None


class _FewerMicrobatches(Exception):
    """A leaf to split holds fewer than ``num_microbatch`` parts: ``count`` of them (rows along
    the split dim, or the microbatches of a packed value)."""

    def __init__(self, count: int, path: str, packed: bool) -> None:
        super().__init__(path)
        self.count, self.path, self.packed = count, path, packed


def _split_dim_chunks(tensor: torch.Tensor, dim: int, n: int, path: str) -> list[torch.Tensor]:
    if tensor.size(dim) == 0:
        raise ValueError(
            f"{path}: cannot split an empty tensor (size 0 along dim {dim}) into microbatches; "
            "pass a non-empty batch, or mark it _Replicate in the split spec"
        )
    if tensor.size(dim) < n:
        raise _FewerMicrobatches(tensor.size(dim), path, packed=False)
    return list(torch.tensor_split(tensor, n, dim))


def _packed_rows(packed: RoundPipePackedData) -> list[int] | None:
    if all(isinstance(v, torch.Tensor) and v.dim() > 0 for v in packed):
        return [v.size(0) for v in packed]
    return None


def _unpack(packed: RoundPipePackedData, n: int, path: str, batch: BatchRows) -> list[Any]:
    if 0 < len(packed) < n:
        raise _FewerMicrobatches(len(packed), path, packed=True)
    if not packed:
        raise ValueError(f"{path}: RoundPipePackedData holds no microbatch")
    values = list(packed)
    if len(values) > n:
        # As 0.1.1: microbatch m takes element m, so the elements past the call's last
        # microbatch are not used (another packed input held fewer, or num_microbatch is lower).
        warnings.warn(
            f"{path}: RoundPipePackedData holds {len(values)} microbatches but the call runs "
            f"{n}; using its first {n}",
            stacklevel=5,
        )
        values = values[:n]
    batch.set(_packed_rows(RoundPipePackedData(values)), path)
    return values


def _split_leaf(
    value: Any, spec: Any, n: int, path: str, batch: BatchRows, rule: SplitRule
) -> list[Any]:
    kind = marker_kind(spec)
    is_tensor = isinstance(value, torch.Tensor)
    if kind == "chunk":
        if not is_tensor or value.dim() == 0:
            raise ValueError(
                f"{path}: TensorChunkSpec needs a tensor with at least one dim, got "
                f"{_describe(value)}; use _Replicate for it"
            )
        dim = spec.split_dim
        if not -value.dim() <= dim < value.dim():
            raise ValueError(
                f"{path}: TensorChunkSpec({dim}) is out of range for a {value.dim()}-d tensor"
            )
        if n == 1:
            return [value]
        chunks = _split_dim_chunks(value, dim, n, path)
        if dim % value.dim() == 0:
            batch.set([c.size(0) for c in chunks], path)
        return chunks
    if kind == "reduce":
        raise ValueError(f"{path}: _CustomReducer only applies to merge_output")
    if kind == "replicate" or n == 1 or not is_tensor or value.dim() == 0:
        return [value] * n
    if rule == "each":
        chunks = _split_dim_chunks(value, 0, n, path)
        batch.set([c.size(0) for c in chunks], path)
        return chunks
    if batch.rows is not None and batch.matches(value):
        return list(torch.split(value, batch.rows, 0))
    if batch.rows is not None:
        if rule == "matching":
            return [value] * n
        per_row = batch.per_row(value)
        if per_row is not None:
            # k rows per sample (a label flattened from (batch, tokens) to (batch * tokens,)):
            # each microbatch takes its samples' rows, as 0.1.1's even cut does whenever the
            # batch splits evenly.
            return list(torch.split(value, [per_row * rows for rows in batch.rows], 0))
        # Cutting this leaf into chunks of its own would pair rows that do not belong together.
        raise ValueError(
            f"{path} has {value.size(0)} rows along dim 0 but {batch.path} has "
            f"{sum(batch.rows)}: automatic splitting cuts every split input and label along the "
            f"batch, so their dim 0 must be the batch size or a whole multiple of it; in the "
            f"split spec (split_input / split_label) mark {path} TensorChunkSpec(0) to cut it "
            "into num_microbatch chunks of its own, or _Replicate to give every microbatch all "
            "of it, or pass a split function"
        )
    chunks = _split_dim_chunks(value, 0, n, path)
    batch.set([c.size(0) for c in chunks], path)
    return chunks


def _split_tree(
    value: Any, spec: Any, n: int, path: str, batch: BatchRows, rule: SplitRule
) -> list[Any]:
    """Split ``value`` into ``n`` values following ``spec`` (``None``, a marker or a tree), its
    automatic leaves by ``rule`` (see :data:`SplitRule`)."""
    if isinstance(value, RoundPipePackedData):
        return _unpack(value, n, path, batch)
    node = _expand(value)
    if spec is not None and marker_kind(spec) is None:
        if node is None:
            raise ValueError(
                f"{path}: the spec is {_describe(spec)} but the value is a leaf "
                f"({_describe(value)}); put a TensorChunkSpec, _Replicate or None there"
            )
        child_specs = _align(node, spec, path, "the spec", "the input")
    elif node is None:
        return _split_leaf(value, spec, n, path, batch, rule)
    else:
        child_specs = [spec] * len(node.children)
    parts = [
        _split_tree(child, child_spec, n, path + label, batch, rule)
        for child, child_spec, label in zip(node.children, child_specs, node.labels, strict=True)
    ]
    return [node.rebuild([part[m] for part in parts]) for m in range(n)]


def _check_count(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"num_microbatch must be an int >= 1, got {n!r}")


@contextmanager
def _naming(field: str) -> Iterator[None]:
    """A ValueError of the split or merge inside names the configuration field it follows."""
    try:
        yield
    except ValueError as error:
        raise ValueError(f"{field}: {error}") from None


def _check_list(result: Any, n: int, what: str, wanted: str | None = None) -> list[Any]:
    """``result`` as a list of ``n`` items; ``wanted`` says why ``n`` (default: the call's
    num_microbatch)."""
    if not isinstance(result, (list, tuple)) or len(result) != n:
        got = f"{len(result)} items" if isinstance(result, (list, tuple)) else _describe(result)
        wanted = f"a list of num_microbatch={n} items" if wanted is None else wanted
        raise ValueError(f"{what} must be {wanted}, got {got}")
    return list(result)


def _refuse_caches(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """A Hugging Face KV cache (``transformers``' ``Cache``, which a decoder model's forward
    builds when ``use_cache`` is on) would be shared by every microbatch, and every layer would
    append each microbatch's keys to it (recompute: again): the attention of one microbatch would
    see the others'. ``ValueError`` naming the argument instead of wrong numbers."""
    named = [(f"args[{i}]", value) for i, value in enumerate(args)] + list(kwargs.items())
    for name, value in named:
        kind = type(value)
        if kind.__module__.startswith("transformers") and any(
            base.__name__ == "Cache" for base in kind.__mro__
        ):
            raise ValueError(
                f"{name} is a transformers {kind.__name__} (a KV cache), which every microbatch "
                "would share and every recompute append to: call the model with use_cache=False "
                "(or set model.config.use_cache = False) when training through RoundPipe"
            )


def split_input(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    num_microbatch: int,
    spec: tuple[Any, Any] | SplitInputFn | None,
    batch: BatchRows | None = None,
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """Split a call's ``(args, kwargs)`` into per-microbatch ``(args_list, kwargs_list)``.

    ``spec`` is ``None`` (automatic), ``(args_spec, kwargs_spec)`` (either part ``None`` for
    automatic) or a function ``fn(args, kwargs, n) -> (args_list, kwargs_list)``. With one
    microbatch nothing is split and a split function is not called (packed leaves still yield
    their element 0). ``batch`` receives the batch the automatic rules found, for
    :func:`split_label`.
    """
    _check_count(num_microbatch)
    args, kwargs = tuple(args), dict(kwargs)
    _refuse_caches(args, kwargs)
    if is_user_function(spec) and num_microbatch == 1:
        spec = None  # one microbatch: no split
    if is_user_function(spec):
        result = spec(args, kwargs, num_microbatch)
        if not isinstance(result, (list, tuple)) or len(result) != 2:
            raise ValueError(
                "split_input function must return (args_list, kwargs_list), got "
                f"{_describe(result)}"
            )
        # Fewer microbatches than asked for are what a batch of fewer rows splits into, as the
        # automatic split does (a preset's split function of a short last batch).
        first = result[0]
        fewer = isinstance(first, (list, tuple)) and 1 <= len(first) < num_microbatch
        count = len(first) if fewer else num_microbatch
        args_list = _check_list(first, count, "split_input's args_list")
        kwargs_list = _check_list(
            result[1],
            count,
            "split_input's kwargs_list",
            f"as long as args_list ({count}; num_microbatch is {num_microbatch})"
            if fewer
            else None,
        )
        for m, (mb_args, mb_kwargs) in enumerate(zip(args_list, kwargs_list, strict=True)):
            if not isinstance(mb_args, (tuple, list)) or not isinstance(mb_kwargs, dict):
                raise ValueError(
                    f"split_input function: microbatch {m} must be (tuple, dict), got "
                    f"({_describe(mb_args)}, {_describe(mb_kwargs)})"
                )
        return [tuple(a) for a in args_list], [dict(k) for k in kwargs_list]
    args_spec, kwargs_spec = (None, None) if spec is None else spec
    batch = BatchRows() if batch is None else batch
    while True:
        try:
            with _naming("split_input"):
                args_list = _split_tree(args, args_spec, num_microbatch, "args", batch, "batch")
                rule: SplitRule = "each" if batch.rows is None else "matching"
                kwargs_list = _split_tree(
                    kwargs, kwargs_spec, num_microbatch, "kwargs", batch, rule
                )
            return args_list, kwargs_list
        except _FewerMicrobatches as fewer:
            # As torch.distributed.pipelining splits (and 0.1.1 with it): a batch of fewer rows
            # than microbatches (a short last batch) runs as that many microbatches.
            if fewer.packed:
                # The first sentence is 0.1.1's, which code may match on.
                warnings.warn(
                    f"Batch index {fewer.count} out of range for RoundPipePackedData input, "
                    f"downsizing batch size to {fewer.count}. ({fewer.path} holds {fewer.count} "
                    f"microbatches but num_microbatch is {num_microbatch}: its producer ran "
                    "another num_microbatch, or a batch of fewer rows)",
                    stacklevel=4,
                )
            num_microbatch = fewer.count
            batch.rows = batch.path = None


def split_label(
    label: Any, num_microbatch: int, spec: Any | SplitLabelFn | None, batch: BatchRows | None = None
) -> list[Any]:
    """Split a label into ``num_microbatch`` labels (automatic, a spec, or ``fn(label, n)``).

    Automatically split leaves must have the size of ``batch`` (the inputs' batch), if known, or
    a whole multiple of it (cut with its samples). With one microbatch nothing is split and a
    split function is not called."""
    _check_count(num_microbatch)
    if is_user_function(spec) and num_microbatch == 1:
        spec = None  # one microbatch: no split
    if is_user_function(spec):
        return _check_list(spec(label, num_microbatch), num_microbatch, "split_label's result")
    batch = BatchRows() if batch is None else batch
    try:
        with _naming("split_label"):
            return _split_tree(label, spec, num_microbatch, "label", batch, "batch")
    except _FewerMicrobatches as fewer:
        raise ValueError(
            f"{fewer.path} holds {fewer.count} rows (or packed microbatches), fewer than the "
            f"inputs' {num_microbatch} microbatches; give the label the batch's size"
        ) from None


def packed_events(value: Any, num_microbatch: int) -> list[list[Event]]:
    """For each microbatch, the pending events of the packed leaves of ``value`` it consumes."""
    events: list[list[Event]] = [[] for _ in range(num_microbatch)]
    for _, leaf in _iter_leaves(value, ""):
        if isinstance(leaf, RoundPipePackedData):
            for m, event in enumerate(leaf.events[:num_microbatch]):
                if event is not None:
                    events[m].append(event)
    return events


# ----------------------------------------------------------------------------------------------
# Merging


def _values_equal(a: Any, b: Any, path: str) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.device == b.device
            and a.dtype == b.dtype
            and torch.equal(a, b)
        )
    try:
        return bool(a == b)
    except Exception as error:
        raise ValueError(
            f"{path}: cannot compare {_describe(a)} values across microbatches ({error}); "
            "give merge_output a spec or a function for it"
        ) from error


def _require_equal(values: list[Any], path: str) -> Any:
    for m, value in enumerate(values[1:], start=1):
        if not _values_equal(values[0], value, path):
            raise ValueError(
                f"{path}: microbatch {m} returned {value!r} but microbatch 0 returned "
                f"{values[0]!r}; values that are not tensors must be equal in every microbatch, "
                "otherwise give merge_output a spec (e.g. _CustomReducer) or a function"
            )
    return values[0]


def _require_tensors(values: list[Any], path: str, rule: str) -> list[torch.Tensor]:
    for m, value in enumerate(values):
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"{path}: {rule} needs tensors but microbatch {m} returned {_describe(value)}"
            )
    return values


def _merge_leaf(values: list[Any], spec: Any, path: str) -> Any:
    kind = marker_kind(spec)
    if kind == "reduce":
        accumulator = spec.init_value
        for value in values:
            accumulator = spec.reduce_fn(accumulator, value)
        return accumulator
    if kind == "replicate" or len(values) == 1:
        return _require_equal(values, path)
    if kind == "chunk":
        tensors = _require_tensors(values, path, "TensorChunkSpec")
        return _concatenated(tensors, spec.split_dim, path)
    if not any(isinstance(value, torch.Tensor) for value in values):
        return _require_equal(values, path)
    tensors = _require_tensors(values, path, "automatic merge")
    if all(t.dim() == 0 for t in tensors):
        stacked = torch.stack(tensors)
        if not (stacked.is_floating_point() or stacked.is_complex()):
            stacked = stacked.to(torch.get_default_dtype())
        return stacked.mean()
    if any(t.dim() == 0 for t in tensors):
        raise ValueError(
            f"{path}: some microbatches returned 0-d tensors and others did not; cannot merge"
        )
    return _concatenated(tensors, 0, path)


def _concatenated(tensors: list[torch.Tensor], dim: int, path: str) -> torch.Tensor:
    """``torch.cat(tensors, dim)``; what torch rejects (sizes that differ beyond ``dim``, dtypes
    or devices it cannot mix) is a ``ValueError`` naming the leaf."""
    try:
        return torch.cat(tensors, dim=dim)
    except RuntimeError as error:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise ValueError(
            f"{path}: cannot concatenate the microbatches' tensors along dim {dim} (shapes "
            f"{shapes}): {str(error).rstrip('.')}; give merge_output a spec or a function for it"
        ) from error


def _combine(
    values: list[Any], spec: Any, path: str, leaf_fn: Callable[[list[Any], Any, str], Any]
) -> Any:
    """Combine the microbatch values of one subtree; ``leaf_fn(values, spec, path)`` per leaf."""
    node = _expand(values[0])
    if spec is not None and marker_kind(spec) is None:
        if node is None:
            raise ValueError(
                f"{path}: the spec is {_describe(spec)} but the output is a leaf "
                f"({_describe(values[0])}); put a TensorChunkSpec, _Replicate, _CustomReducer "
                "or None there"
            )
        child_specs = _align(node, spec, path, "the spec", "the output")
    elif node is None:
        return leaf_fn(values, spec, path)
    else:
        child_specs = [spec] * len(node.children)
    columns = [node.children] + [
        _align(node, value, path, f"microbatch {m}'s output", "microbatch 0's")
        for m, value in enumerate(values[1:], start=1)
    ]
    return node.rebuild(
        [
            _combine([column[i] for column in columns], child_spec, path + label, leaf_fn)
            for i, (child_spec, label) in enumerate(zip(child_specs, node.labels, strict=True))
        ]
    )


def merge_output(outputs: list[Any], spec: Any | MergeOutputFn | bool | None) -> Any:
    """Merge the per-microbatch outputs into one output.

    ``spec`` is ``None``/``True`` (automatic), a spec shaped like an output, or a function
    ``fn(outputs)``. With one microbatch the output is returned unchanged, except that a function
    or a ``_CustomReducer`` is still applied (they define the merged value's form). Merged tensors
    stay connected to the microbatch autograd graphs.
    """
    if not outputs:
        raise ValueError("merge_output needs at least one microbatch output")
    if spec is False:
        raise ValueError("merge_output=False does not merge; use pack_output instead")
    if is_user_function(spec):
        return spec(list(outputs))
    if spec is None or spec is True:
        if len(outputs) == 1:
            return outputs[0]
        spec = None
    with _naming("merge_output"):
        return _combine(outputs, spec, "output", _merge_leaf)


class SplitMergeConfig(Protocol):
    """What :class:`Batch` reads of a resolved run configuration."""

    num_microbatch: int
    split_input: Any
    split_label: Any
    merge_output: Any


class Batch:
    """roundpipe 0.1.1's microbatch holder, kept as compatibility surface: the inputs of one
    call split into microbatches by :func:`split_input` / :func:`split_label`, and merged back
    by :func:`merge_output` or :func:`pack_output`. No machinery of its own.

    ``Batch(args, kwargs, run_config, label=None)`` takes a resolved configuration
    (``roundpipe.run_config.FullRoundPipeRunConfig``). Per microbatch ``m`` it holds
    ``flatten_states[m]`` / ``flatten_specs[m]`` (the ``tree_flatten`` of ``(args, kwargs)``),
    ``forward_events[m]`` / ``backward_events[m]`` (the distinct events of the packed inputs'
    ``transfer_event`` pairs for ``m``) and ``label_list[m]``; ``num_microbatch`` is how many
    there are (fewer than asked when a packed input holds fewer). :meth:`dump` merges the
    states back as the configuration's ``merge_output`` says.
    """

    def __init__(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        run_config: SplitMergeConfig,
        label: Any = None,
    ) -> None:
        rows = BatchRows()
        args_list, kwargs_list = split_input(
            args, kwargs, run_config.num_microbatch, run_config.split_input, rows
        )
        self.num_microbatch = len(args_list)
        self.flatten_states: list[list[Any]] = []
        self.flatten_specs: list[TreeSpec] = []
        for state in zip(args_list, kwargs_list, strict=True):
            leaves, spec = tree_flatten(state)
            self.flatten_states.append(leaves)
            self.flatten_specs.append(spec)
        packed = [leaf for _, leaf in _iter_leaves((args, kwargs), "") if _is_packed(leaf)]
        self.forward_events: list[list[Event]] = []
        self.backward_events: list[list[Event]] = []
        for m in range(self.num_microbatch):
            pairs = [value.transfer_event[m] for value in packed]
            self.forward_events.append(_distinct(forward for forward, _ in pairs))
            self.backward_events.append(_distinct(backward for _, backward in pairs))
        self.label_list = split_label(label, self.num_microbatch, run_config.split_label, rows)

    def dump(self, run_config: SplitMergeConfig) -> Any:
        """The microbatch states merged into one value: packed (``merge_output=False``, each
        leaf a :class:`RoundPipePackedData` whose ``transfer_event`` pairs are the
        microbatches' events), else merged by ``merge_output`` once the forward events
        completed."""
        states = [
            tree_unflatten(leaves, spec)
            for leaves, spec in zip(self.flatten_states, self.flatten_specs, strict=True)
        ]
        if run_config.merge_output is False:
            pairs = [
                (_joined(forward), _joined(backward))
                for forward, backward in zip(self.forward_events, self.backward_events, strict=True)
            ]
            return _combine(
                states,
                None,
                "output",
                lambda values, _spec, _path: RoundPipePackedData(values, pairs),
            )
        for events in self.forward_events:
            for event in events:
                event.synchronize()
        return merge_output(states, run_config.merge_output)


def _is_packed(value: Any) -> TypeIs[RoundPipePackedData]:
    return isinstance(value, RoundPipePackedData)


def _distinct(events: Iterable[Event | None]) -> list[Event]:
    """``events`` without ``None`` and repeats (by identity), in order."""
    seen: dict[int, Event] = {}
    for event in events:
        if event is not None:
            seen.setdefault(id(event), event)
    return list(seen.values())


class _AllEvents:
    """Several events waited for as one."""

    def __init__(self, events: list[Event]) -> None:
        self.events = events

    def synchronize(self) -> None:
        for event in self.events:
            event.synchronize()


def _joined(events: list[Event]) -> Event | None:
    """One event completing after every one of ``events`` (``None`` for none)."""
    if not events:
        return None
    return events[0] if len(events) == 1 else _AllEvents(events)


def pack_output(outputs: list[Any], events: Sequence[Event | None]) -> Any:
    """The structure of ``outputs[0]`` with each leaf replaced by its RoundPipePackedData.

    ``events[m]`` (or ``None`` when ready) completes microbatch ``m``'s values.
    """
    if not outputs or len(events) != len(outputs):
        raise ValueError(
            f"pack_output needs one event per microbatch output, got {len(outputs)} outputs and "
            f"{len(events)} events"
        )
    return _combine(
        outputs, None, "output", lambda values, _spec, _path: RoundPipePackedData(values, events)
    )


# Output types that a layer returns in place of the caller's type, and their conversions (see
# register_unmerged_output).
_UNMERGED_OUTPUTS: dict[type, Callable[[Any], Any]] = {}


def register_unmerged_output(cls: type, convert: Callable[[Any], Any]) -> None:
    """Have a call of one microbatch return ``convert(output)`` where its output is a ``cls``.

    For a last layer whose output stands in for the caller's type inside the pipeline (a preset's
    :class:`~roundpipe.models.presets.MicrobatchOutput`, a Hugging Face ``ModelOutput`` there):
    merge functions (its merge rule among them) receive the stand-ins and build the caller's type,
    and one microbatch, which no merge function sees, is converted by ``convert``."""
    _UNMERGED_OUTPUTS[cls] = convert


def merge_or_pack(outputs: list[Any], events: list[Any], spec: Any) -> Any:
    """Per-microbatch outputs (their copies' events beside them) merged by ``spec`` (see
    :func:`merge_output`), or with ``spec=False`` packed with the events for a downstream
    RoundPipe to wait on. One microbatch's output is returned as it is: no merge function or
    reducer runs (as in roundpipe 0.1.1), only a conversion registered for its type
    (:func:`register_unmerged_output`)."""
    if spec is False:
        return pack_output(outputs, events)
    for event in events:
        if event is not None:
            event.synchronize()
    if len(outputs) > 1:
        return merge_output(outputs, spec)
    convert = _UNMERGED_OUTPUTS.get(type(outputs[0]))
    return outputs[0] if convert is None else convert(outputs[0])


if TYPE_CHECKING:
    from roundpipe.reducers import AvgReducer, avg_reducer
else:

    def __getattr__(name: str) -> Any:
        # roundpipe 0.1.1's AvgReducer / avg_reducer, imported on first use (see reducers.py).
        if name in ("AvgReducer", "avg_reducer"):
            from roundpipe import reducers

            return getattr(reducers, name)
        raise AttributeError(f"module 'roundpipe.batch' has no attribute {name!r}")


__all__ = [
    "AvgReducer",
    "Batch",
    "BatchRows",
    "Event",
    "RoundPipePackedData",
    "SplitMergeConfig",
    "avg_reducer",
    "check_spec",
    "guess_split_spec",
    "is_user_function",
    "marker_kind",
    "merge_or_pack",
    "merge_output",
    "pack_output",
    "packed_events",
    "register_unmerged_output",
    "split_input",
    "split_label",
]
