"""Decoder-only causal LMs as ``nn.Sequential(prefix, *decoder_layers, postfix)``.

* The prefix embeds the tokens and builds positions, attention masks and rotary embeddings once
  per microbatch; it saves the latter for its recompute, so recompute neither rebuilds them nor
  synchronises with the host (mask construction may inspect the padding).
* Every decoder layer passes ``(hidden_states, context)`` on; the context carries the masks,
  rotary embeddings, positions and labels to the layers after it.
* The postfix applies the final norm, the head and the loss and returns the model's usual
  output type. With ``loss_chunk_size`` the head and cross-entropy run chunk by chunk under
  activation checkpointing, so full logits never exist (``logits`` is then ``None``).

Each microbatch's ``loss`` is Hugging Face's loss for that microbatch, as in roundpipe 0.1.1:
the mean over its target tokens, or its summed loss divided by ``num_items_in_batch`` when the
caller passes that (the whole batch's target-token count gives exact whole-batch weighting).
The merged output of ``forward`` averages the microbatch losses, as the automatic merge averages
every scalar (and 0.1.1 does); :func:`merge_summed_loss` adds them up instead, which with
``num_items_in_batch`` is the whole batch's Hugging Face loss. A call may pass
``return_logits=False`` (0.1.1's per-call switch): the loss is then computed chunk by chunk
without logits, as with ``loss_chunk_size``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from roundpipe.batch import guess_split_spec, merge_output, register_unmerged_output, split_input
from roundpipe.context import doing_recompute, get_recompute_data, save_for_recompute
from roundpipe.roundpipe import RoundPipe
from roundpipe.run_config import RoundPipeRunConfig
from roundpipe.torch_internals import register_pytree_node

IGNORE_INDEX = -100  # Hugging Face's label value for "no target here"
# Tokens per chunk of the loss of a call with return_logits=False when the model was wrapped
# without loss_chunk_size.
DEFAULT_LOSS_CHUNK = 1024

MaskKinds = Callable[[Any], list[str]]


@dataclass(frozen=True)
class DecoderFamily:
    """How one Hugging Face decoder-only family differs from the others.

    Attributes:
        name: shown when the preset is used.
        layer_mask_kinds: ``config -> [mask kind per decoder layer]``; kinds are
            ``"full_attention"`` or ``"sliding_attention"``.
        masks_use_position_ids: whether the family builds its masks from the position ids.
        output_type: class name in ``transformers.modeling_outputs``.
        moe_modeling: for a mixture-of-experts family, the ``transformers`` module whose
            ``load_balancing_loss_func`` computes the router auxiliary loss (with the model's
            ``num_experts``, ``num_experts_per_tok`` and ``router_aux_loss_coef``).
    """

    name: str
    layer_mask_kinds: MaskKinds
    masks_use_position_ids: bool = True
    output_type: str = "CausalLMOutputWithPast"
    moe_modeling: str | None = None

    def __str__(self) -> str:
        return f"{self.name} sequential"

    def wrap(
        self,
        model: nn.Module,
        model_run_config: RoundPipeRunConfig = RoundPipeRunConfig(),  # noqa: B008
        name: str | None = None,
        loss_chunk_size: int | None = None,
        **roundpipe_kwargs: Any,
    ) -> RoundPipe:
        """``model`` (or the model inside a PEFT wrapper) as one RoundPipe over the Sequential;
        attribute access goes to ``model`` itself (``config``, ``save_pretrained``...).

        Args:
            loss_chunk_size: when set, tokens per chunk of the chunked head + cross-entropy.
        """
        from roundpipe.models.presets import base_model_of

        if loss_chunk_size is not None and (
            isinstance(loss_chunk_size, bool)
            or not isinstance(loss_chunk_size, int)
            or loss_chunk_size < 1
        ):
            raise ValueError(
                f"loss_chunk_size must be None or an int >= 1, got {loss_chunk_size!r}"
            )
        sequential = self.build(base_model_of(model), loss_chunk_size)
        wrapped = RoundPipe(
            sequential,
            model_run_config=_with_preset_rules(model_run_config),
            name=name or type(model).__name__,
            **roundpipe_kwargs,
        )
        wrapped.set_original_model(model)
        return wrapped

    def build(self, model: nn.Module, loss_chunk_size: int | None = None) -> nn.Sequential:
        """The equivalent ``nn.Sequential(prefix, *decoder_layers, postfix)`` of ``model``; it
        shares the model's modules (and so its parameters)."""
        hf: Any = model  # a Hugging Face causal LM, whose attributes torch's typing cannot see
        config = hf.config
        backbone = hf.model
        count = config.num_hidden_layers
        kinds = self.layer_mask_kinds(config)[:count]
        prefix = DecoderPrefix(self, config, backbone.embed_tokens, backbone.rotary_emb, kinds)
        decoder_layers = list(backbone.layers)[:count]
        layers = [
            DecoderLayerStage(layer, kind)
            for layer, kind in zip(decoder_layers, kinds, strict=True)
        ]
        postfix = CausalLMPostfix(self, config, backbone.norm, hf.lm_head, loss_chunk_size)
        postfix.loss_function = hf.loss_function
        postfix.owner = (hf,)  # read, not registered: the model's modules are its layers
        return nn.Sequential(prefix, *layers, postfix)


