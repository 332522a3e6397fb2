"""Selective activation checkpointing: trade compute for memory on chosen stages of a model.

A checkpointed stage keeps only its input in the forward pass and recomputes its internals in
backward: a few large stages (``layer3`` of a ResNet) often fit a bigger batch or image for about
one extra forward of those stages; ``blocks.*`` names every child of ``blocks`` (each block of a
Transformer, however many). Only the stage's instance ``forward`` is patched, so every
parameter and buffer keeps its name and a checkpoint saved with checkpointing on loads with it off."""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from trainer.infra.errors import UserError, choices

DEFAULT_KEY = "model.activation_checkpointing"


class _CheckpointedForward:
    """Replacement for a stage's ``forward``, stored on the instance. A class rather than a closure: it
    holds the module as an ordinary attribute, so ``copy.deepcopy`` (EMA copies) and pickling rebind it
    to the copied module instead of leaving the copy calling into the original."""

    def __init__(self, module: nn.Module, inner: Callable[..., Any] | None) -> None:
        self.module = module
        # Another instance-level forward that was already there (rare); None means the class's.
        self.inner = inner

    def _plain_forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Checkpointing only pays off when a backward will follow: in eval or under no_grad
        # nothing is stored anyway, and recomputation would never happen.
        if not (self.module.training and torch.is_grad_enabled()):
            return self._plain_forward(*args, **kwargs)
        # preserve_rng_state: dropout inside the stage must draw the same mask when recomputed, or the
        # gradient would belong to a different forward than the loss.
        return checkpoint(self._plain_forward, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=partial(_contexts, self.module), **kwargs)


def _contexts(stage: nn.Module) -> tuple[contextlib.AbstractContextManager[None],
                                         contextlib.AbstractContextManager[None]]:
    return contextlib.nullcontext(), _scratch_norm_buffers(stage)


@contextlib.contextmanager
def _scratch_norm_buffers(stage: nn.Module) -> Iterator[None]:
    """During recomputation, let norm layers write their running statistics to throw-away copies.

    The recompute is a second training-mode forward, so BatchNorm (and InstanceNorm with
    ``track_running_stats``) would fold the same batch into its running statistics again and count
    it twice in ``num_batches_tracked``. Momentum 0 would not stop the counter, and restoring the
    buffers in place would bump the version of tensors the recomputed graph saved for backward.
    Clones avoid both; they carry the current values, so ``momentum=None`` (a cumulative average)
    computes exactly what it did in the first forward."""
    saved: list[tuple[nn.Module, dict[str, torch.Tensor | None]]] = []
    try:
        for module in stage.modules():
            if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats:
                saved.append((module, dict(module._buffers)))
                module._buffers.update({name: buffer.detach().clone() for name, buffer in module._buffers.items()
                                        if buffer is not None})
        yield
    finally:
        # Runs on early stop too: checkpoint ends the recompute by raising through this context
        # once it has every tensor it needs.
        for module, originals in saved:
            module._buffers.update(originals)


def apply_activation_checkpointing(model: nn.Module, stages: Sequence[str], key: str = DEFAULT_KEY) -> list[str]:
    """Checkpoint each named submodule (dotted names: ``layer3``, ``features.4``) in training; the names
    applied, as `select_stages` checks them (a nested stage would be recomputed twice). Applying a stage
    twice is harmless."""
    wanted = select_stages(model, stages, key)
    for name in wanted:
        module = model.get_submodule(name)
        if isinstance(module.__dict__.get("forward"), _CheckpointedForward):
            continue
        module.forward = _CheckpointedForward(module, module.__dict__.get("forward"))
    return wanted


def select_stages(model: nn.Module, stages: Sequence[str], key: str = DEFAULT_KEY) -> list[str]:
    """The stages `apply_activation_checkpointing` would checkpoint, checked, without changing
    `model`: the given names in order without repeats, ``name.*`` standing for each direct child of
    ``name`` (``blocks.*``: every block of a Transformer); `UserError` for a missing or nested one."""
    if isinstance(stages, str):
        # A single name from a config (``activation_checkpointing: layer3``), not its letters.
        stages = [stages]
    wanted: list[str] = []
    for name in stages:
        if not isinstance(name, str) or not name.strip():
            raise UserError(key, f"stage names must be non-empty strings, got {name!r}",
                            choices(_candidate_names(model)))
        for expanded in _expand_wildcard(model, name.strip(), key):
            if expanded not in wanted:
                wanted.append(expanded)

    for name in wanted:
        try:
            model.get_submodule(name)
        except AttributeError:
            raise UserError(key, f"no submodule named '{name}'", choices(_candidate_names(model))) from None

    # Nesting is checked against stages applied earlier as well as this call's.
    all_names = set(checkpointed_stages(model)) | set(wanted)
    for name in wanted:
        for other in all_names:
            if other != name and name.startswith(other + "."):
                raise UserError(key, f"'{name}' is inside '{other}', which is checkpointed as a "
                                     "whole; list only one of them")
    return wanted


def _expand_wildcard(model: nn.Module, name: str, key: str) -> list[str]:
    """``parent.*``: the direct children of ``parent``, in order (a list of blocks is named once,
    whatever its length); any other name as it is."""
    if not name.endswith(".*"):
        return [name]
    parent = name[:-2]
    try:
        module = model.get_submodule(parent) if parent else None
    except AttributeError:
        module = None
    if module is None:
        raise UserError(key, f"no submodule named '{parent}' (in '{name}')", choices(_candidate_names(model)))
    children = [f"{parent}.{child}" for child, _ in module.named_children()]
    if not children:
        raise UserError(key, f"'{parent}' has no submodules for '{name}' to stand for",
                        choices(_candidate_names(model)))
    return children


def checkpointed_stages(model: nn.Module) -> list[str]:
    """Dotted names of the submodules whose forward is checkpointed, in module order."""
    return [name for name, module in model.named_modules()
            if isinstance(module.__dict__.get("forward"), _CheckpointedForward)]


def _candidate_names(model: nn.Module) -> list[str]:
    """Top-level and second-level children: the usual granularity of a stage, short to list."""
    names: list[str] = []
    for name, child in model.named_children():
        names.append(name)
        names.extend(f"{name}.{grandchild}" for grandchild, _ in child.named_children())
    return names
