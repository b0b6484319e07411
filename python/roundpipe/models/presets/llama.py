"""Preset for ``LlamaForCausalLM`` (and models built on it): one causal mask for all layers."""

from roundpipe.models.presets._decoder import DecoderFamily, all_layers

FAMILY = DecoderFamily(name="Llama", layer_mask_kinds=all_layers("full_attention"))
