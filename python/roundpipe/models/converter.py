"""The conversion plan of ``wrap_model_to_roundpipe``: which modules of a model become RoundPipes.

roundpipe 0.1.1's recursive rule, on sizes in bytes of parameters and buffers: a module is kept
on the host (skipped), recursed into, or planned as one RoundPipe (a :class:`Part`) with the
keyword arguments its ``override_config`` entry adds. :class:`Converter` walks the model
top-down and records the replacements; ``roundpipe.models.wrap`` builds them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from roundpipe.memory import module_bytes
from roundpipe.run_config import RoundPipeRunConfig

logger = logging.getLogger("roundpipe")

SkipModules = Iterable[nn.Module | str | type[nn.Module]]
OverrideValue = RoundPipeRunConfig | Mapping[str, Any]
OverrideConfig = Mapping[nn.Module | str, OverrideValue]


def _has_own_forward(module: nn.Module) -> bool:
    # The bound method, so a forward assigned to the instance counts too.
    forward = module.forward
    return getattr(forward, "__func__", forward) is not nn.Module.forward


def _derived_config(
    config: RoundPipeRunConfig | None, chained: bool, single_microbatch: bool
) -> RoundPipeRunConfig | None:
    """``config`` adjusted for where the part sits; ``None`` (each part its own default) when
    nothing changes.

    A chained ModuleList element gets ``merge_output=False`` unless set: its output stays packed
    per microbatch and goes straight into the next element's pipeline. A module below
    ``lower_threshold`` runs as one microbatch (splitting it gains nothing)."""
    if not chained and not single_microbatch:
        return config
    base = RoundPipeRunConfig() if config is None else config
    fields = {name: getattr(base, name) for name in RoundPipeRunConfig.__slots__}
    if chained and fields["merge_output"] is None:
        fields["merge_output"] = False
    if single_microbatch:
        fields["num_microbatch"] = 1
    return RoundPipeRunConfig(**fields)


def override_kwargs(key: object, value: object) -> dict[str, Any]:
    """An ``override_config`` value as RoundPipe keyword arguments."""
    if isinstance(value, RoundPipeRunConfig):
        return {"model_run_config": value}
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(
        f"override_config[{key!r}] must be a RoundPipeRunConfig or a dict of RoundPipe keyword "
        f"arguments, got {type(value).__name__}"
    )


class Converter:
    """The recursive strategy of ``wrap_model_to_roundpipe`` (see its docstring)."""

    def __init__(
        self,
        lower_threshold: int,
        upper_threshold: int,
        skip_modules: list[nn.Module | str | type[nn.Module]],
        override_config: OverrideConfig,
        model_run_config: RoundPipeRunConfig | None,
        name: str,
        roundpipe_kwargs: dict[str, Any],
    ) -> None:
        self.lower, self.upper = lower_threshold, upper_threshold
        self.skip_ids = {id(s) for s in skip_modules if isinstance(s, nn.Module)}
        self.skip_names = {s for s in skip_modules if isinstance(s, str)}
        self.skip_types = tuple(s for s in skip_modules if isinstance(s, type))
        self.path_overrides = {
            key: override_kwargs(key, value)
            for key, value in override_config.items()
            if isinstance(key, str)
        }
        self.module_overrides = {
            id(key): (key, override_kwargs(key, value))
            for key, value in override_config.items()
            if isinstance(key, nn.Module)
        }
        self.model_run_config = model_run_config
        self.name = name
        self.roundpipe_kwargs = roundpipe_kwargs
        self.unused_paths = set(self.path_overrides)
        self.unused_modules = set(self.module_overrides)
        # (parent, attribute name or ModuleList index, child, the part replacing it), in the
        # order the strategy reached them.
        self.replacements: list[tuple[nn.Module, str | int, nn.Module, Part]] = []

    def make(
        self, module: nn.Module, path: str, chained: bool = False, single_microbatch: bool = False
    ) -> Part:
        """The part ``module`` becomes, checked but not built yet (see :func:`_built`)."""
        override = self.override_for(module, path)
        kwargs: dict[str, Any] = {
            "name": f"{self.name}:{path or '<root>'}",
            **self.roundpipe_kwargs,
            **override,
        }
        if "model_run_config" not in override:  # an overriding config is used as given
            kwargs["model_run_config"] = _derived_config(
                self.model_run_config, chained, single_microbatch
            )
        return Part(module, kwargs)

    def override_for(self, module: nn.Module, path: str) -> dict[str, Any]:
        entry = self.module_overrides.get(id(module))
        if entry is not None:
            self.unused_modules.discard(id(module))
            return entry[1]
        self.unused_paths.discard(path)
        return self.path_overrides.get(path, {})

    def skipped(self, module: nn.Module, path: str) -> bool:
        return (
            id(module) in self.skip_ids
            or path in self.skip_names
            or isinstance(module, self.skip_types)
        )

    def convert(self, module: nn.Module, path: str) -> nn.Module | Part:
        """``module`` or the part replacing it; the replacements of its children are listed in
        ``replacements`` (built by :func:`_built`)."""
        if self.skipped(module, path):
            return module
        if path in self.path_overrides:  # our extension: a path override forces one part
            return self.make(module, path)
        if isinstance(module, nn.Sequential):
            return self.make(module, path)
        total = module_bytes(module)
        if _has_own_forward(module) and (
            module_bytes(module, recurse=False) >= self.lower or total <= self.upper
        ):
            return self.make(module, path, single_microbatch=total < self.lower)
        if isinstance(module, nn.ModuleList):
            self.convert_list(module, path)
            return module
        for child_name, child in list(module.named_children()):
            replacement = self.convert(child, f"{path}.{child_name}" if path else child_name)
            if isinstance(replacement, Part):
                self.replacements.append((module, child_name, child, replacement))
        return module

    def convert_list(self, module: nn.ModuleList, path: str) -> None:
        """Every element becomes a RoundPipe; all but the last pass packed outputs on to the next
        one (the parent's forward is expected to feed each element's output into the next).
        An element without a forward of its own (a container) is converted like any module."""
        last = len(module) - 1
        for index, child in enumerate(list(module)):
            child_path = f"{path}.{index}" if path else str(index)
            if self.skipped(child, child_path):
                continue
            if isinstance(child, nn.Sequential) or _has_own_forward(child):
                replacement: nn.Module | Part = self.make(child, child_path, chained=index < last)
            else:
                replacement = self.convert(child, child_path)
            if isinstance(replacement, Part):
                self.replacements.append((module, index, child, replacement))

    def check_overrides_used(self) -> None:
        if self.unused_paths:
            raise ValueError(
                f"override_config names {sorted(self.unused_paths)}, "
                "which the strategy never reached (no such module path, or inside a skipped or "
                "wrapped module); use paths from model.named_modules()"
            )
        for key in self.unused_modules:
            module = self.module_overrides[key][0]
            # roundpipe 0.1.1 ignores such an entry silently; say so, without failing.
            logger.warning(
                "override_config entry for a %s was not used: that module did not become a "
                "RoundPipe of its own (it was recursed into, skipped, or is inside a part)",
                type(module).__name__,
            )


@dataclass
class Part:
    """A module the strategy turns into a RoundPipe, and that RoundPipe's keyword arguments."""

    module: nn.Module
    kwargs: dict[str, Any]


__all__ = [
    "Converter",
    "OverrideConfig",
    "OverrideValue",
    "Part",
    "SkipModules",
    "override_kwargs",
]
