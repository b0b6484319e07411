"""Hugging Face presets: loss and every gradient equal the unwrapped model (tiny random configs
built here; no downloads)."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from roundpipe import RoundPipe, RoundPipeRunConfig, wrap_model_to_roundpipe
from roundpipe.models import merge_summed_loss
from torch import nn

transformers = pytest.importorskip("transformers", reason="the presets need transformers")

VOCAB = 128
SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "tie_word_embeddings": False,
}


def _build(config_name: str, model_name: str, **extra: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        if not hasattr(transformers, model_name):
            pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
        config = getattr(transformers, config_name)(**{**SHAPE, **extra})
        return getattr(transformers, model_name)(config)

    return build


FAMILIES = {
    "qwen3": _build("Qwen3Config", "Qwen3ForCausalLM", intermediate_size=128),
    "llama": _build("LlamaConfig", "LlamaForCausalLM", intermediate_size=128),
    "qwen3_moe": _build(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
    ),
    "gpt_oss": _build(
        "GptOssConfig",
        "GptOssForCausalLM",
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
}


def make_pair(family: str, **wrap_kwargs: Any) -> tuple[nn.Module, RoundPipe]:
    torch.manual_seed(0)
    reference = FAMILIES[family]()
    wrapped = wrap_model_to_roundpipe(copy.deepcopy(reference), **wrap_kwargs)
    assert isinstance(wrapped, RoundPipe)
    return reference, wrapped


def make_batch(padding: bool) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (4, 9), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    if padding:
        attention_mask[1, 6:] = 0
        attention_mask[3, 3:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    batch = {"input_ids": input_ids, "labels": labels}
    if padding:
        batch["attention_mask"] = attention_mask
    return batch


def assert_same_grads(reference: nn.Module, wrapped: RoundPipe) -> None:
    wrapped.synchronize()
    ours = dict(wrapped.original_model.named_parameters())
    for name, param in reference.named_parameters():
        grad = ours[name].grad
        assert grad is not None, name
        # An expert no token was routed to has no gradient in the reference: zero in ours.
        expected = torch.zeros_like(param) if param.grad is None else param.grad
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=2e-6, msg=name)


def microbatches(batch: dict[str, Any], num_microbatch: int) -> list[dict[str, Any]]:
    """The batch split as RoundPipe splits it (``torch.tensor_split`` along dim 0)."""
    chunks = {key: value.tensor_split(num_microbatch) for key, value in batch.items()}
    return [{key: chunks[key][m] for key in batch} for m in range(num_microbatch)]


def reference_loss(reference: nn.Module, batch: dict[str, Any], num_microbatch: int) -> Any:
    """What 0.1.1-style training computes with the unwrapped model: every microbatch's Hugging
    Face loss divided by the number of microbatches, summed; backpropagated into ``reference``."""
    total = sum(
        reference(**part).loss / num_microbatch for part in microbatches(batch, num_microbatch)
    )
    total.backward()
    return total.detach()


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("padding", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("num_microbatch", [1, 3])
@pytest.mark.parametrize("mode", ["forward", "forward_backward"])
def test_preset_matches_the_unwrapped_model(
    num_devices: int, family: str, padding: bool, num_microbatch: int, mode: str
) -> None:
    # Contract (0.1.1): out.loss is Hugging Face's loss of the microbatch, so the 0.1.1-style
    # loss_fn "out.loss / num_microbatch" trains exactly like the unwrapped model run per
    # microbatch; forward's merged loss is the mean of the microbatch losses.
    reference, wrapped = make_pair(family)
    batch = make_batch(padding)
    whole = reference(**batch)
    expected = reference_loss(reference, batch, num_microbatch)
    config = RoundPipeRunConfig(num_microbatch=num_microbatch)
    if mode == "forward":
        output = wrapped(**batch, roundpipe_run_config=config)
        assert type(output) is type(whole)
        torch.testing.assert_close(output.logits, whole.logits.detach(), rtol=1e-4, atol=1e-5)
        output.loss.backward()
        loss = output.loss.detach()
    else:
        loss = wrapped.forward_backward(
            input_kwargs=batch,
            loss_fn=lambda out, _: out.loss / num_microbatch,
            run_config=config,
        )
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert_same_grads(reference, wrapped)


@pytest.mark.slow
@pytest.mark.parametrize("num_microbatch", [1, 2])
def test_outputs_index_like_the_models_own(num_devices: int, num_microbatch: int) -> None:
    # Hugging Face code indexes outputs (out[0] is the loss): loss_fn's per-microbatch outputs
    # and the returned outputs (one microbatch, which nothing merges, included) allow it, and the
    # returned outputs are the model's own output type.
    reference, wrapped = make_pair("llama")
    assert type(wrapped) is RoundPipe  # a preset's model is a RoundPipe, not a subclass
    batch = make_batch(padding=False)
    whole = reference(**batch)
    config = RoundPipeRunConfig(num_microbatch=num_microbatch)
    seen: list[bool] = []

    def loss_fn(out: Any, _label: Any) -> torch.Tensor:
        seen.append(out[0] is out.loss and out[1] is out.logits and len(out.to_tuple()) == 2)
        return out[0] / num_microbatch

    loss, outputs = wrapped.forward_backward(
        input_kwargs=batch, loss_fn=loss_fn, return_outputs=True, run_config=config
    )
    assert seen == [True] * num_microbatch
    assert type(outputs) is type(whole)
    assert outputs[1] is outputs.logits
    torch.testing.assert_close(outputs.logits, whole.logits.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(loss, reference_loss(reference, batch, num_microbatch))


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
@pytest.mark.parametrize("num_microbatch", [1, 3])
@pytest.mark.parametrize("mode", ["forward", "forward_backward"])
def test_chunked_head_and_cross_entropy_match_without_logits(
    num_devices: int, family: str, num_microbatch: int, mode: str
) -> None:
    # Contract: loss_chunk_size changes memory, not the per-microbatch Hugging Face loss.
    reference, wrapped = make_pair(family, loss_chunk_size=5)
    batch = make_batch(padding=True)
    expected = reference_loss(reference, batch, num_microbatch)
    config = RoundPipeRunConfig(num_microbatch=num_microbatch)
    if mode == "forward":
        output = wrapped(**batch, roundpipe_run_config=config)
        assert output.logits is None
        output.loss.backward()
        loss = output.loss.detach()
    else:
        loss = wrapped.forward_backward(
            input_kwargs=batch,
            loss_fn=lambda out, _: out.loss / num_microbatch,
            run_config=config,
        )
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert_same_grads(reference, wrapped)


def test_position_ids_of_one_row_go_whole_to_every_microbatch(num_devices: int) -> None:
    # A keyword-only call: the token tensor is the batch; position_ids of a batch dimension of 1
    # (broadcast by Hugging Face) is passed whole, so the call still runs 2 microbatches.
    reference, wrapped = make_pair("llama")
    batch = make_batch(padding=False)
    position_ids = torch.arange(9).unsqueeze(0) + 3
    calls: list[int] = []

    def loss_fn(out: Any, _: Any) -> torch.Tensor:
        calls.append(1)
        return out.loss / 2

    loss = wrapped.forward_backward(
        input_kwargs={**batch, "position_ids": position_ids},
        loss_fn=loss_fn,
        run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    assert len(calls) == 2
    parts = microbatches(batch, 2)
    expected = sum(reference(**part, position_ids=position_ids).loss / 2 for part in parts)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    assert_same_grads(reference, wrapped)


def test_inference_without_labels_returns_logits() -> None:
    reference, wrapped = make_pair("qwen3")
    batch = make_batch(padding=True)
    del batch["labels"]
    with torch.no_grad():
        output = wrapped(**batch, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=2))
        expected = reference(**batch)
    assert output.loss is None
    torch.testing.assert_close(output.logits, expected.logits, rtol=1e-4, atol=1e-5)


def test_attributes_go_to_the_original_model(tmp_path: Path) -> None:
    reference, wrapped = make_pair("llama")
    original = wrapped.original_model
    assert type(original).__name__ == "LlamaForCausalLM"
    assert wrapped.config is original.config
    assert wrapped.vocab_size == VOCAB
    wrapped.custom_flag = 3
    assert original.custom_flag == 3
    # The Sequential shares the original's parameters, so saving the original saves training.
    with torch.no_grad():
        wrapped.model[0].embed_tokens.weight.add_(1.0)
    wrapped.save_pretrained(tmp_path)
    reloaded = type(reference).from_pretrained(tmp_path)
    torch.testing.assert_close(
        reloaded.model.embed_tokens.weight, reference.model.embed_tokens.weight + 1.0
    )


def test_preset_is_logged_and_can_be_refused(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    with caplog.at_level("INFO", logger="roundpipe"):
        wrap_model_to_roundpipe(FAMILIES["qwen3"]())
    assert [r.message for r in caplog.records if "preset" in r.message] == [
        "roundpipe: wrapping Qwen3ForCausalLM with the Qwen3 sequential preset"
    ]
    recursive = wrap_model_to_roundpipe(FAMILIES["qwen3"](), use_sequential_preset=False)
    assert type(recursive).__name__ == "AutoRoundPipe"


def test_demanding_a_missing_preset_raises() -> None:
    with pytest.raises(NotImplementedError, match="no sequential preset for Sequential"):
        wrap_model_to_roundpipe(nn.Sequential(nn.Linear(2, 2)), use_sequential_preset=True)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_tied_embeddings_match_the_unwrapped_model(num_devices: int, family: str) -> None:
    """lm_head shares embed_tokens' weight across the first and the last layer."""
    torch.manual_seed(0)
    names = {
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
    }
    config_name, model_name = names[family]
    config = getattr(transformers, config_name)(
        **{**SHAPE, "tie_word_embeddings": True, "intermediate_size": 64}
    )
    reference = getattr(transformers, model_name)(config)
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    wrapped = wrap_model_to_roundpipe(copy.deepcopy(reference))
    batch = make_batch(padding=True)
    expected = reference_loss(reference, batch, 3)
    loss = wrapped.forward_backward(
        input_kwargs=batch,
        loss_fn=lambda out, _: out.loss / 3,
        run_config=RoundPipeRunConfig(num_microbatch=3),
    )
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert_same_grads(reference, wrapped)


