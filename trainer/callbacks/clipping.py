"""Gradient clipping with a threshold learnt from the run itself.

A fixed `max_norm` has to be guessed per model, optimizer and batch size; a percentile of the norms
the run actually produces does not. In "percentile" mode the callback watches the global gradient
norm for `calibration_steps` optimizer steps, then clips every later step to the chosen percentile of
what it saw. During calibration each step is clipped to the percentile of the norms recorded so far
(AutoClip's rule), because a run at a high lr without warmup is lost in its first steps: left
unclipped there, the default did no better than no clipping at all where training was fragile
(benchmarks/results/clipping_cpu.md). `clip_during_calibration=false` restores the unclipped
recording. With `rolling_window` the threshold keeps following the last norms instead of staying
frozen (AutoClip, Seetharaman et al. 2020). "fixed_norm", "value" and "off" are there so one
callback covers every clipping choice of a run.

Order of events in Lightning 2.x, which this relies on: the precision plugin runs the closure
(forward + backward), then with fp16 AMP calls `scaler.unscale_(optimizer)`, then fires
`on_before_optimizer_step`, then applies the Trainer's own clipping, then steps (see
`lightning/pytorch/plugins/precision/amp.py::MixedPrecision.optimizer_step` and
`precision.py::Precision._after_closure`). So the gradients seen here are already unscaled, except
for optimizers that unscale inside their own `step()` (fused ones): those are refused at fit start.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, Optional

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

from trainer.configuration.schema import Doc

MODES = ("percentile", "fixed_norm", "value", "off")

# clip_grad_norm_ adds this to the norm before dividing, so a clipped update lands just under the
# threshold rather than exactly on it; keeping the same constant makes "fixed_norm" match torch.
_EPS = 1e-6


def percentile_threshold(norms: Sequence[float], percentile: float) -> float:
    """The `percentile` of `norms` with linear interpolation, exactly as `numpy.percentile`."""
    values = np.asarray(list(norms), dtype=np.float64)
    if values.size == 0:
        raise ValueError("cannot take a percentile of no norms")
    if not 0.0 <= percentile <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {percentile}")
    return float(np.percentile(values, percentile, method="linear"))


def _grads(parameters: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in parameters if p.grad is not None]


def global_grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all existing gradients taken together, as `clip_grad_norm_` computes it, without clipping.

    Parameters without a gradient are skipped; with none at all the norm is 0.
    """
    grads = _grads(parameters)
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6
        return torch.nn.utils.get_total_norm(grads, norm_type)
    if not grads:
        return torch.tensor(0.0)
    # Older torch: the norm of the per-tensor norms is the norm of the concatenation, for any p.
    device = grads[0].device
    per_tensor = [torch.linalg.vector_norm(g.detach(), norm_type).to(device) for g in grads]
    return torch.linalg.vector_norm(torch.stack(per_tensor), norm_type)


def _combine_shares(norm: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The norm of all processes' gradient shares together, from the norm of each share."""
    if not (dist.is_available() and dist.is_initialized()):
        return norm
    if math.isinf(norm_type):
        combined = norm.detach().float().clone()
        dist.all_reduce(combined, op=dist.ReduceOp.MAX)
        return combined
    combined = norm.detach().float().pow(norm_type)
    dist.all_reduce(combined, op=dist.ReduceOp.SUM)
    return combined.pow(1.0 / norm_type)


def _scale_grads(grads: list[torch.Tensor], params: list[torch.Tensor], max_norm: float,
                 total_norm: torch.Tensor) -> None:
    if hasattr(torch.nn.utils, "clip_grads_with_norm_"):  # torch >= 2.6
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)
        return
    coef = torch.clamp(max_norm / (total_norm + _EPS), max=1.0)
    for g in grads:
        g.detach().mul_(coef.to(g.device))


