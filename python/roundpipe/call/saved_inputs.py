"""The layer inputs a call keeps for its backward stages, which recompute their layers from them.

A backward stage recomputes from the input of its first layer (stage grain) or of each of its
layers (layer grain); the forward keeps exactly those, private (whatever a layer later does to
its input) and in host memory. Lone tensors on virtual CPU devices are kept natively
(``_C.KeptInputs``), so that the native layer loop keeps and finds them without Python; every
other input is kept here with the event of its copy to the host."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from roundpipe._native import _C
from roundpipe.call.transfers import flatten, unshared


class SavedInputs:
    """The inputs one call's backward stages recompute from, per (layer, microbatch)."""

    def __init__(
        self, layers: int, microbatches: int, backward_stages: Sequence[range], grain: str
    ) -> None:
        if grain == "layer":
            self.starts = {i for stage in backward_stages for i in stage}
        else:
            self.starts = {stage.start for stage in backward_stages}
        # (input, event of its copy to the host or None) of those not kept natively.
        self._host: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.native = _C.KeptInputs(layers, microbatches)

    def keep(self, layer: int, microbatch: int, value: Any, host: Any, event: Any) -> None:
        """Keep ``host``, the host copy of ``value`` (the input of ``layer``) whose copy
        ``event`` completes (None: already there), private to the backward pass, its leaves
        requiring grad where ``value``'s did (so do the recompute's)."""
        saved = unshared(host, value)
        for kept, leaf in zip(flatten(saved)[0], flatten(value)[0], strict=True):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad and not kept.requires_grad:
                kept.requires_grad_(True)
        self._host[(layer, microbatch)] = (saved, event)

    def keep_call_input(self, microbatch: int, value: Any, moved: Any) -> None:
        """Keep the call's own input ``value`` (the input of layer 0) as it came in,
        ``requires_grad`` flags included; ``moved`` is its copy on the device, which may share
        storage with it."""
        self._host[(0, microbatch)] = (unshared(value, moved), None)

    def find(self, layer: int, microbatch: int) -> tuple[Any, Any]:
        """The input kept for ``layer``'s recompute and the event of its copy to the host."""
        saved = self._host.get((layer, microbatch))
        if saved is not None:
            return saved
        kept = self.native.find(layer, microbatch)
        if kept is None:
            raise KeyError((layer, microbatch))  # `starts` say it was kept
        return kept, None


__all__ = ["SavedInputs"]
