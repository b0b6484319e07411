"""Turning an arbitrary model into RoundPipe parts: ``wrap_model_to_roundpipe`` and
``AutoRoundPipe``.

A model that is (or, through a preset, can be rewritten as) one ``nn.Sequential`` becomes one
``RoundPipe``. Any other model is converted in place, top-down: large parts become RoundPipes
and the parents' own ``forward`` keeps running on the host, gluing them together. The root is
then held by an ``AutoRoundPipe``, which steps every part and the host-side glue parameters as
one model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from roundpipe.context import OptimizerCtx
from roundpipe.forwarding import ForwardingModule
from roundpipe.roundpipe import RoundPipe
from roundpipe.run_config import RoundPipeRunConfig

logger = logging.getLogger("roundpipe")

SkipModules = Sequence[str | type[nn.Module]]


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _has_own_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


def _chained_config(config: RoundPipeRunConfig | None) -> RoundPipeRunConfig:
    """``config`` with ``merge_output=False`` (unless set): the output of a chained ModuleList
    element stays packed per microbatch and goes straight into the next element's pipeline."""
    config = RoundPipeRunConfig() if config is None else config
    fields = {name: getattr(config, name) for name in RoundPipeRunConfig.__slots__}
    if fields["merge_output"] is None:
        fields["merge_output"] = False
    return RoundPipeRunConfig(**fields)


class _Converter:
    """The recursive strategy of ``wrap_model_to_roundpipe`` (see its docstring)."""

    def __init__(
        self,
        lower_threshold: int,
        upper_threshold: int | None,
        skip_modules: SkipModules,
        override_config: dict[str, dict[str, Any]],
        model_run_config: RoundPipeRunConfig | None,
        name: str,
        roundpipe_kwargs: dict[str, Any],
    ) -> None:
        self.lower, self.upper = lower_threshold, upper_threshold
        self.skip_names = {s for s in skip_modules if isinstance(s, str)}
        self.skip_types = tuple(s for s in skip_modules if isinstance(s, type))
        self.override_config = override_config
        self.model_run_config = model_run_config
        self.name = name
        self.roundpipe_kwargs = roundpipe_kwargs
        self.parts: list[tuple[str, RoundPipe]] = []
        self.unused_overrides = set(override_config)
        self.wrapped_params: set[int] = set()

    def make(self, module: nn.Module, path: str, chained: bool) -> RoundPipe:
        kwargs: dict[str, Any] = {
            "model_run_config": self.model_run_config,
            "name": f"{self.name}:{path or '<root>'}",
            **self.roundpipe_kwargs,
            **self.override_config.get(path, {}),
        }
        if chained:
            kwargs["model_run_config"] = _chained_config(kwargs["model_run_config"])
        self.unused_overrides.discard(path)
        params = {id(p) for p in module.parameters()}
        if params & self.wrapped_params:
            raise ValueError(
                f"module '{path}' shares parameters with another RoundPipe part (tied weights?); "
                "RoundPipe parts cannot share parameters: list one of the modules in "
                "skip_modules, or untie the weights"
            )
        self.wrapped_params |= params
        part = RoundPipe(module, **kwargs)
        self.parts.append((path, part))
        return part

    def skipped(self, module: nn.Module, path: str) -> bool:
        return path in self.skip_names or isinstance(module, self.skip_types)

    def fits_one_part(self, module: nn.Module, size: int, list_element: bool) -> bool:
        """Whether ``module`` becomes one single-layer RoundPipe rather than being split."""
        if not _has_own_forward(module):
            return False
        if self.upper is not None:
            return size <= self.upper
        # Without an upper bound, go as deep as the structure allows: the elements of a
        # ModuleList (a model's repeated blocks) and modules without parametrised children.
        return list_element or not any(_numel(child) for child in module.children())

    def convert(
        self, module: nn.Module, path: str, list_element: bool = False, chained: bool = False
    ) -> nn.Module:
        """``module`` or its replacement; its children are converted in place."""
        if self.skipped(module, path):
            return module
        if path in self.override_config:
            return self.make(module, path, chained)
        size = _numel(module)
        if size < self.lower and path:  # the root is wrapped whatever its size
            return module
        if isinstance(module, nn.Sequential):
            return self.make(module, path, chained)
        if isinstance(module, nn.ModuleList):
            self.convert_list(module, path)
            return module
        if self.fits_one_part(module, size, list_element):
            return self.make(module, path, chained)
        for child_name, child in list(module.named_children()):
            replacement = self.convert(child, f"{path}.{child_name}" if path else child_name)
            if replacement is not child:
                setattr(module, child_name, replacement)
        return module

    def convert_list(self, module: nn.ModuleList, path: str) -> None:
        """Convert the elements; all but the last pass packed outputs on to the next one (the
        parent's forward is expected to feed each element's output into the next)."""
        last = len(module) - 1
        for index, child in enumerate(list(module)):
            replacement = self.convert(
                child, f"{path}.{index}", list_element=True, chained=index < last
            )
            if replacement is not child:
                module[index] = replacement


