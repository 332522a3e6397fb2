"""summary.json (what ran, what it cost, what it reached), written atomically at every phase change
so a crash never leaves half a file; and the few lines a finished run prints. What goes into it is
the record phase's (trainer/phases/record.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from trainer.infra.atomic import write_json_atomic

log = logging.getLogger("trainer")


#: The phases a run works in, as summary.json's ``phase`` and ``stopped_in`` name them (the table is in
#: docs/reliability.md, "Where a run stands"); ``status`` stays ``running`` until the run ends, then as ``phase``.
WORKING_PHASES = ("training", "testing", "recording")


class RunRecord:
    """The run's summary.json: started with what ran (status ``running``, phase ``training``),
    written again when the fit has ended (phase ``testing``), ended with how it ended. Only rank 0
    writes it; every write replaces it atomically, so a killed run leaves a summary of where it stood."""

    def __init__(self, path: Path, fields: dict[str, Any], writes: bool = True) -> None:
        self.path = path
        self.fields = {"status": "running", "phase": "training", **fields}
        self.writes = writes
        #: The phase the run is in now (also "recording", which no write of its own announces).
        self.working = "training"

    def begin(self) -> None:
        """Written as the run starts: a run killed outright (SIGKILL, a lost node) leaves a summary
        that says it was running, which the next attempt counts as killed (trainer/infra/attempts.py)."""
        self._write()

    def enter(self, phase: str, **fields: Any) -> None:
        """The run moves on to `phase`; what it knows so far (`fields`) is written with it, except
        for ``recording``, which ends in the final write anyway."""
        assert phase in WORKING_PHASES, phase
        self.working = phase
        if phase != "recording":
            self.fields.update(phase=phase, **fields)
            self._write()

    def end(self, status: str, **fields: Any) -> dict[str, Any]:
        self.fields.update(status=status, phase=status, **fields)
        if status != "completed":
            self.fields["stopped_in"] = self.working
        self._write()
        return self.fields

    def _write(self) -> None:
        if self.writes:
            write_json_atomic(self.path, self.fields)


def optimizer_param_groups(optimizers: Iterable[torch.optim.Optimizer]) -> list[dict[str, Any]]:
    """The first optimizer's groups as the run applied them: lr, weight decay, size, kernel."""
    optimizer = next(iter(optimizers), None)
    return [{"lr": g.get("initial_lr", g["lr"]), "weight_decay": g["weight_decay"],
             "tensors": len(g["params"]), "elements": sum(p.numel() for p in g["params"]),
             "fused": bool(g.get("fused")), "foreach": bool(g.get("foreach"))}
            for g in (optimizer.param_groups if optimizer else [])]


def log_result(summary: dict[str, Any]) -> None:
    """The lines a completed run ends with: metrics, throughput, time and where the summary is."""
    metrics = summary["metrics"]
    throughput = summary["throughput"]
    parts = [f"{split}/{name} {value:.4f}" for split in ("val", "test") for name, value in metrics.get(split, {}).items()]
    log.info("done: %s", "  ".join(parts))
    unit = throughput.get("unit", "samples")
    rate = throughput.get(f"{unit}_per_s")
    log.info("training throughput %s %s/s (%s; %s)", f"{rate:.0f}" if rate else "n/a", unit,
             throughput["method"], throughput["includes"])
    # Reference values the data give (a text corpus's unigram perplexity), beside the run's own.
    for key, baseline in summary.get("data", {}).get("baselines", {}).items():
        split, name = key.split("/", 1)
        value = metrics.get(split, {}).get(name)
        if value is not None:
            log.info("%s %.4g against the baseline %.4g of the data%s", key, value, baseline, _ratio(value, baseline))
    log.info("wall time %.1f s (fit %.1f s); summary: %s", summary["wall_time_s"], summary["fit_time_s"],
             Path(summary["run_dir"]) / "summary.json")


def _ratio(value: float, baseline: float) -> str:
    """" (6.2x lower)" or " (1.5x higher)": no judgement, since some metrics are better higher."""
    if value <= 0 or baseline <= 0 or value == baseline:
        return ""
    return f" ({baseline / value:.1f}x lower)" if value < baseline else f" ({value / baseline:.1f}x higher)"


def split_metrics(metrics: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """``{"val/acc": t, "train/loss_epoch": t}`` -> ``{"val": {"acc": ...}, "train": {"loss": ...}}``."""
    out: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        if "/" not in key or key.endswith("_step"):
            continue
        split, name = key.split("/", 1)
        name = name.removesuffix("_epoch")
        out.setdefault(split, {})[name] = float(value)
    return out
