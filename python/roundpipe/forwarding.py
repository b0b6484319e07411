"""The forwarding base of ``RoundPipe`` and ``AutoRoundPipe``: a wrapper that behaves as the
model it wraps.

Attribute reads that the wrapper does not define go to the original model (see
:meth:`ForwardingModule.set_original_model`), else to the wrapped one; writes and deletes go to
both. The wrapper's own attributes are written once, at construction; the runtime behind it is
one object, ``_runtime``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from roundpipe.optim.copies import OptimizerCopiesView
from roundpipe.state_dict import RuntimeState
from roundpipe.torch_internals import CALL_STATE, child_slots


class ForwardingModule(RuntimeState, OptimizerCopiesView):
    """A module wrapping ``model`` (registered as the submodule ``model``) whose attribute
    reads, writes and deletes go to the wrapped model, whose ``state_dict`` holds the runtime's
    own entries too (:class:`RuntimeState`), and whose parameters are the optimizer copies inside
    ``OptimizerCtx`` (:class:`OptimizerCopiesView`)."""

    model: nn.Module
    original_model: nn.Module | None

    def __init__(self, model: nn.Module, **attributes: Any) -> None:
        """``attributes`` become the wrapper's own (read from the wrapper, never forwarded)."""
        super().__init__()
        # `training` is read from and written to the wrapped model like any other attribute.
        del self.__dict__["training"]
        child_slots(self)["model"] = model
        self.__dict__.update(attributes, model=model, original_model=None, _constructed=True)

    def set_original_model(self, original_model: nn.Module) -> None:
        """Forward attribute reads and writes to ``original_model`` too (e.g. the Hugging Face
        model that a preset turned into a Sequential); reads prefer it."""
        self.__dict__["original_model"] = original_model

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        state = self.__dict__
        target = state.get("original_model") or state.get("model")
        if target is None:
            raise AttributeError(name)
        return getattr(target, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # How the wrapper's own call runs (compile(), full backward hooks) stays the wrapper's.
        if not self.__dict__.get("_constructed") or name in CALL_STATE:
            super().__setattr__(name, value)
            return
        for target in self._forwarding_targets():
            setattr(target, name, value)

    def __delattr__(self, name: str) -> None:
        if not self.__dict__.get("_constructed"):
            super().__delattr__(name)
            return
        for target in self._forwarding_targets():
            if hasattr(target, name):
                delattr(target, name)

    def _forwarding_targets(self) -> list[nn.Module]:
        original = self.__dict__["original_model"]
        model = self.__dict__["model"]
        return [model] if original is None or original is model else [original, model]


__all__ = ["ForwardingModule"]
