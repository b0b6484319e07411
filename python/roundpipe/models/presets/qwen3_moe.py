"""Preset for ``Qwen3MoeForCausalLM``: one mask for all layers (sliding when the config has a
window); MoE output type,
with the router auxiliary loss (``aux_loss``) when ``output_router_logits`` asks, as Hugging
Face's."""

from roundpipe.models.presets._decoder import DecoderFamily, sliding_if_windowed

FAMILY = DecoderFamily(
    name="Qwen3-MoE",
    layer_mask_kinds=sliding_if_windowed,
    output_type="MoeCausalLMOutputWithPast",
    moe_modeling="transformers.models.qwen3_moe.modeling_qwen3_moe",
)
