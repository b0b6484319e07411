"""``RoundPipeTrainer``: Hugging Face's ``transformers.Trainer``, training through RoundPipe.

The trainer keeps ``Trainer``'s loop (data, gradient accumulation, callbacks, logging,
evaluation, checkpoint folders, resuming) and replaces what touches the model and the optimizer:
the model is wrapped once (``wrap_model_to_roundpipe``) and stays in host memory, a training
batch is one ``forward_backward`` (microbatched by the ``RoundPipeRunConfig`` given), and the
optimizer step, gradient clipping, loss-scale update and learning-rate hyperparameters run on
RoundPipe's optimizer thread (asynchronous by default: staleness 1). Saved models are the files
``Trainer`` writes for the unwrapped model; checkpoints hold them and RoundPipe's own consistent
state (``save_checkpoint``). See ``docs/guide.md``, "Hugging Face Trainer".
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from roundpipe.checkpoints.checkpoint import load_checkpoint, save_checkpoint
from roundpipe.integrations.model_files import newest_weights, state_with, unwrapped
from roundpipe.integrations.queued_step import (
    Hyperparameters,
    PendingNorm,
    QueuedOptimizer,
    apply_hyperparameters,
)
from roundpipe.integrations.whole_batch_loss import whole_batch_losses
from roundpipe.models import AutoRoundPipe, wrap_model_to_roundpipe
from roundpipe.models.presets import find_preset
from roundpipe.optim.adam import Adam
from roundpipe.optim.grad_scaler import GradScaler
from roundpipe.roundpipe import RoundPipe
from roundpipe.run_config import RoundPipeRunConfig

# The folder (data-parallel) or file in each checkpoint-N/ with model, optimizer and scaler.
STATE_NAME = "roundpipe_state"


def _unsupported(args: TrainingArguments) -> list[str]:
    """The TrainingArguments set that RoundPipeTrainer does not honour, each with the fix."""
    found = []
    if getattr(args, "deepspeed", None):
        found.append("deepspeed (RoundPipe keeps the state in host memory itself: leave it unset)")
    if getattr(args, "fsdp", None):
        found.append("fsdp (use torchrun: RoundPipe shards the optimizer across ranks itself)")
    for flag in ("gradient_checkpointing", "activation_checkpointing"):
        if getattr(args, flag, False):
            found.append(f"{flag} (RoundPipe always recomputes activations: leave it off)")
    simple = {
        "torch_compile": "leave it off",
        "auto_find_batch_size": "set per_device_train_batch_size",
        "load_best_model_at_end": "checkpoints hold RoundPipe state, not model files",
        "fp16_full_eval": "evaluation runs in the training dtype",
        "bf16_full_eval": "evaluation runs in the training dtype",
        "use_liger_kernel": "leave it off",
    }
    found += [f"{flag} ({fix})" for flag, fix in simple.items() if getattr(args, flag, False)]
    if getattr(args, "label_smoothing_factor", 0.0):
        found.append("label_smoothing_factor (the model's own loss is used: set 0)")
    if getattr(args, "neftune_noise_alpha", None) is not None:
        found.append("neftune_noise_alpha (leave it unset)")
    optim = str(getattr(args.optim, "value", args.optim))
    steps_elsewhere = {
        "schedule_free": "its train/eval weight modes would not reach RoundPipe's optimizer copies",
        "lomo": "it updates the weights inside the backward pass",
        "adalomo": "it updates the weights inside the backward pass",
        "galore": "it is built from the model's modules, not from optimizer copies",
        "apollo": "it is built from the model's modules, not from optimizer copies",
    }
    for prefix, why in steps_elsewhere.items():
        if optim.startswith(prefix):
            found.append(f"optim={optim!r} ({why}: use an optimizer class such as adamw_torch)")
    scheduler = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    if scheduler in ("reduce_lr_on_plateau", "greedy"):
        found.append(f"lr_scheduler_type={scheduler!r} (use a step-based schedule)")
    return found


class RoundPipeTrainer(Trainer):
    """``transformers.Trainer`` that trains ``model`` through RoundPipe.

    Args:
        model: a Hugging Face causal LM (a preset family: Qwen3, Qwen3-MoE, Llama, GPT-OSS), a
            PEFT model around one (its adapters train, the base stays frozen), or any module
            ``wrap_model_to_roundpipe`` takes. Not a RoundPipe: the trainer wraps it once.
        args: ordinary ``TrainingArguments``. ``fp16=True`` trains an fp16 model with fp32
            optimizer copies and ``roundpipe.GradScaler``; ``bf16=True`` a bf16 model with fp32
            copies. Arguments RoundPipe does not honour (DeepSpeed, FSDP, gradient
            checkpointing, ...) raise ``ValueError`` naming them.
        run_config: the model's ``RoundPipeRunConfig`` (microbatches, plan, ...), for training
            and evaluation.
        async_step: ``True`` (default): each optimizer step runs while the next batch trains on
            the weights before it (staleness 1); ``False``: every batch sees the newest
            weights, as plain ``Trainer``.
        wrap_kwargs: more keyword arguments of ``wrap_model_to_roundpipe`` (``pin_model``,
            ``loss_chunk_size``, ``optim_dtype``, ...).
        **kwargs: the other ``Trainer`` arguments (datasets, collator, callbacks,
            ``optimizer_cls_and_kwargs``, ...). ``optimizers`` is refused: the optimizer must be
            built over the optimizer copies the trainer creates; pass
            ``optimizer_cls_and_kwargs`` or ``args.optim`` instead. So are ``model_init`` and
            ``compute_loss_func`` (a subclass's ``compute_loss`` is used, in training too).
    """

    roundpipe_model: RoundPipe | AutoRoundPipe
    scaler: GradScaler | None
    async_step: bool

    def __init__(
        self,
        model: nn.Module,
        args: TrainingArguments | None = None,
        *,
        run_config: RoundPipeRunConfig | None = None,
        async_step: bool = True,
        wrap_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if isinstance(model, (RoundPipe, AutoRoundPipe)) or not isinstance(model, nn.Module):
            raise TypeError(
                "model must be the unwrapped nn.Module (a Hugging Face model): RoundPipeTrainer "
                f"wraps it itself, got {type(model).__name__}"
            )
        if not isinstance(async_step, bool):
            raise TypeError(f"async_step must be a bool, got {type(async_step).__name__}")
        if run_config is not None and not isinstance(run_config, RoundPipeRunConfig):
            raise TypeError(
                f"run_config must be a RoundPipeRunConfig or None, got {type(run_config).__name__}"
            )
        if wrap_kwargs is not None and not isinstance(wrap_kwargs, dict):
            raise TypeError(f"wrap_kwargs must be a dict, got {type(wrap_kwargs).__name__}")
        refused = {
            "optimizers": "pass optimizer_cls_and_kwargs (or args.optim): the trainer builds the "
            "optimizer over the RoundPipe's optimizer copies",
            "model_init": "pass the model itself",
            "compute_loss_func": "use the model's own loss",
        }
        for key, fix in refused.items():
            value = kwargs.get(key)
            if value is not None and value != (None, None):
                raise ValueError(f"RoundPipeTrainer does not take {key}: {fix}")
        super().__init__(model=model, args=args, **kwargs)
        unsupported = _unsupported(self.args)
        if unsupported:
            raise ValueError(
                "RoundPipeTrainer does not support these TrainingArguments: "
                + "; ".join(unsupported)
            )
        if self.args.n_gpu > 1:
            # RoundPipe uses every GPU as its device pool: no DataParallel replicas, so the batch
            # is per_device_train_batch_size and the token count is not split across GPUs (as
            # Trainer does for a model-parallel model).
            self.args._n_gpu = 1
            self._train_batch_size = self.args.train_batch_size
        self.async_step = async_step
        self.scaler = GradScaler() if self.args.fp16 else None
        options = dict(wrap_kwargs or {})
        if self.args.fp16 or self.args.bf16:
            model.to(torch.float16 if self.args.fp16 else torch.bfloat16)
            options.setdefault("optim_dtype", torch.float32)
        if self.args.world_size > 1:
            import torch.distributed as dist

            options.setdefault("data_parallel_group", dist.group.WORLD)
        self.roundpipe_model = wrap_model_to_roundpipe(
            model, model_run_config=run_config, **options
        )
        self._sums_losses = isinstance(self.roundpipe_model, RoundPipe) and (
            find_preset(model) is not None
        )
        self._next_norm: PendingNorm | None = None

    # -- the model stays in host memory, wrapped once ----------------------------------------

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """Nothing: RoundPipe keeps the model in host memory and uploads stages itself."""

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> Any:
        return self.roundpipe_model

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; afterwards the model holds the newest weights (the last step
        waited for and written back)."""
        output = super().train(*args, **kwargs)
        self.roundpipe_model.synchronize()
        return output

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """``Trainer.evaluate`` on the newest weights: waits for the step in flight and writes
        it back, so the next training batch also sees them (as ``async_step=False`` would)."""
        self.roundpipe_model.synchronize()
        metrics: dict[str, float] = super().evaluate(*args, **kwargs)
        return metrics

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.predict`` on the newest weights (see :meth:`evaluate`)."""
        self.roundpipe_model.synchronize()
        return super().predict(*args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the model as ``Trainer`` does (``save_pretrained``: the unwrapped model's names
        and tied weights, safetensors), with the newest weights.

        Outside training the step in flight is written back first. A checkpoint's model files
        (``_internal_call`` during training) are written without that, since writing the step
        back here would change the training: they take its weights from the optimizer copies
        (:func:`roundpipe.integrations.model_files.newest_weights`)."""
        if _internal_call and self.is_in_train:
            # Every rank writes its part of the checkpoint's roundpipe_state into the folder.
            os.makedirs(output_dir or str(self.args.output_dir), exist_ok=True)
        else:
            self.roundpipe_model.synchronize()
        super().save_model(output_dir, _internal_call)

    def _save(
        self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None
    ) -> None:
        """``Trainer._save`` on the model as it was before RoundPipe converted parts of it."""
        newest = None
        if state_dict is None and self.is_in_train and self.async_step:
            # The parameters are one step behind the optimizer copies; with data parallelism
            # every rank takes part in assembling the copies.
            newest = newest_weights(self.roundpipe_model)
        model = self.model
        assert isinstance(model, nn.Module)  # the trainer's model from its constructor on
        with unwrapped(model):
            if newest is not None and self.args.should_save:
                state_dict = state_with(model, newest)
            super()._save(output_dir, state_dict)

    # -- optimizer and schedule --------------------------------------------------------------

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The optimizer ``args.optim`` (or ``optimizer_cls_and_kwargs``) names, over the
        RoundPipe's optimizer copies with ``Trainer``'s weight-decay groups; AdamW and Adam
        become ``roundpipe.optim.Adam``. ``self.optimizer`` is a :class:`QueuedOptimizer` in
        front of it (the real one is ``self.optimizer.optimizer``)."""
        if self.optimizer is not None:
            return self.optimizer
        wrapped = self.roundpipe_model
        # Decay is decided by name, on the module whose parameter names the optimizer copies
        # carry: a RoundPipe's copies are named as its own parameters ("model.<name>"), an
        # AutoRoundPipe's as the model it holds (its parts' paths, then "model.<name>").
        named_module = wrapped.model if isinstance(wrapped, AutoRoundPipe) else wrapped
        decay = set(self.get_decay_parameter_names(named_module))
        named = list(wrapped.optim_named_parameters())
        known = {name for name, _ in named_module.named_parameters()}
        unknown = [name for name, _ in named if name not in known]
        if unknown:
            raise RuntimeError(
                f"optimizer copies {unknown[:3]} have no parameter of that name in the model: "
                "cannot tell which take weight decay"
            )
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        groups = [group for group in groups if group["params"]] or groups[:1]
        if self.optimizer_cls_and_kwargs is not None:
            cls, options = self.optimizer_cls_and_kwargs
        else:
            cls, options = self.get_optimizer_cls_and_kwargs(self.args)
        options = dict(options)
        if cls in (torch.optim.AdamW, torch.optim.Adam):
            for key in ("fused", "foreach"):
                options.pop(key, None)
            if cls is torch.optim.AdamW:
                options["decoupled_weight_decay"] = True
            cls = Adam
        inner = cls(groups, **options)
        self.optimizer = QueuedOptimizer(inner, self._submit_step, self._wait_for_step)
        return self.optimizer

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None
    ) -> tuple[Any, Any]:
        if self._created_lr_scheduler:
            self.lr_scheduler = None
            self._created_lr_scheduler = False
        self.create_optimizer()
        self.create_scheduler(num_training_steps=max_steps)
        self.model_wrapped = self.roundpipe_model
        if resume_from_checkpoint is not None:
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self.roundpipe_model, train_dataloader

    def _queued(self) -> QueuedOptimizer:
        if not isinstance(self.optimizer, QueuedOptimizer):
            raise TypeError(
                "RoundPipeTrainer's optimizer was replaced; build it through create_optimizer()"
            )
        return self.optimizer

    def _pending_norm(self) -> PendingNorm:
        if self._next_norm is None:
            self._next_norm = PendingNorm(self.roundpipe_model.synchronize)
        return self._next_norm

    def _clip_grad_norm(self, model: nn.Module) -> PendingNorm:
        """The norm of the step about to be queued: the clipping runs in that step."""
        return self._pending_norm()

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> PendingNorm:
        return grad_norm if isinstance(grad_norm, PendingNorm) else self._pending_norm()

    def _submit_step(self, hyperparameters: Hyperparameters) -> None:
        """Queue one optimizer step: hyperparameters, unscale, clip, step, scale update."""
        model = self.roundpipe_model
        optimizer = self._queued().optimizer
        scaler = self.scaler
        max_norm = self.args.max_grad_norm if self.args.max_grad_norm > 0 else float("inf")
        norm = self._pending_norm()
        self._next_norm = None

        def step_fn() -> None:
            try:
                apply_hyperparameters(optimizer, hyperparameters)
                if scaler is not None:
                    scaler.unscale_(optimizer)
                if isinstance(model, RoundPipe):
                    total = model.clip_grad_norm_(max_norm)
                else:
                    total = torch.nn.utils.clip_grad_norm_(model.optim_parameters(), max_norm)
                norm.set(float(total))
                if scaler is not None:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad()
            finally:
                norm.done()

        model.step(step_fn, self.async_step)

    def _wait_for_step(self) -> None:
        model = self.roundpipe_model
        if isinstance(model, RoundPipe):
            model.wait_for_step()
        else:
            model.synchronize()

    def _maybe_log_save_evaluate(
        self, tr_loss: torch.Tensor, grad_norm: Any, *args: Any, **kwargs: Any
    ) -> None:
        if isinstance(grad_norm, PendingNorm):  # waiting for the step only when it is logged
            grad_norm = grad_norm.result() if self.control.should_log else None
        super()._maybe_log_save_evaluate(tr_loss, grad_norm, *args, **kwargs)

    # -- a training batch --------------------------------------------------------------------

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Forward, loss and backward of one batch through the pipeline; returns the loss
        ``Trainer`` reports for it (the batch's share of the accumulation window's loss). A
        subclass that overrides ``compute_loss`` gets it called here (see
        :meth:`_custom_loss_step`)."""
        wrapped = self.roundpipe_model
        wrapped.train()
        inputs = dict(inputs)
        scaler = self.scaler
        if type(self).compute_loss is not Trainer.compute_loss:
            return self._custom_loss_step(inputs, num_items_in_batch)
        exact = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        if exact:
            inputs["num_items_in_batch"] = num_items_in_batch
        factor = 1.0
        if exact and self.args.average_tokens_across_devices and self.args.world_size > 1:
            factor = float(self.args.world_size)  # num_items counts every rank's tokens
        if not exact:
            factor = 1.0 / self.current_gradient_accumulation_steps
        if isinstance(wrapped, RoundPipe) and exact:
            # Every microbatch's loss is its share of num_items: they add up to the batch's.
            reported: list[torch.Tensor] = []

            def loss_fn(output: Any, _: Any) -> torch.Tensor:
                loss: torch.Tensor = output["loss"] * factor
                reported.append(loss.detach())
                return scaler.scale(loss) if scaler is not None else loss

            wrapped.forward_backward(input_kwargs=inputs, loss_fn=loss_fn)
            total = torch.stack([loss.float().cpu() for loss in reported]).sum()
        else:
            # forward() + backward(), with the whole batch's loss as compute_loss would see it.
            with self.compute_loss_context_manager():
                outputs = wrapped(**inputs)
            loss = (outputs["loss"] if isinstance(outputs, dict) else outputs[0]) * factor
            (scaler.scale(loss) if scaler is not None else loss).backward()
            total = loss.detach().float().cpu()
        return total.to(self.args.device)

    def _custom_loss_step(
        self, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None
    ) -> torch.Tensor:
        """A batch through a subclass's ``compute_loss`` (given the RoundPipe model): its loss,
        scaled for gradient accumulation as ``Trainer.training_step`` scales it, goes through
        ``.backward()`` (the pipelined backward of the ``forward()`` it called)."""
        with self.compute_loss_context_manager():
            loss = self.compute_loss(
                self.roundpipe_model, inputs, num_items_in_batch=num_items_in_batch
            )
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"{type(self).__name__}.compute_loss returned a {type(loss).__name__}; with "
                "return_outputs=False it must return the loss tensor"
            )
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        return loss.detach().float().cpu().to(self.args.device)

    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        """``Trainer``'s, in which (around every ``compute_loss``, the trainer's or a
        subclass's, in training and evaluation) a preset's call with ``labels`` returns the
        whole batch's loss, as the unwrapped model would: token-weighted over the
        microbatches, ``num_items_in_batch`` respected (see
        :func:`roundpipe.integrations.whole_batch_loss.whole_batch_losses`)."""
        stack = super().compute_loss_context_manager()
        wrapped = self.roundpipe_model
        if self._sums_losses and isinstance(wrapped, RoundPipe):
            stack.enter_context(whole_batch_losses(wrapped))
        return stack

    # -- checkpoints: one RoundPipe state per checkpoint-N/ ----------------------------------

    def _state_path(self, folder: str) -> str:
        return os.path.join(folder, STATE_NAME)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Model, optimizer copies and state, scaler, pending write-back (``save_checkpoint``,
        on every rank) with the scheduler's state and the next step's hyperparameters."""
        queued = self._queued()
        extra = {
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None,
            "hyperparameters": queued.hyperparameters(),
        }
        save_checkpoint(
            self._state_path(output_dir),
            self.roundpipe_model,
            queued.optimizer,
            self.scaler,
            extra=extra,
        )

    def _save_scaler(self, output_dir: str) -> None:
        """Nothing: the scaler is in the RoundPipe state."""

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Nothing: the model is loaded with the optimizer (``_load_optimizer_and_scheduler``)."""

    def _load_scaler(self, checkpoint: str | None) -> None:
        """Nothing: the scaler is in the RoundPipe state."""

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = self._state_path(checkpoint)
        if not os.path.exists(path):
            raise ValueError(
                f"{checkpoint} has no {STATE_NAME}: RoundPipeTrainer resumes from checkpoints "
                "it saved itself (a plain Trainer checkpoint's model loads with "
                "from_pretrained before building the trainer)"
            )
        queued = self._queued()
        extra = load_checkpoint(path, self.roundpipe_model, queued.optimizer, self.scaler)
        queued.set_hyperparameters(extra["hyperparameters"])
        if self.lr_scheduler is not None and extra["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])


__all__ = ["STATE_NAME", "RoundPipeTrainer"]
