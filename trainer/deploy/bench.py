"""``python -m trainer.deploy bench RUN_DIR|CKPT``: inference latency and throughput per batch size.

Eager, folded, compiled (CUDA only) and ONNX Runtime side by side in one process, interleaved per
batch size so that a busy machine slows all of them alike; each call timed alone after warm-up,
with the device synchronized before the clock is read. docs/deploy.md ("bench") gives the rest."""

from __future__ import annotations

import functools
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, cast

import numpy as np
import torch
from torch import nn

from trainer.deploy.export import checked_eval, evaluation_images, export_folder, load_network, locate
from trainer.infra.atomic import write_json_atomic, write_text_atomic
from trainer.infra.figures import new_figure, save_png
from trainer.models.fuse import fuse_for_inference

DEFAULT_BATCH_SIZES = (1, 8, 32, 128)


@dataclass(frozen=True)
class Timing:
    variant: str
    batch: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    calls: int

    @property
    def images_per_s(self) -> float:
        return self.batch / (self.p50_ms / 1000)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between the closest ranks (numpy's)."""
    if len(values) == 0:
        raise ValueError("no values")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q, method="linear"))


def time_calls(call: Callable[[], Any], synchronize: Callable[[], None], warmup: int, calls: int,
               budget_s: float) -> list[float]:
    """Milliseconds of each of up to `calls` timed calls (fewer when `budget_s` runs out, at least 5).
    Not torch.utils.benchmark's Timer, deliberately: it times blocks of calls and reports their
    means, while a serving latency table needs each call's own time for its p90 and p99 tails."""
    for _ in range(warmup):
        call()
    synchronize()
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < calls and (len(times) < 5 or time.perf_counter() < deadline):
        start = time.perf_counter()
        call()
        synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return times


def _torch_variant(net: nn.Module, device: torch.device) -> Callable[[torch.Tensor], Any]:
    net = net.to(device)

    def run(images: torch.Tensor) -> Any:
        with torch.inference_mode():
            return net(images)

    return run


def _onnx_variant(path: Path) -> Callable[[torch.Tensor], Any]:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()  # the same threads as PyTorch's side
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return lambda images: session.run(None, {name: images.cpu().numpy()})


def variants(net: nn.Module, onnx_path: Path, device: torch.device) -> dict[str, Callable[[torch.Tensor], Any]]:
    folded = fuse_for_inference(net)
    found = {"eager": _torch_variant(net, device), "folded": _torch_variant(folded, device)}
    if device.type == "cuda":  # on the CPU this framework measured compile no faster; it stays a CUDA variant
        compiled = cast(nn.Module, torch.compile(folded))  # an OptimizedModule; torch types it a Callable
        found["compiled"] = _torch_variant(compiled, device)
    found["onnxruntime"] = _onnx_variant(onnx_path)
    return found


def bench(runs: dict[str, Callable[[torch.Tensor], Any]], images: torch.Tensor, batch_sizes: Sequence[int],
          device: torch.device, warmup: int, calls: int, budget_s: float) -> list[Timing]:
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    timings = []
    for batch in batch_sizes:
        repeats = -(-batch // len(images))
        inputs = images.repeat(repeats, *([1] * (images.dim() - 1)))[:batch].to(device)
        for name, run in runs.items():
            ms = time_calls(functools.partial(run, inputs), synchronize, warmup, calls, budget_s)
            timings.append(Timing(name, batch, percentile(ms, 50), percentile(ms, 90), percentile(ms, 99), len(ms)))
    return timings


def table(timings: list[Timing]) -> list[str]:
    eager = {t.batch: t.p50_ms for t in timings if t.variant == "eager"}
    lines = ["| batch | variant | P50 ms | P90 ms | P99 ms | images/s | P50 vs eager | calls |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for t in timings:
        lines.append(f"| {t.batch} | {t.variant} | {t.p50_ms:.3f} | {t.p90_ms:.3f} | {t.p99_ms:.3f} | "
                     f"{t.images_per_s:,.0f} | {eager[t.batch] / t.p50_ms:.2f}x | {t.calls} |")
    return lines


def plot(timings: list[Timing], path: Path) -> None:
    figure = new_figure(figsize=(11, 4))
    (left, right) = figure.subplots(1, 2)
    for variant in dict.fromkeys(t.variant for t in timings):
        rows = [t for t in timings if t.variant == variant]
        left.plot([t.batch for t in rows], [t.p50_ms for t in rows], marker="o", label=variant)
        right.plot([t.batch for t in rows], [t.images_per_s for t in rows], marker="o", label=variant)
    for axis, label in ((left, "P50 latency, ms"), (right, "images/s (batch / P50)")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("batch size")
        axis.set_ylabel(label)
        axis.legend(fontsize=8)
    figure.tight_layout()
    save_png(figure, path)


def bench_run(source: Path, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, warmup: int = 10, calls: int = 100,
              budget_s: float = 3.0, device: Optional[str] = None) -> tuple[list[Timing], Path]:
    """Time every variant of the run's network; returns the timings and the markdown written."""
    run_dir, checkpoint = locate(Path(source))
    onnx_path = export_folder(source) / "model.onnx"
    with tempfile.TemporaryDirectory(prefix="bench-data-") as scratch:
        net, _, datamodule, _ = load_network(run_dir, checkpoint, Path(scratch))
        images = evaluation_images(datamodule)
    net = checked_eval(net, images)
    target = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    timings = bench(variants(net, onnx_path, target), images, batch_sizes, target, warmup, calls, budget_s)
    where = torch.cuda.get_device_name(target) if target.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    lines = [f"# Inference latency: {checkpoint.name} on {where}", "",
             f"Each call timed alone after {warmup} warm-up calls, device synchronized; up to {calls} calls or "
             f"{budget_s:g} s per variant and batch size; variants interleaved per batch size.", "", *table(timings)]
    markdown = run_dir / "deploy_bench.md"
    write_text_atomic(markdown, "\n".join(lines) + "\n")
    write_json_atomic(run_dir / "deploy_bench.json", {"checkpoint": str(checkpoint), "device": where, "timings": [
        t.__dict__ | {"images_per_s": t.images_per_s} for t in timings]})
    plot(timings, run_dir / "deploy_bench.png")
    return timings, markdown
