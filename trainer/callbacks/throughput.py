"""Training throughput, measured honestly.

Lightning's ThroughputMonitor reports rolling means and has no notion of warm-up; this one skips the
warm-up steps, times windows of steps within an epoch with the device synchronized only at their
ends, and reports the median window (docs/diagnosis.md, "Throughput and MFU, honestly")."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback


def batch_size_of(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, (list, tuple)) and batch:
        return batch_size_of(batch[0])
    if isinstance(batch, dict) and batch:
        return batch_size_of(next(iter(batch.values())))
    raise TypeError(f"cannot tell the batch size of {type(batch).__name__}")


def image_side(batch: Any) -> int | None:
    """The side of a batch's images (NCHW first element), None for other batches."""
    images = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    if isinstance(images, torch.Tensor) and images.ndim == 4:
        return int(images.shape[-1])
    return None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _pooled(partial: list[tuple[int, float]]) -> float | None:
    """The count per second over unfinished windows of (count, seconds), pooled; None without time."""
    seconds = sum(t for _, t in partial)
    return sum(n for n, _ in partial) / seconds if seconds > 0 else None


class ThroughputMeter(Callback):
    INCLUDES = "data wait + forward + backward + optimizer step; excludes validation and warm-up"
    WARMUP_STEPS = 5
    WINDOW_STEPS = 10

    def __init__(self, warmup_steps: int = WARMUP_STEPS, window_steps: int = WINDOW_STEPS, flops_per_sample: int | None = None,
                 peak_flops: float | None = None, mfu_note: str = "", unit: str = "samples",
                 units_of: Callable[[Any], int | torch.Tensor] | None = None,
                 bf16_peak_flops: float | None = None) -> None:
        """`unit`: what the task counts a batch in; `units_of(batch)`: how many a batch holds (an int,
        or a device tensor summed on the device and read at a window's end). With a unit other than
        samples, `flops_per_sample` is per unit, and the rate of units is reported beside samples/s."""
        self.warmup_steps = warmup_steps
        self.window_steps = window_steps
        self.flops_per_sample = flops_per_sample
        self.unit = unit
        self.units_of = units_of if unit != "samples" else None
        #: The rate of units per window (tokens/s), beside window_rates (samples/s).
        self.window_unit_rates: list[float] = []
        self._units: int | torch.Tensor = 0
        self.peak_flops = peak_flops
        self.bf16_peak_flops = bf16_peak_flops
        self.mfu_note = mfu_note
        self.window_rates: list[float] = []
        self._unlogged: dict[str, float] = {}  # the latest window's rates, until the loggers have them
        #: Each timed window's (start, end) in `time.perf_counter()` seconds, this attempt only: what
        #: a sampler of the device's utilisation averages over (trainer/callbacks/utilisation.py).
        self.window_spans: list[tuple[float, float]] = []
        #: The image side of each window (progressive resizing changes it per epoch; None: not images).
        self.window_sides: list[int | None] = []
        #: The image side of each epoch's first batch, by epoch (what progressive resizing trained at).
        self.side_by_epoch: dict[int, int] = {}
        self._partial: list[tuple[int, float]] = []
        self._partial_units: list[tuple[int, float]] = []
        self._warmup_left = warmup_steps
        self._side: int | None = None
        # (clock at the window's start, samples and steps since); the clock is read after a device sync only
        # at a window's ends: syncing every step would stop the host queueing the next step.
        self._anchor: tuple[float, int, int] | None = None
        #: Processes training in step with this one (DDP, FSDP): each step of this process is one
        #: step of all of them, so samples/s counts the global batch and MFU divides by the devices.
        self.processes = 1

    @property
    def mfu_known(self) -> bool:
        return bool(self.flops_per_sample and self.peak_flops)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.processes = trainer.world_size

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._anchor = None  # the first step of an epoch includes starting the loader

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        side = image_side(batch)
        if side is not None and trainer.current_epoch not in self.side_by_epoch:
            self.side_by_epoch[trainer.current_epoch] = side
        if side != self._side:
            if self._side is not None:
                # A new image size: its first steps pick new kernels (cuDNN autotuning) or compile
                # another graph, so it gets a warm-up of its own.
                self._warmup_left = self.warmup_steps
                self._anchor = None
            self._side = side
        if self._warmup_left > 0:
            self._warmup_left -= 1
            return
        if self._anchor is None:
            synchronize(pl_module.device)
            self._anchor = (time.perf_counter(), 0, 0)
            self._units = 0
            return
        start, samples, steps = self._anchor
        samples += batch_size_of(batch) * self.processes
        if self.units_of is not None:
            self._units = self._units + self.units_of(batch)
        steps += 1
        if steps < self.window_steps:
            self._anchor = (start, samples, steps)
            return
        synchronize(pl_module.device)
        now = time.perf_counter()
        rate = samples / (now - start)
        self.window_rates.append(rate)
        self.window_spans.append((start, now))
        self.window_sides.append(self._side)
        fresh = {"perf/samples_per_s": rate}
        if self.units_of is not None:
            # This process's units times the processes: every process's batch is alike in shape.
            unit_rate = int(self._units) * self.processes / (now - start)
            self.window_unit_rates.append(unit_rate)
            fresh[f"perf/{self.unit}_per_s"] = unit_rate
        if self.mfu_known:
            fresh["perf/mfu"] = self._mfu(self.window_unit_rates[-1] if self.units_of is not None else rate)
        self._unlogged = fresh
        self._anchor = (now, 0, 0)
        self._units = 0

    def logged_values(self) -> dict[str, float]:
        """The latest window's rates (and MFU), once, for the loggers (trainer/callbacks/step_log.py):
        written at the first log step after the window ended."""
        fresh, self._unlogged = self._unlogged, {}
        return fresh

    def _close_partial(self, pl_module: L.LightningModule) -> None:
        """An unfinished window ends at the next point where training pauses (validation, the
        epoch's end); it is kept only for runs too short to fill one window."""
        if self._anchor is not None and self._anchor[2] > 0:
            synchronize(pl_module.device)
            start, samples, _ = self._anchor
            seconds = time.perf_counter() - start
            self._partial.append((samples, seconds))
            if self.units_of is not None:
                self._partial_units.append((int(self._units) * self.processes, seconds))
        self._anchor = None
        self._units = 0

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "fit":  # not a stand-alone validate()
            self._close_partial(pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close_partial(pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close_partial(pl_module)

    def state_dict(self) -> dict[str, Any]:
        """The windows measured so far go into every checkpoint: a resumed run's rate is the median
        over the windows of all its attempts (each attempt skips its own warm-up again), and a run
        resumed after its training ended reports the rate its training had."""
        return {"window_rates": list(self.window_rates), "window_sides": list(self.window_sides),
                "side_by_epoch": {str(k): v for k, v in self.side_by_epoch.items()},
                "partial": [list(p) for p in self._partial], "window_unit_rates": list(self.window_unit_rates),
                "partial_units": [list(p) for p in self._partial_units]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.window_rates = [float(r) for r in state_dict.get("window_rates", [])]
        self.window_sides = list(state_dict.get("window_sides", [None] * len(self.window_rates)))
        self.side_by_epoch = {int(k): int(v) for k, v in state_dict.get("side_by_epoch", {}).items()}
        self._partial = [(int(s), float(t)) for s, t in state_dict.get("partial", [])]
        self.window_unit_rates = [float(r) for r in state_dict.get("window_unit_rates", [])]
        self._partial_units = [(int(s), float(t)) for s, t in state_dict.get("partial_units", [])]

    def summary(self) -> dict[str, Any]:
        result: dict[str, Any] = {"warmup_steps": self.warmup_steps, "window_steps": self.window_steps,
                                  "includes": self.INCLUDES}
        if self.window_rates:
            result.update(samples_per_s=statistics.median(self.window_rates), windows=len(self.window_rates),
                          method=f"median of {len(self.window_rates)} windows of {self.window_steps} steps")
        elif self._partial:
            result.update(samples_per_s=_pooled(self._partial), windows=0,
                          method="run too short for a full window: all post-warm-up steps pooled")
        else:
            result.update(samples_per_s=None, windows=0, method="run too short: no step after warm-up")
        by_side = self.samples_per_s_by_side()
        if len(by_side) > 1:
            result["samples_per_s_by_side"] = {str(side): rate for side, rate in by_side.items()}
            result["method"] += "; the sizes of progressive resizing pooled (by size: samples_per_s_by_side)"
        if self.side_by_epoch:
            result["side_by_epoch"] = [self.side_by_epoch[e] for e in sorted(self.side_by_epoch)]
        rate = result["samples_per_s"]
        # The FLOPs per sample are counted at the final size, so MFU is that size's.
        full_rate = by_side[max(by_side)] if len(by_side) > 1 else rate
        flops_key = "flops_per_sample"
        if self.units_of is not None:
            full_rate = self._unit_rate()
            result[f"{self.unit}_per_s"] = full_rate
            flops_key = f"flops_per_{self.unit.removesuffix('s')}"
        result.update({"unit": self.unit, flops_key: self.flops_per_sample, "peak_flops": self.peak_flops,
                       "mfu": self._mfu(full_rate) if full_rate and self.mfu_known else None,
                       "mfu_note": self.mfu_note, "processes": self.processes,
                       "bf16_peak_flops": self.bf16_peak_flops,
                       "mfu_bf16_peak": self._mfu(full_rate, self.bf16_peak_flops)
                       if full_rate and self.flops_per_sample and self.bf16_peak_flops else None})
        return result

    def _unit_rate(self) -> float | None:
        """The median window's units per second (tokens/s), pooled like samples/s when no window filled."""
        return statistics.median(self.window_unit_rates) if self.window_unit_rates else _pooled(self._partial_units)

    def samples_per_s_by_side(self) -> dict[int, float]:
        """The median window of each image side (progressive resizing), smallest side first."""
        sides = sorted({side for side in self.window_sides if side is not None})
        return {side: statistics.median(r for r, s in zip(self.window_rates, self.window_sides) if s == side)
                for side in sides}

    def _mfu(self, rate: float, peak: float | None = None) -> float:
        peak = peak if peak is not None else self.peak_flops
        assert self.flops_per_sample is not None and peak is not None  # callers check mfu_known
        return rate * self.flops_per_sample / (peak * self.processes)
