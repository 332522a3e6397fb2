"""diagnose=true: time the parts of a step on the composed run instead of training (the timing and
the verdict are trainer/measure/diagnose.py's)."""

from __future__ import annotations

import torch

from trainer.callbacks.throughput import ThroughputMeter
from trainer.data.synthetic import SyntheticDataModule
from trainer.infra.library_logs import quiet_library_warnings
from trainer.measure.communication import CommunicationTimer
from trainer.measure.diagnose import ModelStep, diagnose
from trainer.phases.build import build_trainer
from trainer.phases.state import Run


def run_diagnosis(run: Run) -> None:
    """The full step runs the real loop and callbacks, only shorter: no validation, checkpoints,
    loggers or progress output, and just enough steps for the throughput meter's windows. The parts
    are timed with the optimizer the plan's recipe builds, as training's is."""
    spec, plan, parts, task = run.spec, run.plan, run.parts, run.task
    steps = spec.top.diagnose_steps
    # Under DDP every process runs the same diagnosis (its fit's all-reduces must match); the timer
    # times the all-reduce inside that fit, on the model Lightning wrapped (trainer/measure/communication.py).
    communication = (CommunicationTimer(steps, plan.communication.gradient_compression)
                     if run.devices.processes > 1 else None)
    built = build_trainer(run, measuring_steps=ThroughputMeter.WARMUP_STEPS + 1 + steps,
                          extra_callbacks=[communication] if communication is not None else [])
    device = plan.device
    task.to(device)
    optimizer = plan.optimizer.build(task.net)

    def full_step() -> tuple[float | None, list[float]]:
        """One process's samples/s (the meter counts every process's) and its windows'."""
        with quiet_library_warnings():
            built.trainer.fit(task, datamodule=parts.datamodule)
        processes = max(built.meter.processes, 1)
        rate = built.meter.summary()["samples_per_s"]
        return (rate / processes if rate else rate), [r / processes for r in built.meter.window_rates]

    context = {"accelerator": plan.accelerator, "precision": plan.precision, "tf32": plan.tf32,
               "channels_last": plan.channels_last, "compile": plan.compile_mode,
               "optimizer_implementation": plan.optimizer_implementation,
               "num_workers": plan.loader.num_workers, "pin_memory": plan.loader.pin_memory,
               "device_normalize": getattr(parts.datamodule, "device_normalize", True),
               "decode": plan.derived["data.decode"].value,
               "activation_checkpointing": list(plan.checkpointed_stages),
               "convolutional": any(isinstance(m, torch.nn.Conv2d) for m in task.modules()),
               "unit": plan.unit, "units_per_sample": plan.units_per_sample,
               "processes": run.devices.processes, "gradient_compression": plan.communication.gradient_compression,
               "parameters": sum(p.numel() for p in task.parameters() if p.requires_grad)}
    precision = built.trainer.precision_plugin
    diagnose(parts.datamodule, ModelStep(task, optimizer, precision.forward_context, getattr(precision, "scaler", None),
                                         device), full_step, context, run.job.run_dir, steps=steps,
             sweep=not isinstance(parts.datamodule, SyntheticDataModule), communication=communication,
             write=run.rank_zero)
