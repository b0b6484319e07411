"""The state-dict protocol of ``RoundPipe`` and ``AutoRoundPipe``: their model's entries plus the
runtime's own (optimizer copies, gradients not yet stepped, a pending write-back) under a prefix
of their own, read without changing the training and loaded all or nothing.

``state_dict()`` first waits for the step in flight without writing it back (``wait_for_step``),
so the parameters are the weights the next iteration uses and the optimizer copies are after that
step. ``load_state_dict()`` checks every entry (``_check_state_dict``) before it drains pending
work (``drain``), loads the model's entries, then applies the own ones it staged
(``refresh_copies``). The runtime's own entries are ``_own_state`` / ``_load_own_state`` of each
class; :func:`check_state_dict` runs the same checks for any module, changing nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from roundpipe.torch_internals import NORM_CLASSES, loads_state_dict_plainly

_saving = threading.local()


@contextmanager
def _regular_entries_only() -> Iterator[None]:
    """``state_dict()`` inside leaves out the runtime's own entries (nothing is cloned)."""
    _saving.regular_only = True
    try:
        yield
    finally:
        _saving.regular_only = False


def _quoted(keys: list[str]) -> str:
    return ", ".join(f'"{key}"' for key in keys)


def _load_error(module: nn.Module, error_msgs: list[str]) -> RuntimeError:
    """The error ``nn.Module.load_state_dict`` raises, with the same wording."""
    return RuntimeError(
        f"Error(s) in loading state_dict for {type(module).__name__}:\n\t" + "\n\t".join(error_msgs)
    )


def _views(module: nn.Module) -> list[tuple[str, RuntimeState]]:
    """(prefix of its own entries, view) of every RuntimeState in ``module``."""
    return [
        (f"{path}.{view._own_state_prefix}" if path else view._own_state_prefix, view)
        for path, view in module.named_modules(remove_duplicate=False)
        if isinstance(view, RuntimeState)
    ]


def _unstage(module: nn.Module) -> None:
    """Drop the own entries that a check staged in the views of ``module``."""
    for own, view in _views(module):
        view._load_own_state({}, own, [])


def _check_entries(
    module: nn.Module,
    state_dict: Any,
    strict: bool,
    same_kind: bool,
    optional: Collection[str] = (),
) -> None:
    """The checks of :meth:`RuntimeState._check_state_dict`, for any module: with
    ``same_kind`` an entry's dtype must be of its tensor's kind (see ``_check_entry``), else any
    tensor-like value of the right shape passes, as in ``nn.Module.load_state_dict`` (whose
    exceptions it keeps too: a 1-element entry for a 0-dim tensor, lazy parameters). Keys in
    ``optional`` may be missing."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"Expected state_dict to be dict-like, got {type(state_dict)}.")
    with _regular_entries_only():
        expected = nn.Module.state_dict(module, keep_vars=True)
    error_msgs: list[str] = []
    missing = [key for key in expected if key not in state_dict and key not in optional]
    for key, like in expected.items():
        if key not in state_dict or not isinstance(like, Tensor):
            continue
        if same_kind:
            RuntimeState._check_entry(key, state_dict[key], like, error_msgs)
        elif key.rpartition(".")[2] != "_extra_state":  # set_extra_state takes any object
            _check_torch_entry(key, state_dict[key], like, error_msgs)
    unexpected = [key for key in state_dict if key not in expected]
    views = _views(module)
    for own, view in views:
        entries = {
            key.removeprefix(own): value for key, value in state_dict.items() if key.startswith(own)
        }
        view._load_own_state(entries, own, error_msgs)
        left = {f"{own}{key}" for key in entries}  # not taken: unexpected
        unexpected = [key for key in unexpected if not key.startswith(own) or key in left]
    if strict and (missing or unexpected):
        keys = [("Missing", missing), ("Unexpected", unexpected)]
        error_msgs[:0] = [
            f"{kind} key(s) in state_dict: {_quoted(found)}. " for kind, found in keys if found
        ]
    if error_msgs:
        _unstage(module)  # nothing staged stays behind
        raise _load_error(module, error_msgs)


def _check_torch_entry(key: str, value: Any, like: Tensor, error_msgs: list[str]) -> None:
    """``nn.Module._load_from_state_dict``'s checks of one entry, with its wording."""
    if not torch.overrides.is_tensor_like(value):  # type: ignore[no-untyped-call]
        error_msgs.append(
            f'While copying the parameter named "{key}", expected torch.Tensor or Tensor-like '
            f"object from checkpoint but received {type(value)}"
        )
        return
    if nn.parameter.is_lazy(like):
        return
    shape = value.shape
    if len(like.shape) == 0 and len(shape) == 1 and shape[0] == 1:
        shape = torch.Size([])  # torch loads a 1-element entry into a 0-dim tensor
    if shape != like.shape:
        error_msgs.append(
            f"size mismatch for {key}: copying a param with shape {value.shape} from "
            f"checkpoint, the shape in current model is {like.shape}."
        )


