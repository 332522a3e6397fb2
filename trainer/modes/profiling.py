"""profile=true: a few steps of the real loop under torch.profiler instead of training (the
recording and the report are trainer/measure/profile.py's)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from trainer.phases.build import Parts, build_trainer, device_of
from trainer.configuration.spec import RunSpec
from trainer.infra.errors import UserError
from trainer.infra.library_logs import quiet_library_warnings
from trainer.modes.measuring import measuring
from trainer.phases.plan import Plan
from trainer.groups.precision import compute_dtype
from trainer.measure.profile import StepProfiler, machine_roof, write_report
from trainer.task import ClassificationTask

log = logging.getLogger("trainer")


def run_profile(spec: RunSpec, plan: Plan, parts: Parts, task: ClassificationTask, run_dir: Path, name: str) -> None:
    """Like the diagnosis: the real loop, without validation, checkpoints, loggers or progress output."""
    steps = spec.top.profile_steps
    device = device_of(plan)
    folder = run_dir / "profile"
    folder.mkdir(parents=True, exist_ok=True)
    profiler = StepProfiler(folder, steps, on_device=device.type == "cuda")
    built = build_trainer(*measuring(spec, plan, profiler.total + 1), run_dir, parts, extra_callbacks=[profiler])
    with quiet_library_warnings():
        built.trainer.fit(task, datamodule=parts.datamodule)
    if profiler.events is None:
        raise UserError("profile_steps", f"the run ended before {profiler.total} training steps were recorded",
                        "a data set with more batches per epoch, or fewer profile_steps")
    dtype = compute_dtype(plan.precision)
    roof = machine_roof(device, plan.precision, plan.tf32, torch.float32 if dtype == torch.float32 else torch.bfloat16)
    record = write_report(profiler.events, folder, device.type == "cuda", dtype.itemsize, roof,
                          f"{name} on {plan.accelerator}, batch {spec.data['batch_size']}, {plan.precision}")
    top = ", ".join(f"{c['category']} {c['share']:.0%}" for c in record["categories"][:4])
    log.info("profile: %.2f ms per step over %d steps; %s; memory-bound operators %.0f%% of the step",
             record["step_ms"], record["steps"], top, 100 * record["memory_bound_share"])
    for flag in record["unusual"]:
        log.info("profile: unusual: %s", flag)
    log.info("profile written: %s (ops.md, profile.json, roofline.png, the trace for Perfetto or TensorBoard)", folder)
