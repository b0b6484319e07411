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
from roundpipe.torch_internals import version_of


class SavedInputs:
    """The inputs one call's backward stages recompute from, per (layer, microbatch)."""

    def __init__(
        self,
        layers: int,
        microbatches: int,
        backward_stages: Sequence[range],
        grain: str,
        model: str,
    ) -> None:
        self.model = model
        if grain == "layer":
            self.starts = {i for stage in backward_stages for i in stage}
        else:
            self.starts = {stage.start for stage in backward_stages}
        # (input, event of its copy to the host or None) of those not kept natively.
        self._host: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.native = _C.KeptInputs(layers, microbatches)
        # The call's own input tensors kept as they are (not copied), with their versions.
        self._versions: dict[int, list[tuple[torch.Tensor, int]]] = {}

    def keep(self, layer: int, microbatch: int, value: Any, host: Any, event: Any) -> None:
        """Keep ``host``, the host copy of ``value`` (the input of ``layer``) whose copy
        ``event`` completes (None: already there), private to the backward pass, its leaves
        requiring grad where ``value``'s did (so do the recompute's)."""
        saved = unshared(host, value)
        for kept, leaf in zip(flatten(saved)[0], flatten(value)[0], strict=True):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad and not kept.requires_grad:
                kept.requires_grad_(True)
        self._host[(layer, microbatch)] = (saved, event)

    def keep_call_input(self, microbatch: int, value: Any, moved: Any, check: bool) -> None:
        """Keep the call's own input ``value`` (the input of layer 0) as it came in,
        ``requires_grad`` flags included; ``moved`` is its copy on the device, which may share
        storage with it. With ``check``, its tensors kept as they are (``moved`` is a copy:
        CUDA) must not change before the backward recomputes from them: their versions are
        checked then."""
        saved = unshared(value, moved)
        self._host[(0, microbatch)] = (saved, None)
        self._versions[microbatch] = [
            (kept, version_of(kept))
            for kept, leaf in zip(flatten(saved)[0], flatten(value)[0], strict=True)
            if check and isinstance(kept, torch.Tensor) and kept is leaf
        ]

    def find(self, layer: int, microbatch: int) -> tuple[Any, Any]:
        """The input kept for ``layer``'s recompute and the event of its copy to the host."""
        saved = self._host.get((layer, microbatch))
        if saved is not None:
            if layer == 0:
                self._check_unchanged(microbatch)
            return saved
        kept = self.native.find(layer, microbatch)
        if kept is None:
            raise KeyError((layer, microbatch))  # `starts` say it was kept
        return kept, None

    def _check_unchanged(self, microbatch: int) -> None:
        """PyTorch's error for a tensor its graph saved and the user changed in place since the
        forward: the recompute would compute from other values than the forward did."""
        for kept, version in self._versions.get(microbatch, []):
            if version_of(kept) != version:
                raise RuntimeError(
                    f"RoundPipe model '{self.model}': one of the variables needed for gradient "
                    f"computation has been modified by an inplace operation: an input of the "
                    f"forward() call (microbatch {microbatch}, shape {tuple(kept.shape)}) is at "
                    f"version {version_of(kept)}; expected version {version} instead. The backward "
                    "recomputes the layers from it: do not change a forward()'s inputs in place "
                    "before its backward (clone them)."
                )


__all__ = ["SavedInputs"]
