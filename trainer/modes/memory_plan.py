"""memory_plan=true: where a step's memory goes at the run's batch (the measurement is
trainer/measure/memory.py's), drawn, and kept for the start-up lines and summary.json."""

from __future__ import annotations

import torch

from trainer.groups.precision import compute_dtype
from trainer.measure.memory import MemoryPlan, autocast_for, plan_memory, plot_plan
from trainer.modes.measuring import memory_inputs
from trainer.phases.state import Run


def measure_memory_plan(run: Run) -> MemoryPlan:
    """Measured on a copy of the network before it is compiled or checkpointed."""
    spec, plan, parts = run.spec, run.plan, run.parts
    inputs = memory_inputs(plan.device, plan.channels_last, plan.optimizer, parts.definition)
    device = inputs.device
    half = autocast_for("bf16-mixed", device) if compute_dtype(plan.precision) == torch.float32 else None
    memory = plan_memory(parts.net, inputs.optimizer_for(plan.optimizer_implementation), inputs.make_batch,
                         inputs.loss, autocast_for(plan.precision, device), device,
                         plan.batch_size, half_context=half,
                         make_fused=None if plan.optimizer_implementation == "fused" else inputs.optimizer_for("fused"))
    if plan.checkpointed_stages:
        memory.notes.append(f"measured without the configured checkpointing of {', '.join(plan.checkpointed_stages)}")
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if run.rank_zero:
        plot_plan(memory, run.job.run_dir / "memory_plan.png", f"{spec.model['_target_'].rsplit('.', 1)[-1]}, "
                                                       f"{plan.precision}, {plan.optimizer_implementation} optimizer")
    return memory
