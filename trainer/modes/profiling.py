"""profile=true: a few steps of the real loop under torch.profiler instead of training (the
recording and the report are trainer/measure/profile.py's)."""

from __future__ import annotations

import logging

import torch

from trainer.callbacks.nvtx import NvtxRanges
from trainer.groups.precision import compute_dtype
from trainer.infra.errors import UserError
from trainer.infra.library_logs import quiet_library_warnings
from trainer.measure.profile import StepProfiler, all_reduce_line, machine_roof, write_report
from trainer.phases.build import build_trainer
from trainer.phases.state import Run

log = logging.getLogger("trainer")


def run_profile(run: Run) -> None:
    """Like the diagnosis: the real loop, without validation, checkpoints, loggers or progress output.
    Under DDP every process records the same steps and rank 0 alone writes the report."""
    spec, plan, parts, task, name = run.spec, run.plan, run.parts, run.task, run.identity.name
    steps = spec.top.profile_steps
    device = plan.device
    folder = run.job.run_dir / "profile"
    if run.rank_zero:
        folder.mkdir(parents=True, exist_ok=True)
    profiler = StepProfiler(folder, steps, on_device=device.type == "cuda", write_trace=run.rank_zero)
    # The step's phases as NVTX ranges for Nsight Systems; only on CUDA (a CPU run is told so).
    ranges = NvtxRanges(device)
    built = build_trainer(run, measuring_steps=profiler.total + 1, extra_callbacks=[profiler, ranges])
    with quiet_library_warnings():
        built.trainer.fit(task, datamodule=parts.datamodule)
    if profiler.events is None:
        raise UserError("profile_steps", f"the run ended before {profiler.total} training steps were recorded",
                        "a data set with more batches per epoch, or fewer profile_steps")
    if not run.rank_zero:
        return  # measured alike, silently: rank 0 writes the report
    dtype = compute_dtype(plan.precision)
    roof = machine_roof(device, plan.precision, plan.tf32, torch.float32 if dtype == torch.float32 else torch.bfloat16)
    record = write_report(profiler.events, folder, device.type == "cuda", dtype.itemsize, roof,
                          f"{name} on {plan.accelerator}, batch {plan.batch_size}, {plan.precision}",
                          nvtx=ranges.status)
    top = ", ".join(f"{c['category']} {c['share']:.0%}" for c in record["categories"][:4])
    log.info("profile: %.2f ms per step over %d steps; %s; memory-bound operators %.0f%% of the step",
             record["step_ms"], record["steps"], top, 100 * record["memory_bound_share"])
    if "all_reduce" in record:
        log.info("profile: %s", all_reduce_line(record["all_reduce"]["ms_per_step"], record["step_ms"]))
    for flag in record["unusual"]:
        log.info("profile: unusual: %s", flag)
    log.info("profile: %s", ranges.status)
    log.info("profile written: %s (ops.md, profile.json, roofline.png, the trace for Perfetto or TensorBoard)", folder)
