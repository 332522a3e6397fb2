"""summary.json and env.json: written atomically, so a crash never leaves half a file."""

from __future__ import annotations

import json
import math
import os
import resource
import tempfile
from pathlib import Path
from typing import Any

import torch


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(_jsonable(data), indent=2) + "\n")


def write_text_atomic(path: Path, text: str) -> None:
    """Write to a temporary file in the same folder, fsync, then rename over the target."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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


def peak_memory(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        return {"what": "peak CUDA memory allocated by tensors", "bytes": torch.cuda.max_memory_allocated(device),
                "reserved_bytes": torch.cuda.max_memory_reserved(device)}
    # ru_maxrss is in KiB on Linux.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"what": "peak resident memory of the process (CPU run)", "bytes": rss}


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