def check_state_dict(module: nn.Module, state_dict: Any, strict: bool) -> None:
    """Raise what ``module.load_state_dict(state_dict, strict)`` would raise for its entries
    (the wrong shape, not a tensor, and under ``strict`` missing or unexpected keys), changing
    nothing: ``roundpipe.load_checkpoint`` checks the whole file before it drains the step in
    flight or loads any part.

    A RoundPipe or AutoRoundPipe runs its own check (its own entries and dtypes included). A
    plain module is held to ``nn.Module``'s rules, and not checked at all (its load decides)
    where hooks or a custom ``_load_from_state_dict`` may rewrite the entries."""
    if isinstance(module, RuntimeState):
        module._check_state_dict_only(state_dict, strict)
        return
    modules = [m for _, m in module.named_modules(remove_duplicate=False)]
    if not all(loads_state_dict_plainly(m) for m in modules):
        return
    optional = _norm_counters(module, state_dict)
    _check_entries(module, state_dict, strict, same_kind=False, optional=optional)


def _norm_counters(module: nn.Module, state_dict: Any) -> set[str]:
    """The ``num_batches_tracked`` keys that ``module``'s norms fill in when ``state_dict``
    lacks them, as BatchNorm's loading does: where its metadata gives no version 2 or later."""
    metadata = getattr(state_dict, "_metadata", None) or {}
    return {
        f"{path}.num_batches_tracked" if path else "num_batches_tracked"
        for path, m in module.named_modules(remove_duplicate=False)
        if isinstance(m, NORM_CLASSES) and (metadata.get(path, {}).get("version") or 0) < 2
    }