class MicrobatchOutput(dict[str, Any]):
    """The postfix's output for one microbatch: ``loss`` and ``logits`` as items and attributes.

    Unlike a Hugging Face ``ModelOutput`` it keeps ``None`` entries when rebuilt from its
    leaves, so the runtime's gradient trees (``None`` where a leaf got no gradient) keep its
    shape. ``output_type`` names the model's own output type (in
    ``transformers.modeling_outputs``), which the merged output of a call is.
    """

    def __init__(self, *args: Any, output_type: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.__dict__["output_type"] = output_type

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"MicrobatchOutput has no field {name!r}") from None

    def __getitem__(self, key: str | int | slice) -> Any:
        """A field by name, or by position among the fields that are set, as a Hugging Face
        ``ModelOutput`` indexes (``out[0]`` is the loss when there is one)."""
        if isinstance(key, str):
            return super().__getitem__(key)
        return self.to_tuple()[key]

    def to_tuple(self) -> tuple[Any, ...]:
        """The fields that are not ``None``, in order (``ModelOutput.to_tuple``)."""
        return tuple(value for value in self.values() if value is not None)

    def as_model_output(self) -> Any:
        """The same fields as the model's own output type."""
        from transformers import modeling_outputs

        fields = {name: value for name, value in self.items() if value is not None}
        return getattr(modeling_outputs, self.output_type)(**fields)


register_pytree_node(
    MicrobatchOutput,
    lambda output: (list(output.values()), (tuple(output.keys()), output.output_type)),
    lambda values, context: MicrobatchOutput(
        zip(context[0], values, strict=True), output_type=context[1]
    ),
    serialized_type_name="roundpipe.models.presets.MicrobatchOutput",
)
# A call of one microbatch merges nothing: its output reaches the caller as the model's own type.
register_unmerged_output(MicrobatchOutput, MicrobatchOutput.as_model_output)


# -------------------------------------------------------------------------------------------
# Mask kinds shared by the families


def kinds_from_layer_types(config: Any) -> list[str]:
    """Per-layer kinds as the config lists them (``config.layer_types``)."""
    return list(config.layer_types)


def all_layers(kind: str) -> MaskKinds:
    """Every layer uses one mask of ``kind``."""
    return lambda config: [kind] * config.num_hidden_layers


def sliding_if_windowed(config: Any) -> list[str]:
    """One mask for every layer: sliding when the config has a window, else full."""
    kind = "full_attention" if config.sliding_window is None else "sliding_attention"
    return [kind] * config.num_hidden_layers


# -------------------------------------------------------------------------------------------
# The layers


