"""Offline versions of roundpipe 0.1.1's model tests (``tests/models/test_*.py``).

0.1.1's tests fine-tune downloaded checkpoints and compare the losses with recorded ones. These
keep their training loops, wrapping arguments and assertion formula (the mean relative loss
difference below a tolerance) with tiny models built from configs (tied input and output
embeddings), and compute the reference losses with the unwrapped model in plain PyTorch, in the
same run: synchronous steps as plain steps, asynchronous ones with RoundPipe's staleness of one
step (``reference.stale_step``). The data has structure to learn (each token predicts the
next), and the learning rate is high enough that an untrained model fails the tolerance, so a
run that does not train as the reference does cannot pass. The forward-only tests of the MoE
families (0.1.1's ``test_qwen3moe.py`` and ``test_gpt_oss.py``) run a model first trained in plain
PyTorch, whose losses an untrained model's miss by more than the tolerance.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import roundpipe
import torch
from reference import stale_step
from roundpipe import GradScaler, RoundPipeRunConfig, wrap_model_to_roundpipe
from roundpipe.models.function import CompileForCausalLMLoss
from roundpipe.optim import Adam
from torch import nn

transformers = pytest.importorskip("transformers", reason="the model ports need transformers")

VOCAB, EPOCHS, LR = 48, 2, 2e-2
SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "tie_word_embeddings": True,
    "use_cache": False,
}
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"intermediate_size": 48}),
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"intermediate_size": 48}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "intermediate_size": 48,
            "moe_intermediate_size": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "intermediate_size": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
}


def raw_model(family: str) -> nn.Module:
    config_name, model_name, extra = FAMILIES[family]
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    torch.manual_seed(0)
    return getattr(transformers, model_name)(getattr(transformers, config_name)(**SHAPE, **extra))


def dataloader(rows: int = 4) -> list[dict[str, torch.Tensor]]:
    """Four padded batches of ``rows`` counting sequences (token t + 1 follows token t)."""
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        lengths = torch.randint(6, 11, (rows,), generator=generator)
        starts = torch.randint(0, VOCAB, (rows, 1), generator=generator)
        ids = (starts + torch.arange(10)) % VOCAB
        mask = (torch.arange(10) < lengths[:, None]).long()
        labels = ids.masked_fill(mask == 0, -100)
        batches.append({"input_ids": ids * mask, "attention_mask": mask, "labels": labels})
    return batches


def epochs(rows: int = 4) -> Iterator[dict[str, torch.Tensor]]:
    for _ in range(EPOCHS):
        for batch in dataloader(rows):
            yield {key: value.clone() for key, value in batch.items()}


def hf_loss(model: nn.Module, batch: dict[str, torch.Tensor], **kwargs: Any) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return CompileForCausalLMLoss(logits=logits, labels=batch["labels"], vocab_size=VOCAB, **kwargs)


def samples(batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The batch one sample at a time, as 0.1.1's accumulate loops feed it."""
    rows = batch["input_ids"].shape[0]
    return [{key: value[row : row + 1] for key, value in batch.items()} for row in range(rows)]


def num_items(labels: torch.Tensor) -> int:
    return int((labels[..., 1:] != -100).sum().item())


def reference_losses(family: str, is_async: bool, per_sample: bool = False) -> list[float]:
    """The unwrapped model trained by plain PyTorch Adam on the same batches (the whole batch's
    loss, or with ``per_sample`` the sum of per-sample shares of it, as 0.1.1's accumulate
    loops compute it)."""
    live = raw_model(family)
    master = copy.deepcopy(live)
    optimizer = torch.optim.Adam((master if is_async else live).parameters(), lr=LR)
    losses = []
    for batch in epochs():
        if per_sample:
            n, total = num_items(batch["labels"]), 0.0
            for part in samples(batch):
                loss = hf_loss(live, part, num_items_in_batch=n)
                loss.backward()
                total += loss.item()
            losses.append(total)
        else:
            loss = hf_loss(live, batch)
            loss.backward()
            losses.append(loss.item())
        if is_async:
            stale_step(live, master, optimizer)
        else:
            optimizer.step()
            optimizer.zero_grad()
    return losses


