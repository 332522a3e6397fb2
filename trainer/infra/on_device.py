"""Values a training step keeps on its device, so that it never waits for the host.

Every read of a tensor's value on the host (`.item()`, `.tolist()`, `bool(t)`, `float(t)`) waits
for all the kernels queued before it: a step that reads one cannot launch the next step's work while
this one computes. Decisions a step makes from its own numbers (clip or not, skip or not) are
therefore made here with device arithmetic (`torch.where`, masks, counters), and the host reads them
later, at the log, checkpoint and epoch intervals, all in one read (`read_together`);
`DeviceValues` keeps such values, and their percentile, on the device."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Optional

import torch


def value_dtype(device: torch.device) -> torch.dtype:
    """float64 for recorded values (a norm and its percentile as numpy would hold them), except
    where the device has no float64 (Apple's MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def read_together(values: Mapping[str, torch.Tensor]) -> dict[str, list[float]]:
    """The host's copy of several device tensors in one read (one wait for the device), each
    flattened to a list of floats (integers up to 2**53 come back exact)."""
    if not values:
        return {}
    flat = [t.detach().reshape(-1) for t in values.values()]
    device = flat[0].device
    dtype = value_dtype(device)
    joined = torch.cat([t.to(device=device, dtype=dtype) for t in flat]).tolist()
    out, at = {}, 0
    for name, t in zip(values, flat):
        out[name] = joined[at:at + t.numel()]
        at += t.numel()
    return out


class DeviceValues:
    """Up to `capacity` values on one device, appended where a device condition holds; `ring`: once
    full, each new value replaces the oldest (a rolling window), else later values are dropped.
    The storage is made on the first append, on that value's device (`bind`)."""

    def __init__(self, capacity: int, ring: bool = False) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.ring = ring
        self._values: Optional[torch.Tensor] = None
        self._count: Optional[torch.Tensor] = None  # values held (<= capacity)
        self._next: Optional[torch.Tensor] = None  # where a ring's next value goes
        self._slots: Optional[torch.Tensor] = None
        self._pending: list[float] = []  # loaded from a checkpoint before the device was known

    @property
    def bound(self) -> bool:
        return self._values is not None

    def bind(self, device: torch.device) -> None:
        if self._values is not None and self._values.device == device:
            return
        held = self.host_values()
        dtype = value_dtype(device)
        self._values = torch.zeros(self.capacity, dtype=dtype, device=device)
        self._slots = torch.arange(self.capacity, device=device)
        self._count = torch.zeros((), dtype=torch.long, device=device)
        self._next = torch.zeros((), dtype=torch.long, device=device)
        if held:
            kept = list(held)[-self.capacity:]
            self._values[:len(kept)] = torch.tensor(kept, dtype=dtype)
            self._count.fill_(len(kept))
            self._next.fill_(len(kept) % self.capacity)
        self._pending = []

    def append(self, value: torch.Tensor, when: torch.Tensor) -> None:
        """Append `value` (a 0-d tensor) where the 0-d bool `when` holds; no host read."""
        self.bind(value.device)
        assert self._values is not None and self._count is not None and self._next is not None
        # Filled in order and never wrapped, the next slot is the count, and a full store has none.
        slot = (self._slots == (self._next if self.ring else self._count)) & when
        self._values.copy_(torch.where(slot, value.to(self._values.dtype), self._values))
        if not self.ring:
            self._count.add_(slot.any().long())
            return
        taken = when.long()
        self._count.copy_(torch.clamp(self._count + taken, max=self.capacity))
        self._next.copy_((self._next + taken) % self.capacity)

    def count(self) -> torch.Tensor:
        assert self._count is not None, "bind first"
        return self._count

    def percentile(self, q: float) -> torch.Tensor:
        """The `q`th percentile of the values held, exactly as `numpy.percentile(..., method="linear")`
        (the same index arithmetic and interpolation formula); NaN when none."""
        assert self._values is not None and self._count is not None and self._slots is not None, "bind first"
        n = self._count
        ordered = torch.sort(torch.where(self._slots < n, self._values,
                                         torch.full_like(self._values, math.inf))).values
        # numpy: virtual index (n - 1) * (q / 100), floor and the next one (clipped to the last).
        position = (n - 1).clamp(min=0).to(ordered.dtype) * (q / 100.0)
        below = torch.floor(position).long()
        above = torch.minimum(below + 1, (n - 1).clamp(min=0))
        gamma = position - below.to(ordered.dtype)
        low = ordered.gather(0, below.reshape(1)).reshape(())
        high = ordered.gather(0, above.reshape(1)).reshape(())
        # torch.lerp uses numpy's two-sided formula: a + (b - a) t below t = 0.5, b - (b - a)(1 - t) above.
        value = torch.lerp(low, high, gamma)
        return torch.where(n > 0, value, torch.full_like(value, math.nan))

    def host_values(self) -> list[float]:
        """The values held, oldest first (a host read: for checkpoints and records)."""
        if self._values is None:
            return list(self._pending)
        assert self._count is not None and self._next is not None
        got = read_together({"values": self._values, "count": self._count, "next": self._next})
        # A ring's oldest value is where the next goes; a store filled in order starts at 0.
        count, start = int(got["count"][0]), int(got["next"][0]) if self.ring else 0
        values = got["values"]
        if count < self.capacity:
            return values[:count]
        return values[start:] + values[:start]

    def load(self, values: Sequence[float]) -> None:
        """Hold `values` (oldest first) instead of what is held now."""
        self._pending = [float(v) for v in values][-self.capacity:]
        device = self._values.device if self._values is not None else None
        self._values = None
        if device is not None:
            self.bind(device)


def scalar(value: float, device: torch.device, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A 0-d tensor on `device` (made once, at set-up: a host value copied to the device each step
    would make the host wait on CUDA)."""
    return torch.tensor(value, dtype=dtype or value_dtype(device), device=device)
