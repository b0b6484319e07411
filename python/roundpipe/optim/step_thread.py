"""The process's optimizer thread: the queue every model's optimizer steps run on, in order.

Iterations are counted by the steps submitted in this process; a job on the thread runs on behalf
of the iteration that submitted it (:func:`current_iteration`), and the newest step the program
has waited for is *settled* (:func:`settled_iteration`): what it did is what the next iteration
may use, whatever the timing of the steps after it. Jobs that no model waits for
(``GradScaler.update(is_async=True)``) are *detached*: their errors are raised by the next
``step()``, ``synchronize()``, forward or ``GradScaler`` getter. At exit and before ``fork()`` the
thread and the native workers are drained (:mod:`roundpipe.lifecycle`'s ``optimizer thread``).
Each model's steps are queued by its :class:`roundpipe.optim.step.StepPipeline`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from roundpipe import lifecycle
from roundpipe._native import _C

# Iterations are counted by the steps submitted in this process. The main thread is in iteration
# `_submitted`; a job runs on behalf of the iteration that submitted it (see current_iteration).
_submitted = 0
# The newest step the program has waited for (finish(), a synchronous step, a drain): what it has
# done is settled; what a step still in flight does is not, even if it happens to have run.
_settled: float = -1
_job = threading.local()
# Events of asynchronous jobs that no model waits for (GradScaler.update(is_async=True)): their
# errors are raised by the next step(), synchronize(), forward or GradScaler getter.
_detached: list[Any] = []
# Whether this process has queued optimizer work (the fork and exit hooks have nothing to do
# otherwise, and must not start the optimizer thread).
_used_optimizer_thread = False


def _refuse_model_parameters(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """Before any optimizer's step on the optimizer thread: one built over the model's own
    parameters instead of its optimizer copies would find no gradient on them (they are in the
    host arena) and silently do nothing; a clear error instead."""
    trained: frozenset[int] | None = getattr(_job, "trained_ids", None)
    if trained is None:
        return
    for group in optimizer.param_groups:
        if any(id(param) in trained for param in group["params"]):
            raise RuntimeError(
                f"{type(optimizer).__name__} in step_fn was built over the model's parameters "
                "(model.parameters()); RoundPipe hands the gradients to the optimizer copies: "
                "build it over model.optim_parameters()"
            )


register_optimizer_step_pre_hook(_refuse_model_parameters)


def current_iteration() -> int:
    """The training iteration this thread works for: on the optimizer thread, the iteration whose
    gradients the running step consumes; elsewhere, the iteration being computed."""
    iteration = getattr(_job, "iteration", None)
    return _submitted if iteration is None else iteration


def in_step_job() -> bool:
    """True on the optimizer thread while it runs a step."""
    return getattr(_job, "iteration", None) is not None


def submit(job: Callable[[], None]) -> Any:
    """Queue ``job`` on the optimizer thread (first in, first out); returns its event."""
    global _used_optimizer_thread
    _used_optimizer_thread = True
    return _C.submit_optimizer_job(job)


def submit_detached(job: Callable[[], None]) -> None:
    """Queue ``job`` on the optimizer thread; its error is raised by :func:`raise_detached_errors`
    once it has run."""
    _detached.append(submit(job))


def wait_for_job(event: Any) -> BaseException | None:
    """``event.synchronize()`` for a job on the optimizer thread, telling a Ctrl-C during the
    wait apart from a job that raised ``KeyboardInterrupt`` itself (user code may).

    Raises the job's own error once it ended with one. A Ctrl-C while the job is still queued or
    running propagates, the job left as it is (the caller waits for it again next time). A
    Ctrl-C that came as the job ended successfully is returned, for the caller to raise once it
    has done what follows a successful job."""
    try:
        try:
            event.synchronize()
            return None
        except KeyboardInterrupt as error:
            if not event.query():
                raise  # the job is still queued or running
            interrupt = error
        event.synchronize()  # it ended: raises its own error again, if it had one
        return interrupt
    finally:
        # The event keeps the job's error, out of the garbage collector's sight: a traceback
        # frame of the error that referenced the event would keep both, and the model, alive.
        del event


def raise_detached_errors(wait: bool = False) -> None:
    """Re-raise the first error of the detached jobs (with its own type and ``__cause__``): of
    those that have run, or, with ``wait``, of all queued so far."""
    while _detached and (wait or _detached[0].query()):
        try:
            interrupt = wait_for_job(_detached[0])
        except KeyboardInterrupt:
            if not _detached[0].query():
                raise  # the job is still queued or running: it stays listed
            _detached.pop(0)  # the job's own KeyboardInterrupt
            raise
        except BaseException:
            _detached.pop(0)
            raise
        _detached.pop(0)
        if interrupt is not None:
            raise interrupt


def settled_iteration() -> float:
    """The newest step iteration the program has waited for (-1: none). State changed by steps up
    to it is what the next iteration may use, whatever the timing of the steps after it."""
    return _settled


def restored_iteration() -> float:
    """The iteration that stands for the step a loaded checkpoint had in flight: between the
    iterations before the load and those after it (so never settled yet). The loaded model's
    pending write-back settles it at the next ``step()``, where the saving run settled the real
    step, and state keyed by it (a loaded scaler's pending scale) follows."""
    return _submitted - 0.5


def drain_optimizer_thread() -> None:
    """Wait until every step submitted so far has run (the thread is first in, first out), then
    raise the errors of detached jobs."""
    if not in_step_job():
        submitted = _submitted
        submit(lambda: None).synchronize()
        settle(submitted - 1)
        raise_detached_errors()


def wait_optimizer_thread() -> None:
    """Wait until every job submitted so far has run, then raise the errors of detached jobs;
    unlike :func:`drain_optimizer_thread` nothing is settled, so what the steps in flight did
    stays unseen by the iterations, as if nobody had waited (a checkpoint must not change the
    training)."""
    if not in_step_job():
        submit(lambda: None).synchronize()
        raise_detached_errors()


def _wait_for_optimizer_thread(seconds: float | None) -> bool:
    """Wait (interruptibly) until the jobs queued so far have run, at most ``seconds`` (None: no
    bound). True if they have."""
    marker = submit(lambda: None)
    if seconds is None:
        marker.synchronize()
        return True
    deadline = time.monotonic() + seconds
    while not marker.query():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def next_iteration() -> int:
    """Count one more step submitted; returns the iteration it steps (the one being computed)."""
    global _submitted
    iteration, _submitted = _submitted, _submitted + 1
    return iteration


def settle(iteration: float) -> None:
    """The program has waited for the step of ``iteration``."""
    global _settled
    _settled = max(_settled, iteration)


@contextmanager
def running_job(iteration: int, trained_ids: frozenset[int]) -> Iterator[None]:
    """On the optimizer thread: the block runs the step of ``iteration`` over the model whose
    trained parameters are ``trained_ids`` (an optimizer stepping those instead of their
    optimizer copies is refused)."""
    _job.iteration, _job.trained_ids = iteration, trained_ids
    try:
        yield
    finally:
        _job.iteration = _job.trained_ids = None


def _drain_at_exit(seconds: float | None) -> bool:
    """Finish every queued native job (optimizer steps included) while the interpreter is still
    alive, within ``seconds`` (None: no bound): jobs may hold tensors that own Python objects,
    which must not be released during shutdown. Errors of unfinished steps stay with their
    events, unreported at exit. False: work was given up (a copy waiting on a hung GPU, say)."""
    deadline = None if seconds is None else time.monotonic() + seconds
    if _used_optimizer_thread and not _wait_for_optimizer_thread(seconds):
        return False
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    return bool(_C.drain_workers(left))  # then the copy engines and the weight writer


def _drain_before_fork() -> None:
    """Let the optimizer thread finish its queued steps before ``fork()``, so the child inherits
    finished steps and consistent optimizer copies instead of a step it cannot complete (native
    threads do not survive fork; the child's waits for them raise). Skipped inside a step (the
    thread would wait for itself)."""
    if lifecycle.fork_interrupted() or not _used_optimizer_thread or in_step_job():
        return
    try:
        _wait_for_optimizer_thread(None)
        _C.drain_workers()
    except KeyboardInterrupt:
        lifecycle.interrupted_before_fork()


def _forget_parent_jobs() -> None:
    """In a forked child: the parent's detached jobs are not the child's to report."""
    _detached.clear()


lifecycle.join(
    "optimizer thread",
    lifecycle.Participant(
        at_exit=_drain_at_exit,
        unfinished="optimizer work",
        before_fork=_drain_before_fork,
        after_fork_in_child=_forget_parent_jobs,
    ),
)

__all__ = [
    "current_iteration",
    "drain_optimizer_thread",
    "in_step_job",
    "next_iteration",
    "raise_detached_errors",
    "restored_iteration",
    "running_job",
    "settle",
    "settled_iteration",
    "submit",
    "submit_detached",
    "wait_for_job",
    "wait_optimizer_thread",
]
