"""The step pipeline: optimizer copies, gradient hand-over and asynchronous optimizer steps.

``RoundPipe.step(step_fn)`` hands the iteration's gradients to the process's optimizer thread and
swaps in a second gradient arena, so the next iteration accumulates while the optimizer works.
On that thread every optimizer copy receives its gradient (a pending gradient, see
``roundpipe.optim.copies``: cast into ``.grad`` only if something reads it) and ``step_fn``
runs with ``OptimizerCtx`` active. When the next ``step()`` (or ``synchronize()``) begins, after
the iteration in between has used the previous weights (bounded staleness 1), the new weights are
queued into the parameter arena layer by layer on the native weight writer; a stage upload waits
only for its own layers' writes (per-layer fences), and the next optimizer job waits for the
whole write-back before it changes the optimizer copies. ``is_async=False`` waits for both.

Fused path: when ``step_fn`` steps ``roundpipe.optim.Adam`` (directly or through
``roundpipe.GradScaler``) on fp32 copies of bf16/fp16 parameters, one native pass reads the
gradients straight from the arena, unscales them and updates weights and moments; a synchronous
step also writes the new low-precision weights straight into the parameter arena in that pass
(``roundpipe.optim.fused_writeback``). An asynchronous one cannot (the iteration in flight still
reads the parameters) and has the write-back cast them from the copies: a staging arena for them
would cost 2 bytes per parameter of host memory for the same traffic (the pass would write them
and the writer read them, instead of the writer reading the 4-byte copies). With offloaded copies
(``optim_offload``) the copies are on disk, and the pass writes the new weights over the
gradients it has read in the handed-over arena instead, which is cleared once the write-back has
read them. GradScaler's inf/NaN
check is a read-only pass before it, since a step with a non-finite gradient must not change
anything. The handed-over gradient arena is cleared by dropping its pages
(:func:`roundpipe.memory.clear_arena`), so between steps it costs no memory.

Data parallel (``roundpipe.distributed``): the optimizer copies are the own shard's pieces; the
job first averages the handed-over arena across the ranks, and after ``step_fn`` stages the
pieces' new weights and all-gathers them, so the write-back copies every parameter from that
staging arena as on one process.

An exception in ``step_fn`` is re-raised at the next ``step``, ``synchronize`` or forward call
(same type, the original as ``__cause__``, the message naming the model and phase), and the
failed step's weights are not written back. (A synchronous step's fused pass writes them in
place as it updates the copies, so a failure after that pass leaves them matching the copies.)
Other asynchronous jobs (``GradScaler.update`` queued from the main thread) report their errors
the same way (:func:`roundpipe.optim.step_thread.submit_detached`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection
from typing import Any

import torch

from roundpipe._native import _C
from roundpipe.context import OptimizerCtx, locate_error
from roundpipe.distributed import DataParallel
from roundpipe.lifecycle import interrupts_deferred
from roundpipe.memory import ModelMemory, clear_arena
from roundpipe.optim import step_thread
from roundpipe.optim.adam import fused_writeback
from roundpipe.optim.copies import OptimizerCopy
from roundpipe.optim.offload import OffloadStore
from roundpipe.optim.step_thread import raise_detached_errors, submit, wait_for_job
from roundpipe.timeline.tracing import active_tracer
from roundpipe.torch_internals import version_of

_NATIVE_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _hand_over(pairs: list[tuple[OptimizerCopy, torch.Tensor]]) -> None:
    """Give each optimizer copy its gradient: as a pending gradient (no copy made) when it has
    none, else added to its ``.grad`` now: fp32 in one native multi-threaded pass over all of
    them, other dtypes through torch."""
    dsts, srcs = [], []
    with torch.no_grad():
        for copy, grad in pairs:
            current = copy.grad
            if current is None:
                copy.hand_over_grad(grad)
            elif current.dtype == torch.float32 and grad.dtype in _NATIVE_GRAD_DTYPES:
                dsts.append(current)
                srcs.append(grad)
            else:
                current.add_(grad)
    if dsts:
        _C.grad_accumulate(dsts, srcs, False)


def _without_frozen(
    pairs: list[tuple[OptimizerCopy, torch.Tensor]], frozen: set[OptimizerCopy]
) -> list[tuple[OptimizerCopy, torch.Tensor]]:
    """The pairs to hand over: a parameter frozen after wrapping gets no gradient (``.grad``
    stays ``None``, so optimizers skip it, as they skip a frozen parameter in plain PyTorch after
    ``zero_grad()``) unless it had gradients accumulated before it was frozen."""
    if not frozen:
        return pairs
    return [(copy, grad) for copy, grad in pairs if copy not in frozen or bool(grad.any())]


class StepPipeline:
    """Optimizer copies and in-flight optimizer work of one model."""

    def __init__(
        self,
        memory: ModelMemory,
        optim_dtype: torch.dtype | None,
        name: str = "model",
        data_parallel: DataParallel | None = None,
        offload: OffloadStore | None = None,
    ) -> None:
        self.memory, self.name = memory, name
        # The files of the optimizer copies kept on disk (optim_offload), or None.
        self.offload = offload
        # Asynchronous steps on offloaded copies: the handed-over gradient arena, where the
        # step's fused pass wrote the new low-precision weights over the gradients it read, so
        # that the write-back reads them from memory instead of the copies on disk (cleared
        # before it takes gradients again: _release_staged).
        self._fused_into: torch.Tensor | None = None
        # With data parallelism: the own shard's layout and the collectives of every step.
        self.data_parallel = data_parallel
        # How step_fn's errors name the step.
        self.where = f"RoundPipe model {name!r}: optimizer step"
        self.optim_dtype = optim_dtype
        self._copies: dict[int, OptimizerCopy] | None = None
        self._spare_grads: torch.Tensor | None = None
        self._job: Any = None  # the optimizer thread's event of the last step
        self._job_iteration: float = -1  # and the iteration it steps
        self._written: Any = None  # event of the last write-back into the parameter arena
        self.submitted = 0  # steps queued so far (see _Runtime.weights_version)
        # The optimizer copies whose low-precision weights roundpipe.optim.Adam wrote straight
        # into the parameter arena in the last successful (synchronous) step's update pass.
        self._fused: set[torch.Tensor] = set()
        # Each trainable parameter's version counter when it and its copy last agreed. Steps
        # write the parameters through aliases that leave it alone, so a change means the user
        # changed the parameter (copy_, fill_, a load of the wrapped model): see take_edits.
        self._agreed: dict[int, int] = {}
        # The trained parameters' slots (fixed once the model is wrapped; aliases excluded).
        self._trained = [slot for slot in memory.slots() if slot.grad_offset is not None]
        self.trained_ids = frozenset(id(slot.param) for slot in self._trained)

    def copies(self) -> dict[int, OptimizerCopy]:
        """Optimizer copies keyed by ``id`` of the model parameter, created on first use."""
        if self._copies is None:
            if self.offload is not None:
                self._copies = self.offload.masters(
                    {id(p): self.piece_of(p, p.detach()) for p in self._stepped_params()}
                )
            else:
                self._copies = {
                    id(param): OptimizerCopy(
                        self.piece_of(param, param.detach()).to(
                            self.optim_dtype or param.dtype, copy=True
                        )
                    )
                    for param in self._stepped_params()
                }
            self.note_agreement()
        return self._copies

    def note_agreement(self) -> None:
        """The parameters and their copies agree now (copies made or loaded)."""
        self._agreed = {id(slot.param): version_of(slot.param) for slot in self._trained}

    def take_edits(self) -> set[int]:
        """Parameters changed in place since they and their copies last agreed (no step in
        flight): their copies take the new values, as plain PyTorch's optimizer would step the
        parameter as edited, and no write-back may undo the edit. Returns their ids."""
        if self._copies is None:
            return set()
        edited: set[int] = set()
        with torch.no_grad():
            for slot in self._trained:
                param = slot.param
                if version_of(param) == self._agreed.get(id(param)):
                    continue
                copy = self._copies.get(id(param))  # data parallel: own pieces only
                if copy is not None:
                    copy.copy_(self.piece_of(param, param.detach()))
                self._agreed[id(param)] = version_of(param)
                edited.add(id(param))
        return edited

    def _stepped_params(self) -> list[torch.Tensor]:
        """The parameters this process has optimizer copies of: with data parallelism those
        overlapping the own shard, else every trainable one."""
        dp = self.data_parallel
        if dp is not None:
            return [piece.slot.param for piece in dp.slices]
        return [slot.param for slot in self.memory.slots() if slot.param.requires_grad]

    def piece_of(self, param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """The part of ``value`` (shaped as ``param``) that ``param``'s optimizer copy holds:
        all of it, or with data parallelism the own shard's elements (1-D)."""
        start, stop = self.elements_of(param)
        return value if self.data_parallel is None else value.reshape(-1)[start:stop]

    def copy_shape(self, param: torch.Tensor) -> torch.Size | None:
        """The shape of ``param``'s optimizer copy on this rank (None: it has none here)."""
        dp = self.data_parallel
        if dp is None:
            return param.shape
        piece = dp.piece_by_param.get(id(param))
        return None if piece is None else torch.Size([piece.stop - piece.start])

    def elements_of(self, param: torch.Tensor) -> tuple[int, int]:
        """``[start, stop)`` of the flattened ``param`` that its optimizer copy holds."""
        dp = self.data_parallel
        piece = None if dp is None else dp.piece_by_param.get(id(param))
        return (0, param.numel()) if piece is None else (piece.start, piece.stop)

    def has_copies(self) -> bool:
        return self._copies is not None

    def step(
        self,
        step_fn: Callable[..., Any],
        is_async: bool,
        args: Any,
        kwargs: Any,
        reached: Collection[int] | None = None,
    ) -> None:
        """Queue one optimizer step over the gradients accumulated so far (already complete).
        Only the copies of the parameters in ``reached`` (``id``s; None: all of them) get a
        gradient: the others have none since the last step or ``zero_grad()`` (no backward
        reached them), as plain PyTorch's parameters have none then, and optimizers skip them.
        With data parallelism every copy gets the gradient averaged over the ranks."""
        if self.data_parallel is not None:
            self.data_parallel.agree("step")  # before anything changes: a ValueError leaves all
        self.finish()
        # From the hand-over to the job queued, nothing waits, and a Ctrl-C half-way would lose
        # the gradients (or the step): held until the job is queued.
        with interrupts_deferred():
            self._submit(step_fn, is_async, args, kwargs, reached)
        if not is_async:
            self.finish()
            self.memory.wait_writes()

    def _submit(
        self,
        step_fn: Callable[..., Any],
        is_async: bool,
        args: Any,
        kwargs: Any,
        reached: Collection[int] | None,
    ) -> None:
        """The hand-over of the gradients to the optimizer thread and the step's job (see
        :meth:`step`)."""
        copies = self.copies()
        self.take_edits()  # after a synchronous step or none: finish() had nothing to write back
        handed_over = self.memory.grads
        if self._spare_grads is None:
            self._spare_grads = self.memory.new_grad_arena()
        self._release_staged()
        self.memory.grads, self._spare_grads = self._spare_grads, handed_over
        slots = self._trained
        iteration = step_thread.next_iteration()
        self.submitted += 1
        self._job_iteration = iteration

        written = self._written
        dp = self.data_parallel
        if dp is not None:
            dp.note_step()
        # Synchronous: nothing reads the parameter arena until this step is done (calls wait for
        # their uploads before they return), so Adam may write the new weights right there.
        # Asynchronous: the iteration in flight still reads it, and the write-back casts them from
        # the copies. With data parallelism the fused pass writes into the staging shard.
        # Offloaded copies: the new weights replace the gradients they come from, chunk by chunk.
        staging = handed_over if is_async and dp is None and self.offload is not None else None
        targets = (
            {}
            if is_async and dp is None and staging is None
            else self._fused_targets(copies, slots, staging)
        )
        # Copies of parameters frozen now (requires_grad_(False) after wrapping).
        frozen = {
            copies[id(slot.param)]
            for slot in slots
            if not slot.param.requires_grad and id(slot.param) in copies
        }

        def run_step() -> None:
            if written is not None:  # the previous step's weights must be read out first
                written.synchronize()
            if dp is None:
                pairs = [
                    (copies[id(slot.param)], self.memory.grad_view(slot, handed_over))
                    for slot in slots
                    if reached is None or id(slot.param) in reached
                ]
            else:
                pairs = self._reduce_gradients(dp, copies, handed_over)
            _hand_over(_without_frozen(pairs, frozen))
            staged = False
            try:
                with OptimizerCtx(), self._agreeing(), fused_writeback(targets) as in_place:
                    step_fn(*args, **kwargs)
                # What step_fn changed after the fused pass wrote it (a clamp, a projection) is
                # written back like the rest.
                fused = {copy for copy, version in in_place.items() if version_of(copy) == version}
                self._fused, self._fused_into = fused, staging
                staged = staging is not None
            except Exception as error:
                raise locate_error(error, f"{self.where} (step_fn)") from error
            finally:
                # Pending gradients that step_fn neither consumed nor dropped become real ones
                # before their arena is reused.
                for copy, _ in pairs:
                    copy.resolve_grad()
                if not staged:
                    clear_arena(handed_over)
            if dp is not None:
                self._gather_weights(dp, copies, fused)

        tracer = active_tracer()

        def job() -> None:
            start = tracer.mark() if tracer is not None else None
            try:
                with step_thread.running_job(iteration, self.trained_ids):
                    run_step()
            finally:
                if tracer is not None:
                    tracer.record(
                        "optimizer_step",
                        model=self.name,
                        device=None,
                        lane="optimizer",
                        start=start,
                        end=tracer.mark(),
                    )

        self._job = submit(job)

    def _agreeing(self) -> Any:
        """The context in which GradScaler's verdicts agree over the data-parallel ranks."""
        dp = self.data_parallel
        return dp.active() if dp is not None else contextlib.nullcontext()

    def _reduce_gradients(
        self, dp: DataParallel, copies: dict[int, OptimizerCopy], handed_over: torch.Tensor
    ) -> list[tuple[OptimizerCopy, torch.Tensor]]:
        """Average the handed-over gradients over the ranks; the own pieces' copies and their
        averaged gradients."""
        try:
            dp.reduce_gradients(handed_over)
        except Exception as error:
            handed_over.zero_()
            raise locate_error(error, f"{self.where} (data-parallel gradient reduce)") from error
        return [(copies[id(piece.slot.param)], dp.grad_of(piece)) for piece in dp.slices]

    def _gather_weights(
        self, dp: DataParallel, copies: dict[int, OptimizerCopy], fused: set[torch.Tensor]
    ) -> None:
        """Stage the own pieces' new weights that the fused pass did not write (cast to the
        parameters' dtypes) and all-gather every rank's."""
        try:
            with torch.no_grad():
                for piece in dp.slices:
                    copy = copies[id(piece.slot.param)]
                    if copy not in fused:
                        dp.target_of(piece).copy_(copy.detach())
            dp.gather_weights()
        except Exception as error:
            raise locate_error(error, f"{self.where} (weight all-gather)") from error

    def clip_grad_norm_(self, max_norm: float, norm_type: float) -> torch.Tensor:
        """Scale the optimizer copies' gradients so that their norm over the whole model (every
        rank's pieces) is at most ``max_norm``; returns that norm before clipping."""
        copies = list(self.copies().values())
        dp = self.data_parallel
        if dp is None:
            return torch.nn.utils.clip_grad_norm_(copies, max_norm, norm_type)
        grads = [g for g in (copy.grad for copy in copies) if g is not None]
        with torch.no_grad():
            total = dp.grad_norm(grads, norm_type)
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for grad in grads:
                grad.mul_(coef.to(grad.dtype))
        return total

    def finish(self) -> None:
        """Wait for the last step, re-raise its error, and queue its weights' write-back."""
        job = self._job
        if job is not None:
            tracer = active_tracer()
            start = tracer.mark() if tracer is not None else None
            try:
                # A failed step raises here; its weights are not written back.
                interrupt = wait_for_job(job)
            except BaseException as error:
                if isinstance(error, KeyboardInterrupt) and not job.query():
                    raise  # the step is still running: the next finish() waits for it again
                # Nothing the error's traceback keeps may hold its event (see wait_for_job).
                self._job = job = None
                step_thread.settle(self._job_iteration)
                raise
            # A Ctrl-C half-way would leave some layers without the step's weights, the step
            # counted as done: held until the write-back is queued.
            with interrupts_deferred():
                self._job = None
                step_thread.settle(self._job_iteration)
                self._written = self._write_back(skip=self.take_edits())
            if interrupt is not None:
                raise interrupt  # Ctrl-C came as the step ended: its write-back is queued
            if tracer is not None:
                tracer.record(
                    "wait",
                    model=self.name,
                    device=None,
                    lane="main",
                    start=start,
                    end=tracer.mark(),
                )
                if self._written is not None:
                    tracer.record_transfer(
                        "writeback", model=self.name, device=None, lane="writer", done=self._written
                    )
        raise_detached_errors(wait=True)

    def wait_step(self) -> None:
        """Wait for the step in flight without queuing its write-back or settling it: the
        optimizer copies (and the optimizer's state) are then after that step, the parameters
        still before it, and its write-back stays pending for the next ``step()``. A failed
        step's error is raised here and again by the next ``step()`` or ``synchronize()``."""
        if self._job is not None:
            self._job.synchronize()

    def write_back_pending(self) -> bool:
        """Whether the last step's new weights are still to be written into the parameters
        (queued by the next ``step()``, ``synchronize()`` or ``drain()``)."""
        return self._job is not None

    def restore_pending_step(self) -> None:
        """After loading a checkpoint saved with a step in flight: the optimizer copies hold
        that step's result, the parameters the weights before it. As in the saving run, the next
        ``step()`` (or ``synchronize()``) writes the copies back. They are cast on the way, which
        gives the bits an asynchronous step writes back (its copies, cast the same way). With
        data parallelism every rank loads together, and each stages and all-gathers its pieces
        as the saved step did (on the optimizer thread, in the order of the collectives)."""
        dp = self.data_parallel
        if dp is None:
            self._job = submit(lambda: None)  # a finished step, standing for the saved one
        else:
            copies = self.copies()
            self._job = submit(lambda: self._gather_weights(dp, copies, set()))
        self._job_iteration = step_thread.restored_iteration()
        self._release_staged()
        self._fused = set()

    def _release_staged(self) -> None:
        """Clear the arena that holds staged new weights (once their write-back has read them),
        so that it takes gradients again."""
        staged, self._fused_into = self._fused_into, None
        if staged is None:
            return
        if self._written is not None:
            self._written.synchronize()
        clear_arena(staged)

    def _fused_targets(
        self,
        copies: dict[int, OptimizerCopy],
        slots: list[Any],
        staging: torch.Tensor | None = None,
    ) -> dict[torch.Tensor, torch.Tensor]:
        """fp32 optimizer copy -> where our Adam writes its bf16/fp16 parameter's new weights in
        the same pass as the update: the parameter itself (synchronous steps only: nothing reads
        the parameter arena meanwhile; through a ``.data`` alias, which leaves its version
        counter alone, see ``take_edits``), its place in ``staging`` (asynchronous steps on
        offloaded copies) or, with data parallelism, the piece's place in the staging arena that
        is all-gathered."""
        dp = self.data_parallel
        return {
            copies[id(slot.param)]: (
                slot.param.data if staging is None else self.memory.grad_view(slot, staging)
            )
            if dp is None
            else dp.target_of(dp.piece_by_param[id(slot.param)])
            for slot in slots
            if slot.param.dtype in (torch.bfloat16, torch.float16)
            and id(slot.param) in copies
            and copies[id(slot.param)].dtype == torch.float32
        }

    def _write_back(self, skip: set[int]) -> Any:
        """Queue the new weights into the parameter arena, layer by layer: the next iteration's
        uploads wait only for their own layers. Returns the last write's event. They are the
        optimizer copies' values (cast on the way), less those a synchronous fused pass already
        wrote in place and the parameters in ``skip`` (ids: changed by the user meanwhile); with
        data parallelism every other trainable parameter's, from the all-gathered staging arena.
        The writes go through ``.data`` aliases, which leave the parameters' version counters
        alone (see ``take_edits``)."""
        copies, done, dp = self.copies(), self._fused, self.data_parallel
        last = None
        for layer in self.memory.layers:
            slots = [
                s
                for s in layer.slots
                if s.primary is None and s.grad_offset is not None and id(s.param) not in skip
            ]
            if dp is None:
                staged = self._fused_into  # the fused pass's weights wait there, if not in place
                slots = [
                    s
                    for s in slots
                    if id(s.param) in copies
                    and (staged is not None or copies[id(s.param)] not in done)
                ]
                news = [
                    self.memory.grad_view(slot, staged)
                    if staged is not None and copies[id(slot.param)] in done
                    else copies[id(slot.param)].detach()
                    for slot in slots
                ]
            else:
                news = [self.memory.grad_view(slot, dp.staged()) for slot in slots]
            if slots:
                targets = [slot.param.data for slot in slots]
                last = self.memory.write_async(layer.index, targets, news)
        return last

    def raise_if_failed(self) -> None:
        """Re-raise a finished step's error without waiting for a running one. A step that
        succeeded keeps its write-back for the next ``step()`` (staleness 1)."""
        job = self._job
        if job is not None and job.query():
            del job  # the error's traceback must not hold its event (see wait_for_job)
            try:
                self._job.synchronize()
            except BaseException:
                self.finish()
        raise_detached_errors()


__all__ = ["StepPipeline"]
