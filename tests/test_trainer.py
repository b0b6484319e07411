"""RoundPipeTrainer against plain ``transformers.Trainer``: logged losses, gradient norms and
learning rates on the same model and data, resume from a checkpoint, PEFT, refused arguments."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from roundpipe import RoundPipeRunConfig  # noqa: E402
from roundpipe.integrations.transformers import STATE_NAME, RoundPipeTrainer  # noqa: E402
from transformers import (  # noqa: E402
    Qwen3Config,
    Qwen3ForCausalLM,
    Trainer,
    TrainingArguments,
)

STEPS = 12
ACCUMULATION = 2
BATCH = 4
SEQ = 16
VOCAB = 64


def tiny_qwen3(seed: int = 0, tied: bool = True) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    return Qwen3ForCausalLM(config)


def tiny_gpt2(tied: bool = False, seed: int = 0) -> torch.nn.Module:
    """GPT-2 has no preset: RoundPipe converts it in place into an AutoRoundPipe's parts."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def dataset(count: int = STEPS * ACCUMULATION * BATCH) -> list[dict[str, torch.Tensor]]:
    """Counting sequences; some targets masked so that batches have unequal token counts."""
    generator = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(count):
        start = int(torch.randint(0, VOCAB, (1,), generator=generator))
        ids = (start + torch.arange(SEQ)) % VOCAB
        labels = ids.clone()
        labels[: int(torch.randint(0, SEQ // 2, (1,), generator=generator))] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def arguments(out: Path, **overrides: Any) -> TrainingArguments:
    options: dict[str, Any] = {
        "output_dir": str(out),
        "max_steps": STEPS,
        "per_device_train_batch_size": BATCH,
        "gradient_accumulation_steps": ACCUMULATION,
        "learning_rate": 3e-3,
        "weight_decay": 0.1,
        "warmup_steps": 2,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
        "seed": 3,
        "dataloader_num_workers": 0,
    }
    options.update(overrides)
    return TrainingArguments(**options)


def step_logs(trainer: Trainer) -> list[dict[str, float]]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def reference_logs(out: Path) -> list[dict[str, float]]:
    trainer = Trainer(model=tiny_qwen3(), args=arguments(out), train_dataset=dataset())
    trainer.train()
    return step_logs(trainer)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, float]]:
    return reference_logs(tmp_path_factory.mktemp("reference"))


def assert_logs_match(ours: list[dict[str, float]], theirs: list[dict[str, float]]) -> None:
    assert [entry["step"] for entry in ours] == [entry["step"] for entry in theirs]
    for mine, ref in zip(ours, theirs, strict=True):
        for key in ("loss", "grad_norm", "learning_rate"):
            assert mine[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-9), (key, mine, ref)


@pytest.mark.slow
def test_losses_match_trainer(tmp_path: Path, reference: list[dict[str, float]]) -> None:
    trainer = RoundPipeTrainer(
        tiny_qwen3(),
        arguments(tmp_path),
        train_dataset=dataset(),
        run_config=RoundPipeRunConfig(num_microbatch=2),
        async_step=False,
    )
    trainer.train()
    ours = step_logs(trainer)
    assert len(ours) == STEPS
    assert_logs_match(ours, reference)


@pytest.mark.slow
def test_resume_reproduces_the_steps_after_the_checkpoint(tmp_path: Path) -> None:
    def run(out: Path, resume: str | None) -> RoundPipeTrainer:
        trainer = RoundPipeTrainer(
            tiny_qwen3(seed=5 if resume else 0),  # resuming must replace these weights
            arguments(out, save_strategy="steps", save_steps=6),
            train_dataset=dataset(),
            async_step=False,
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full", None)
    checkpoint = tmp_path / "full" / "checkpoint-6"
    assert (checkpoint / STATE_NAME).exists()
    resumed = run(tmp_path / "resumed", str(checkpoint))
    expected = [entry for entry in step_logs(full) if entry["step"] > 6]
    history = step_logs(resumed)  # the checkpoint's log history, then the resumed steps
    assert [entry["step"] for entry in history] == list(range(1, STEPS + 1))
    got = history[6:]
    assert_logs_match(got, expected)
    for mine, ref in zip(got, expected, strict=True):
        assert mine["loss"] == ref["loss"]  # the same computation, bit for bit
    weights = dict(full.model.named_parameters())
    for name, param in resumed.model.named_parameters():
        torch.testing.assert_close(param, weights[name], rtol=0, atol=0)


def test_async_step_trains_with_staleness_one(
    tmp_path: Path, reference: list[dict[str, float]]
) -> None:
    """Asynchronous steps: step 3 trains on the weights after step 1 (lr 0 in the warm-up), so
    its loss differs from the synchronous run; it still falls, on Trainer's schedule."""
    trainer = RoundPipeTrainer(tiny_qwen3(), arguments(tmp_path), train_dataset=dataset())
    trainer.train()
    ours = step_logs(trainer)
    assert ours[0]["loss"] == pytest.approx(reference[0]["loss"], rel=1e-4)
    assert ours[1]["loss"] == pytest.approx(reference[1]["loss"], rel=1e-4)  # lr 0 at step 1
    assert ours[2]["loss"] != pytest.approx(reference[2]["loss"], rel=1e-6)
    assert [entry["learning_rate"] for entry in ours] == pytest.approx(
        [entry["learning_rate"] for entry in reference]
    )
    assert ours[-1]["loss"] < 0.9 * ours[0]["loss"]


def test_evaluate_matches_trainer(tmp_path: Path) -> None:
    rows = dataset(12)
    ref = Trainer(model=tiny_qwen3(), args=arguments(tmp_path / "ref"), eval_dataset=rows)
    ours = RoundPipeTrainer(
        tiny_qwen3(),
        arguments(tmp_path / "ours", per_device_eval_batch_size=6),
        eval_dataset=rows,
        run_config=RoundPipeRunConfig(num_microbatch=3),
    )
    ref.args.per_device_eval_batch_size = 6
    assert ours.evaluate()["eval_loss"] == pytest.approx(ref.evaluate()["eval_loss"], rel=1e-5)


def test_peft_trains_adapters_only(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        tiny_qwen3(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    )
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer = RoundPipeTrainer(
        model, arguments(tmp_path, max_steps=3), train_dataset=dataset(24), async_step=False
    )
    trainer.train()
    optimized = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert sum(p.numel() for p in optimized) == sum(p.numel() for p in adapters.values())
    after = dict(model.named_parameters())
    for name, before in frozen.items():
        assert torch.equal(after[name], before), name
    assert any(not torch.equal(after[name], before) for name, before in adapters.items())


def with_lora(model: torch.nn.Module, targets: list[str]) -> torch.nn.Module:
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets))


# The models whose saved files are compared with plain Trainer's: without a preset (converted in
# place), with tied embeddings, with a preset, and LoRA adapters around either.
MODELS = {
    "gpt2": lambda: tiny_gpt2(tied=False),
    "gpt2_tied": lambda: tiny_gpt2(tied=True),
    "qwen3": tiny_qwen3,
    "gpt2_lora": lambda: with_lora(tiny_gpt2(tied=True), ["c_attn"]),
    "qwen3_lora": lambda: with_lora(tiny_qwen3(), ["q_proj", "v_proj"]),
}


def saved_files(folder: Path) -> dict[str, Any]:
    """Each file of a saved model; for a safetensors file, its tensors' names, dtypes, shapes."""
    from safetensors import safe_open

    files: dict[str, Any] = {}
    for path in sorted(folder.iterdir()):
        if path.suffix == ".safetensors":
            with safe_open(str(path), "pt") as handle:
                files[path.name] = {
                    key: (handle.get_slice(key).get_dtype(), handle.get_slice(key).get_shape())
                    for key in handle.keys()
                }
        elif path.is_file():
            files[path.name] = None
    return files


def load_saved(kind: str, folder: Path) -> torch.nn.Module:
    """``from_pretrained`` of a saved folder (a PEFT adapter onto a fresh base), refusing any
    weight the files lack or do not fit."""
    if kind.endswith("_lora"):
        import warnings

        peft = pytest.importorskip("peft")
        base = MODELS[kind.removesuffix("_lora")]()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            adapted = peft.PeftModel.from_pretrained(base, str(folder))
        assert not [w for w in caught if "missing adapter keys" in str(w.message)]
        return adapted  # type: ignore[no-any-return]
    cls = type(MODELS[kind]())
    loaded, info = cls.from_pretrained(str(folder), output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or newly initialized
    return loaded  # type: ignore[no-any-return]


def assert_weights_equal(loaded: torch.nn.Module, params: list[tuple[str, torch.Tensor]]) -> None:
    for name, param in params:
        assert torch.equal(loaded.get_parameter(name), param), name


@pytest.mark.parametrize("kind", list(MODELS))
def test_save_model_writes_what_trainer_writes(tmp_path: Path, kind: str) -> None:
    # The files, their tensors' names (tied weights once, as transformers keeps them) and the
    # trained weights, bit for bit, whether or not RoundPipe converted the model in place.
    model = MODELS[kind]()
    params = list(model.named_parameters())  # the unwrapped names, on the tensors that train
    initial = {name: param.detach().clone() for name, param in params}
    trainer = RoundPipeTrainer(
        model, arguments(tmp_path / "run", max_steps=3), train_dataset=dataset(24)
    )
    trainer.train()
    assert any(not torch.equal(param, initial[name]) for name, param in params)
    trainer.save_model(str(tmp_path / "ours"))
    Trainer(model=MODELS[kind](), args=arguments(tmp_path / "ref")).save_model(
        str(tmp_path / "theirs")
    )
    assert saved_files(tmp_path / "ours") == saved_files(tmp_path / "theirs")
    assert_weights_equal(load_saved(kind, tmp_path / "ours"), params)


@pytest.mark.parametrize("kind", ["gpt2", "gpt2_tied", "gpt2_lora"])
def test_save_pretrained_of_the_converted_model_writes_what_trainer_writes(
    tmp_path: Path, kind: str
) -> None:
    # A model without a preset is converted in place: the user's own ``model.save_pretrained``
    # (and the wrapper's, which forwards to it) must write the unwrapped model's files too, not
    # the RoundPipe parts' names (which from_pretrained would load as random weights).
    model = MODELS[kind]()
    params = list(model.named_parameters())
    trainer = RoundPipeTrainer(
        model, arguments(tmp_path / "run", max_steps=2), train_dataset=dataset(16)
    )
    trainer.train()
    Trainer(model=MODELS[kind](), args=arguments(tmp_path / "ref")).save_model(
        str(tmp_path / "theirs")
    )
    theirs = saved_files(tmp_path / "theirs")
    theirs.pop("training_args.bin")
    for saver, folder in ((model, "direct"), (trainer.roundpipe_model, "wrapper")):
        saver.save_pretrained(str(tmp_path / folder))
        assert saved_files(tmp_path / folder) == theirs
        assert_weights_equal(load_saved(kind, tmp_path / folder), params)


@pytest.mark.parametrize(
    ("kind", "precision"),
    [("gpt2_tied", {}), ("qwen3", {}), ("gpt2_lora", {}), ("qwen3", {"bf16": True})],
    ids=["gpt2_tied", "qwen3", "gpt2_lora", "qwen3_bf16"],
)
def test_checkpoint_model_files_hold_the_steps_weights(
    tmp_path: Path, kind: str, precision: dict[str, bool]
) -> None:
    # Asynchronous steps: when checkpoint-3 is written, step 3 is still to be written back. Its
    # model files hold the weights after step 3 all the same (those of a 3-step run; with bf16,
    # the fp32 optimizer copies cast as the write-back casts them), and writing them changes
    # nothing of the training (the run goes on as one without checkpoints).
    def run(out: Path, steps: int, **overrides: Any) -> RoundPipeTrainer:
        args = arguments(
            out,
            max_steps=steps,
            lr_scheduler_type="constant_with_warmup",
            **precision,
            **overrides,
        )
        trainer = RoundPipeTrainer(MODELS[kind](), args, train_dataset=dataset(48))
        trainer.train()
        return trainer

    saving = run(tmp_path / "saving", 6, save_strategy="steps", save_steps=3)
    checkpoint = tmp_path / "saving" / "checkpoint-3"
    short = run(tmp_path / "short", 3)
    plain = run(tmp_path / "plain", 6)
    assert step_logs(saving) == step_logs(plain)
    assert_weights_equal(saving.model, list(plain.model.named_parameters()))
    short.save_model(str(tmp_path / "short_files"))
    # RoundPipeTrainer trains a bf16 model (Trainer an fp32 one under autocast): the reference
    # is plain Trainer's files of the model in the dtype that trains.
    reference = MODELS[kind]().to(torch.bfloat16 if precision else torch.float32)
    Trainer(model=reference, args=arguments(tmp_path / "ref")).save_model(str(tmp_path / "ref"))
    model_files = {name: keys for name, keys in saved_files(tmp_path / "ref").items() if keys}
    assert {name: keys for name, keys in saved_files(checkpoint).items() if keys} == model_files
    from safetensors.torch import load_file

    for name in model_files:
        ours, after_three = load_file(checkpoint / name), load_file(tmp_path / "short_files" / name)
        assert not [key for key in after_three if not torch.equal(ours[key], after_three[key])]


@pytest.mark.parametrize("kind", ["gpt2_tied", "qwen3"])
def test_save_only_model_checkpoints_hold_what_trainer_writes(tmp_path: Path, kind: str) -> None:
    # save_only_model: each checkpoint-N/ holds the model files and trainer_state.json only, the
    # same files as plain Trainer's, with the weights after step N.
    def run(
        trainer_cls: type, out: Path, steps: int, **overrides: Any
    ) -> list[tuple[str, torch.nn.Parameter]]:
        model = MODELS[kind]()
        params = list(model.named_parameters())  # the unwrapped names
        args = arguments(out, max_steps=steps, **overrides)
        trainer_cls(model, args, train_dataset=dataset(24)).train()
        return params

    only = {"save_strategy": "steps", "save_steps": 2, "save_only_model": True}
    run(RoundPipeTrainer, tmp_path / "ours", 3, **only)
    run(Trainer, tmp_path / "theirs", 3, **only)
    ours, theirs = tmp_path / "ours" / "checkpoint-2", tmp_path / "theirs" / "checkpoint-2"
    assert saved_files(ours) == saved_files(theirs)
    assert_weights_equal(load_saved(kind, ours), run(RoundPipeTrainer, tmp_path / "short", 2))


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"deepspeed": {"train_batch_size": 8}}, "deepspeed"),
        ({"fsdp": "full_shard"}, "fsdp"),
        ({"gradient_checkpointing": True}, "checkpointing"),
        ({"label_smoothing_factor": 0.1}, "label_smoothing_factor"),
        (
            {"lr_scheduler_type": "reduce_lr_on_plateau", "eval_strategy": "steps"},
            "reduce_lr_on_plateau",
        ),
        ({"optim": "lomo"}, "lomo"),
        ({"optim": "schedule_free_adamw"}, "schedule_free_adamw"),
    ],
)
def test_unsupported_arguments_are_named(
    tmp_path: Path, overrides: dict[str, Any], named: str
) -> None:
    try:
        args = arguments(tmp_path, **overrides)
    except (ImportError, ValueError) as error:  # transformers refuses it itself (no deepspeed)
        pytest.skip(f"TrainingArguments refuses {overrides}: {error}")
    with pytest.raises(ValueError, match=named):
        RoundPipeTrainer(tiny_qwen3(), args, train_dataset=dataset(8), eval_dataset=dataset(4))


