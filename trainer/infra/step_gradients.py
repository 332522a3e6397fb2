"""The gradients of one optimizer step and their norms, taken once for every part that needs them.

The non-finite guard (is every gradient finite?) and the clipping (the global norm) both start from
the per-tensor 2-norms of the same gradients, just before the same optimizer step. Each used to take
its own; `step_gradients` takes them once per optimizer and step, with one multi-tensor call per
device and dtype (`torch._foreach_norm`, as `torch.nn.utils.get_total_norm` does), and hands the
same result to whoever asks next at that step. The number of operations does not grow with the
number of parameter tensors."""

from __future__ import annotations

import functools
import weakref
from typing import Optional, cast

import torch


class StepGradients:
    """The parameters of an optimizer that have a gradient at this step, and their norms."""

    def __init__(self, params: list[torch.Tensor], norms: torch.Tensor,
                 by_device: Optional[dict[torch.device, list[torch.Tensor]]] = None) -> None:
        #: The parameters with a gradient, in the order of `norms`.
        self.params = params
        #: Each gradient's 2-norm (1-D, in the gradients' dtype, or the widest of theirs and float32
        #: when they differ; on the first gradient's device): finite exactly when every element of
        #: that gradient is.
        self.norms = norms
        self._total: Optional[torch.Tensor] = None
        self._by_device = by_device

    @property
    def total(self) -> torch.Tensor:
        """The 2-norm of all the gradients together: `clip_grad_norm_`'s (the norm of the norms)."""
        if self._total is None:
            self._total = torch.linalg.vector_norm(self.norms)
        return self._total

    def grads_by_device(self) -> dict[torch.device, list[torch.Tensor]]:
        """The gradients grouped by device (for one multi-tensor call per device)."""
        if self._by_device is None:
            grouped: dict[torch.device, list[torch.Tensor]] = {}
            for p in self.params:
                assert p.grad is not None
                grouped.setdefault(p.grad.device, []).append(p.grad)
            self._by_device = grouped
        return self._by_device


_TAKEN: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, StepGradients]]" = weakref.WeakKeyDictionary()
_UNIFORM: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[tuple[int, ...], bool]]" = weakref.WeakKeyDictionary()


def step_gradients(optimizer: torch.optim.Optimizer, step: int) -> Optional[StepGradients]:
    """The gradients of `optimizer`'s parameters just before its step number `step` (the Trainer's
    global step), taken once and shared by every caller at that step; None when no parameter has a
    gradient (the step's backward was skipped)."""
    taken = _TAKEN.get(optimizer)
    if taken is not None and taken[0] == step:
        return taken[1]
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not params:
        return None
    # A parameter's gradient keeps its device and dtype from step to step: looked at once per set of
    # parameters (their ids cannot be reused while the optimizer holds them).
    key = tuple(map(id, params))
    known = _UNIFORM.get(optimizer)
    uniform = known[1] if known is not None and known[0] == key else None
    gradients = of_parameters(params, uniform)
    if uniform is None:
        _UNIFORM[optimizer] = (key, len({(p.grad.device, p.grad.dtype) for p in params}) == 1)
    _TAKEN[optimizer] = (step, gradients)
    return gradients


def of_parameters(params: list[torch.Tensor], uniform: Optional[bool] = None) -> StepGradients:
    """The norms of `params`' gradients (every one of them must have one; none: a norm of 0).
    `uniform`: whether they share one device and dtype, if the caller knows (None: looked at)."""
    if not params:
        return StepGradients([], torch.zeros(0))
    grads = cast(list[torch.Tensor], [p.grad for p in params])
    first = grads[0]
    if uniform is None:
        uniform = all(g.device == first.device and g.dtype == first.dtype for g in grads)
    if uniform:
        # As get_total_norm: the norms in the gradients' own dtype.
        return StepGradients(params, torch.stack(torch._foreach_norm(grads)), {first.device: grads})
    # Several devices or dtypes: one call per group, the parameters reordered to match.
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        assert p.grad is not None
        groups.setdefault((p.grad.device, p.grad.dtype), []).append(p)
    ordered = [p for members in groups.values() for p in members]
    dtype = functools.reduce(torch.promote_types, (dtype for _, dtype in groups), torch.float32)
    norms = [torch.stack(torch._foreach_norm(cast(list[torch.Tensor], [p.grad for p in members]))).to(first.device, dtype)
             for members in groups.values()]
    return StepGradients(ordered, torch.cat(norms))