def _no_step() -> None:
    """The step of a part whose optimizer copies the shared ``step_fn`` updates."""


@dataclass
class _GlueState:
    """The runtime of an AutoRoundPipe: the host glue's parameters and their optimizer copies,
    and whether a step carried by the last part is still to be finished."""

    params: list[tuple[str, nn.Parameter]]
    optim_dtype: torch.dtype | None
    copies: dict[int, nn.Parameter] | None = None
    step_due: bool = False
    # The glue's optimizer copies read by load_state_dict, applied once the parameters are loaded.
    loaded: dict[str, torch.Tensor] = field(default_factory=dict)


class AutoRoundPipe(ForwardingModule):
    """A model whose large parts run as RoundPipes while its own ``forward`` runs on the host.

    Built by :func:`wrap_model_to_roundpipe` for models that cannot be one ``nn.Sequential``.
    Calling it runs the (converted) model's forward; ``.backward()`` on the result runs every
    part's pipelined backward. ``optim_parameters``/``step``/``synchronize`` treat all parts and
    the parameters left on the host (the "glue") as one model; the glue has optimizer copies
    too, so asynchronous steps keep staleness 1 for every parameter.

    There is no ``forward_backward``: the host code between the parts separates their
    pipelines, so there is no single pipeline to fuse (see the error it raises).

    Attribute reads and writes the wrapper does not define go to the wrapped model (and to the
    one given to ``set_original_model``), as on a ``RoundPipe``.
    """

    parts: list[tuple[str, RoundPipe]]
    _runtime: _GlueState

    _own_state_prefix = "_roundpipe.glue."  # the host glue's optimizer copies

    def __init__(
        self,
        model: nn.Module,
        parts: Sequence[tuple[str, RoundPipe]],
        optim_dtype: torch.dtype | None = None,
    ) -> None:
        part_params = {id(p) for _, part in parts for p in part.model.parameters()}
        glue = [
            (name, param)
            for name, param in model.named_parameters()
            if id(param) not in part_params and param.requires_grad
        ]
        super().__init__(model, parts=list(parts), _runtime=_GlueState(glue, optim_dtype))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's forward (its RoundPipe parts run pipelined)."""
        return self.model(*args, **kwargs)

    def forward_backward(self, *args: Any, **kwargs: Any) -> Any:
        """Not available on an AutoRoundPipe; raises ``NotImplementedError`` saying why."""
        raise NotImplementedError(
            "AutoRoundPipe has no forward_backward: the model's own forward runs on the host "
            "between its RoundPipe parts, so there is no single pipeline to fuse. Use "
            "`loss = loss_fn(model(...), label); loss.backward()` instead, or make the model "
            "an nn.Sequential (or use a preset) so wrap_model_to_roundpipe returns a RoundPipe."
        )

    # -- parameters --------------------------------------------------------------------------

    def _glue_copy_map(self) -> dict[int, nn.Parameter]:
        glue = self._runtime
        if glue.copies is None:
            dtype = glue.optim_dtype
            glue.copies = {
                id(param): nn.Parameter(param.detach().to(dtype or param.dtype, copy=True))
                for _, param in glue.params
            }
        return glue.copies

    def optim_named_parameters(
        self, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """Named optimizer copies of every trainable parameter: each part's (named after the
        part's path) and the host glue's."""
        lead = f"{prefix}." if prefix else ""
        for path, part in self.parts:
            yield from part.optim_named_parameters(f"{lead}{path}", remove_duplicate)
        copies = self._glue_copy_map()
        for name, param in self._runtime.params:
            yield f"{lead}{name}", copies[id(param)]

    # -- optimizer ---------------------------------------------------------------------------

    def step(
        self, step_fn: Callable[..., Any], is_async: bool = True, *args: Any, **kwargs: Any
    ) -> None:
        """Run ``step_fn(*args, **kwargs)`` once over the gradients of all parts and the glue.

        Every part hands its gradients to the (single, in-order) optimizer thread; ``step_fn``
        runs after the last hand-over, so it sees every optimizer copy's ``.grad``. Asynchronous
        by default (staleness 1, as ``RoundPipe.step``); ``is_async=False`` waits and
        publishes the new weights.
        """
        if not callable(step_fn):
            raise TypeError(f"step_fn must be callable, got {type(step_fn).__name__}")
        if not isinstance(is_async, bool):
            raise TypeError(f"is_async must be a bool, got {type(is_async).__name__}")
        self._finish_step()
        glue_grads = self._take_glue_grads()
        copies = self._glue_copy_map()

        def job() -> None:
            with torch.no_grad():
                for key, grad in glue_grads:
                    master = copies[key]
                    if master.grad is None:
                        master.grad = grad.to(master.dtype, copy=True)
                    else:
                        master.grad.add_(grad)
            with OptimizerCtx():
                step_fn(*args, **kwargs)

        parts = [part for _, part in self.parts]
        if not parts:
            job()
            self._write_back_glue()
            return
        for part in parts[:-1]:
            part.step(_no_step)
        self._runtime.step_due = True
        parts[-1].step(job)
        if not is_async:
            self._finish_step()

    def synchronize(self) -> None:
        """Wait for the optimizer, publish the newest weights into every parameter and the
        accumulated gradients into the parts' ``param.grad`` (the glue's are there already)."""
        self._finish_step()
        for _, part in self.parts:
            part.synchronize()

    # -- checkpoints -------------------------------------------------------------------------

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped model's state (``model.<name>``) after draining pending work (every part's
        and the glue's new weights written back), with each part's own entries and the glue's
        optimizer copies (``_roundpipe.glue.<name>``), so a resumed run continues exactly."""
        self._finish_step()
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a ``state_dict()`` of this model; pending work is drained first. Optimizer
        copies come from the checkpoint, else from the loaded parameters."""
        if assign:
            raise ValueError(
                "assign=True would replace parameters that RoundPipe keeps in its host arenas; "
                "load with assign=False"
            )
        self._finish_step()
        parts = [part for _, part in self.parts]
        for part in parts:
            part.drain()  # gradient transfers may still be landing in the arenas
        self._check_state_dict(state_dict, strict)  # nothing changes unless all of it loads
        result = super().load_state_dict(state_dict, strict=strict)
        for part in parts:
            part.refresh_copies()
        glue = self._runtime
        saved_copies, glue.loaded = glue.loaded, {}
        if saved_copies or glue.copies is not None:
            copies = self._glue_copy_map()
            with torch.no_grad():
                for name, param in glue.params:
                    copies[id(param)].copy_(saved_copies.get(name, param))
        return result

    def _own_state(self) -> dict[str, Any]:
        """The host glue's optimizer copies, by parameter name (the parts save their own)."""
        glue = self._runtime
        if glue.copies is None:
            return {}
        return {name: glue.copies[id(param)].detach().clone() for name, param in glue.params}

    def _load_own_state(self, entries: dict[str, Any], prefix: str, error_msgs: list[str]) -> None:
        glue = self._runtime
        known = dict(glue.params)
        glue.loaded = {}
        for key in [key for key in entries if key in known]:
            value = entries.pop(key)
            self._check_entry(f"{prefix}{key}", value, known[key], error_msgs)
            glue.loaded[key] = value

    # -- internals ---------------------------------------------------------------------------

    def _take_glue_grads(self) -> list[tuple[int, torch.Tensor]]:
        """The glue's gradients of this iteration, removed from the parameters so the next
        iteration accumulates afresh while the optimizer works."""
        grads = []
        for _, param in self._runtime.params:
            if param.grad is not None:
                grads.append((id(param), param.grad))
                param.grad = None
        return grads

    def _finish_step(self) -> None:
        """Wait for the pending ``step_fn`` (carried by the last part) and write every part's and
        the glue's new weights back."""
        glue = self._runtime
        if not glue.step_due:
            return
        glue.step_due = False
        parts = [part for _, part in self.parts]
        # The last part's job runs step_fn after every other part's hand-over: once it is done,
        # every optimizer copy is final and each part may write its copies back.
        for part in reversed(parts):
            part.synchronize()
        self._write_back_glue()

    def _write_back_glue(self) -> None:
        copies = self._glue_copy_map()
        with torch.no_grad():
            for _, param in self._runtime.params:
                param.copy_(copies[id(param)])


def wrap_model_to_roundpipe(
    model: nn.Module,
    use_sequential_preset: bool | None = None,
    lower_threshold: int = 16 * 1024,
    upper_threshold: int | None = None,
    skip_modules: SkipModules = (),
    override_config: dict[str, dict[str, Any]] | None = None,
    model_run_config: RoundPipeRunConfig | None = None,
    name: str | None = None,
    **roundpipe_kwargs: Any,
) -> RoundPipe | AutoRoundPipe:
    """Wrap ``model`` for pipelined training: a ``RoundPipe`` when it is (or a preset makes it)
    one ``nn.Sequential``, otherwise an ``AutoRoundPipe`` over parts converted in place.

    Strategy, top-down from the root (module paths as in ``named_modules()``):

    1. Presets (unless ``use_sequential_preset=False``): a known Hugging Face causal LM becomes
       an equivalent ``nn.Sequential(prefix, *decoder_layers, postfix)`` in one RoundPipe.
       ``use_sequential_preset=True`` demands one (``NotImplementedError`` if there is none).
    2. Modules named in ``skip_modules`` (paths, or module classes) stay on the host, untouched.
    3. A path in ``override_config`` becomes one RoundPipe with those keyword arguments merged
       over ``roundpipe_kwargs`` (e.g. ``{"model.layers.0": {"optim_dtype": torch.float32}}``).
    4. A module (other than the root) with fewer than ``lower_threshold`` parameters
       (elements) stays on the host.
    5. An ``nn.Sequential`` becomes a multi-layer RoundPipe.
    6. An ``nn.ModuleList``'s elements are converted, and consecutive RoundPipe elements are
       chained: each passes its output packed per microbatch to the next (so the parent's
       forward must feed each element's output straight into the next one).
    7. A module with its own ``forward`` and at most ``upper_threshold`` parameters becomes a
       single-layer RoundPipe; with ``upper_threshold=None``, ModuleList elements and modules
       without parametrised children do.
    8. Otherwise its children are converted the same way and its own forward runs on the host.

    Args:
        model: the model; converted in place unless a single RoundPipe takes it whole.
        use_sequential_preset: ``None`` uses a preset when one matches, ``True`` requires one,
            ``False`` never uses one.
        lower_threshold: parameter count below which a module stays on the host.
        upper_threshold: parameter count up to which a module is wrapped whole.
        skip_modules: module paths or classes to keep on the host as they are.
        override_config: per-path RoundPipe keyword arguments (forces that path into one part).
        model_run_config: the run config of every part (default: each part its own, empty one).
        name: base name of the parts in logs and errors (default ``<class name>``).
        **roundpipe_kwargs: further ``RoundPipe`` arguments (``optim_dtype``, ``pin_model``).

    Raises:
        NotImplementedError: ``use_sequential_preset=True`` and no preset handles the model.
        ValueError: a threshold is negative or inverted, or an ``override_config`` path does
            not name a module the strategy reached.
    """
    from roundpipe.models.presets import find_preset

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if use_sequential_preset not in (None, True, False):
        raise TypeError(
            f"use_sequential_preset must be None, True or False, got {use_sequential_preset!r}"
        )
    if lower_threshold < 0:
        raise ValueError(f"lower_threshold must be >= 0, got {lower_threshold}")
    if upper_threshold is not None and upper_threshold < lower_threshold:
        raise ValueError(
            f"upper_threshold ({upper_threshold}) must be None or >= lower_threshold "
            f"({lower_threshold})"
        )
    for entry in skip_modules:
        if not isinstance(entry, (str, type)):
            raise TypeError(
                f"skip_modules entries must be module paths (str) or module classes, got {entry!r}"
            )
    override_config = dict(override_config or {})
    name = name or type(model).__name__
    if use_sequential_preset is not False:
        preset = find_preset(model)
        if preset is not None:
            logger.info("roundpipe: wrapping %s with the %s preset", type(model).__name__, preset)
            return preset.wrap(
                model,
                model_run_config=RoundPipeRunConfig()
                if model_run_config is None
                else model_run_config,
                name=name,
                **roundpipe_kwargs,
            )
        if use_sequential_preset:
            raise NotImplementedError(
                f"no sequential preset for {type(model).__name__}; presets exist for "
                "Qwen3ForCausalLM, Qwen3MoeForCausalLM, LlamaForCausalLM and GptOssForCausalLM. "
                "Pass use_sequential_preset=None (or False) to wrap it recursively."
            )
    converter = _Converter(
        lower_threshold,
        upper_threshold,
        skip_modules,
        override_config,
        model_run_config,
        name,
        roundpipe_kwargs,
    )
    root = converter.convert(model, "")
    if converter.unused_overrides:
        raise ValueError(
            f"override_config names {sorted(converter.unused_overrides)}, which the strategy "
            "never reached (no such module path, or inside a skipped or wrapped module); use "
            "paths from model.named_modules()"
        )
    if isinstance(root, RoundPipe):
        return root
    return AutoRoundPipe(root, converter.parts, roundpipe_kwargs.get("optim_dtype"))


__all__ = ["AutoRoundPipe", "wrap_model_to_roundpipe"]
