"""Turning an arbitrary model into RoundPipe parts: ``wrap_model_to_roundpipe``,
``wrap_model`` (the presets alone) and ``AutoRoundPipe``.

A model that is (or, through a preset, can be rewritten as) one ``nn.Sequential`` becomes one
``RoundPipe``. Any other model is converted in place, top-down, by roundpipe 0.1.1's recursive
rule (sizes in bytes of parameters and buffers): large parts become RoundPipes and the parents'
own ``forward`` keeps running on the host, gluing them together. The root is then held by an
``AutoRoundPipe``, which steps every part and the host-side glue parameters as one model.
"""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from roundpipe.context import OptimizerCtx
from roundpipe.device import device_count
from roundpipe.forwarding import ForwardingModule
from roundpipe.memory import module_bytes
from roundpipe.models.converter import (
    Converter,
    OverrideConfig,
    Part,
    SkipModules,
    override_kwargs,
)
from roundpipe.roundpipe import RoundPipe
from roundpipe.run_config import RoundPipeRunConfig

logger = logging.getLogger("roundpipe")

# RoundPipe constructor keywords an AutoRoundPipe accepts and ignores (its parts are built).
_IGNORED_AUTO_KWARGS = frozenset({"pin_model", "model_run_config"})


@contextmanager
def unwrapped(model: nn.Module) -> Iterator[None]:
    """``model`` as it was before ``wrap_model_to_roundpipe`` turned parts of it into
    RoundPipes, for the duration: each part's place holds the module it wraps (the same
    parameters), so ``state_dict()``, ``save_pretrained`` and PEFT see the model's own module
    tree and names. Nothing may run the model meanwhile."""
    places = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, RoundPipe)
    ]
    try:
        for parent, name, part in places:
            setattr(parent, name, part.model)
        yield
    finally:
        for parent, name, part in reversed(places):
            setattr(parent, name, part)