def untrained_losses(family: str, batches: list[dict[str, torch.Tensor]]) -> list[float]:
    model = raw_model(family)
    with torch.no_grad():
        return [hf_loss(model, batch).item() for batch in batches]


def assert_close_losses(
    losses: list[float],
    ref: list[float],
    tolerance: float,
    family: str,
    batches: list[dict[str, torch.Tensor]] | None = None,
) -> None:
    """0.1.1's formula, and proof that it discriminates: the untrained model's losses on the same
    ``batches`` (default: the training loops' ``epochs()``) fail it."""
    diff = [abs(v - r) / r for v, r in zip(losses, ref, strict=True)]
    assert sum(diff) / len(diff) < tolerance, (losses, ref)
    untrained = untrained_losses(family, list(epochs()) if batches is None else batches)
    untrained_diff = [abs(v - r) / r for v, r in zip(untrained, ref, strict=True)]
    assert sum(untrained_diff) / len(untrained_diff) > tolerance, "the references must have trained"


def scaled_step(scaler: GradScaler, optim: Adam) -> Callable[[], None]:
    return lambda: (scaler.step(optim), optim.zero_grad(), None)[-1]


def wrapped_with_adam(
    family: str, run_config: RoundPipeRunConfig, use_preset: bool
) -> tuple[nn.Module, Adam, GradScaler]:
    """``family``'s model wrapped as 0.1.1's training loops wrap it (fp32 optimizer copies),
    ``roundpipe.optim.Adam`` over its copies and a ``GradScaler`` starting at 8192."""
    model = wrap_model_to_roundpipe(
        raw_model(family),
        model_run_config=run_config,
        use_sequential_preset=use_preset,
        optim_dtype=torch.float32,
    )
    return model, Adam(model.optim_parameters(), lr=LR), GradScaler(8192.0)