class DecoderPrefix(nn.Module):
    """Layer 0: embeddings, positions, masks and rotary embeddings of a microbatch."""

    def __init__(
        self,
        family: DecoderFamily,
        config: Any,
        embed_tokens: nn.Module,
        rotary_emb: nn.Module,
        kinds: list[str],
    ) -> None:
        super().__init__()
        self.family, self.config, self.kinds = family, config, sorted(set(kinds))
        self.embed_tokens, self.rotary_emb = embed_tokens, rotary_emb

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        num_items_in_batch: torch.Tensor | int | None = None,
        return_logits: bool = True,
        output_router_logits: bool | None = None,
        return_dict: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        # Hugging Face's output switches: accepted at the values that change nothing.
        for switch, value, refused in [
            ("return_dict", return_dict, False),
            ("output_hidden_states", output_hidden_states, True),
            ("output_attentions", output_attentions, True),
        ]:
            if value is refused:
                raise ValueError(
                    f"{switch}={value}: the RoundPipe preset returns the model's output type "
                    "with loss and logits only; leave it unset (run the original model for it)"
                )
        if not isinstance(return_logits, bool):
            raise TypeError(f"return_logits must be a bool, got {type(return_logits).__name__}")
        if not return_logits and labels is None:
            raise ValueError(
                "return_logits=False returns only the loss: pass labels, or leave return_logits "
                "at True for the logits"
            )
        if output_router_logits is None:
            output_router_logits = bool(getattr(self.config, "output_router_logits", False))
        if output_router_logits and self.family.moe_modeling is None:
            raise ValueError(
                f"output_router_logits=True: {self.family.name} models have no router; leave "
                "it unset"
            )
        if past_key_values is not None or use_cache:
            raise ValueError(
                "the RoundPipe preset trains without a KV cache; leave past_key_values and "
                "use_cache unset (generate with the original model instead)"
            )
        if not isinstance(logits_to_keep, int) or logits_to_keep != 0:
            raise ValueError("the RoundPipe preset computes all logits; leave logits_to_keep at 0")
        embeds = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        if doing_recompute():
            position_ids, masks, cos, sin = get_recompute_data()
        else:
            if position_ids is None:
                position_ids = torch.arange(embeds.shape[1], device=embeds.device).unsqueeze(0)
            masks = self._masks(embeds, attention_mask, position_ids)
            cos, sin = self.rotary_emb(embeds, position_ids)
            save_for_recompute(position_ids, masks, cos.detach(), sin.detach())
        context = {
            "masks": masks,
            "position_embeddings": (cos, sin),
            "position_ids": position_ids,
            "labels": labels,
            "num_items_in_batch": num_items_in_batch,
            "return_logits": return_logits,
            # Each MoE layer appends its router logits (see DecoderLayerStage); None: not asked.
            "router_logits": [] if output_router_logits else None,
            "attention_mask": attention_mask,
        }
        return embeds, context

    def _masks(
        self, embeds: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor
    ) -> dict[str, Any]:
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        builders = {
            "full_attention": create_causal_mask,
            "sliding_attention": create_sliding_window_causal_mask,
        }
        arguments: dict[str, Any] = {
            "config": self.config,
            "inputs_embeds": embeds,
            "attention_mask": attention_mask,
            _mask_cache_argument(): None,
        }
        if self.family.masks_use_position_ids:
            arguments["position_ids"] = position_ids
        return {kind: builders[kind](**arguments) for kind in self.kinds}


@functools.cache
def _mask_cache_argument() -> str:
    """The name of the mask builders' KV-cache argument: ``cache`` from transformers 5.24 on,
    ``past_key_values`` before (5.24 still takes it with a warning; 5.40 drops it)."""
    from transformers.masking_utils import create_causal_mask

    parameters = inspect.signature(create_causal_mask).parameters
    return "cache" if "cache" in parameters else "past_key_values"