def _save_pretrained_unwrapped(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``save_pretrained`` of a model converted in place (bound to it as its own attribute, so
    that ``push_to_hub`` and an ``AutoRoundPipe``'s forwarded call use it too): the files of the
    model as it was, its own parameter names and tied weights, not the parts' wrapper entries."""
    with unwrapped(model):
        return type(model).save_pretrained(model, *args, **kwargs)  # type: ignore[attr-defined]


def _built(converter: Converter, root: nn.Module | Part, name: str) -> RoundPipe | AutoRoundPipe:
    """The parts ``converter`` planned, built and put in place of their modules, then the
    RoundPipe or AutoRoundPipe over the root. If anything fails on the way, every module put
    in place is taken out again: the model is left as it came (its parameters keep their values,
    in the host memory of the parts built meanwhile)."""
    placed: list[tuple[nn.Module, str | int, nn.Module]] = []
    shared = _shared_across(part.module for _, _, _, part in converter.replacements)
    try:
        for parent, key, child, part in converter.replacements:
            borrowed = [p for p in part.module.parameters() if id(p) in shared]
            _put(parent, key, RoundPipe(part.module, **part.kwargs, shared_parameters=borrowed))
            placed.append((parent, key, child))
        if isinstance(root, Part):
            return RoundPipe(root.module, **root.kwargs)
        optim_dtype = converter.roundpipe_kwargs.get("optim_dtype")
        wrapped = AutoRoundPipe(root, name=name, optim_dtype=optim_dtype)
        if placed and callable(getattr(type(root), "save_pretrained", None)):
            root.__dict__["save_pretrained"] = types.MethodType(_save_pretrained_unwrapped, root)
        return wrapped
    except BaseException:
        for parent, key, child in reversed(placed):
            _put(parent, key, child)
        raise


def _shared_across(modules: Iterable[nn.Module]) -> set[int]:
    """``id`` of each trained parameter that several of ``modules`` use (a weight tied across
    parts): the host glue trains it, and every part that uses it borrows it."""
    users: dict[int, int] = {}
    for module in modules:
        for param in module.parameters():
            if param.requires_grad:
                users[id(param)] = users.get(id(param), 0) + 1
    return {key for key, count in users.items() if count > 1}


def _put(parent: nn.Module, key: str | int, child: nn.Module) -> None:
    if isinstance(key, int):
        assert isinstance(parent, nn.ModuleList)
        parent[key] = child
    else:
        setattr(parent, key, child)


def _find_parts(model: nn.Module) -> list[tuple[str, RoundPipe]]:
    """The RoundPipes in ``model``'s module tree (``model`` itself included), by path, outermost
    only: a RoundPipe's own modules belong to it."""
    parts: list[tuple[str, RoundPipe]] = []
    seen: set[int] = set()

    def visit(module: nn.Module, path: str) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if isinstance(module, RoundPipe):
            parts.append((path, module))
            return
        for child_name, child in module.named_children():
            visit(child, f"{path}.{child_name}" if path else child_name)

    visit(model, "")
    return parts


# The glue's entry saying that its optimizer copies are one step ahead of its parameters.
_PENDING = "pending_writeback"


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

    Built by :func:`wrap_model_to_roundpipe` for models that cannot be one ``nn.Sequential``, or
    directly as ``AutoRoundPipe(model)`` over a model whose submodules are RoundPipes (the parts,
    ``parts``: ``(path, RoundPipe)`` pairs in module order).
    Calling it runs the (converted) model's forward; ``.backward()`` on the result runs every
    part's pipelined backward. ``optim_parameters``/``step``/``synchronize`` treat all parts and
    the parameters left on the host (the "glue") as one model; the glue has optimizer copies
    too, so asynchronous steps keep staleness 1 for every parameter.

    There is no ``forward_backward``: the host code between the parts separates their
    pipelines, so there is no single pipeline to fuse (see the error it raises).

    Attribute reads and writes the wrapper does not define go to the wrapped model (and to the
    one given to ``set_original_model``), as on a ``RoundPipe``.
    """

    name: str
    optim_dtype: torch.dtype | None
    parts: list[tuple[str, RoundPipe]]
    _runtime: _GlueState

    _own_state_prefix = "_roundpipe.glue."  # the host glue's optimizer copies

    def __init__(
        self,
        model: nn.Module,
        name: str | None = None,
        optim_dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> None:
        """Hold ``model``, whose RoundPipe submodules (found in its module tree) are its parts.

        Args:
            model: the model, typically with some submodules replaced by RoundPipes (as
                :func:`wrap_model_to_roundpipe` does); a model without any runs on the host.
            name: identifier in logs and errors (default: the model's class name).
            optim_dtype: dtype of the host glue's optimizer copies (default: each parameter's);
                the parts keep their own.
            **kwargs: ``RoundPipe`` keywords that do not apply here (``pin_model``,
                ``model_run_config``: the parts are built already), accepted and ignored.

        Raises:
            TypeError: an argument of the wrong type, or an unknown keyword.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str or None, got {type(name).__name__}")
        if optim_dtype is not None and not (
            isinstance(optim_dtype, torch.dtype) and optim_dtype.is_floating_point
        ):
            raise TypeError(
                f"optim_dtype must be a floating-point torch.dtype, got {optim_dtype!r}"
            )
        unknown = sorted(set(kwargs) - _IGNORED_AUTO_KWARGS)
        if unknown:
            raise TypeError(
                f"AutoRoundPipe got unexpected keyword arguments {unknown}; it takes model, name, "
                f"optim_dtype and ignores {sorted(_IGNORED_AUTO_KWARGS)}"
            )
        parts = _find_parts(model)
        data_parallel = [path for path, part in parts if part.data_parallel_size > 1]
        if data_parallel:
            raise ValueError(
                f"AutoRoundPipe: parts {data_parallel} have a data_parallel_group, but the "
                "gradients of the parameters left on the host would not be averaged across "
                "ranks; data parallelism needs the whole model in one RoundPipe (an "
                "nn.Sequential or a preset)"
            )
        # What the parts train; a weight they share (shared_parameters) is the glue's.
        part_params = {
            id(p)
            for _, part in parts
            for p in part.model.parameters()
            if not any(p is shared for shared in part.shared_parameters)
        }
        glue = [
            (param_name, param)
            for param_name, param in model.named_parameters()
            if id(param) not in part_params and param.requires_grad
        ]
        super().__init__(
            model,
            name=name if name is not None else type(model).__name__,
            optim_dtype=optim_dtype,
            parts=parts,
            _runtime=_GlueState(glue, optim_dtype),
        )

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
        for _, part in self.parts:
            part.hand_over_shared_grads()  # the weights they share are the glue's to step
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
            part.hand_over_shared_grads()
        for _, part in self.parts:
            part.synchronize()

    # -- checkpoints -------------------------------------------------------------------------

    def wait_for_step(self) -> None:
        """Wait for every part's step in flight without writing it back (the last part's job
        runs ``step_fn``: the glue's copies are then final too); ``state_dict()`` does this first,
        and ``_roundpipe.glue.pending_writeback`` records that the glue's copies are one step
        ahead."""
        for _, part in self.parts:
            part.wait_for_step()

    def drain(self) -> None:
        """Finish the pending step (every part's and the glue's write-back) and every part's
        gradient transfers (what ``load_state_dict`` does before it loads)."""
        self._finish_step()
        for _, part in self.parts:
            part.drain()

    def refresh_copies(self) -> None:
        """After a load: every part's optimizer copies and pending write-back, and the glue's
        copies (from the checkpoint, else from the loaded parameters)."""
        parts = [part for _, part in self.parts]
        for part in parts:
            part.refresh_copies()
        glue = self._runtime
        saved_copies, glue.loaded = glue.loaded, {}
        pending = saved_copies.pop(_PENDING, None)
        glue.step_due = pending is not None and bool(pending) and bool(parts)
        if saved_copies or glue.copies is not None:
            copies = self._glue_copy_map()
            with torch.no_grad():
                for name, param in glue.params:
                    copies[id(param)].copy_(saved_copies.get(name, param))

    def _own_state(self) -> dict[str, Any]:
        """The host glue's optimizer copies, by parameter name (the parts save their own)."""
        glue = self._runtime
        if glue.copies is None:
            return {}
        entries = {name: glue.copies[id(param)].detach().clone() for name, param in glue.params}
        if glue.step_due:  # the copies are one step ahead of the parameters
            entries[_PENDING] = torch.tensor(True)
        return entries

    def _load_own_state(self, entries: dict[str, Any], prefix: str, error_msgs: list[str]) -> None:
        glue = self._runtime
        known: dict[str, torch.Tensor] = dict(glue.params)
        known[_PENDING] = torch.tensor(True)
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


def wrap_model(model: nn.Module | types.FunctionType, **roundpipe_kwargs: Any) -> RoundPipe:
    """``model`` as one RoundPipe through its sequential preset (roundpipe 0.1.1's preset
    dispatcher; :func:`wrap_model_to_roundpipe` tries it first).

    Args:
        model: a Hugging Face causal LM with a preset (or a PEFT wrapper around one), or a
            Python function (0.1.1's ``"function"`` preset: ``roundpipe.models.function``).
        **roundpipe_kwargs: ``RoundPipe`` arguments (``model_run_config``, ``name``,
            ``optim_dtype``, ``pin_model``) and the presets' ``loss_chunk_size``.

    Raises:
        NotImplementedError: no preset handles ``type(model)``.
    """
    if isinstance(model, types.FunctionType):
        from roundpipe.models import function

        return function.wrap_model(model, **roundpipe_kwargs)
    from roundpipe.models.presets import find_preset

    preset = find_preset(model)
    if preset is None:
        raise NotImplementedError(
            f"no sequential preset for {type(model).__name__}; presets exist for "
            "Qwen3ForCausalLM, Qwen3MoeForCausalLM, LlamaForCausalLM and GptOssForCausalLM. "
            "Use wrap_model_to_roundpipe(model, use_sequential_preset=False) to wrap it "
            "recursively."
        )
    if "model_run_config" in roundpipe_kwargs and roundpipe_kwargs["model_run_config"] is None:
        del roundpipe_kwargs["model_run_config"]  # the preset's own default
    logger.info("roundpipe: wrapping %s with the %s preset", type(model).__name__, preset)
    return preset.wrap(model, **roundpipe_kwargs)


def wrap_with_preset(model: nn.Module, expected: type, **roundpipe_kwargs: Any) -> RoundPipe:
    """:func:`wrap_model` for a model that must be an ``expected`` (roundpipe 0.1.1's
    per-family ``wrap_model``, see ``roundpipe.models.qwen3`` and its siblings); otherwise
    ``NotImplementedError`` naming both classes."""
    if not isinstance(model, expected):
        raise NotImplementedError(
            f"model class {type(model).__name__} is not an instance of the expected class "
            f"{expected.__name__}; use roundpipe.models.wrap_model(model), which finds the "
            "preset for the model's class"
        )
    return wrap_model(model, **roundpipe_kwargs)


def _check_threshold(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int (bytes), got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 (bytes), got {value}")


def _checked_skip_modules(skip_modules: SkipModules) -> list[nn.Module | str | type[nn.Module]]:
    if isinstance(skip_modules, (str, nn.Module)):
        raise TypeError(
            "skip_modules must be a container of modules (e.g. [model.head]), module paths or "
            f"module classes, got a single {type(skip_modules).__name__}; wrap it in a list"
        )
    entries = list(skip_modules)
    for entry in entries:
        if not isinstance(entry, (nn.Module, str)) and not (
            isinstance(entry, type) and issubclass(entry, nn.Module)
        ):
            raise TypeError(
                "skip_modules entries must be module instances, module paths (str) or module "
                f"classes, got {entry!r}"
            )
    return entries


def _checked_override_config(override_config: OverrideConfig | None) -> OverrideConfig:
    if override_config is None:
        return {}
    if not isinstance(override_config, Mapping):
        raise TypeError(
            "override_config must be a dict {module or path: RoundPipeRunConfig or dict of "
            f"RoundPipe keyword arguments}}, got {type(override_config).__name__}"
        )
    for key, value in override_config.items():
        if not isinstance(key, (nn.Module, str)):
            raise TypeError(
                f"override_config keys must be module instances or module paths, got {key!r}"
            )
        override_kwargs(key, value)
    return override_config


def wrap_model_to_roundpipe(
    model: nn.Module,
    use_sequential_preset: bool | None = None,
    lower_threshold: int = 16 * 1024,
    upper_threshold: int | None = None,
    skip_modules: SkipModules = (),
    override_config: OverrideConfig | None = None,
    model_run_config: RoundPipeRunConfig | None = None,
    name: str | None = None,
    **roundpipe_kwargs: Any,
) -> RoundPipe | AutoRoundPipe:
    """Wrap ``model`` for pipelined training: a ``RoundPipe`` when it is (or a preset makes it)
    one ``nn.Sequential`` or one part, otherwise an ``AutoRoundPipe`` over parts converted in
    place.

    Strategy (roundpipe 0.1.1's), top-down from the root; sizes are the bytes of a module's
    parameters and buffers, "own" meaning not counting its children:

    1. Presets (unless ``use_sequential_preset=False``): a known Hugging Face causal LM becomes
       an equivalent ``nn.Sequential(prefix, *decoder_layers, postfix)`` in one RoundPipe
       (:func:`wrap_model`). ``use_sequential_preset=True`` demands one
       (``NotImplementedError`` if there is none); ``None`` prints a line to stderr when one is
       used.
    2. A module in ``skip_modules`` stays as it is and runs on the host.
    3. An ``nn.Sequential`` becomes a multi-layer RoundPipe.
    4. A module with its own ``forward`` whose own size is ``>= lower_threshold`` or whose total
       size is ``<= upper_threshold`` becomes a single-layer RoundPipe; if its total size is
       ``< lower_threshold`` it runs as one microbatch (``num_microbatch=1``).
    5. Every element of an ``nn.ModuleList`` becomes a RoundPipe, and all but the last pass
       their output packed per microbatch to the next (``merge_output=False`` unless set), so
       the parent's forward must feed each element's output straight into the next one.
    6. Otherwise its children are converted the same way and its own forward runs on the host.

    Extensions: ``skip_modules`` also takes module paths (as in ``named_modules()``) and
    classes; ``override_config`` also takes paths as keys, which force that module into one
    RoundPipe, and dicts of ``RoundPipe`` keyword arguments as values.

    Args:
        model: the model; converted in place unless a single RoundPipe takes it whole.
        use_sequential_preset: ``None`` uses a preset when one matches, ``True`` requires one,
            ``False`` never uses one.
        lower_threshold: own size in bytes from which a module is wrapped whole; modules
            smaller in total run as one microbatch.
        upper_threshold: total size in bytes up to which a module is wrapped whole (default:
            the model's size divided by the number of devices plus one).
        skip_modules: modules (instances, paths or classes) to keep on the host as they are.
        override_config: ``{module or path: RoundPipeRunConfig}`` for the RoundPipe built from
            that module (a dict value gives RoundPipe keyword arguments instead).
        model_run_config: the run config of every part (default: each part its own, empty one).
        name: base name of the parts in logs and errors (default ``<class name>``).
        **roundpipe_kwargs: further ``RoundPipe`` arguments (``optim_dtype``, ``pin_model``).

    Raises:
        NotImplementedError: ``use_sequential_preset=True`` and no preset handles the model.
        TypeError: an argument or an entry of ``skip_modules``/``override_config`` has the
            wrong type.
        ValueError: a negative threshold, an ``override_config`` path the strategy never
            reached, or two parts sharing parameters.

    Whatever it raises, the model is left as it came: every part is chosen and checked before
    the first is built, and a part that fails to build takes the others out again.
    """
    from roundpipe.models.presets import find_preset

    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if use_sequential_preset not in (None, True, False):
        raise TypeError(
            f"use_sequential_preset must be None, True or False, got {use_sequential_preset!r}"
        )
    _check_threshold("lower_threshold", lower_threshold)
    if upper_threshold is not None:
        _check_threshold("upper_threshold", upper_threshold)
    skip_list = _checked_skip_modules(skip_modules)
    overrides = _checked_override_config(override_config)
    name = name or type(model).__name__
    if use_sequential_preset or (use_sequential_preset is None and find_preset(model)):
        # Without a preset, wrap_model raises the NotImplementedError that True asks for.
        wrapped = wrap_model(
            model, model_run_config=model_run_config, name=name, **roundpipe_kwargs
        )
        if use_sequential_preset is None:
            print(
                f"[INFO] roundpipe: wrapped {name} ({type(model).__name__}) with its sequential "
                "preset from roundpipe.models; pass use_sequential_preset=False to wrap it "
                "recursively instead",
                file=sys.stderr,
            )
        return wrapped
    if "loss_chunk_size" in roundpipe_kwargs:
        raise TypeError(
            f"loss_chunk_size applies to the Hugging Face presets only; {name} "
            f"({type(model).__name__}) is wrapped recursively, without one: drop loss_chunk_size"
        )
    if upper_threshold is None:
        upper_threshold = module_bytes(model) // (device_count() + 1)
    converter = Converter(
        lower_threshold,
        upper_threshold,
        skip_list,
        overrides,
        model_run_config,
        name,
        roundpipe_kwargs,
    )
    # Every part is chosen and checked before the first is built, so that an error leaves the
    # model as it came.
    root = converter.convert(model, "")
    converter.check_overrides_used()
    return _built(converter, root, name)


__all__ = ["AutoRoundPipe", "unwrapped", "wrap_model", "wrap_model_to_roundpipe"]
