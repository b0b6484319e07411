"""roundpipe 0.1.1's module path of the Qwen3 preset: ``EXPECTED_MODEL_CLASS`` and
``wrap_model`` (the preset itself lives in ``roundpipe.models.presets``)."""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import Qwen3ForCausalLM

from roundpipe.models.wrap import wrap_with_preset
from roundpipe.roundpipe import RoundPipe

EXPECTED_MODEL_CLASS = Qwen3ForCausalLM


def wrap_model(model: nn.Module, **roundpipe_kwargs: Any) -> RoundPipe:
    """``model`` (a ``Qwen3ForCausalLM``) as one RoundPipe through the Qwen3 preset."""
    return wrap_with_preset(model, EXPECTED_MODEL_CLASS, **roundpipe_kwargs)
