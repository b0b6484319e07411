"""Wrapping real models: ``wrap_model_to_roundpipe``, ``AutoRoundPipe`` and the Hugging Face
presets (``roundpipe.models.presets``; ``transformers`` is imported only when one is used)."""

from roundpipe.models.wrap import AutoRoundPipe, wrap_model_to_roundpipe

__all__ = ["AutoRoundPipe", "wrap_model_to_roundpipe"]
