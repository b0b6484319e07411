"""Preset for ``Qwen3MoeForCausalLM``: one mask for all layers (sliding when the config has a
window); MoE output type. The router auxiliary loss is not supported (see ``DecoderFamily``)."""

from roundpipe.models.presets._decoder import DecoderFamily, sliding_if_windowed

FAMILY = DecoderFamily(
    name="Qwen3-MoE",
    layer_mask_kinds=sliding_if_windowed,
    output_type="MoeCausalLMOutputWithPast",
)
