"""Which accelerator a run uses and how many devices it spans, counted one way everywhere (the run,
the SLURM launcher's resolver and the launch checks)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from trainer.infra.errors import UserError


def resolve_accelerator(requested: str) -> tuple[str, str]:
    """The accelerator `trainer.accelerator` names (``auto``: CUDA, else MPS, else the CPU) and how
    it was chosen; asking for one that is absent is a `UserError`."""
    cuda = torch.cuda.is_available()
    mps = hasattr(torch.backends, "mps") and torch.backends.mps.is_available()
    if requested == "auto":
        chosen = "cuda" if cuda else "mps" if mps else "cpu"
        return chosen, f"auto -> {chosen}" + (f" ({torch.cuda.get_device_name()})" if cuda else " (no CUDA device)")
    if requested in ("gpu", "cuda") and not cuda:
        raise UserError("trainer.accelerator", f"'{requested}' asked for but no CUDA device is visible", "auto, cpu")
    if requested == "mps" and not mps:
        raise UserError("trainer.accelerator", "'mps' asked for but MPS is not available", "auto, cpu")
    chosen = "cuda" if requested == "gpu" else requested
    return chosen, f"{requested} (as configured)"


#: Set to 1 by `import lightning` (so that checking for CUDA does not initialize it before workers
#: fork): torch's `torch.cuda.is_available()` then counts devices through NVML, and with no GPU driver
#: it opens NVML again (a failed dlopen) at every call, which torch.optim's Adam and AdamW make at
#: every step (their graph-capture health check): 117 us a step on a 2-core AMD EPYC, for nothing.
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def stop_nvml_probes_without_cuda() -> bool:
    """Where no CUDA device is visible, torch's plain check instead of the NVML one (the same answer,
    no device to initialize; with a driver and no visible device a few microseconds, without one
    less). Returns whether it changed anything; where a device is visible, nothing changes (a CUDA
    run initializes CUDA and torch caches the count)."""
    if os.environ.get(NVML_CHECK) != "1" or torch.cuda.is_available():
        return False
    del os.environ[NVML_CHECK]
    return True


#: What `trainer.devices` may be, for the line that refuses anything else.
DEVICES_ALLOWED = "a positive count, a list of device ids, a string of ids ('0,1'), or auto / -1 (all)"


def parse_devices(devices: Any, accelerator: str) -> tuple[int, Optional[tuple[int, ...]]]:
    """(how many devices per node `trainer.devices` names: a count, a list of ids, ``"0,1"``, or
    ``auto``/-1, every visible GPU and one CPU process; the ids it names: a list, or ``"0,1"``, where
    ``"1,"`` is Lightning's one id 1; None for a count or auto). Anything else is refused in one line."""
    if isinstance(devices, (list, tuple)):
        if devices and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices):
            return len(devices), tuple(devices)
    elif isinstance(devices, str) and "," in devices:
        ids = [d.strip() for d in devices.split(",") if d.strip()]
        if ids and all(d.isdigit() for d in ids):
            return len(ids), tuple(int(d) for d in ids)
    elif devices in ("auto", -1, "-1"):
        return (torch.cuda.device_count() if accelerator == "cuda" else 1), None
    elif isinstance(devices, int) and not isinstance(devices, bool) or isinstance(devices, str) and devices.strip().isdigit():
        return int(devices), None
    raise UserError("trainer.devices", f"{devices!r} names no devices", DEVICES_ALLOWED)


@dataclass(frozen=True)
class Devices:
    """Where a run trains, decided once from the `trainer` group (trainer/phases/identify.py) and
    read by every phase after: the accelerator and how it was chosen, devices per node, nodes."""

    accelerator: str
    how: str
    per_node: int
    nodes: int
    #: The device ids `trainer.devices` named (a list, or "0,1"); None where it gave a count or auto.
    ids: Optional[tuple[int, ...]] = None

    @property
    def trainer_devices(self) -> int | list[int]:
        """The Trainer's `devices`: the ids named, else the count decided here, so that Lightning
        trains on exactly what every phase before it counted (it does not resolve auto again)."""
        return list(self.ids) if self.ids is not None else self.per_node

    @property
    def processes(self) -> int:
        """One per device on every node (Lightning's DDP and FSDP)."""
        return self.per_node * self.nodes

    def global_batch(self, batch: int, accumulation: int) -> int:
        return batch * self.processes * accumulation


def decide_devices(trainer_cfg: Mapping[str, Any]) -> Devices:
    accelerator, how = resolve_accelerator(str(trainer_cfg.get("accelerator", "auto")))
    per_node, ids = parse_devices(trainer_cfg.get("devices", 1), accelerator)
    if per_node < 1:
        raise UserError("trainer.devices", f"resolves to {per_node} devices", DEVICES_ALLOWED)
    return Devices(accelerator, how, per_node, int(trainer_cfg.get("num_nodes", 1) or 1), ids)


def usable_cpus() -> int:
    """CPUs this process may run on (affinity and cgroup-limited containers included)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)