class DecoderLayerStage(nn.Module):
    """One decoder layer: ``(hidden_states, context) -> (hidden_states, context)``."""

    def __init__(self, layer: nn.Module, mask_kind: str) -> None:
        super().__init__()
        self.layer, self.mask_kind = layer, mask_kind
        # A mixture-of-experts layer's routers (transformers' ``*TopKRouter``), whose first output
        # is the router logits.
        self.routers = [m for m in layer.modules() if type(m).__name__.endswith("TopKRouter")]

    def forward(self, state: tuple[torch.Tensor, dict[str, Any]]) -> Any:
        hidden, context = state
        captured: list[torch.Tensor] = []
        wanted = context["router_logits"] is not None
        handles = [
            router.register_forward_hook(lambda _m, _i, output: captured.append(output[0]))
            for router in (self.routers if wanted else [])
        ]
        try:
            hidden = self.layer(
                hidden,
                attention_mask=context["masks"][self.mask_kind],
                position_embeddings=context["position_embeddings"],
                position_ids=context["position_ids"],
            )
        finally:
            for handle in handles:
                handle.remove()
        if captured:
            context = {**context, "router_logits": [*context["router_logits"], *captured]}
        return hidden, context


class CausalLMPostfix(nn.Module):
    """The last layer: final norm, head and loss, returned as the model's output type."""

    loss_function: Callable[..., torch.Tensor]
    owner: tuple[Any, ...]  # the Hugging Face model (its router settings)

    def __init__(
        self,
        family: DecoderFamily,
        config: Any,
        norm: nn.Module,
        lm_head: nn.Module,
        loss_chunk_size: int | None,
    ) -> None:
        super().__init__()
        self.family, self.config, self.loss_chunk_size = family, config, loss_chunk_size
        self.norm, self.lm_head = norm, lm_head

    def forward(self, state: tuple[torch.Tensor, dict[str, Any]]) -> MicrobatchOutput:
        hidden, context = state
        hidden = self.norm(hidden)
        labels, num_items = context["labels"], context["num_items_in_batch"]
        loss: torch.Tensor | None = None
        logits: torch.Tensor | None = None
        chunk = self.loss_chunk_size
        if not context["return_logits"]:
            chunk = chunk or DEFAULT_LOSS_CHUNK
        if labels is not None and chunk is not None:
            loss = chunked_causal_lm_loss(hidden, self.lm_head, labels, num_items, chunk)
        elif context["return_logits"]:
            logits = self.lm_head(hidden)
            if labels is not None:
                loss = self.loss_function(
                    logits=logits,
                    labels=labels,
                    vocab_size=self.config.vocab_size,
                    num_items_in_batch=num_items,
                )
        fields: dict[str, Any] = {"loss": loss, "logits": logits}
        if context["router_logits"] is not None:
            aux = self._router_aux_loss(context["router_logits"], context["attention_mask"])
            if loss is not None:
                coef = self.owner[0].router_aux_loss_coef
                fields["loss"] = loss + coef * aux.to(loss.device)
            fields["aux_loss"] = aux
        return MicrobatchOutput(fields, output_type=self.family.output_type)

    def _router_aux_loss(
        self, router_logits: list[torch.Tensor], attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """Hugging Face's load-balancing loss of the microbatch over every layer's routers."""
        assert self.family.moe_modeling is not None
        modeling = importlib.import_module(self.family.moe_modeling)
        hf = self.owner[0]
        aux: torch.Tensor = modeling.load_balancing_loss_func(
            tuple(router_logits), hf.num_experts, hf.num_experts_per_tok, attention_mask
        )
        return aux


def _shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """Token t's target is token t + 1; the last position has none."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def _summed_cross_entropy(
    head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    logits = head(hidden).float()
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_causal_lm_loss(
    hidden: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor,
    num_items: torch.Tensor | int | None,
    chunk_size: int,
) -> torch.Tensor:
    """The causal LM loss of ``head(hidden)`` computed ``chunk_size`` tokens at a time.

    Each chunk's logits are recomputed in backward (checkpointing), so at most one chunk of
    logits exists at any time. Normalised by ``num_items`` when given (Hugging Face's
    ``num_items_in_batch``), else by this microbatch's target-token count.
    """
    return chunked_linear_cross_entropy(
        hidden, head, _shifted_targets(labels), num_items, chunk_size
    )


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    head: nn.Module,
    targets: torch.Tensor,
    num_items: torch.Tensor | int | None,
    chunk_size: int,
) -> torch.Tensor:
    """The cross-entropy of ``head(hidden)`` against ``targets`` (already shifted; positions
    holding ``IGNORE_INDEX`` count for nothing), ``chunk_size`` tokens at a time, normalised as
    :func:`chunked_causal_lm_loss`."""
    targets = targets.reshape(-1).to(hidden.device)
    flat = hidden.reshape(-1, hidden.size(-1))
    chunk_loss = functools.partial(_summed_cross_entropy, head)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, flat.size(0), chunk_size):
        end = start + chunk_size
        total = total + checkpoint(
            chunk_loss,
            flat[start:end],
            targets[start:end],
            use_reentrant=False,
            preserve_rng_state=False,
        )
    if num_items is None:
        num_items = (targets != IGNORE_INDEX).sum()
    if isinstance(num_items, torch.Tensor):
        num_items = num_items.to(total.device)
    return total / num_items


# -------------------------------------------------------------------------------------------
# Splitting and merging


def _split_tokens_first(
    args: tuple[Any, ...], kwargs: dict[str, Any], num_microbatch: int
) -> tuple[list[tuple[Any, ...]], list[dict[str, Any]]]:
    """The automatic split with the token tensor as the batch: the kwargs of its size are split
    with it, the others (``position_ids`` of a batch dimension of 1) passed whole."""
    tokens = [kwargs.get(key) for key in ("input_ids", "inputs_embeds")]
    batched = [t for t in tokens if isinstance(t, torch.Tensor) and t.dim() > 0]
    if args or not batched:
        return split_input(args, kwargs, num_microbatch, None)
    kwargs_spec, _ = guess_split_spec(kwargs, batched[0].size(0))
    return split_input(args, kwargs, num_microbatch, (None, kwargs_spec))


def _merged(outputs: list[MicrobatchOutput], summed: bool) -> Any:
    """The model's output type over the microbatch outputs: logits concatenated, losses
    averaged (the automatic merge's rule for scalars) or, with ``summed``, added up."""
    from transformers import modeling_outputs

    merged: dict[str, Any] = {}
    losses = [output["loss"] for output in outputs]
    if losses[0] is not None:
        total = torch.stack([loss.to(losses[0].device) for loss in losses]).sum()
        merged["loss"] = total if summed else total / len(losses)
    if outputs[0].get("aux_loss") is not None:  # a scalar of each microbatch: averaged
        merged["aux_loss"] = merge_output([output["aux_loss"] for output in outputs], None)
    logits = [output["logits"] for output in outputs]
    if logits[0] is not None:
        merged["logits"] = merge_output(logits, None)
    return getattr(modeling_outputs, outputs[0].output_type)(**merged)


def merge_mean_loss(outputs: list[MicrobatchOutput]) -> Any:
    """A preset's default ``merge_output``: logits concatenated, the microbatch losses
    averaged, as the automatic merge averages every scalar."""
    return _merged(outputs, summed=False)


def merge_summed_loss(outputs: list[MicrobatchOutput]) -> Any:
    """A ``merge_output`` for a preset's forward that adds the microbatch losses up: with
    ``num_items_in_batch`` (the whole batch's target-token count) each is its share of the whole
    batch, so the merged ``loss`` is the Hugging Face loss of the whole batch::

        out = model(**batch, num_items_in_batch=n,
                    roundpipe_run_config=RoundPipeRunConfig(merge_output=merge_summed_loss))
    """
    return _merged(outputs, summed=True)


def _with_preset_rules(config: RoundPipeRunConfig) -> RoundPipeRunConfig:
    """``config`` with the preset's split and merge rules where it leaves them unset."""
    fields = {field: getattr(config, field) for field in RoundPipeRunConfig.__slots__}
    if fields["split_input"] is None:
        fields["split_input"] = _split_tokens_first
    if fields["merge_output"] is None:
        fields["merge_output"] = merge_mean_loss
    return RoundPipeRunConfig(**fields)


__all__ = [
    "CausalLMPostfix",
    "DecoderFamily",
    "DecoderLayerStage",
    "DecoderPrefix",
    "MicrobatchOutput",
    "all_layers",
    "chunked_causal_lm_loss",
    "chunked_linear_cross_entropy",
    "kinds_from_layer_types",
    "merge_mean_loss",
    "merge_summed_loss",
    "sliding_if_windowed",
]
