"""data.batch_size=auto: the largest per-device batch, a multiple of 8, that fits (on CUDA, real
steps until out of memory; on a CPU, data.memory_budget_gb against the measured memory plan)."""

from __future__ import annotations

from pathlib import Path

from trainer.data.base import AUTO_BATCH_START
from trainer.infra.atomic import write_json_atomic
from trainer.infra.distributed import rank_zero_record
from trainer.infra.errors import UserError
from trainer.measure.memory import autocast_for, largest_batch_that_runs, largest_batch_within, plan_memory
from trainer.modes.measuring import memory_inputs
from trainer.phases.plan import Derived, Probe
from trainer.phases.state import Run

#: data.batch_size=auto: rank 0 writes what it found here; the other ranks read it, so every rank
#: trains with the same batch (each rank measuring its own device could differ on CUDA).
AUTO_BATCH_FILE = "batch_size_auto.json"


def find_batch_size(run: Run, probe: Probe) -> Derived:
    """The batch found, with how; rank 0 measures, the other ranks read what it found. The steps it
    measures run as the probe says (device, precision, memory format and the optimizer's kernel are
    the run's); the plan is resolved afterwards, at the batch found."""
    record = run.job.run_dir / AUTO_BATCH_FILE
    if not run.rank_zero:
        return batch_of_rank_zero(record)
    parts = run.parts
    inputs = memory_inputs(probe.device, probe.channels_last, probe.optimizer(run.spec, parts.net, AUTO_BATCH_START),
                           parts.definition)
    budget = parts.datamodule.memory_budget_gb
    limit = max(AUTO_BATCH_START, parts.info.sizes.get("train", 0) // max(1, probe.devices.per_node))
    context = autocast_for(probe.precision, inputs.device)
    optimizer = inputs.optimizer_for(probe.implementation)
    try:
        if inputs.device.type == "cuda":
            batch, how = largest_batch_that_runs(parts.net, optimizer, inputs.make_batch, inputs.loss,
                                                 context, inputs.device, AUTO_BATCH_START, limit)
        elif budget is None:
            raise UserError("data.memory_budget_gb", "missing: data.batch_size=auto on a CPU sizes the batch to a "
                            "memory budget", "the GiB one training step may use, e.g. data.memory_budget_gb=4")
        if budget is not None:
            memory = plan_memory(parts.net, optimizer, inputs.make_batch, inputs.loss, context, inputs.device,
                                 AUTO_BATCH_START, measure_peak=False, with_practices=False)
            within, within_how = largest_batch_within(memory, budget * 2**30, AUTO_BATCH_START, limit)
            if inputs.device.type != "cuda" or within < batch:
                batch, how = within, within_how
    except ValueError as ex:
        raise UserError("data.batch_size", f"auto: not even {AUTO_BATCH_START} samples fit: {ex}",
                        "a larger data.memory_budget_gb, a smaller model or image size, or a fixed batch_size"
                        ) from None
    write_json_atomic(record, {"batch_size": batch, "how": how})
    return Derived(batch, how)


def batch_of_rank_zero(record: Path, timeout_s: float = 600.0) -> Derived:
    """What rank 0 found, once it has written it (a UserError after `timeout_s`)."""
    found = rank_zero_record(record, ("batch_size", "how"), "data.batch_size", "auto",
                             "a fixed data.batch_size, or check rank 0's log", timeout_s)
    return Derived(int(found["batch_size"]), f"{found['how']} (rank 0's)")