@pytest.mark.parametrize("loss_chunk_size", [None, 5])
def test_num_items_in_batch_gives_whole_batch_token_weighting(
    num_devices: int, loss_chunk_size: int | None
) -> None:
    # Contract (Hugging Face): with num_items_in_batch every microbatch's loss is its summed
    # token loss / num_items_in_batch, so the microbatch losses add up to the whole batch's mean.
    reference, wrapped = make_pair("llama", loss_chunk_size=loss_chunk_size)
    batch = make_batch(padding=True)
    num_items = (batch["labels"][:, 1:] != -100).sum()
    expected = reference(**batch)
    expected.loss.backward()
    loss = wrapped.forward_backward(
        input_kwargs={**batch, "num_items_in_batch": num_items},
        loss_fn=lambda out, _: out.loss,
        run_config=RoundPipeRunConfig(num_microbatch=3),
    )
    torch.testing.assert_close(loss, expected.loss.detach(), rtol=1e-5, atol=1e-6)
    assert_same_grads(reference, wrapped)
    # forward's merged loss averages the microbatch shares (the automatic merge averages every
    # scalar, as 0.1.1's does): num_microbatch times that is the whole batch's loss;
    # merge_summed_loss asks for the whole batch's loss itself.
    config = RoundPipeRunConfig(num_microbatch=3)
    merged = wrapped(**batch, num_items_in_batch=num_items, roundpipe_run_config=config)
    torch.testing.assert_close(merged.loss * 3, expected.loss.detach(), rtol=1e-5, atol=1e-6)
    summed = RoundPipeRunConfig(num_microbatch=3, merge_output=merge_summed_loss)
    merged = wrapped(**batch, num_items_in_batch=num_items, roundpipe_run_config=summed)
    torch.testing.assert_close(merged.loss, expected.loss.detach(), rtol=1e-5, atol=1e-6)
    if loss_chunk_size is None:
        assert merged.logits.shape[0] == batch["input_ids"].shape[0]