def test_bad_arguments(tmp_path: Path) -> None:
    args = arguments(tmp_path)
    model = tiny_qwen3()
    with pytest.raises(TypeError, match="async_step"):
        RoundPipeTrainer(model, args, async_step=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="run_config"):
        RoundPipeTrainer(model, args, run_config={"num_microbatch": 2})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="optimizer_cls_and_kwargs"):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        RoundPipeTrainer(model, args, optimizers=(opt, None))
    with pytest.raises(TypeError, match="unwrapped"):
        RoundPipeTrainer(copy.deepcopy(torch.nn.Linear(2, 2)).__class__, args)  # type: ignore[arg-type]


def run_ranks(out: Path, which: str) -> None:
    """tests/trainer_ranks.py on 2 ranks under torchrun (gloo)."""
    import os
    import subprocess
    import sys

    script = Path(__file__).with_name("trainer_ranks.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(script), str(out), which]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env=os.environ.copy()
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.slow
def test_torchrun_ranks_match_trainer_under_ddp(tmp_path: Path) -> None:
    # 2 ranks under torchrun (gloo): RoundPipeTrainer takes the data-parallel group (replicas,
    # sharded host optimizer) and logs what plain Trainer logs under DistributedDataParallel.
    import json

    logs = {}
    for which in ("trainer", "roundpipe"):
        run_ranks(tmp_path, which)
        logs[which] = json.loads((tmp_path / f"{which}.json").read_text())
    assert len(logs["trainer"]) == STEPS
    assert_logs_match(logs["roundpipe"], logs["trainer"])


@pytest.mark.slow
def test_torchrun_checkpoint_model_files_hold_the_steps_weights(tmp_path: Path) -> None:
    # With data parallelism each rank steps a piece of every weight: checkpoint-3, written while
    # step 3 is in flight, still holds the whole weights after step 3 (a 3-step run's).
    from safetensors.torch import load_file

    run_ranks(tmp_path, "checkpoint")
    ours = load_file(tmp_path / "saving" / "checkpoint-3" / "model.safetensors")
    after_three = load_file(tmp_path / "short_files" / "model.safetensors")
    assert ours.keys() == after_three.keys()
    assert not [key for key in after_three if not torch.equal(ours[key], after_three[key])]


def test_fp16_trains_an_fp16_model_with_fp32_copies_and_a_scaler(
    tmp_path: Path, reference: list[dict[str, float]]
) -> None:
    # fp16=True: the model in fp16, fp32 optimizer copies, roundpipe.GradScaler scaling the
    # loss; the logged losses follow fp32 Trainer's within fp16's rounding.
    model = tiny_qwen3()
    trainer = RoundPipeTrainer(
        model, arguments(tmp_path, fp16=True), train_dataset=dataset(), async_step=False
    )
    trainer.train()
    assert next(model.parameters()).dtype == torch.float16
    assert trainer.scaler is not None and trainer.scaler.get_scale() > 1.0
    copies = list(trainer.roundpipe_model.optim_parameters())
    assert copies and all(copy.dtype == torch.float32 for copy in copies)
    ours = step_logs(trainer)
    assert [entry["step"] for entry in ours] == [entry["step"] for entry in reference]
    for mine, ref in zip(ours, reference, strict=True):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=2e-3), (mine, ref)


