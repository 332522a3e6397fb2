"""An optimizer's step undone where a device flag is set, for optimizers without a `found_inf` path.

`StepUndo.take` copies the parameters and the optimizer's state before the step; `undo_where(flag)`
after it puts every tensor back to its copy where the 0-d bool `flag` is set, and leaves the step
applied where it is not. Neither reads the flag on the host, and both are a fixed number of
operations per (device, dtype) whatever the number of tensors (`_Group`: flat buffers and views).

A `where` selects, so a NaN the bad step left in the unselected tensors does not matter, and the
copy comes back bit for bit (an interpolation with the flag as weight would take a host read: torch's
`_foreach_lerp_` turns a tensor weight into a Python number). State the step creates (the first
step's moments and counters) is zeroed where the flag is set, which is the fresh state of torch's
optimizers (`state_before_step`, `zero_new_state`: also the guard's, after a fused step it skipped)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch


class _Group:
    """The tensors of one device and dtype, their flat views and the two flat buffers."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.device = tensors[0].device
        self.views = [_flat(t) for t in tensors]
        total = sum(v.numel() for v in self.views)
        self.copy = torch.empty(total, dtype=tensors[0].dtype, device=self.device)
        self.stepped = torch.empty_like(self.copy)
        self.copy_chunks = list(torch.split(self.copy, [v.numel() for v in self.views]))
        self.stepped_chunks = list(torch.split(self.stepped, [v.numel() for v in self.views]))

    def take(self) -> None:
        torch._foreach_copy_(self.copy_chunks, self.views)

    def undo_where(self, flag: torch.Tensor) -> None:
        torch.cat(self.views, out=self.stepped)
        torch.where(flag, self.copy, self.stepped, out=self.stepped)
        torch._foreach_copy_(self.views, self.stepped_chunks)


class StepUndo:
    """See the module docstring. `host_flag_reason` says why a step waited for the device, if one did."""

    def __init__(self) -> None:
        self._groups: list[_Group] = []
        self._key: Any = None
        self._known: Optional[set[int]] = None  # the state before the step (None: no step can add any)
        self._optimizer: Optional[torch.optim.Optimizer] = None
        self._params: list[torch.Tensor] = []
        self.host_flag_reason: Optional[str] = None

    def take(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
        # torch's optimizers update their state in place, so from the second step on the same
        # tensors come back: the buffers are kept while the parameters, the number of state entries
        # and the first parameter's state tensors are the same ones (a loaded state dict is not).
        first = optimizer.state.get(params[0], {}) if params else {}
        key = (tuple(map(id, params)), len(optimizer.state), tuple(id(v) for v in first.values()))
        if key != self._key:
            self._build(optimizer, params)
            self._key = key
        for group in self._groups:
            group.take()

    def _build(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
        tensors: list[torch.Tensor] = list(params)
        for p in params:
            tensors.extend(v for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor))
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for t in tensors:
            by_kind.setdefault((t.device, t.dtype), []).append(t.detach())
        self._groups = [_Group(members) for members in by_kind.values()]
        self._known = state_before_step(optimizer, params)
        self._optimizer, self._params = optimizer, params

    def undo_where(self, flag: torch.Tensor) -> None:
        """After the step: every tensor back to its copy where `flag` (0-d bool) is set."""
        assert self._optimizer is not None, "take a copy first"
        flags: dict[torch.device, torch.Tensor] = {}

        def flag_on(device: torch.device) -> torch.Tensor:
            if device not in flags:
                if device != flag.device and device.type == "cpu" and flag.device.type != "cpu":
                    # torch's non-fused Adam family keeps its step counts on the CPU (unless
                    # capturable): putting them back needs the flag there, one wait per step.
                    self.host_flag_reason = "the optimizer keeps state on the CPU (step counts)"
                flags[device] = flag.to(device)
            return flags[device]

        with torch.no_grad():
            for group in self._groups:
                group.undo_where(flag_on(group.device))
            if self._known is not None:
                zero_new_state(self._optimizer, self._params, self._known, flag_on)


def state_before_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> Optional[set[int]]:
    """The ids of `params`' state tensors before a step, for `zero_new_state` after it; None when
    every parameter has state already: torch's optimizers make a parameter's state on its first step,
    so then the step can create none."""
    if all(optimizer.state.get(p) for p in params):
        return None
    return {id(v) for p in params for v in optimizer.state.get(p, {}).values()}


def zero_new_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], known: set[int],
                   flag_on: Callable[[torch.device], torch.Tensor]) -> None:
    """Zero, where the flag (`flag_on(device)`) is set, the state tensors a step created (not in
    `known`): the fresh state of torch's optimizers (zero moments and step counts; a zero momentum
    buffer acts as none). One operation per new tensor, on the steps that create state only."""
    with torch.no_grad():
        for p in params:
            for v in optimizer.state.get(p, {}).values():
                if isinstance(v, torch.Tensor) and id(v) not in known:
                    v.masked_fill_(flag_on(v.device), 0)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D view of `t`'s elements in memory order (channels_last weights included)."""
    if t.is_contiguous():
        return t.view(-1)
    if not _dense(t):
        raise ValueError(f"a tensor of shape {tuple(t.shape)} and strides {t.stride()} has gaps or overlaps; "
                         "the non-finite guard's undo needs parameters and state that are dense")
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill a contiguous block of memory, each once (in some order)."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda x: x[1]):
        if stride != expected:
            return False
        expected *= size
    return True
