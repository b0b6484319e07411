"""Wrapping real models: ``wrap_model_to_roundpipe``, ``AutoRoundPipe``, ``wrap_model`` (the
Hugging Face presets alone; ``transformers`` is imported only when one is used).

``SUPPORTED_MODELS`` maps each class with a preset (and ``"function"``, the loss functions) to
its roundpipe 0.1.1 module, relative to this package, as 0.1.1 lists them.
"""

from roundpipe.models.presets._decoder import merge_summed_loss
from roundpipe.models.wrap import AutoRoundPipe, wrap_model, wrap_model_to_roundpipe

SUPPORTED_MODELS: dict[str, str] = {
    "function": ".function",
    "GptOssForCausalLM": ".gpt_oss",
    "LlamaForCausalLM": ".llama",
    "Qwen3MoeForCausalLM": ".qwen3_moe",
    "Qwen3ForCausalLM": ".qwen3",
}

__all__ = [
    "SUPPORTED_MODELS",
    "AutoRoundPipe",
    "merge_summed_loss",
    "wrap_model",
    "wrap_model_to_roundpipe",
]
