"""Preset for ``Qwen3ForCausalLM``: per-layer full or sliding-window masks (``layer_types``)."""

from roundpipe.models.presets._decoder import DecoderFamily, kinds_from_layer_types

FAMILY = DecoderFamily(name="Qwen3", layer_mask_kinds=kinds_from_layer_types)