@pytest.mark.slow
def test_weight_decay_reaches_a_model_without_preset(tmp_path: Path) -> None:
    # GPT-2 has no preset: wrapped as an AutoRoundPipe, whose optimizer copies are named after
    # the model it holds. Trainer's weight-decay groups must still find them.
    reference = Trainer(
        model=tiny_gpt2(), args=arguments(tmp_path / "ref"), train_dataset=dataset()
    )
    reference.train()
    trainer = RoundPipeTrainer(
        tiny_gpt2(), arguments(tmp_path / "ours"), train_dataset=dataset(), async_step=False
    )
    trainer.train()
    optimizer = trainer.optimizer.optimizer  # type: ignore[union-attr]
    decays = [group["weight_decay"] for group in optimizer.param_groups]
    assert decays == [0.1, 0.0]
    assert_logs_match(step_logs(trainer), step_logs(reference))


class ZLoss:
    """A subclass's own loss: cross-entropy from the logits plus a z-loss term."""

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        labels = inputs.pop("labels")
        logits = model(**inputs)["logits"].float()
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        loss = loss + 1e-2 * logits.logsumexp(-1).pow(2).mean()
        return (loss, logits) if return_outputs else loss


@pytest.mark.slow
def test_a_subclass_compute_loss_is_what_trains(tmp_path: Path) -> None:
    class PlainZ(ZLoss, Trainer):
        pass

    class OursZ(ZLoss, RoundPipeTrainer):
        pass

    reference = PlainZ(
        model=tiny_qwen3(), args=arguments(tmp_path / "ref"), train_dataset=dataset()
    )
    reference.train()
    trainer = OursZ(
        tiny_qwen3(),
        arguments(tmp_path / "ours"),
        train_dataset=dataset(),
        run_config=RoundPipeRunConfig(num_microbatch=2),
        async_step=False,
    )
    trainer.train()
    assert_logs_match(step_logs(trainer), step_logs(reference))


