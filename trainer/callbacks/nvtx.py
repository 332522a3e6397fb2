"""NVTX ranges around the phases of a training step (data, forward, backward, optimizer), read from
Lightning's hooks, so that a capture with Nsight Systems shows each step's phases above its kernels
(docs/diagnosis.md, "NVTX ranges and Nsight Systems"). One range is open at a time, and every range
pushed is popped, also when the fit stops on an exception. Only on CUDA: elsewhere (or a torch
without NVTX) the callback does nothing. NVTX marks cost about a microsecond each and put no sync on
the device."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

#: The phases, in the order a step goes through them.
PHASES = ("data", "forward", "backward", "optimizer")


def nvtx_available(device: Optional[torch.device] = None) -> tuple[bool, str]:
    """Whether NVTX ranges can be marked for a run on `device` (None: CUDA if there is one), and the
    words the profile's output uses."""
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return False, "NVTX ranges: off (no CUDA)"
    try:
        torch.cuda.nvtx.range_push("probe")
        torch.cuda.nvtx.range_pop()
    except Exception as ex:  # noqa: BLE001 - a torch built without NVTX: the ranges step aside
        return False, f"NVTX ranges: off (this torch cannot mark them: {type(ex).__name__})"
    return True, "NVTX ranges: on (" + ", ".join(PHASES) + "): capture with nsys profile -t cuda,nvtx"


class NvtxRanges(Callback):
    """Marks each training step's phases as NVTX ranges (see the module docstring) for a run on
    `device`. `nvtx` is torch.cuda.nvtx (a stand-in in the tests); `enabled` None: where
    `nvtx_available` says so."""

    def __init__(self, device: Optional[torch.device] = None, enabled: Optional[bool] = None,
                 nvtx: Any = None) -> None:
        if enabled is None:
            enabled, self.status = nvtx_available(device)
        else:
            self.status = "NVTX ranges: on" if enabled else "NVTX ranges: off"
        self.enabled = enabled
        self.nvtx = nvtx if nvtx is not None else torch.cuda.nvtx
        self.depth = 0  # ranges this callback has pushed and not yet popped (0 or 1)

    def _enter(self, phase: Optional[str]) -> None:
        """Close the open phase, if any, and open `phase` (None: none)."""
        if not self.enabled:
            return
        if self.depth:
            self.nvtx.range_pop()
            self.depth -= 1
        if phase is not None:
            self.nvtx.range_push(phase)
            self.depth += 1

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._enter("data")

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._enter("forward")

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self._enter("backward")

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._enter("optimizer")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._enter("data")

    # Every way out of the loop closes what is open, so that the ranges stay balanced.
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._enter(None)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._enter(None)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._enter(None)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._enter(None)
