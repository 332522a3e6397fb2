"""The gradients of one optimizer step and their norms, taken once for every part that needs them.

The non-finite guard (is every gradient finite?) and the clipping (the global norm) both start from
the per-tensor 2-norms of the same gradients, just before the same optimizer step: `step_gradients`
takes them once per optimizer and step, with one multi-tensor call per device and dtype
(`torch._foreach_norm`, as `torch.nn.utils.get_total_norm` does), whatever the number of parameter
tensors, and hands the same result to whoever asks next at that step."""

from __future__ import annotations

import functools
import weakref
from typing import Optional, cast

import torch


class StepGradients:
    """The parameters of an optimizer that have a gradient at this step, and their norms."""

    def __init__(self, params: list[torch.Tensor], norms: torch.Tensor | list[torch.Tensor],
                 by_device: Optional[dict[torch.device, list[torch.Tensor]]] = None) -> None:
        #: The parameters with a gradient, in the order of `norms`.
        self.params = params
        # The norms as one tensor, or (not stacked yet) each gradient's as a 0-d tensor of one dtype and device.
        self._norms: Optional[torch.Tensor] = norms if isinstance(norms, torch.Tensor) else None
        self._parts = norms if isinstance(norms, list) else None
        self._total: Optional[torch.Tensor] = None
        self._by_device = by_device

    @property
    def norms(self) -> torch.Tensor:
        """Each gradient's 2-norm (1-D, in the gradients' dtype, or the widest of theirs and float32
        when they differ; on the first gradient's device): finite exactly when every element of that
        gradient is."""
        if self._norms is None:
            assert self._parts is not None
            self._norms = torch.stack(self._parts)
        return self._norms

    @property
    def dtype(self) -> torch.dtype:
        return self._norms.dtype if self._norms is not None else cast(list[torch.Tensor], self._parts)[0].dtype

    @property
    def device(self) -> torch.device:
        return self._norms.device if self._norms is not None else cast(list[torch.Tensor], self._parts)[0].device

    def stack_into(self, row: torch.Tensor, norms_view: torch.Tensor, after: torch.Tensor) -> bool:
        """The norms, then `after` (a 0-d tensor of their dtype and device), written into `row` (1-D,
        one longer than the norms) in one operation, `norms_view` (a view of row's first entries,
        made once by the caller) becoming `norms`. False, with nothing written, when the norms were
        already stacked (read before, or from gradients of several dtypes or devices)."""
        if self._parts is None or self._norms is not None:
            return False
        torch.stack([*self._parts, after], out=row)
        self._norms = norms_view
        return True

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


class _Taken:
    """An optimizer's last step gradients, and whether its parameters' gradients share one device
    and dtype (a gradient keeps both from step to step: looked at once per set of parameters, held
    here with their ids so that no other tensor can take one)."""

    def __init__(self) -> None:
        self.step = -1
        self.gradients: Optional[StepGradients] = None
        self.params: tuple[int, ...] = ()
        self.held: list[torch.Tensor] = []  # the parameters of `params`, held: no other tensor takes their ids
        self.uniform = False
        self._first: Optional[tuple[torch.Tensor, int]] = None  # the first gradient taken, and its version

    def current(self, step: int) -> bool:
        """Whether the gradients taken are still this step's: the same step number, and the first
        gradient the same tensor, unchanged (a step number alone could come again: the same optimizer
        in a second fit; a backward since makes new gradients or adds into them)."""
        if self.step != step or self.gradients is None or self._first is None:
            return False
        grad, version = self._first
        return self.gradients.params[0].grad is grad and grad._version == version

    def keep(self, step: int, gradients: StepGradients) -> None:
        grad = gradients.params[0].grad
        assert grad is not None
        self.step, self.gradients, self._first = step, gradients, (grad, grad._version)


def steps_in_kernel(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` hands its gradients to one fused kernel that reads a GradScaler's
    `grad_scale` (divides every gradient by it, in place, as it steps) and `found_inf` (skips the step
    on the device): torch.optim's fused Adam, AdamW, SGD and Adagrad."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and bool(optimizer.defaults.get("fused"))


_TAKEN: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _Taken]" = weakref.WeakKeyDictionary()


def step_gradients(optimizer: torch.optim.Optimizer, step: int) -> Optional[StepGradients]:
    """The gradients of `optimizer`'s parameters just before its step number `step` (the Trainer's
    global step), taken once and shared by every caller at that step; None when no parameter has a
    gradient (the step's backward was skipped)."""
    taken = _TAKEN.get(optimizer)
    if taken is None:
        taken = _TAKEN[optimizer] = _Taken()
    elif taken.current(step):
        return taken.gradients
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not params:
        return None
    key = tuple(map(id, params))
    if key != taken.params:
        taken.params, taken.held = key, params
        taken.uniform = len({(p.grad.device, p.grad.dtype) for p in params}) == 1
    gradients = of_parameters(params, taken.uniform)
    taken.keep(step, gradients)
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
        return StepGradients(params, list(torch._foreach_norm(grads)), {first.device: grads})
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