@pytest.mark.slow
@pytest.mark.parametrize("use_preset", [True, False])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_minimum(num_devices: int, family: str, use_preset: bool) -> None:
    # The unwrapped model's own parameters stepped by torch's Adam after synchronize().
    raw = raw_model(family)
    model = wrap_model_to_roundpipe(
        raw, model_run_config=RoundPipeRunConfig(num_microbatch=3), use_sequential_preset=use_preset
    )
    optim = torch.optim.Adam(raw.parameters(), lr=LR)
    losses = []
    for input_dict in epochs():
        labels = input_dict.pop("labels")
        logits = model(**input_dict).logits
        loss = CompileForCausalLMLoss(logits=logits, labels=labels, vocab_size=VOCAB)
        loss.backward()
        losses.append(loss.item())
        model.synchronize()
        optim.step()
        optim.zero_grad()
    assert_close_losses(losses, reference_losses(family, False), 0.005, family)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("use_preset", "is_async"), [(True, True), (True, False), (False, True), (False, False)]
)
@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe", "gpt_oss"])
def test_classic(num_devices: int, family: str, use_preset: bool, is_async: bool) -> None:
    # roundpipe.optim.Adam on fp32 optimizer copies, a GradScaler, model.step.
    model, optim, scaler = wrapped_with_adam(
        family, RoundPipeRunConfig(num_microbatch=3), use_preset
    )
    losses = []
    for input_dict in epochs():
        labels = input_dict.pop("labels")
        logits = model(**input_dict).logits
        loss = CompileForCausalLMLoss(logits=logits, labels=labels, vocab_size=VOCAB)
        scaler.scale(loss).backward()
        losses.append(loss.item())
        model.step(scaled_step(scaler, optim), is_async=is_async)
        scaler.update()
    assert_close_losses(losses, reference_losses(family, is_async), 0.01, family)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_classic_accumulate(num_devices: int, family: str) -> None:
    # One sample per call, the whole batch's target count as num_items_in_batch.
    model, optim, scaler = wrapped_with_adam(family, RoundPipeRunConfig(num_microbatch=1), False)
    losses = []
    for input_dict in epochs():
        n, total = num_items(input_dict["labels"]), 0.0
        for part in samples(input_dict):
            logits = model(
                input_ids=part["input_ids"], attention_mask=part["attention_mask"]
            ).logits
            loss = CompileForCausalLMLoss(
                logits=logits, labels=part["labels"], vocab_size=VOCAB, num_items_in_batch=n
            )
            scaler.scale(loss).backward()
            total += loss.item()
        losses.append(total)
        model.step(scaled_step(scaler, optim))
        scaler.update()
    assert_close_losses(losses, reference_losses(family, True, per_sample=True), 0.01, family)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("is_async", "grain"), [(True, "stage"), (False, "stage"), (True, "layer")]
)
@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe", "gpt_oss"])
def test_fused(num_devices: int, family: str, is_async: bool, grain: str) -> None:
    # forward_backward without logits, each microbatch's loss its share of the whole batch's.
    model, optim, scaler = wrapped_with_adam(
        family, RoundPipeRunConfig(num_microbatch=3, recompute_grain=grain), True
    )
    losses = []
    for input_dict in epochs():
        input_dict = {
            **input_dict,
            "return_logits": False,
            "num_items_in_batch": num_items(input_dict["labels"]),
        }
        loss = model.forward_backward(
            input_kwargs=input_dict, loss_fn=lambda output, _: scaler.scale(output.loss)
        )
        losses.append(loss.item() / scaler.get_scale())
        model.step(scaled_step(scaler, optim), is_async=is_async)
        scaler.update()
    assert_close_losses(losses, reference_losses(family, is_async), 0.01, family)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_label(num_devices: int, family: str) -> None:
    # 0.1.1's Llama fused loop: the labels split as forward_backward's label, each microbatch's
    # loss the wrapped model's own Hugging Face loss_function of its logits (attributes read
    # through the wrapper), weighted by the whole batch's target count.
    model, optim, scaler = wrapped_with_adam(family, RoundPipeRunConfig(num_microbatch=3), True)
    losses = []
    for input_dict in epochs():
        labels = input_dict.pop("labels")
        n = num_items(labels)
        loss = model.forward_backward(
            input_kwargs=dict(input_dict),
            label=labels,
            loss_fn=lambda outputs, labels, n=n: scaler.scale(
                model.loss_function(
                    logits=outputs.logits,
                    labels=labels,
                    vocab_size=model.vocab_size,
                    num_items_in_batch=n,
                )
            ),
        )
        losses.append(loss.item() / scaler.get_scale())
        model.step(scaled_step(scaler, optim))
        scaler.update()
    assert_close_losses(losses, reference_losses(family, True), 0.01, family)


# 0.1.1's MoE forward tests: batches of 10 samples in 4 microbatches (an uneven split).
FORWARD_ROWS, FORWARD_MICROBATCHES = 10, 4


