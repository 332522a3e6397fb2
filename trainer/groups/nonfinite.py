"""The non-finite guard: a step whose loss or gradients hold NaN or Inf is skipped, not applied.

Its behaviour is in docs/reliability.md ("The non-finite guard"). The skip drops the gradients:
PyTorch's optimizers leave a parameter without a gradient untouched (no update, no momentum or Adam
moment, no step count). Under an fp16 GradScaler overflows are routine, so the guard only counts
and stops once the scale is below 1 and steps still overflow, which no loss scaling can cure. Costs
one device synchronization per optimizer step (the check must be known before the step)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Sequence

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from trainer.infra.errors import UserError
from trainer.infra.schema import AT_LEAST_ONE, ConfigGroup, Doc, check_target


class NonFiniteTraining(UserError):
    """Training diverged: too many consecutive steps with non-finite loss or gradients."""


class NonFiniteGuard(Callback):
    def __init__(self, mode: Annotated[Literal["skip", "off"], Doc("skip a step whose loss or gradients are "
                                                                  "NaN/Inf, or off")] = "skip",
                 max_consecutive: Annotated[int, AT_LEAST_ONE, Doc("bad steps in a row that stop the run with a "
                                                                   "diagnostic checkpoint")] = 10) -> None:
        if mode not in ("skip", "off"):
            raise ValueError(f"mode must be 'skip' or 'off', got {mode!r}")
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive must be at least 1, got {max_consecutive}")
        self.mode = mode
        self.max_consecutive = max_consecutive
        self.skipped_steps = 0
        self.consecutive = 0
        self.first_nonfinite: dict[str, Any] | None = None
        self.skipped_at: list[int] = []  # the first 100 skipped steps, for the record
        self.diagnostic_checkpoint: str | None = None
        self._loss: torch.Tensor | None = None

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self._loss = loss.detach()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        if self.mode == "off":
            return
        named = [(name, p) for name, p in pl_module.named_parameters() if p.grad is not None]
        if not named:
            return  # backward was skipped: nothing to check
        grads = [p.grad for _, p in named if p.grad is not None]  # all of them; mypy forgets the filter above
        finite = local_finite = self._all_finite(grads, self._loss)
        self._loss = None
        if trainer.world_size > 1:
            # Every process must skip (or stop) together: DDP's gradients agree after their
            # all-reduce, but a loss is each process's own, and a process that stepped alone would
            # leave the replicas apart (or one stopping alone would leave the others waiting).
            finite = trainer.strategy.reduce_boolean_decision(finite, all=True)
        if finite:
            self.consecutive = 0
            return
        step = int(trainer.global_step)
        self.skipped_steps += 1
        self.consecutive += 1
        if len(self.skipped_at) < 100:
            self.skipped_at.append(step)
        if self.consecutive == 1 or self.first_nonfinite is None:
            self.first_nonfinite = {"step": step, "parameter": _first_nonfinite(named) if not local_finite
                                    else "(another process's loss or gradient shard; this process's were finite)"}
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        scaled = scaler is not None and scaler.is_enabled()
        if not scaled:
            for _, p in named:
                p.grad = None  # the optimizer skips every parameter: weights and state untouched
        pl_module.log("nonfinite/skipped", float(self.skipped_steps), on_step=True, on_epoch=False, batch_size=1)
        if self.consecutive >= self.max_consecutive and (scaler is None or not scaled or scaler.get_scale() < 1.0):
            self._stop(trainer)

    @staticmethod
    def _all_finite(grads: list[torch.Tensor], loss: torch.Tensor | None) -> bool:
        # The norm of a tensor is finite exactly when all its elements are: one reduction per
        # tensor (a single foreach kernel where available) and one sync for the whole check.
        norms = torch._foreach_norm(grads) if hasattr(torch, "_foreach_norm") else [g.norm() for g in grads]
        values = torch.stack([n.float() for n in norms])
        if loss is not None:
            values = torch.cat([values, loss.float().reshape(1).to(values.device)])
        return bool(torch.isfinite(values).all())

    def _stop(self, trainer: L.Trainer) -> None:
        assert self.first_nonfinite is not None
        path = Path(trainer.default_root_dir) / "checkpoints" / f"nonfinite-step{int(trainer.global_step):06d}.ckpt"
        path.parent.mkdir(parents=True, exist_ok=True)
        trainer.save_checkpoint(str(path), weights_only=False)  # full (resumable); said, not defaulted
        self.diagnostic_checkpoint = str(path)
        first = self.first_nonfinite
        raise NonFiniteTraining(
            "training",
            f"{self.consecutive} steps in a row had a non-finite loss or gradient (the first in "
            f"{first['parameter']} at step {first['step']}); the last good weights are in {path}",
            "a lower optimizer.lr, clipping=fixed_norm, precision=fp32, or a larger nonfinite.max_consecutive")

    def summary(self) -> dict[str, Any]:
        return {"mode": self.mode, "max_consecutive": self.max_consecutive, "skipped_steps": self.skipped_steps,
                "skipped_at": list(self.skipped_at), "first_nonfinite": self.first_nonfinite,
                "diagnostic_checkpoint": self.diagnostic_checkpoint}

    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps, "consecutive": self.consecutive,
                "first_nonfinite": self.first_nonfinite, "skipped_at": list(self.skipped_at)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps = int(state_dict["skipped_steps"])
        self.consecutive = int(state_dict["consecutive"])
        self.first_nonfinite = state_dict["first_nonfinite"]
        self.skipped_at = [int(s) for s in state_dict["skipped_at"]]


def _first_nonfinite(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """The first parameter, in module order, whose gradient holds a NaN or Inf."""
    for name, p in named:
        if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
            return name
    return "(the loss; every gradient was finite)"


GROUP = ConfigGroup("nonfinite", __name__, "the guard that skips NaN/Inf steps", lambda values: check_target("nonfinite", values), target=True)
