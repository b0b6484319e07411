"""Preset for ``GptOssForCausalLM``: alternating full and sliding-window layers
(``layer_types``), masks built without position ids; MoE output type."""

from roundpipe.models.presets._decoder import DecoderFamily, kinds_from_layer_types

FAMILY = DecoderFamily(
    name="GPT-OSS",
    layer_mask_kinds=kinds_from_layer_types,
    masks_use_position_ids=False,
    output_type="MoeCausalLMOutputWithPast",
    moe_modeling="transformers.models.gpt_oss.modeling_gpt_oss",
)