class GradientClipping(Callback):
    """Clip gradients just before each optimizer step; see the module docstring for the modes.

    Non-finite norms (fp16 overflow steps, which the GradScaler skips anyway) are counted but never
    recorded and never clipped: one inf would poison a percentile, and clamping an inf gradient would
    only hide the overflow.

    The callback holds one history of norms, so "percentile" mode takes a single optimizer. Use the
    attributes `calibration_norms` (the first `calibration_steps` finite norms), `window` (the rolling
    window, when set), `threshold`, `calibrated_threshold` and the counters `steps_seen`,
    `steps_clipped` and `nonfinite_steps` to inspect it, or `summary()`.
    """

    def __init__(
        self,
        mode: Annotated[str, Doc("percentile (AutoClip with rolling_window), fixed_norm, value or off")] = "percentile",
        percentile: Annotated[float, Doc("clip the global norm at this percentile of the recorded norms")] = 95.0,
        calibration_steps: Annotated[int, Doc("optimizer steps whose norms are recorded first")] = 100,
        clip_during_calibration: Annotated[bool, Doc("clip each calibration step to the percentile of the "
                                                     "norms recorded so far; false: record them unclipped")] = True,
        rolling_window: Annotated[Optional[int], Doc("then take the percentile of the last N norms "
                                                     "(AutoClip); null: keep the calibrated one")] = None,
        max_norm: Annotated[Optional[float], Doc("fixed_norm: the global norm clipped to")] = None,
        clip_value: Annotated[Optional[float], Doc("value: each gradient element clamped to +-this")] = None,
        log: Annotated[bool, Doc("log clip/grad_norm, clip/threshold and clip/clipped every step")] = True,
    ) -> None:
        _validate(mode, percentile, calibration_steps, clip_during_calibration, rolling_window, max_norm,
                  clip_value, log)
        self.mode = mode
        self.percentile = float(percentile)
        self.calibration_steps = calibration_steps
        self.clip_during_calibration = clip_during_calibration
        self.rolling_window = rolling_window
        self.max_norm = None if max_norm is None else float(max_norm)
        self.clip_value = None if clip_value is None else float(clip_value)
        self.log = log

        self.calibration_norms: list[float] = []
        self.window: deque[float] = deque(maxlen=rolling_window)
        self.calibrated_threshold: float | None = None
        # The fixed modes know their bound from the start; "value" reports its per-element bound.
        self.threshold: float | None = {"fixed_norm": self.max_norm, "value": self.clip_value}.get(mode)
        self.steps_seen = 0
        self.steps_clipped = 0
        self.nonfinite_steps = 0
        self._sharded = False  # set at fit start: FSDP holds the gradients in shares (see on_fit_start)

    # -- the work, usable without a Trainer --------------------------------------------------------

    def observe_and_clip(self, parameters: Iterable[torch.Tensor],
                         sharded: bool = False) -> tuple[float, float | None, bool]:
        """Observe the global gradient norm of `parameters`, record it and clip in place as the mode says.

        Returns (the pre-clip norm, the threshold in force after this step, None while an unclipped
        calibration lasts, whether the gradients were changed). Parameters without a gradient are
        ignored. `sharded`: each process holds a disjoint share of the gradients (FSDP), so the norms
        of the shares are combined over the process group first, and every process clips with the
        same factor.
        """
        params = [p for p in parameters if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None]  # all of them; mypy forgets the filter above
        total = global_grad_norm(params)
        if sharded:
            total = _combine_shares(total, 2.0)
        if self.mode == "value":
            # One device sync for both numbers: the norm for the log and the largest element for
            # deciding whether the clamp changes anything.
            largest = global_grad_norm(params, float("inf")).to(total.device)
            if sharded:
                largest = _combine_shares(largest, float("inf"))
            norm, peak = torch.stack([total.float(), largest.float()]).tolist()
        else:
            norm = total.item()
        self.steps_seen += 1

        if not math.isfinite(norm):
            self.nonfinite_steps += 1
            return norm, self.threshold, False
        if self.mode == "off":
            return norm, None, False
        if self.mode == "value":
            assert self.clip_value is not None  # mode 'value' is refused without it
            clipped = peak > self.clip_value
            if clipped:
                torch.nn.utils.clip_grad_value_(params, self.clip_value)
                self.steps_clipped += 1
            return norm, self.threshold, clipped

        if self.mode == "percentile" and not self._record(norm):
            return norm, self.threshold, False  # an unclipped calibration step
        assert self.threshold is not None
        clipped = norm > self.threshold
        if clipped:
            _scale_grads(grads, params, self.threshold, total)
            self.steps_clipped += 1
        return norm, self.threshold, clipped

    def _record(self, norm: float) -> bool:
        """Record a finite norm and set the threshold for this step; True when that threshold applies."""
        if self.rolling_window is not None:
            self.window.append(norm)  # the pre-clip norm, so clipping cannot drag the threshold down
        if len(self.calibration_norms) < self.calibration_steps:
            # Recorded before the threshold is taken, as AutoClip does: the first step is never
            # clipped (a percentile of one norm is that norm), a new largest norm always is.
            self.calibration_norms.append(norm)
            if len(self.calibration_norms) == self.calibration_steps:
                self.calibrated_threshold = percentile_threshold(self.calibration_norms, self.percentile)
                self.threshold = self.calibrated_threshold
            elif self.clip_during_calibration:
                self.threshold = percentile_threshold(self.calibration_norms, self.percentile)
            return self.clip_during_calibration
        if self.rolling_window is not None:
            self.threshold = percentile_threshold(self.window, self.percentile)
        return True

    def describe(self) -> str:
        """What this callback will do, in words (the run prints it with the other derived values)."""
        if self.mode == "percentile":
            later = f"the last {self.rolling_window} (AutoClip)" if self.rolling_window else None
            if self.clip_during_calibration:
                return (f"clip to the {self.percentile:g}th percentile of the norms so far for "
                        f"{self.calibration_steps} steps, then of {later or f'those {self.calibration_steps}'}")
            text = f"clip to the {self.percentile:g}th percentile of the first {self.calibration_steps} steps' norms " \
                   "(those unclipped)"
            return text + (f", then of {later}" if later else "")
        if self.mode == "fixed_norm":
            return f"clip the global norm to {self.max_norm:g}"
        if self.mode == "value":
            return f"clamp each gradient to +-{self.clip_value:g}"
        return "no clipping"

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "percentile": self.percentile,
            "calibration_steps": self.calibration_steps,
            "clip_during_calibration": self.clip_during_calibration,
            "rolling_window": self.rolling_window,
            "threshold": self.threshold,
            "calibrated_threshold": self.calibrated_threshold,
            "steps_clipped": self.steps_clipped,
            "steps_observed": self.steps_seen,
            "nonfinite_steps": self.nonfinite_steps,
            "max_norm": self.max_norm,
            "clip_value": self.clip_value,
        }

    # -- Lightning hooks ---------------------------------------------------------------------------

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.mode == "off":
            return
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            fused = [type(o).__name__ for o in trainer.optimizers if getattr(o, "_step_supports_amp_scaling", False)]
            if fused:
                # Lightning does not unscale for these (their step() does it), so we would see
                # gradients multiplied by the loss scale; unscaling here would unscale them twice.
                raise RuntimeError(
                    f"GradientClipping(mode={self.mode!r}) needs unscaled gradients, but with fp16 AMP the "
                    f"optimizer(s) {fused} unscale inside step() (fused=True). Use a foreach (non-fused) "
                    "optimizer with fp16, or bf16 precision, or mode='off'.")
        if self.mode == "percentile" and len(trainer.optimizers) > 1:
            raise RuntimeError(
                f"GradientClipping(mode='percentile') keeps one history of norms but the module has "
                f"{len(trainer.optimizers)} optimizers; their norms would be mixed into one threshold.")
        if trainer.gradient_clip_val:
            raise RuntimeError(
                f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) clips again after GradientClipping"
                f"(mode={self.mode!r}); use one of the two.")
        # FSDP: each rank holds a shard of the gradients; their norms are combined before use.
        self._sharded = isinstance(trainer.strategy, FSDPStrategy) and trainer.world_size > 1
        if self.mode in ("percentile", "fixed_norm") and isinstance(trainer.strategy, DeepSpeedStrategy):
            # DeepSpeed keeps its gradients in its own buffers, out of this callback's reach.
            raise RuntimeError(
                f"GradientClipping(mode={self.mode!r}) cannot see DeepSpeed's partitioned gradients; "
                "use DeepSpeed's own gradient_clipping setting.")

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        if self.mode == "off":
            return  # no norm, no device sync: "off" costs nothing
        # The optimizer's own parameters, like Lightning's clipping: with several optimizers the
        # other ones' gradients are not ours to touch (and under AMP are not unscaled yet).
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not params:
            return  # backward was skipped (training_step returned None): nothing to observe
        norm, threshold, clipped = self.observe_and_clip(params, sharded=self._sharded)
        if not self.log:
            return
        kwargs: dict[str, Any] = {"on_step": True, "on_epoch": False, "batch_size": 1}
        pl_module.log("clip/grad_norm", norm, **kwargs)
        if threshold is not None:
            pl_module.log("clip/threshold", threshold, **kwargs)
        pl_module.log("clip/clipped", float(clipped), **kwargs)

    # -- checkpointing -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "settings": self._settings(),
            "calibration_norms": list(self.calibration_norms),
            "window": list(self.window),
            "calibrated_threshold": self.calibrated_threshold,
            "threshold": self.threshold,
            "steps_seen": self.steps_seen,
            "steps_clipped": self.steps_clipped,
            "nonfinite_steps": self.nonfinite_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Checkpoints written before clip_during_calibration existed recorded their calibration unclipped.
        saved = {"clip_during_calibration": False, **state_dict["settings"]}
        if saved != self._settings():
            # A recording made under other settings is not a continuation of this run.
            raise ValueError(f"GradientClipping state was saved with {saved} but this run uses "
                             f"{self._settings()}; match the settings or start without the checkpoint.")
        self.calibration_norms = [float(n) for n in state_dict["calibration_norms"]]
        self.window = deque((float(n) for n in state_dict["window"]), maxlen=self.rolling_window)
        self.calibrated_threshold = state_dict["calibrated_threshold"]
        self.threshold = state_dict["threshold"]
        self.steps_seen = int(state_dict["steps_seen"])
        self.steps_clipped = int(state_dict["steps_clipped"])
        self.nonfinite_steps = int(state_dict["nonfinite_steps"])

    def _settings(self) -> dict[str, Any]:
        return {"mode": self.mode, "percentile": self.percentile, "calibration_steps": self.calibration_steps,
                "clip_during_calibration": self.clip_during_calibration, "rolling_window": self.rolling_window,
                "max_norm": self.max_norm, "clip_value": self.clip_value}


