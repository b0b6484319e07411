"""The host gradient state of one model: what its calls accumulated and what is still landing.

Gradients accumulate in the model's host arena across calls until a ``step()`` takes them.
This object keeps that consistent: it waits for a call's transfers before the next one (or a
step) uses the arena, rolls back what a failed call accumulated, sums a backward pass through
several ``forward()`` calls before adding it (:class:`PassGrads`), and takes back gradients that
``synchronize()`` published into ``param.grad`` as the user left them. The model owns it; the
autograd node of a ``forward()`` is handed it for the backward.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch

from roundpipe._native import _C
from roundpipe.context import locate_error, run_param_hooks
from roundpipe.lifecycle import interrupts_deferred
from roundpipe.memory import ModelMemory, clear_arena
from roundpipe.torch_internals import backward_hooks, current_graph_task_id, queue_engine_callback

_Result = TypeVar("_Result")

# Backward passes summed at once (accumulate_in_pass): a pass that fails elsewhere never ends,
# and the oldest is dropped to make room for a new one.
_OPEN_PASSES = 4


@dataclass(frozen=True)
class GradientPolicy:
    """What a call's backward stages do with the parameters' gradients; this gradient state
    builds it for each backward and passes it in (``Call.backward``, ``Call.forward_backward``)."""

    #: False: a backward that wants the inputs' gradients only (``torch.autograd.grad``), so
    #: the parameters' are not downloaded.
    keep: bool = True
    #: The host arena holds gradients of earlier calls (a forward_backward's device buffers
    #: then start from them, so each microbatch's add to them in turn, as plain PyTorch does).
    arena_holds_grads: bool = False
    #: The backward of a forward() whose output a downstream model's forward_backward consumed
    #: (chained with merge_output=False): one pass per microbatch there, so its gradients are
    #: added one microbatch after the other, in order, as forward_backward's own.
    microbatch_passes: bool = False
    #: The backward of a forward() in a backward pass whose gradients are summed before they
    #: are added (several forward() calls, a tied weight's hooks): they go into this arena of
    #: the pass, whose sums are added to the model's when the pass ends.
    pass_arena: torch.Tensor | None = None


@dataclass
class GradientOutcome:
    """What a call's stages left behind for the gradient state: the events of its transfers
    still in flight (gradient downloads, kept activations), and ``id`` of each trained
    parameter its backward stages gave a gradient."""

    pending: list[Any]
    reached: set[int]


class PassGrads:
    """The gradients of one backward pass through several ``forward()`` calls of the model (or
    through a tied weight with hooks), summed over them in an arena of the pass (``arena``, laid
    out as the model's), and added to the model's arena once, when the pass ends, after the
    parameters' hooks ran on their sums. Plain PyTorch sums a parameter's gradient over the
    whole pass, runs its hooks on the sum and adds that to ``.grad``: adding each call's part in
    turn would round differently, and a hook such as a clamp would clip each part."""

    def __init__(self, arena: torch.Tensor) -> None:
        self.arena: torch.Tensor | None = arena  # None once dropped
        self.reached: set[int] = set()  # ``id`` of each parameter the pass gave a gradient


class GradientState:
    """Pending gradient transfers and the arena's published/dirty flags of one model."""

    def __init__(
        self, memory: ModelMemory, name: str = "model", param_names: dict[int, str] | None = None
    ) -> None:
        self.memory, self.name = memory, name
        self._param_names = param_names or {}  # id of a parameter -> its name, for errors
        self.pending: list[Any] = []  # events of gradient transfers into the arena
        # The arena holds gradients not yet stepped (saved in checkpoints).
        self.dirty = False
        # synchronize() put views of the arena into param.grad; the user may have changed them.
        self.published = False
        # ``id`` of each trained parameter with a gradient in the arena: one a backward reached
        # (or the user set) since the last step or zero_grad(). The others have none, as in
        # plain PyTorch (.grad None), and a step hands them none, so optimizers skip them.
        self.reached: set[int] = set()
        # The trained parameters and their gradient offsets (fixed once the model is wrapped).
        self._slots = [slot for slot in memory.slots() if slot.grad_offset is not None]
        self._offsets = [cast(int, slot.grad_offset) for slot in self._slots]
        self._params = [slot.param for slot in self._slots]
        self._tied = [param for param in self._params if id(param) in memory.tied]
        # Frozen when the model was wrapped: no gradient slot (see begin_call).
        self._untrained = [slot.param for slot in memory.slots() if slot.grad_offset is None]
        # The autograd nodes of the model's forward() calls still alive (roundpipe.call.autograd),
        # to tell whether a backward pass goes through several of them.
        self.forward_nodes: weakref.WeakSet[Any] = weakref.WeakSet()
        # The backward passes through several forward() calls in progress, by graph task.
        self._passes: dict[int, PassGrads] = {}

    def wait_pending(self) -> None:
        """Wait for every gradient transfer of earlier calls; the first error is raised and the
        rest are dropped. A Ctrl-C leaves the unfinished ones pending (waited for next time)."""
        pending = self.pending
        try:
            while pending:
                pending[0].synchronize()
                pending.pop(0)
        except KeyboardInterrupt:
            raise
        except BaseException:
            pending.clear()
            raise

    def begin_call(self) -> None:
        """Before a call that accumulates gradients: finish the previous call's accumulation and
        take over gradients the user changed after ``synchronize()``. A parameter frozen when
        the model was wrapped and unfrozen since has no place for a gradient: ``RuntimeError``
        before any work, rather than train without its gradient."""
        unfrozen = [param for param in self._untrained if param.requires_grad]
        if unfrozen:
            name = self._param_names.get(id(unfrozen[0]), "?")
            raise RuntimeError(
                f"RoundPipe model '{self.name}': parameter '{name}' "
                "was frozen (requires_grad=False) when the model was wrapped, so no gradient is "
                "kept for it, and requires grad now. Wrap the model with every parameter you "
                "will train trainable, and freeze with requires_grad_(False) after wrapping "
                "(which can be undone)"
            )
        self.wait_pending()
        self._absorb_user_grads()

    def accumulate(
        self,
        run: Callable[[GradientPolicy], tuple[_Result, GradientOutcome]],
        microbatch_passes: bool = False,
    ) -> _Result:
        """``run(policy)``: a call's stages that accumulate gradients into the model's arena
        (``microbatch_passes``: see :class:`GradientPolicy`). On success its transfers become
        pending; on failure (the call waited for its transfers) the gradients it already
        accumulated are rolled back, so the next call trains as if the failed one never ran."""
        self.begin_call()
        policy = GradientPolicy(arena_holds_grads=self.dirty, microbatch_passes=microbatch_passes)
        backup = self.memory.grads.clone() if self.dirty else None
        try:
            result, outcome = run(policy)
        except BaseException:
            if backup is None:
                clear_arena(self.memory.grads)
            else:
                self.memory.grads.copy_(backup)
            raise
        self.pending.extend(outcome.pending)
        self.reached |= outcome.reached
        self.dirty = True
        return result

    def accumulate_in_pass(
        self,
        run: Callable[[GradientPolicy], tuple[_Result, GradientOutcome]],
        lock: AbstractContextManager[Any],
    ) -> _Result:
        """``run(policy)``: the backward of a ``forward()`` in a backward pass whose gradients
        are summed before they are added (it goes through several forward() calls, or a tied
        weight's hooks need its whole gradient): they go into the pass's arena (the policy's
        ``pass_arena``; see :class:`PassGrads`). The pass's first call makes it and has the
        engine call :meth:`_end_pass` under ``lock`` (the model's call lock) when the pass is
        done. On failure the pass's sums are dropped, and the model's arena is untouched."""
        self.begin_call()
        task = current_graph_task_id()
        grads = self._passes.get(task)
        if grads is None:
            while len(self._passes) >= _OPEN_PASSES:
                self._drop_pass(next(iter(self._passes)))
            grads = self._passes[task] = PassGrads(self.memory.new_grad_arena())
            end_pass = functools.partial(self._end_pass_locked, lock, task, grads)
            queue_engine_callback(end_pass)
        try:
            result, outcome = run(GradientPolicy(pass_arena=grads.arena))
        except BaseException:
            self._drop_pass(task)
            raise
        self.pending.extend(outcome.pending)
        grads.reached |= outcome.reached
        return result

    def hooks_on_tied(self) -> bool:
        """Whether a parameter that several layers use (tied weights) has hooks: they run once,
        on its whole gradient, which only the end of the backward pass has (its uses' parts are
        summed there, see :meth:`accumulate_in_pass`)."""
        return any(backward_hooks(param) for param in self._tied)

    def _drop_pass(self, task: int) -> None:
        """Forget the sums of a pass (failed, or never ended)."""
        grads = self._passes.pop(task, None)
        if grads is not None:
            grads.arena = None

    def _end_pass_locked(
        self, lock: AbstractContextManager[Any], task: int, grads: PassGrads
    ) -> None:
        with lock:
            self._end_pass(task, grads)

    def _end_pass(self, task: int, grads: PassGrads) -> None:
        """Add the sums of a pass (:class:`PassGrads`) to the model's arena, each parameter's
        after its hooks ran on it in the order they were registered (what a hook returns
        replaces it), as plain PyTorch adds them to ``.grad``."""
        if grads.arena is None:
            raise RuntimeError(
                f"RoundPipe model '{self.name}': the gradients of this backward pass were "
                "dropped while it ran (a step() or zero_grad() of the model, or more than "
                f"{_OPEN_PASSES} backward passes through several of its forward() calls at "
                "once); they are not accumulated"
            )
        self._passes.pop(task, None)
        arena, grads.arena = grads.arena, None
        if not grads.reached:
            return
        self.wait_pending()  # the pass's downloads
        self.memory.fold_alias_grads(arena)
        for slot in self.memory.borrowed:  # handed to the parameter's .grad later
            if id(slot.param) in grads.reached:
                self.memory.grad_view(slot).add_(self.memory.grad_view(slot, arena))
                self.reached.add(id(slot.param))
        sums = _C.typed_views(arena, 0, self._offsets, self._params)
        views = self._views()
        with torch.no_grad():
            for param, total, view in zip(self._params, sums, views, strict=True):
                if id(param) not in grads.reached:
                    continue
                try:
                    result = run_param_hooks(param, total)
                except Exception as error:
                    name = self._param_names.get(id(param), "?")
                    where = f"RoundPipe model '{self.name}': a hook of parameter '{name}'"
                    raise locate_error(error, where) from error
                view.add_(result)
                self.reached.add(id(param))
        self.dirty = True

    @contextmanager
    def handing_over(self) -> Iterator[None]:
        """Around handing the arena to an optimizer step: complete and folded before, clean
        after the hand-over."""
        self.wait_pending()
        self._drop_passes()
        # Taking back the user's gradients and folding the aliases' must not stop half-way (a
        # retry would take or fold some twice).
        with interrupts_deferred():
            self._absorb_user_grads()
            self.memory.fold_alias_grads()
            self._hand_over_borrowed()
        arena = self.memory.grads
        try:
            yield
        finally:
            # Handed over once the step swapped in the other arena, even if a Ctrl-C came later
            # (in a synchronous step's wait).
            if self.memory.grads is not arena:
                self.dirty = False
                self.reached = set()

    def hand_over_shared(self) -> None:
        """Add the gradients this model accumulated for the parameters another owner trains
        (``shared_parameters``: borrowed slots, see ``roundpipe.memory``) to their ``.grad``, as
        a backward through this model's uses would in plain PyTorch, and clear them here;
        transfers still landing are waited for first."""
        if not self.memory.borrowed:
            return
        self.wait_pending()
        with interrupts_deferred():
            self.memory.fold_alias_grads()
            self._hand_over_borrowed()

    def _hand_over_borrowed(self) -> None:
        memory = self.memory
        with torch.no_grad():
            for slot in memory.borrowed:
                if id(slot.param) not in self.reached:
                    continue
                self.reached.discard(id(slot.param))
                grad, param = memory.grad_view(slot), slot.param
                if param.grad is None:
                    param.grad = grad.clone()
                else:
                    param.grad.add_(grad)
                grad.zero_()

    def _drop_passes(self) -> None:
        """Forget the sums of every pass in progress: a step or ``zero_grad()`` comes after the
        backward passes whose gradients it is meant for; one still running (in another thread)
        raises when it ends, rather than add to the next step's gradients."""
        for task in list(self._passes):
            self._drop_pass(task)

    def reach_all(self) -> None:
        """Every trained parameter has a gradient in the arena (loaded from a checkpoint)."""
        self.reached = {id(param) for param in self._params}
        self.dirty = True

    def clear(self, set_to_none: bool) -> None:
        """``zero_grad()``: the gradients accumulated so far are gone, published or not (the
        transfers still landing are waited for first). Published ``.grad`` become ``None``, or
        with ``set_to_none=False`` stay the arena's views, now zero: gradients of zero then,
        as plain PyTorch's are, which a step hands over."""
        self.wait_pending()
        self._drop_passes()
        with torch.no_grad():
            self.memory.grads.zero_()
        for param in self._params:
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            elif self.published:
                param.grad.zero_()  # a tensor the user set in place of the view
            else:  # a stray gradient (see _absorb_stray_grads): zero, as the arena's now are
                param.grad = None
                self.reached.add(id(param))
        self.dirty = not set_to_none
        if set_to_none:
            self.reached = set()

    def publish(self) -> None:
        """Views of the arena into ``param.grad`` (transfers already waited for); ``None``
        while it holds no gradients (none accumulated since the last step), as plain PyTorch
        leaves ``.grad`` after ``zero_grad()``."""
        memory = self.memory
        memory.wait_writes()
        if not self.published:
            self._absorb_stray_grads()
        memory.fold_alias_grads()
        self._hand_over_borrowed()
        if self.dirty:
            _C.set_grads(self._params, self._views())
        for param in self._params:
            if id(param) not in self.reached:
                param.grad = None
        self.published = True

    def _views(self) -> list[torch.Tensor]:
        """Every trained parameter's gradient in the current arena, in ``_slots`` order
        (``memory.grad_view`` of each, cut by one native call: publishing and taking back make
        one per parameter per iteration)."""
        return _C.typed_views(self.memory.grads, 0, self._offsets, self._params)

    def _absorb_user_grads(self) -> None:
        """Gradients published by ``synchronize()`` go back into the arena as the user left them:
        cleared (``None``) means zero, a replaced tensor is copied in, views are kept. With none
        published, gradients found in ``.grad`` add to the arena's (:meth:`_absorb_stray_grads`)."""
        if not self.published:
            self._absorb_stray_grads()
            return
        grads = [slot.param.grad for slot in self._slots]
        self.reached = {
            id(p) for p, grad in zip(self._params, grads, strict=True) if grad is not None
        }
        dirty = bool(self.reached)
        with torch.no_grad():
            if not dirty:
                # Every gradient cleared (zero_grad(set_to_none=True)): the arena in one memset
                # (clear_arena would hand its pages back, and the next backward would fault
                # every one of them in again), and no view of it cut.
                self.memory.grads.zero_()
            else:
                for slot, view, grad in zip(self._slots, self._views(), grads, strict=True):
                    if grad is None:
                        view.zero_()
                    elif grad.data_ptr() != view.data_ptr():
                        view.copy_(grad)
                    slot.param.grad = None
        self.published = False
        self.dirty = dirty

    def _absorb_stray_grads(self) -> None:
        """Gradients that reached ``.grad`` while none was published (a backward through the
        wrapped module called directly, an auxiliary loss) add to the arena's, as plain
        PyTorch's ``.grad`` accumulates them with the model's; ``.grad`` is cleared again."""
        stray = [i for i, slot in enumerate(self._slots) if slot.param.grad is not None]
        if not stray:
            return
        views = self._views()
        with torch.no_grad():
            for i in stray:
                param = self._slots[i].param
                assert param.grad is not None
                views[i].add_(param.grad.to(views[i].device))
                param.grad = None
                self.reached.add(id(param))
        self.dirty = True


__all__ = ["GradientOutcome", "GradientPolicy", "GradientState", "PassGrads"]
