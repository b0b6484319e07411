"""A RoundPipe's own state-dict entries (``_roundpipe.<key>``): what its runtime holds beside the
model's parameters and buffers, saved so that a resumed run continues bit for bit.

- ``optim.<name>``: the optimizer copies (with data parallelism this rank's pieces);
- ``grads``: gradients accumulated but not yet stepped (the whole gradient arena);
- ``pending_writeback`` (a bool tensor, True, present only then): the copies are one step ahead
  of the parameters (an asynchronous step was in flight), so the next ``step()`` writes them back
  where the saving run did.

A load first *stages* the entries (:meth:`ModelState.stage`: checked against the model, nothing
changed) and *applies* them once the parameters are loaded (:meth:`ModelState.apply`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from roundpipe.gradients import GradientState
from roundpipe.memory import ModelMemory
from roundpipe.optim.step import StepPipeline
from roundpipe.state_dict import RuntimeState

Named = list[tuple[str, nn.Parameter]]


class ModelState:
    """The own entries of one RoundPipe: read from, and loaded into, its memory, gradient state
    and step pipeline."""

    def __init__(self, memory: ModelMemory, gradients: GradientState, steps: StepPipeline) -> None:
        self.memory, self.gradients, self.steps = memory, gradients, steps
        # Entries read by load_state_dict, applied once the parameters are loaded.
        self.staged: dict[str, torch.Tensor] = {}

    def entries(self, optimizer_copies: Iterable[tuple[str, nn.Parameter]]) -> dict[str, Any]:
        """The entries to save, keyed without the prefix, from the named optimizer copies."""
        entries: dict[str, Any] = {}
        if self.steps.has_copies():
            for name, copy in optimizer_copies:
                entries[f"optim.{name}"] = copy.detach().clone()
            if self.steps.write_back_pending():
                entries["pending_writeback"] = torch.tensor(True)
        if self.gradients.dirty:
            entries["grads"] = self._typed_grads().clone()
        return entries

    def _typed_grads(self) -> torch.Tensor:
        """The gradient arena typed as its gradients where they share one dtype (else its
        bytes): a checkpoint's pending gradients then load by value into a model of another
        float dtype of that size (bf16 into fp16), as torch casts parameters, not as bytes."""
        memory = self.memory
        dtypes = {dtype for _, _, dtype in memory.grad_runs(range(len(memory.layers)))}
        return memory.grads.view(dtypes.pop()) if len(dtypes) == 1 else memory.grads

    def stage(
        self, trainable: Named, entries: dict[str, Any], prefix: str, error_msgs: list[str]
    ) -> None:
        """Check and stage the checkpoint's entries (``trainable``: the model's named trained
        parameters), noting what is wrong in ``error_msgs`` and removing the keys taken from
        ``entries``. An optimizer copy's entry is shaped as the copy: the parameter, or with data
        parallelism this rank's piece of it (a meta tensor stands for its shape and dtype); a
        whole copy (a checkpoint of one process) gives a data-parallel rank its piece."""
        steps = self.steps
        known: dict[str, torch.Tensor | None] = {}
        whole: dict[str, nn.Parameter] = {}
        for name, trained in trainable:
            shape = steps.copy_shape(trained)
            key = f"optim.model.{name}"
            known[key] = None if shape is None else trained.new_empty(shape, device="meta")
            whole[key] = trained
        saved_grads = entries.get("grads")
        raw = isinstance(saved_grads, torch.Tensor) and saved_grads.dtype == torch.uint8
        known["grads"] = self.memory.grads if raw else self._typed_grads()  # bytes: older files
        known["pending_writeback"] = torch.tensor(True)
        self.staged = {}
        check = RuntimeState._check_entry
        for key in [key for key in entries if key in known]:
            value, param, like = entries.pop(key), whole.get(key), known[key]
            if param is not None and isinstance(value, torch.Tensor) and value.shape == param.shape:
                check(f"{prefix}{key}", value, param, error_msgs)
                if like is not None:
                    self.staged[key] = steps.piece_of(param, value)
            elif like is None:
                error_msgs.append(f'"{prefix}{key}": this rank holds no piece of that parameter')
            else:
                check(f"{prefix}{key}", value, like, error_msgs)
                self.staged[key] = value

    def apply(self, trainable: Named) -> None:
        """After the parameters were loaded: the staged gradients, the optimizer copies (from
        their entries, else from the loaded parameters: existing copies only, unless the
        checkpoint has some), then the checkpoint's pending write-back."""
        staged, self.staged = self.staged, {}
        grads = staged.pop("grads", None)
        if grads is not None:
            with torch.no_grad():
                arena = self.memory.grads if grads.dtype == torch.uint8 else self._typed_grads()
                arena.copy_(grads)
            self.gradients.reach_all()
        pending = staged.pop("pending_writeback", None)
        saved_copies = {key.removeprefix("optim."): value for key, value in staged.items()}
        steps = self.steps
        if saved_copies or steps.has_copies():
            copies = steps.copies()
            with torch.no_grad():
                for name, param in trainable:
                    if id(param) in copies:
                        saved = saved_copies.get(f"model.{name}")  # shaped as the copy
                        value = saved if saved is not None else steps.piece_of(param, param)
                        copies[id(param)].copy_(value)
            steps.note_agreement()
        if pending is not None and bool(pending):
            steps.restore_pending_step()


__all__ = ["ModelState"]