def _positive_finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _validate(mode: str, percentile: float, calibration_steps: int, clip_during_calibration: bool,
              rolling_window: int | None, max_norm: float | None, clip_value: float | None, log: bool) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not isinstance(percentile, (int, float)) or isinstance(percentile, bool) or not 0 < percentile <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {percentile!r}")
    if not isinstance(calibration_steps, int) or isinstance(calibration_steps, bool) or calibration_steps < 1:
        raise ValueError(f"calibration_steps must be an integer >= 1, got {calibration_steps!r}")
    if rolling_window is not None and (not isinstance(rolling_window, int) or isinstance(rolling_window, bool)
                                       or rolling_window < 1):
        raise ValueError(f"rolling_window must be None or an integer >= 1, got {rolling_window!r}")
    if not isinstance(log, bool):
        raise ValueError(f"log must be a bool, got {log!r}")
    if not isinstance(clip_during_calibration, bool):
        raise ValueError(f"clip_during_calibration must be a bool, got {clip_during_calibration!r}")
    # A setting the mode ignores is almost always a mistake in the config, so it is refused.
    if mode == "fixed_norm" and not _positive_finite(max_norm):
        raise ValueError(f"mode='fixed_norm' needs max_norm > 0, got {max_norm!r}")
    if mode != "fixed_norm" and max_norm is not None:
        raise ValueError(f"max_norm only applies to mode='fixed_norm', not {mode!r}")
    if mode == "value" and not _positive_finite(clip_value):
        raise ValueError(f"mode='value' needs clip_value > 0, got {clip_value!r}")
    if mode != "value" and clip_value is not None:
        raise ValueError(f"clip_value only applies to mode='value', not {mode!r}")
    if mode != "percentile" and rolling_window is not None:
        raise ValueError(f"rolling_window only applies to mode='percentile', not {mode!r}")
