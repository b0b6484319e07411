"""Sequential presets for Hugging Face causal LMs.

Each family module describes how its model differs (masks per layer, output type); the shared
machinery in ``_decoder`` turns the model into ``nn.Sequential(prefix, *decoder_layers,
postfix)``. ``transformers`` is imported only when a preset is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from roundpipe.models.presets._decoder import DecoderFamily

# Class name -> family module; matched on the model's class hierarchy by name, so finding a
# preset never imports transformers.
_FAMILY_MODULES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "LlamaForCausalLM": "llama",
    "GptOssForCausalLM": "gpt_oss",
}


def base_model_of(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a PEFT wrapper (``get_base_model``), else ``model``."""
    get_base_model = getattr(type(model), "get_base_model", None)
    return model.get_base_model() if callable(get_base_model) else model  # type: ignore[operator]


def find_preset(model: nn.Module) -> DecoderFamily | None:
    """The preset for ``model`` (or the model a PEFT wrapper holds), or ``None``."""
    for cls in type(base_model_of(model)).__mro__:
        module_name = _FAMILY_MODULES.get(cls.__name__)
        if module_name is not None:
            module = importlib.import_module(f"roundpipe.models.presets.{module_name}")
            family: DecoderFamily = module.FAMILY
            return family
    return None


__all__ = ["base_model_of", "find_preset"]
