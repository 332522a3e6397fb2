"""A run's attempts: the history of a run that was preempted, requeued and carried on.

A requeued SLURM job starts again in its own folder and a run resumed with ``resume=auto`` in
another; either way the summary.json beside the checkpoint it resumes from holds the attempts so
far. What each attempt records and how steps lost are counted is in docs/scale-out.md ("Preemption
and requeue") and docs/reliability.md ("Where a run stands")."""

from __future__ import annotations

import json
import os
import signal
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

#: The scheduler's ids for this attempt, when it runs as a SLURM job.
_SLURM_FIELDS = {"slurm_job_id": "SLURM_JOB_ID", "slurm_restart_count": "SLURM_RESTART_COUNT"}


def utc_now() -> str:
    """Now, in UTC to the second: the time stamp of every record a run writes."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def earlier_attempts(resumed_checkpoint: Path | None, resumed_step: int | None) -> list[dict[str, Any]]:
    """The attempts before this one, read from the summary.json of the run folder the checkpoint
    lies in; the last of them gets the steps it lost (what it reached past `resumed_step`)."""
    if resumed_checkpoint is None:
        return []
    try:
        summary = json.loads((Path(resumed_checkpoint).parent.parent / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if not isinstance(summary, dict):
        return []
    attempts = [dict(a) for a in summary.get("attempts") or [] if isinstance(a, dict)]
    if not attempts:  # written before attempts were recorded: the summary is the one attempt
        attempts = [{"status": summary.get("status"), "steps": summary.get("steps")}]
    last = attempts[-1]
    if last.get("status") == "running":  # it never wrote its end: killed (SIGKILL, node failure)
        last["status"] = "killed"
        last["stopped_in"] = summary.get("phase", "training")
    reached = last.get("steps")
    last["steps_lost"] = max(0, int(reached) - int(resumed_step or 0)) if isinstance(reached, int) else None
    return attempts


def this_attempt(number: int, resumed_step: int | None) -> dict[str, Any]:
    """The record of the attempt that starts now."""
    record: dict[str, Any] = {"attempt": number, "started": utc_now(), "resumed_from_step": resumed_step,
                              "status": "running", "steps": None}
    record.update({field: os.environ[var] for field, var in _SLURM_FIELDS.items() if var in os.environ})
    return record


def ended(attempt: dict[str, Any], status: str, steps: int, signum: int | None = None,
          stopped_in: str | None = None) -> dict[str, Any]:
    """The attempt's record once it has ended (`stopped_in`: the phase a run that did not complete
    stopped in)."""
    done = {**attempt, "status": status, "steps": steps, "ended": utc_now()}
    if stopped_in is not None:
        done["stopped_in"] = stopped_in
    if signum is not None:
        done["signal"] = signal.Signals(signum).name
    return done


def totals(attempts: list[dict[str, Any]]) -> dict[str, Any]:
    """summary.json's counts over all attempts: how often the run was preempted and started again,
    and how many optimizer steps were computed twice (None when a killed attempt's are unknown)."""
    lost = [a.get("steps_lost") for a in attempts[:-1]]
    return {"attempts": attempts, "requeues": len(attempts) - 1,
            "preemptions": sum(1 for a in attempts if a.get("status") == "preempted"),
            "steps_lost": None if any(v is None for v in lost) else sum(lost)}