def trained_model(family: str) -> nn.Module:
    """The family's tiny model after plain-PyTorch training on the forward tests' batches: its
    loss depends on what it is fed (an untrained model's is near log(VOCAB) whatever the input),
    so a forward that mixes up rows or microbatches cannot match the reference."""
    model = raw_model(family)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for batch in epochs(FORWARD_ROWS):
        hf_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_auto_forward(num_devices: int, family: str) -> None:
    # Forward only (gradients on, no backward), wrapped recursively: the whole batch's loss of
    # the merged logits. Router logits are not asked for, so aux_loss is None, as unwrapped.
    trained = trained_model(family)
    model = wrap_model_to_roundpipe(
        copy.deepcopy(trained),
        model_run_config=RoundPipeRunConfig(num_microbatch=FORWARD_MICROBATCHES),
        use_sequential_preset=False,
    )
    batches = dataloader(FORWARD_ROWS)
    losses, aux_losses = [], []
    for input_dict in batches:
        input_dict = dict(input_dict)
        labels = input_dict.pop("labels")
        out = model(**input_dict)
        aux_losses.append(out.aux_loss)
        loss = CompileForCausalLMLoss(
            logits=out.logits, labels=labels, vocab_size=model.config.vocab_size
        )
        losses.append(loss.item())
    with torch.no_grad():
        ref = [hf_loss(trained, batch).item() for batch in batches]
    assert aux_losses == [None] * len(batches)
    assert_close_losses(losses, ref, 0.005, family, batches)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_preset_forward(num_devices: int, family: str) -> None:
    # The preset's forward with router logits, without logits, each microbatch's loss its share
    # of the whole batch's: the merge averages loss and aux_loss, so num_microbatch times the
    # loss less the router term is the whole batch's loss (a summed merge would be 4x off), and
    # aux_loss the mean of the unwrapped model's load-balancing losses of the microbatches
    # (dim 0 cut as torch.tensor_split cuts it; the loss is not linear in the batch).
    trained = trained_model(family)
    model = wrap_model_to_roundpipe(
        copy.deepcopy(trained),
        model_run_config=RoundPipeRunConfig(num_microbatch=FORWARD_MICROBATCHES),
        use_sequential_preset=True,
    )
    batches = dataloader(FORWARD_ROWS)
    losses, aux_losses = [], []
    for input_dict in batches:
        out = model(
            **input_dict,
            output_router_logits=True,
            return_logits=False,
            num_items_in_batch=num_items(input_dict["labels"]),
        )
        aux_losses.append(out.aux_loss.item())
        router_term = model.router_aux_loss_coef * out.aux_loss
        losses.append(((out.loss - router_term) * FORWARD_MICROBATCHES).item())
    with torch.no_grad():
        ref = [hf_loss(trained, batch).item() for batch in batches]
        ref_aux = [
            torch.stack(
                [
                    trained(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
                    for ids, mask in zip(
                        batch["input_ids"].tensor_split(FORWARD_MICROBATCHES),
                        batch["attention_mask"].tensor_split(FORWARD_MICROBATCHES),
                        strict=True,
                    )
                ]
            )
            .mean()
            .item()
            for batch in batches
        ]
    assert_close_losses(losses, ref, 0.005, family, batches)
    aux_diff = [abs(v - r) / r for v, r in zip(aux_losses, ref_aux, strict=True)]
    assert sum(aux_diff) / len(aux_diff) < 0.01, (aux_losses, ref_aux)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_fused_accumulate(num_devices: int, family: str) -> None:
    model, optim, scaler = wrapped_with_adam(family, RoundPipeRunConfig(num_microbatch=1), True)
    losses = []
    for input_dict in epochs():
        n, total = num_items(input_dict["labels"]), 0.0
        for part in samples(input_dict):
            loss = model.forward_backward(
                input_kwargs={**part, "return_logits": False, "num_items_in_batch": n},
                loss_fn=lambda output, _: scaler.scale(output.loss),
            )
            total += loss.item()
        losses.append(total / scaler.get_scale())
        model.step(scaled_step(scaler, optim))
        scaler.update()
    assert_close_losses(losses, reference_losses(family, True, per_sample=True), 0.01, family)


def test_0_1_1_names_are_importable() -> None:
    # The module paths and names 0.1.1's tests and documentation import.
    import importlib

    from roundpipe.device import get_num_devices
    from roundpipe.models import SUPPORTED_MODELS
    from roundpipe.optim.adam import Adam as AdamAtItsModule

    assert AdamAtItsModule is Adam  # roundpipe.optim is a package, as in 0.1.1
    assert get_num_devices() == roundpipe.device_count()
    for class_name, module_path in SUPPORTED_MODELS.items():
        module = importlib.import_module(module_path, "roundpipe.models")
        if class_name != "function":
            assert module.EXPECTED_MODEL_CLASS.__name__ == class_name
            with pytest.raises(NotImplementedError, match="not an instance of the expected"):
                module.wrap_model(nn.Linear(2, 2))
