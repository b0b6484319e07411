"""The forms of Adam's moments in :class:`roundpipe.optim.Adam` (its ``state_dtype``) and the
conversions between them.

* ``torch.float32``: ``exp_avg`` and ``exp_avg_sq`` as torch's Adam keeps them.
* ``torch.bfloat16``: the same keys in bf16 (the step rounds them stochastically).
* ``torch.int8``: ``exp_avg`` as int8 codes and ``exp_avg_sq`` as uint8 codes, in the
  parameter's shape, each with one float32 scale per block of :data:`STATE_BLOCK` elements of the
  flattened parameter (``exp_avg_scale``, ``exp_avg_sq_scale``), and the code's version
  (``int8_code``, :data:`INT8_CODE`): a code is a small float (the top bits of an fp16 with 3
  mantissa bits) in units of its block's largest magnitude (``csrc/optim/adam.h`` defines it).
  A state in another version of the code is refused with ``ValueError``.

A state in any form converts into any other (:func:`convert_moments`), so an optimizer loads the
state of another ``state_dtype`` (torch's included) and keeps its own form.

``state_dict()`` exports 8-bit moments decoded (:func:`exported`): ``exp_avg`` and ``exp_avg_sq``
as the float32 values they stand for, which is what torch's Adam reads, beside their block scales,
which torch ignores. Loading such a state back into 8-bit moments encodes the values against those
scales and keeps the codes when they decode to the very same bits (always, unless the values were
changed since), so the round trip is bit for bit while the values stay torch's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from roundpipe._native import _C

STATE_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
SCALE_KEYS = {"exp_avg": "exp_avg_scale", "exp_avg_sq": "exp_avg_sq_scale"}
CODE_DTYPES = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}
# Elements per scale of int8 moments.
STATE_BLOCK: int = _C.state_block()
# The key and version of the 8-bit code that csrc/optim/adam.h's StateDType::kInt8 describes:
# bumped whenever that format changes, so that codes are never read in another one's meaning. The
# state holds it as a 0-dim int64 tensor, like every other value of an Adam state entry.
CODE_KEY = "int8_code"
INT8_CODE = 2


def code_tag() -> Tensor:
    """The state's :data:`CODE_KEY` value of this roundpipe's 8-bit code."""
    return torch.tensor(INT8_CODE)


def code_version(entry: Mapping[str, Any]) -> int | None:
    """The 8-bit code version a state entry declares (1, the first code, had no tag); None for
    a tag that is no integer."""
    tag = entry.get(CODE_KEY, 1)
    if isinstance(tag, Tensor) and tag.numel() == 1 and not tag.is_floating_point():
        return int(tag.item())
    return tag if isinstance(tag, int) else None


def check_state_dtype(state_dtype: Any) -> torch.dtype:
    """``state_dtype`` if it is one of :data:`STATE_DTYPES`, else TypeError/ValueError."""
    if not isinstance(state_dtype, torch.dtype):
        raise TypeError(
            f"state_dtype must be a torch.dtype (torch.float32, torch.bfloat16 or torch.int8), "
            f"got {type(state_dtype).__name__}"
        )
    if state_dtype not in STATE_DTYPES:
        raise ValueError(
            f"state_dtype must be torch.float32, torch.bfloat16 or torch.int8 (block-wise 8-bit "
            f"moments), got {state_dtype}"
        )
    return state_dtype


def blocks(numel: int) -> int:
    """Scales of an int8 moment of ``numel`` elements."""
    return -(-numel // STATE_BLOCK)


def fresh_moments(
    param: Tensor,
    state_dtype: torch.dtype,
    zeros: Callable[[torch.Size, torch.dtype], Tensor] | None = None,
) -> dict[str, Tensor]:
    """Zero moments for ``param`` in ``state_dtype``'s form; ``zeros(shape, dtype)`` makes each
    tensor where given (for a dense parameter), else torch's zeros in the parameter's layout."""
    if state_dtype != torch.int8:
        dtype = param.dtype if state_dtype == torch.float32 else state_dtype
        if zeros is not None:
            return {key: zeros(param.shape, dtype) for key in MOMENT_KEYS}
        return {
            key: torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
            for key in MOMENT_KEYS
        }
    make = zeros or (lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    moments = {CODE_KEY: code_tag()}
    for key in MOMENT_KEYS:
        moments[key] = make(param.shape, CODE_DTYPES[key])
        moments[SCALE_KEYS[key]] = make(torch.Size([blocks(param.numel())]), torch.float32)
    return moments


def in_form(state: Mapping[str, Any], param: Tensor, state_dtype: torch.dtype) -> bool:
    """Whether ``state``'s moments (if any) are dense CPU tensors in ``state_dtype``'s form for
    ``param``, as the native kernel reads them."""
    for key in MOMENT_KEYS:
        value = state.get(key)
        if value is None:
            continue
        dtype = CODE_DTYPES[key] if state_dtype == torch.int8 else state_dtype
        if value.dtype != dtype or not value.is_contiguous() or value.numel() != param.numel():
            return False
        if state_dtype == torch.int8:
            scale = state.get(SCALE_KEYS[key])
            if not _is_scale_of(scale, param.numel()):
                return False
    return True


def _is_scale_of(scale: Any, numel: int) -> bool:
    return (
        isinstance(scale, Tensor)
        and scale.dtype == torch.float32
        and scale.device.type == "cpu"
        and scale.is_contiguous()
        and scale.numel() == blocks(numel)
    )


def moment_values(entry: Mapping[str, Any], key: str) -> Tensor:
    """The moment ``key`` of a parameter's state ``entry`` as float32 values (a new tensor for
    8-bit codes, decoded exactly; the tensor itself or a cast of it otherwise)."""
    value: Tensor = entry[key]
    if value.dtype not in (torch.int8, torch.uint8):
        return value.to(torch.float32)
    if value.dtype != CODE_DTYPES[key]:
        raise ValueError(
            f"the optimizer state's {key} holds {value.dtype} codes; 8-bit {key} is "
            f"{CODE_DTYPES[key]}"
        )
    version = code_version(entry)
    if version != INT8_CODE:
        raise ValueError(
            f"the optimizer state's 8-bit {key} is in version {version} of roundpipe's 8-bit code "
            f"({CODE_KEY}), which this roundpipe does not read (it reads version {INT8_CODE}): "
            f"load the state with the roundpipe that saved it into an optimizer with "
            f"state_dtype=torch.float32 and save that state to carry it over"
        )
    scale = entry.get(SCALE_KEYS[key])
    if scale is None or not _is_scale_of(scale, value.numel()):
        raise ValueError(
            f"the optimizer state's 8-bit {key} needs {SCALE_KEYS[key]}: a float32 tensor of "
            f"{blocks(value.numel())} block scales, got "
            f"{None if scale is None else tuple(scale.shape)}"
        )
    values = torch.empty(value.shape)
    _C.dequantize_moment(key == "exp_avg", value.contiguous(), scale, values)
    return values


def _encoded(entry: Mapping[str, Any], key: str, param: Tensor) -> tuple[Tensor, Tensor]:
    """The 8-bit codes and scales of the moment ``key`` of ``entry`` (not in codes). Float32
    values exported with their block scales (:func:`exported`) are encoded against those scales
    and kept when they decode to the same bits; any other values are rounded to the nearest
    codes against fresh scales (each block's largest magnitude)."""
    values = moment_values(entry, key).to(param.device).contiguous()
    is_exp_avg = key == "exp_avg"
    codes = torch.empty(param.shape, dtype=CODE_DTYPES[key])
    hint = entry.get(SCALE_KEYS[key])
    exported_form = entry[key].dtype == torch.float32 and _is_scale_of(hint, param.numel())
    if exported_form and isinstance(hint, Tensor):
        scales = hint.detach().clone()
        _C.quantize_moment(is_exp_avg, values, codes, scales, given_scales=True)
        decoded = torch.empty(param.shape)
        _C.dequantize_moment(is_exp_avg, codes, scales, decoded)
        if torch.equal(decoded.view(-1).view(torch.int32), values.view(-1).view(torch.int32)):
            return codes, scales
    scales = torch.empty(blocks(param.numel()))
    _C.quantize_moment(is_exp_avg, values, codes, scales)
    return codes, scales


def convert_moments(
    entry: Mapping[str, Any], param: Tensor, state_dtype: torch.dtype
) -> dict[str, Tensor]:
    """The moments of a saved state ``entry`` (any form) in ``state_dtype``'s form for
    ``param``: copies, so the saved state is never aliased. A state already in that form, or
    exported from it (:func:`exported`), gives the same bits; other fp32 values become int8
    codes rounded to nearest."""
    moments: dict[str, Tensor] = {}
    if state_dtype == torch.int8 and any(key in entry for key in MOMENT_KEYS):
        moments[CODE_KEY] = code_tag()
    for key in MOMENT_KEYS:
        if key not in entry:
            continue
        value: Tensor = entry[key]
        if state_dtype == torch.int8 and value.dtype == CODE_DTYPES[key]:
            moment_values(entry, key)  # validates the scales
            moments[key] = value.detach().clone(memory_format=torch.contiguous_format)
            moments[SCALE_KEYS[key]] = entry[SCALE_KEYS[key]].detach().clone()
        elif state_dtype == torch.int8:
            moments[key], moments[SCALE_KEYS[key]] = _encoded(entry, key, param)
        else:
            dtype = param.dtype if state_dtype == torch.float32 else state_dtype
            values = value if value.dtype == dtype else moment_values(entry, key)
            moments[key] = values.to(dtype=dtype, device=param.device, copy=True)
    return moments


def exported(entry: Mapping[str, Any]) -> Mapping[str, Any]:
    """A parameter's state as ``state_dict()`` holds it: 8-bit moments as the float32 values
    they stand for (what torch's Adam reads) beside their block scales (which it ignores), without
    the code's tag; any other state as it is."""
    if not any(
        isinstance(entry.get(key), Tensor) and entry[key].dtype == CODE_DTYPES[key]
        for key in MOMENT_KEYS
    ):
        return entry
    return {
        key: moment_values(entry, key) if key in MOMENT_KEYS else value
        for key, value in entry.items()
        if key != CODE_KEY
    }


def elementwise_state(entry: Mapping[str, Any]) -> dict[str, Any]:
    """A parameter's state with 8-bit moments decoded into float32 values: every tensor is then
    one value per element, so pieces of it can be cut at any element (sharded checkpoints)."""
    if not any(key in entry for key in SCALE_KEYS.values()):
        return dict(entry)
    state = {
        key: value for key, value in entry.items() if key not in (*SCALE_KEYS.values(), CODE_KEY)
    }
    for key in MOMENT_KEYS:
        if key in entry:
            state[key] = moment_values(entry, key)
    return state
