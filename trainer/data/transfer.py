"""The host-to-device copy of a batch on a side CUDA stream (`SideStreamCopy`), so that it overlaps
the compute of the step before instead of queueing behind it on the compute stream (docs/config.md,
"Loader keys"). Where the copy cannot be asynchronous (not CUDA, or host memory not page-locked)
this is Lightning's own move, unchanged."""

from __future__ import annotations

from typing import Any, Callable

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning_utilities.core.apply_func import apply_to_collection


def _pinned(tensor: torch.Tensor) -> bool:
    return tensor.is_pinned()


def tensors_of(batch: Any) -> list[torch.Tensor]:
    """The tensors of a (nested) batch, in the collections Lightning's move walks (sequences,
    mappings, dataclasses)."""
    found: list[torch.Tensor] = []
    apply_to_collection(batch, torch.Tensor, found.append)
    return found


def can_overlap(batch: Any, device: torch.device) -> bool:
    """Whether the batch's copy to `device` can run asynchronously on a side stream: a CUDA target and
    every host tensor page-locked (a copy from pageable memory is synchronous whatever the stream)."""
    if torch.device(device).type != "cuda":
        return False
    tensors = [t for t in tensors_of(batch) if t.device.type == "cpu"]
    return bool(tensors) and all(_pinned(t) for t in tensors)


class SideStreamCopy:
    """Moves batches to a CUDA device on a side stream (one per device, made on first use). `cuda` is
    `torch.cuda` (a stand-in in the tests); `move` is Lightning's move, used on the side stream and,
    unchanged, for every batch that cannot overlap."""

    def __init__(self, cuda: Any = None, move: Callable[[Any, torch.device], Any] = move_data_to_device) -> None:
        self._cuda = cuda
        self.move = move
        self._streams: dict[Any, Any] = {}
        #: Batches copied on the side stream, and those moved as Lightning does (for the tests and a report).
        self.overlapped = 0
        self.plain = 0

    @property
    def cuda(self) -> Any:
        return self._cuda if self._cuda is not None else torch.cuda

    def __getstate__(self) -> dict[str, Any]:
        # The data module that holds this is pickled and deep-copied (DDP's spawn, a multirun's
        # copies): streams cannot be, and a copy makes its own on first use.
        return {**self.__dict__, "_streams": {}}

    def __call__(self, batch: Any, device: torch.device) -> Any:
        device = torch.device(device)
        if not can_overlap(batch, device):
            self.plain += 1
            return self.move(batch, device)
        compute = self.cuda.current_stream(device)
        side = self._stream(device)
        with self.cuda.stream(side):
            moved = self.move(batch, device)  # non_blocking: Lightning's move sets it for CUDA targets
            copied = self.cuda.Event()
            copied.record(side)
        # The step's kernels start after the copy ends (the host does not wait); the allocator, which
        # tracks memory by the side stream, must not hand the tensors out while the step reads them.
        compute.wait_event(copied)
        for tensor in tensors_of(moved):
            tensor.record_stream(compute)
        self.overlapped += 1
        return moved

    def _stream(self, device: torch.device) -> Any:
        key = device.index if device.index is not None else self.cuda.current_device()
        if key not in self._streams:
            self._streams[key] = self.cuda.Stream(device=device)
        return self._streams[key]
