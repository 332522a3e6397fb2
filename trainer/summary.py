"""summary.json and env.json: written atomically, so a crash never leaves half a file."""

from __future__ import annotations

import json
import math
import resource
from pathlib import Path
from typing import Any

import torch

from trainer.atomic import write_text_atomic
from trainer.fingerprint import proc_kib


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(_jsonable(data), indent=2) + "\n")


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return _jsonable(value.item() if value.numel() == 1 else value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, Path):
        return str(value)
    return str(value)


def reset_peak_memory(device: torch.device) -> bool:
    """Start the peak-memory count afresh for this run; False where the platform cannot.

    On CPU the peak resident set (VmHWM) is reset through /proc/self/clear_refs (Linux >= 4.0), so
    the jobs of a multirun, which share one process, each report their own peak.
    """
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_memory(device: torch.device, reset_done: bool = True) -> dict[str, Any]:
    if device.type == "cuda":
        return {"what": "peak CUDA memory allocated by tensors", "bytes": torch.cuda.max_memory_allocated(device),
                "reserved_bytes": torch.cuda.max_memory_reserved(device)}
    high_water = proc_kib("/proc/self/status", "VmHWM") if reset_done else None
    if high_water is not None:
        return {"what": "peak resident memory of the process during this run (CPU run)", "bytes": high_water}
    # ru_maxrss is in KiB on Linux.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"what": "peak resident memory of the process since it started (CPU run)", "bytes": rss}


def split_metrics(metrics: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``{"val/acc": t, "train/loss_epoch": t}`` -> ``{"val": {"acc": ...}, "train": {"loss": ...}}``."""
    out: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        if "/" not in key or key.endswith("_step"):
            continue
        split, name = key.split("/", 1)
        name = name.removesuffix("_epoch")
        out.setdefault(split, {})[name] = float(value)
    return out