class RuntimeState(nn.Module):
    """A module whose ``state_dict`` holds the runtime's own entries beside the model's, under
    ``_own_state_prefix``, read without changing the training and loaded all or nothing.

    Subclasses define ``_own_state`` and ``_load_own_state`` (the own entries), and
    ``wait_for_step``, ``drain`` and ``refresh_copies`` (what a read waits for, what a load
    drains first and applies last); ``_state_lock`` is held around reads and loads.

    Loading is all or nothing: ``_check_state_dict`` validates every entry before anything
    changes, and ``_load_own_state`` only checks and stages the own entries (``refresh_copies``
    applies them once the parameters are loaded)."""

    _own_state_prefix = "_roundpipe."

    def _own_state(self) -> dict[str, Any]:
        """Entries to save beside the module's own, keyed without the prefix."""
        raise NotImplementedError

    def _load_own_state(self, entries: dict[str, Any], prefix: str, error_msgs: list[str]) -> None:
        """Check the checkpoint's entries under ``prefix`` (their keys without it), note what is
        wrong in ``error_msgs``, stage them to apply after the load, and remove from ``entries``
        the keys taken: those left are unexpected keys. Changes nothing of the model."""
        raise NotImplementedError

    @staticmethod
    def _check_entry(key: str, value: Any, like: Tensor, error_msgs: list[str]) -> None:
        """Note in ``error_msgs`` why checkpoint entry ``value`` cannot be loaded into ``like``
        (shape exact, same kind of dtype: copying casts a float to another float, but never makes a
        float of an integer or drops an imaginary part)."""
        if not isinstance(value, Tensor):
            error_msgs.append(f'"{key}" must be a tensor, got {type(value).__name__}')
        elif value.shape != like.shape:
            error_msgs.append(
                f"size mismatch for {key}: copying a param with shape {value.shape} from "
                f"checkpoint, the shape in current model is {like.shape}."
            )
        elif (value.is_floating_point(), value.is_complex()) != (
            like.is_floating_point(),
            like.is_complex(),
        ) or (not like.is_floating_point() and not like.is_complex() and value.dtype != like.dtype):
            error_msgs.append(
                f"dtype mismatch for {key}: the checkpoint holds {value.dtype}, the current model "
                f"{like.dtype}."
            )

    def _check_state_dict(self, state_dict: Any, strict: bool) -> None:
        """Raise what ``load_state_dict(state_dict, strict)`` would raise, before it changes
        anything: a ``TypeError`` for a non-mapping, a ``RuntimeError`` worded as
        ``nn.Module.load_state_dict``'s for entries of the wrong shape or dtype and, under
        ``strict``, missing or unexpected keys (unknown own entries included). The own entries
        stay staged for the load that follows."""
        optional = _norm_counters(self, state_dict)
        _check_entries(self, state_dict, strict, same_kind=True, optional=optional)

    def _check_state_dict_only(self, state_dict: Any, strict: bool) -> None:
        """:meth:`_check_state_dict`, leaving nothing staged (a check before any state is
        drained or loaded)."""
        try:
            self._check_state_dict(state_dict, strict)
        finally:
            _unstage(self)

    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if getattr(_saving, "regular_only", False):
            return
        for key, value in self._own_state().items():
            destination[f"{prefix}{self._own_state_prefix}{key}"] = value

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        own = f"{prefix}{self._own_state_prefix}"
        unexpected_keys[:] = [key for key in unexpected_keys if not key.startswith(own)]
        entries = {
            key.removeprefix(own): value for key, value in state_dict.items() if key.startswith(own)
        }
        self._load_own_state(entries, own, error_msgs)
        unexpected_keys.extend(f"{own}{key}" for key in entries)

    def _state_lock(self) -> AbstractContextManager[Any]:
        """Held while the state is read or loaded (the model's call lock, if it has one)."""
        return nullcontext()

    def wait_for_step(self) -> None:
        """Wait for the step in flight without writing its weights back."""
        raise NotImplementedError

    def drain(self) -> None:
        """Finish pending work (transfers, the step in flight and its write-back)."""
        raise NotImplementedError

    def refresh_copies(self) -> None:
        """Apply the own entries staged by the load (or refresh the optimizer copies from the
        loaded parameters)."""
        raise NotImplementedError

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The model's state, plus RoundPipe's own: the optimizer copies, gradients accumulated
        but not yet stepped and, while an asynchronous step is in flight, a pending write-back
        flag (a bool tensor, True).

        Reading the state never changes the training, as in PyTorch: the step in flight is
        waited for but not written back, so the parameters are the weights the next iteration
        uses (one step stale) and the optimizer copies (and the optimizer's own state, read
        afterwards) are after that step; the pending write-back records that the copies are one
        step ahead. Loading such a state restores exactly that: the next ``step()`` applies the
        pending write-back where the saving run applied it, so a resumed run continues the same
        trajectory bit for bit. A failed step in flight raises here (nothing is saved) and again
        at the next ``step()`` or ``synchronize()``.

        Checkpoint recipe (``roundpipe.save_checkpoint`` / ``load_checkpoint`` do this, atomically
        and checksummed)::

            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(state, path)
            ...
            state = torch.load(path, weights_only=True)
            model.load_state_dict(state["model"])  # before creating or loading the optimizer
            optimizer.load_state_dict(state["optimizer"])
        """
        with self._state_lock():
            self.wait_for_step()
            return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a ``state_dict()`` of this (or a plain) model, checked entirely before anything
        changes; then pending work is drained and the state replaces it, pending write-backs
        included (see :meth:`state_dict`). Without the own optimizer-copy entries (a plain
        model's checkpoint) existing optimizer copies are refreshed from the loaded parameters.
        Read checkpoint files with ``torch.load(path, weights_only=True)``: a checkpoint must not
        be able to run code."""
        if assign:
            raise ValueError(
                "assign=True would replace the parameters that RoundPipe keeps in its host "
                "arenas; load with assign=False"
            )
        with self._state_lock():
            self._check_state_dict(state_dict, strict)  # nothing changes unless all of it loads
            self.drain()
            result = super().load_state_dict(state_dict, strict=strict)
            self.refresh_copies()
            return result


__all__ = ["RuntimeState", "check_state_dict"]
