"""Wrapping real models: ``wrap_model_to_roundpipe``, ``AutoRoundPipe``, ``wrap_model`` (the
Hugging Face presets alone; ``transformers`` is imported only when one is used)."""

from roundpipe.models.wrap import AutoRoundPipe, wrap_model, wrap_model_to_roundpipe

__all__ = ["AutoRoundPipe", "wrap_model", "wrap_model_to_roundpipe"]
