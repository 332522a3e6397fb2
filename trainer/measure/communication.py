"""`diagnose=true` under DDP: how much of the step the gradient all-reduce takes, measured in the
diagnosis's own fit on the model Lightning's DDPStrategy wrapped, at the end of the fit when every
process has reached the same point: **exposed** (forward + backward timed in pairs as DDP runs it and
under ``no_sync()``) and **alone** (one ``all_reduce`` of the gradients' bytes after a barrier);
docs/diagnosis.md ("Under DDP") describes both. Every process runs the same pairs and the same
all-reduces: collectives must match or the run hangs."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch
from lightning.pytorch.callbacks import Callback

from trainer.callbacks.throughput import synchronize

#: The dtype each gradient bucket is sent in, by `trainer.gradient_compression`.
SENT_DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class CommunicationTiming:
    """The gradient all-reduce of one step, in ms, with how it was measured."""

    processes: int
    backend: str
    gradient_bytes: int  # the bytes one all-reduce sends: every gradient, in `dtype`
    dtype: str
    pairs: int  # forward + backward pairs timed (with and without the all-reduce)
    synced_ms: float  # median forward + backward as DDP runs it
    unsynced_ms: float  # median forward + backward under no_sync()
    exposed_ms: float  # median of the pairs' differences: what the backward did not hide
    exposed_noise_ms: float
    alone_ms: float  # median of the direct all-reduces
    alone_noise_ms: float
    note: Optional[str] = None  # e.g. PowerSGD: the direct all-reduce is of the uncompressed bytes

    @property
    def exposed_or_zero_ms(self) -> float:
        return max(0.0, self.exposed_ms)

    @property
    def bandwidth_gb_s(self) -> Optional[float]:
        """The all-reduce's algorithm bandwidth: the gradients' bytes over the time alone."""
        return self.gradient_bytes / (self.alone_ms / 1000) / 1e9 if self.alone_ms > 0 else None

    def record(self, full_ms: float) -> dict[str, Any]:
        return {**asdict(self), "exposed_share_of_full_step": share_of(self.exposed_or_zero_ms, full_ms),
                "alone_share_of_full_step": share_of(self.alone_ms, full_ms), "bandwidth_gb_s": self.bandwidth_gb_s,
                "method": "exposed: median over pairs of (forward + backward) minus the same under DDP's no_sync(); "
                          "alone: median all_reduce of a flat tensor of the gradients' bytes after a barrier, device "
                          "synchronized"}


def share_of(ms: float, full_ms: float) -> float:
    return ms / full_ms if full_ms > 0 else 0.0


def half_iqr(samples: list[float]) -> float:
    if len(samples) < 4:
        return 0.0
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return (q3 - q1) / 2


def timed_ms(run: Callable[[], Any], device: torch.device) -> float:
    """Milliseconds of `run`, the device synchronized before and after it."""
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    return (time.perf_counter() - start) * 1000


def exposed_from_pairs(synced: list[float], unsynced: list[float]) -> tuple[float, float]:
    """(median, half the interquartile range) of the pairs' differences, in ms: the pairs run one
    after the other, so a slow moment of the machine shifts both halves of a pair alike."""
    if not synced or len(synced) != len(unsynced):
        raise ValueError("the synced and unsynced timings must come in pairs")
    differences = [a - b for a, b in zip(synced, unsynced)]
    return statistics.median(differences), half_iqr(differences)


def timing_from(synced: list[float], unsynced: list[float], alone: list[float], *, processes: int, backend: str,
                gradient_bytes: int, dtype: str, note: Optional[str] = None) -> CommunicationTiming:
    """The figures from the raw samples (ms)."""
    exposed, exposed_noise = exposed_from_pairs(synced, unsynced)
    return CommunicationTiming(processes, backend, gradient_bytes, dtype, len(synced), statistics.median(synced),
                               statistics.median(unsynced), exposed, exposed_noise, statistics.median(alone),
                               half_iqr(alone), note)


def time_pairs(model: Any, step: Callable[[], None], device: torch.device, pairs: int,
               warmup: int = 2) -> tuple[list[float], list[float]]:
    """`pairs` timings (ms) of `step` as DDP runs it and under `model.no_sync()`, alternated."""

    def unsynced() -> None:
        with model.no_sync():
            step()

    timed = [(timed_ms(step, device), timed_ms(unsynced, device)) for _ in range(warmup + pairs)][warmup:]
    return [synced for synced, _ in timed], [without for _, without in timed]


def time_all_reduce(numel: int, dtype: torch.dtype, device: torch.device, repeats: int,
                    warmup: int = 2) -> list[float]:
    """ms of `repeats` all-reduces of a flat tensor of `numel` elements, each after a barrier (so the
    clock does not count one process waiting for another), device synchronized."""
    import torch.distributed as dist

    flat = torch.ones(numel, dtype=dtype, device=device)
    samples = []
    for _ in range(warmup + repeats):
        dist.barrier()
        samples.append(timed_ms(lambda: dist.all_reduce(flat), device))
    return samples[warmup:]


class CommunicationTimer(Callback):
    """At the end of the diagnosis's fit, on every process of a DDP run: the exposed all-reduce and
    the all-reduce alone (module docstring), on the last training batch. `compression`: the run's
    `trainer.gradient_compression` (the dtype the all-reduce sends)."""

    def __init__(self, pairs: int, compression: str = "none") -> None:
        self.pairs, self.compression = pairs, compression
        self.result: Optional[CommunicationTiming] = None
        self._batch: Any = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._batch = batch  # on the device and finished, as the step received it

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        from torch.nn.parallel import DistributedDataParallel

        model = trainer.strategy.model
        if trainer.world_size < 2 or not isinstance(model, DistributedDataParallel) or self._batch is None:
            return
        import torch.distributed as dist

        device = pl_module.device
        definition, batch = pl_module.definition, self._batch
        precision = trainer.precision_plugin
        scaler = getattr(precision, "scaler", None)

        def step() -> None:
            with precision.forward_context():
                loss = pl_module.evaluation_loss(definition.forward(model, batch), definition.targets(batch))
            (scaler.scale(loss) if scaler is not None else loss).backward()
            model.zero_grad(set_to_none=True)

        was_training = pl_module.training
        pl_module.train()
        try:
            synced, unsynced = time_pairs(model, step, device, self.pairs)
        finally:
            model.zero_grad(set_to_none=True)
            pl_module.train(was_training)
        parameters = [p for p in model.parameters() if p.requires_grad]
        dtype = SENT_DTYPE.get(self.compression, parameters[0].dtype if parameters else torch.float32)
        numel = sum(p.numel() for p in parameters)
        alone = time_all_reduce(numel, dtype, device, max(self.pairs, 5))
        note = ("PowerSGD sends low-rank factors, not the gradients: the all-reduce alone is of the "
                "uncompressed bytes, an upper bound") if self.compression == "powersgd" else None
        self.result = timing_from(synced, unsynced, alone, processes=trainer.world_size, backend=dist.get_backend(),
                                  gradient_bytes=numel * dtype.itemsize, dtype=str(dtype).removeprefix("torch."),
                                  note=note)


def communication_lines(timing: CommunicationTiming, full_ms: float) -> list[str]:
    """The diagnosis's lines for the all-reduce (docs/diagnosis.md, "Under DDP")."""
    size = timing.gradient_bytes / 2**20
    bandwidth = timing.bandwidth_gb_s
    lines = [f"gradient all-reduce ({timing.processes} processes on {timing.backend}, {size:.2f} MiB of "
             f"{timing.dtype} gradients per step):",
             f"  {'exposed (step - step under no_sync)':<40} {timing.exposed_ms:9.2f} ms  "
             f"{share_of(timing.exposed_or_zero_ms, full_ms):4.0%} of the full step",
             f"  {'alone (one all-reduce, synchronized)':<40} {timing.alone_ms:9.2f} ms  "
             f"{share_of(timing.alone_ms, full_ms):4.0%} of the full step"
             + (f"  ({bandwidth:.2f} GB/s)" if bandwidth else "")]
    if timing.exposed_ms <= timing.exposed_noise_ms:
        lines.append(f"note: the exposed all-reduce is within its noise ({timing.exposed_noise_ms:.2f} ms): the "
                     "backward hides it, or it is too small to tell")
    elif timing.alone_ms > 0 and timing.exposed_ms < 0.5 * timing.alone_ms:
        lines.append("note: the backward hides part of the all-reduce (DDP starts each gradient bucket's as soon "
                     "as it is ready)")
    if timing.note:
        lines.append(f"note: {timing.note}")
    return lines
