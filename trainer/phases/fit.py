"""The fit and test phases: the Lightning Trainer fits the task (from the checkpoint resumed from, if
any) and tests the best checkpoint or the final weights."""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path
from typing import Any, NamedTuple

from trainer.callbacks.utilisation import device_utilisation
from trainer.groups.compile import compile_counts, compiled_line
from trainer.infra import attempts
from trainer.infra.errors import UserError
from trainer.infra.library_logs import quiet_library_warnings
from trainer.infra.summary import split_metrics
from trainer.measure.memory import peak_memory, reset_peak_memory
from trainer.phases.products import Built
from trainer.phases.resume import Checkpoint, read_resumable
from trainer.phases.state import Run

log = logging.getLogger("trainer")


class Fitted(NamedTuple):
    fit_seconds: float
    metrics: dict[str, dict[str, float]]
    use_best: bool
    peak_memory: dict[str, Any]
    #: The callbacks' records at the end of training, taken before testing the best checkpoint
    #: restores their states as they were when it was written.
    training_records: dict[str, Any]
    #: The checkpoint holding training's final state (None when none does: checkpointing off).
    final_checkpoint: str | None


def fit(run: Run) -> Fitted:
    """Fit, from the checkpoint resumed from if any; a signal stop or an interruption raises. A run
    resumed after its training had ended fits nothing: what its training reached comes from that
    checkpoint (trainer/callbacks/logged_metrics.py)."""
    built, parts, resume_from, memory_device = run.built, run.parts, run.identity.resume_from, run.plan.device
    trainer = built.trainer
    # The jobs of a multirun share this process: collect the previous job's reference cycles
    # (trainer <-> module) before counting this run's peak, or its model would still be resident.
    gc.collect()
    peak_reset = reset_peak_memory(memory_device)
    compiled_before = compile_counts()
    with quiet_library_warnings():
        started = time.perf_counter()
        trainer.fit(run.task, datamodule=parts.datamodule, ckpt_path=str(resume_from.path) if resume_from else None,
                    weights_only=True)
        fit_seconds = time.perf_counter() - started
    if trainer.interrupted:
        raise KeyboardInterrupt
    records: dict[str, Any] = {"throughput": built.meter.summary(), "loss": built.losses.summary(), "scheduler": run.task.schedule,
               "clipping": parts.clipping.summary(), "nonfinite": parts.guard.summary(),
               "device_utilisation": device_utilisation(trainer.callbacks)}  # type: ignore[attr-defined]  # set by a connector
    if run.plan.compile_mode != "off":
        # What Dynamo compiled during this fit (variable lengths and progressive resizing recompile).
        after = compile_counts()
        records["compiled"] = {**{key: after[key] - compiled_before[key] for key in after},
                               "dynamic": run.plan.compile_dynamic}
        log.info(compiled_line(records["compiled"]))
    if built.target is not None:
        records["target"] = built.target.summary()
        log.info(built.target.line())
    use_best = built.checkpoint is not None and bool(built.checkpoint.best_model_path)
    final = _final_checkpoint(built, resume_from)
    # From here a stop signal ends the test early, as the final state is kept (GracefulStop).
    built.stopper.final_checkpoint = final
    return Fitted(fit_seconds, split_metrics(built.logged.final(trainer)), use_best,
                  peak_memory(memory_device, peak_reset), records, final)


def _final_checkpoint(built: Built, resume_from: Checkpoint | None) -> str | None:
    """The checkpoint that holds training's final state: the last one written, or (a run resumed
    after its training had ended) the one it resumed from."""
    step = int(built.trainer.global_step)
    last = built.checkpoint.last_model_path if built.checkpoint is not None else ""
    for path in [p for p in (last, resume_from.path if resume_from else None) if p]:
        try:
            if read_resumable(Path(path)).global_step == step:
                return str(path)
        except UserError:
            continue
    return None


def training_fields(run: Run, fitted: Fitted) -> dict[str, Any]:
    """What the fit reached, written into summary.json as the test starts (with the steps this
    attempt reached: an attempt killed from here on has lost none)."""
    trainer, identity = run.built.trainer, run.identity
    steps = trainer.global_step
    return {"metrics": fitted.metrics, **fitted.training_records, "steps": steps,
            "epochs": trainer.current_epoch, "fit_time_s": fitted.fit_seconds,
            "final_checkpoint": fitted.final_checkpoint,
            **attempts.totals([*identity.earlier_attempts, {**identity.attempt, "steps": steps}])}


def test_after_fit(run: Run, fitted: Fitted) -> Fitted:
    """Test the best checkpoint (or the final weights without checkpointing)."""
    with quiet_library_warnings():
        tested = run.built.trainer.test(run.task, datamodule=run.parts.datamodule, ckpt_path="best" if fitted.use_best else None,
                                    verbose=False, weights_only=True)
    return fitted._replace(metrics={**fitted.metrics, **split_metrics(tested[0] if tested else {})})