@pytest.mark.slow
@pytest.mark.parametrize("in_config", [False, True], ids=["per_call", "config"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_router_auxiliary_loss_matches_the_unwrapped_model(
    num_devices: int, family: str, in_config: bool
) -> None:
    # output_router_logits (per call, or in the config): each microbatch's aux_loss is Hugging
    # Face's load-balancing loss of that microbatch, its loss includes router_aux_loss_coef times
    # it, the merged aux_loss is their mean (0.1.1's merge), and the routers get its gradient.
    reference, wrapped = make_pair(family)
    for model in (reference, wrapped.original_model):
        model.config.output_router_logits = in_config
        model.router_aux_loss_coef = 0.5  # large enough that a missing part shows
    batch = make_batch(padding=True)
    asked = {} if in_config else {"output_router_logits": True}
    parts = microbatches(batch, 2)
    outputs = [reference(**part, **asked) for part in parts]
    sum(out.loss / 2 for out in outputs).backward()
    config = RoundPipeRunConfig(num_microbatch=2)
    merged = wrapped(**batch, **asked, roundpipe_run_config=config)
    expected_aux = sum(out.aux_loss for out in outputs) / 2
    assert merged.aux_loss is not None and expected_aux > 0
    torch.testing.assert_close(merged.aux_loss, expected_aux.detach(), rtol=1e-5, atol=1e-6)
    loss = wrapped.forward_backward(
        input_kwargs={**batch, **asked}, loss_fn=lambda out, _: out.loss / 2, run_config=config
    )
    torch.testing.assert_close(loss, sum(out.loss.detach() for out in outputs) / 2)
    assert_same_grads(reference, wrapped)
    with pytest.raises(ValueError, match="have no router"):
        make_pair("qwen3")[1](**batch, output_router_logits=True)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_per_call_switches_of_0_1_1(num_devices: int, family: str) -> None:
    # return_logits=False computes the loss chunk by chunk without logits (0.1.1's per-call
    # switch; same loss); output_router_logits=False is accepted per call, True refused.
    reference, wrapped = make_pair(family)
    batch = make_batch(padding=True)
    expected = reference(**batch).loss
    config = RoundPipeRunConfig(num_microbatch=2)
    out = wrapped(**batch, return_logits=False, roundpipe_run_config=config)
    assert out.logits is None
    plain = wrapped(**batch, roundpipe_run_config=config)
    torch.testing.assert_close(out.loss, plain.loss, rtol=1e-5, atol=1e-6)
    assert out.loss.item() != pytest.approx(expected.item() * 2)  # a mean, not a sum
    loss = wrapped.forward_backward(
        input_kwargs={**batch, "return_logits": False, "output_router_logits": False},
        loss_fn=lambda output, _: output.loss / 2,
        run_config=config,
    )
    torch.testing.assert_close(loss, reference_loss(reference, batch, 2), rtol=1e-5, atol=1e-6)
    assert_same_grads(reference, wrapped)
    with pytest.raises(TypeError, match="return_logits must be a bool"):
        wrapped(**batch, return_logits="no")


def test_unsupported_model_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="loss_chunk_size"):
        wrap_model_to_roundpipe(FAMILIES["llama"](), loss_chunk_size=0)


def test_bad_call_arguments_name_the_fix() -> None:
    _, wrapped = make_pair("qwen3")
    batch = make_batch(padding=False)
    with pytest.raises(ValueError, match="without a KV cache"):
        wrapped(**batch, use_cache=True)
    with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds"):
        wrapped(labels=batch["labels"])
    # Without labels return_logits=False would compute every layer and return nothing.
    with pytest.raises(ValueError, match=r"return_logits=False.*labels"):
        wrapped(input_ids=batch["input_ids"], return_logits=False)


def test_hugging_face_output_switches_at_their_defaults_are_accepted() -> None:
    # A Hugging Face model takes return_dict=True and output_hidden_states/output_attentions
    # False as no-ops; a preset does the same and refuses what it cannot return by name.
    reference, wrapped = make_pair("qwen3")
    batch = make_batch(padding=False)
    defaults = {"return_dict": True, "output_hidden_states": False, "output_attentions": False}
    output = wrapped(**batch, **defaults)
    torch.testing.assert_close(output.loss, reference(**batch, **defaults).loss)
    for switch, value in [
        ("return_dict", False),
        ("output_hidden_states", True),
        ("output_attentions", True),
    ]:
        with pytest.raises(ValueError, match=f"{switch}={value}"):
            wrapped(**batch, **{switch: value})


@pytest.mark.slow
def test_importing_roundpipe_does_not_import_transformers() -> None:
    code = "import sys, roundpipe; print('transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_adapters_added_after_wrapping_are_refused() -> None:
    # get_peft_model() of the RoundPipe inserts parameters no arena holds: they would be
    # neither uploaded nor trained (optim_parameters() was empty), so the call refuses them.
    peft = pytest.importorskip("peft", reason="the LoRA path needs peft")
    _, wrapped = make_pair("qwen3")
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(wrapped, lora)
    with pytest.raises(RuntimeError, match=r"q_proj.*not one it wrapped.*before wrapping"):
        model(**make_batch(padding=False))


def test_lora_adapters_train_on_a_frozen_pageable_base(num_devices: int) -> None:
    peft = pytest.importorskip("peft", reason="the LoRA path needs peft")
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(FAMILIES["qwen3"](), lora)
    reference = copy.deepcopy(model)
    wrapped = wrap_model_to_roundpipe(model, pin_model="off")
    assert wrapped.original_model is model
    trainable = [name for name, _ in wrapped.optim_named_parameters()]
    assert trainable and all("lora_" in name for name in trainable)
    batch = make_batch(padding=True)
    loss = wrapped.forward_backward(
        input_kwargs=batch,
        loss_fn=lambda out, _: out.loss / 2,
        run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    torch.testing.assert_close(loss, reference_loss(reference, batch, 2))
    wrapped.synchronize()
    ours = dict(model.named_parameters())
    for name, param in reference.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(ours[name].grad, param.grad, rtol=1e-4, atol=2e-6)
        else:
            assert ours[name].grad is None, name


@pytest.mark.requires_cuda
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_preset_on_cuda_in_bf16(family: str) -> None:
    torch.manual_seed(0)
    reference = FAMILIES[family]().to(torch.bfloat16)
    model = copy.deepcopy(reference)
    reference.cuda()
    bf16_wrapped = wrap_model_to_roundpipe(model, optim_dtype=torch.float32)
    batch = make_batch(padding=True)
    expected = reference_loss(reference, {k: v.cuda() for k, v in batch.items()}, 2)
    loss = bf16_wrapped.forward_backward(
        input_kwargs=batch,
        loss_fn=lambda out, _: out.loss / 2,
        run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    expected_loss = expected.float().cpu()
    torch.testing.assert_close(loss.float(), expected_loss, rtol=3e-2, atol=3e-2)
    bf16_wrapped.synchronize()
    ours = dict(bf16_wrapped.original_model.named_parameters())
    for name, param in reference.named_parameters():
        if param.grad is None:
            continue
        error = (ours[name].grad.float() - param.grad.float().cpu()).norm()
        assert error <= 0.1 * param.grad.float().norm() + 1e-3, name


def test_recursive_wrapping_of_a_hugging_face_model(num_devices: int) -> None:
    torch.manual_seed(0)
    reference = FAMILIES["qwen3"]()
    wrapped = wrap_model_to_roundpipe(
        copy.deepcopy(reference),
        use_sequential_preset=False,
        model_run_config=RoundPipeRunConfig(num_microbatch=3),
    )
    # 0.1.1's rule (bytes): embeddings and head (32 KiB >= 16 KiB own) and the layers are parts;
    # the small norm and rotary embedding are parts too, run as one microbatch.
    layers = [f"model.layers.{i}" for i in range(3)]
    expected_parts = ["model.embed_tokens", *layers, "model.norm", "model.rotary_emb", "lm_head"]
    assert [path for path, _ in wrapped.parts] == expected_parts
    assert wrapped.model.model.norm.model_run_config.num_microbatch == 1
    batch = make_batch(padding=True)
    # A KV cache would be shared by the microbatches of each decoder layer: train without one.
    output = wrapped(**batch, use_cache=False)
    output.loss.backward()
    expected = reference(**batch)
    expected.loss.backward()
    torch.testing.assert_close(output.loss, expected.loss)
    wrapped.synchronize()
    # A part's parameters are named "<path>.model.<name>": drop the RoundPipe level.
    ours = {name.replace(".model.", ".", 1): p for name, p in wrapped.model.named_parameters()}
    for name, param in reference.named_parameters():
        torch.testing.assert_close(ours[name].grad, param.grad, rtol=1e-4, atol=2e-6, msg=name)