class ModelLoss:
    """A subclass's ``compute_loss`` that returns the model's own loss, as the Hugging Face
    docs write one."""

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        outputs = model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


class ModelLossOverItems:
    """The same, normalised over the accumulation window's target tokens."""

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> Any:
        outputs = model(**inputs, num_items_in_batch=num_items_in_batch)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


@pytest.mark.parametrize("logic", [ModelLoss, ModelLossOverItems], ids=lambda c: c.__name__)
@pytest.mark.parametrize("kind", ["qwen3", "gpt2"])
def test_a_subclass_returning_the_models_loss_matches_trainer(
    tmp_path: Path, logic: type, kind: str
) -> None:
    # The two microbatches of a batch hold unequal numbers of target tokens (dataset() masks a
    # random prefix of each row): the loss the subclass sees must be the whole batch's, as the
    # unwrapped model computes it in plain Trainer, not an average of the microbatches' own.
    plain_cls = type("Plain", (logic, Trainer), {})
    ours_cls = type("Ours", (logic, RoundPipeTrainer), {})
    make = MODELS[kind]
    reference = plain_cls(model=make(), args=arguments(tmp_path / "ref"), train_dataset=dataset())
    reference.train()
    trainer = ours_cls(
        make(),
        arguments(tmp_path / "ours"),
        train_dataset=dataset(),
        run_config=RoundPipeRunConfig(num_microbatch=2),
        async_step=False,
    )
    trainer.train()
    ours, theirs = step_logs(trainer), step_logs(reference)
    assert [entry["step"] for entry in ours] == [entry["step"] for entry in theirs]
    for mine, ref in zip(ours, theirs, strict=True):
        for key in ("loss", "grad_norm"):
            assert mine[key] == pytest.approx(ref[key], rel=2e-7), (key, mine, ref)


def test_several_gpus_are_one_device_pool(
    tmp_path: Path, reference: list[dict[str, float]]
) -> None:
    # Trainer would replicate the model over n_gpu GPUs (DataParallel), multiplying the batch
    # and dividing the token count; RoundPipe's pool is every GPU, so neither happens.
    args = arguments(tmp_path)
    assert args.n_gpu <= 1
    args._n_gpu = 2  # as on a machine with two GPUs, without torchrun
    trainer = RoundPipeTrainer(tiny_qwen3(), args, train_dataset=dataset(), async_step=False)
    assert trainer.args.n_gpu == 1 and trainer.args.train_batch_size == BATCH
    trainer.train()
    assert_logs_match(step_logs(trainer), reference)
