"""The `clipping` group: gradient clipping, one rule class per choice, and the callback that records
(and, for the rules Lightning does not know, applies) it.

A choice names its rule as `_target_` (conf/clipping/NAME.yaml); the rule's arguments are its keys.
A new rule is one subclass of `ClippingRule`: what it says (`describe`, `settings`) and either the
Trainer arguments with which Lightning clips (`trainer_arguments`: the fixed norm and the value
clamp, `Trainer(gradient_clip_val=..., gradient_clip_algorithm=...)`) or the threshold this
callback clips the global norm to at each step (`threshold_for`, with the state it keeps).

The default, `Percentile`, learns its threshold from the run itself: a fixed `max_norm` has to be
guessed per model, optimizer and batch size; a percentile of the norms the run produces does not.
It watches the global gradient norm for `calibration_steps` optimizer steps, then clips every later
step to the chosen percentile of what it saw. During calibration each step is clipped to the
percentile of the norms recorded so far (AutoClip's rule), because a run at a high lr without
warmup is lost in its first steps: left unclipped there, the default did no better than no
clipping at all where training was fragile (benchmarks/results/clipping_cpu.md). With
`rolling_window` the threshold keeps following the last norms instead of staying frozen (AutoClip,
Seetharaman et al. 2020).

Order of events in Lightning 2.x, which this relies on (tests/unit/test_clipping.py pins it): the
precision plugin runs the closure (forward + backward), then with fp16 AMP calls
`scaler.unscale_(optimizer)`, then fires `on_before_optimizer_step`, then applies the Trainer's own
clipping, then steps (`lightning/pytorch/plugins/precision/precision.py::Precision._after_closure`).
So the gradients seen here are unscaled and not yet clipped by Lightning, except for optimizers
that unscale inside their own `step()` (fused ones): those are refused at fit start.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, ClassVar, Optional

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

from trainer.infra.errors import UserError
from trainer.infra.schema import ConfigGroup, Doc, check_target, locate_target

# clip_grad_norm_ adds this to the norm before dividing, so a clipped update lands just under the
# threshold rather than exactly on it.
_EPS = 1e-6


# --- the rules -------------------------------------------------------------------------------------

class ClippingRule:
    """One clipping choice. `mode` names it in records; the constructor's arguments are its keys."""

    mode: ClassVar[str] = ""

    def describe(self) -> str:
        raise NotImplementedError

    def settings(self) -> dict[str, Any]:
        """What the rule was made with: a checkpoint recorded under other settings is refused."""
        return {"mode": self.mode}

    def trainer_arguments(self) -> dict[str, Any]:
        """Lightning's own clipping, for a rule it knows: the Trainer's arguments (none: the callback clips)."""
        return {}

    @property
    def clips_here(self) -> bool:
        """Whether the callback clips (else Lightning does, or nothing does)."""
        return False

    @property
    def threshold(self) -> Optional[float]:
        """The bound in force, for the logs and the summary (None: none yet)."""
        return None

    def threshold_for(self, norm: float) -> Optional[float]:
        """The bound this step's finite global norm `norm` is clipped to (recording it as the rule
        needs); None: the step is left as it is."""
        return None

    def exceeded(self, norm: float, largest: float) -> bool:
        """Whether Lightning's clipping changes a step with this global norm and largest element."""
        return False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def summary(self) -> dict[str, Any]:
        return {**self.settings(), "threshold": self.threshold}


class Off(ClippingRule):
    mode = "off"

    def describe(self) -> str:
        return "no clipping"


class _ClippedByLightning(ClippingRule):
    """A rule the Trainer applies (its `gradient_clip_val` and `gradient_clip_algorithm`): the
    callback only counts the steps it changes."""

    algorithm: ClassVar[str]
    #: The rule's one key, and whether it bounds each element (else the global norm).
    key: ClassVar[str]
    per_element: ClassVar[bool]

    def __init__(self, bound: float) -> None:
        if not _positive_finite(bound):
            raise ValueError(f"{self.key} must be a finite number > 0, got {bound!r}")
        self.bound = float(bound)

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), self.key: self.bound}

    def trainer_arguments(self) -> dict[str, Any]:
        return {"gradient_clip_val": self.bound, "gradient_clip_algorithm": self.algorithm}

    @property
    def threshold(self) -> Optional[float]:
        return self.bound

    def exceeded(self, norm: float, largest: float) -> bool:
        return (largest if self.per_element else norm) > self.bound


class FixedNorm(_ClippedByLightning):
    """The global gradient norm clipped to `max_norm` by Lightning (`torch.nn.utils.clip_grad_norm_`)."""

    mode, algorithm, key, per_element = "fixed_norm", "norm", "max_norm", False

    def __init__(self, max_norm: Annotated[float, Doc("the global norm clipped to")]) -> None:
        super().__init__(max_norm)

    def describe(self) -> str:
        return f"clip the global norm to {self.bound:g} (Lightning's gradient_clip_val)"


class Value(_ClippedByLightning):
    """Every gradient element clamped to [-clip_value, clip_value] by Lightning (`clip_grad_value_`)."""

    mode, algorithm, key, per_element = "value", "value", "clip_value", True

    def __init__(self, clip_value: Annotated[float, Doc("each gradient element clamped to +-this")]) -> None:
        super().__init__(clip_value)

    def describe(self) -> str:
        return f"clamp each gradient to +-{self.bound:g} (Lightning's gradient_clip_val, by value)"


class Percentile(ClippingRule):
    """Clip to a percentile of the run's own global norms (see the module docstring). The attributes
    `calibration_norms` (the first `calibration_steps` finite norms), `window` (the rolling window,
    when set), `threshold` and `calibrated_threshold` show where it stands."""

    mode = "percentile"

    def __init__(
        self,
        percentile: Annotated[float, Doc("clip the global norm at this percentile of the recorded norms")] = 95.0,
        calibration_steps: Annotated[int, Doc("optimizer steps whose norms are recorded first")] = 100,
        clip_during_calibration: Annotated[bool, Doc("clip each calibration step to the percentile of the "
                                                     "norms recorded so far; false: record them unclipped")] = True,
        rolling_window: Annotated[Optional[int], Doc("then take the percentile of the last N norms "
                                                     "(AutoClip); null: keep the calibrated one")] = None,
    ) -> None:
        if isinstance(percentile, bool) or not isinstance(percentile, (int, float)) or not 0 < percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {percentile!r}")
        if not _whole(calibration_steps):
            raise ValueError(f"calibration_steps must be an integer >= 1, got {calibration_steps!r}")
        if rolling_window is not None and not _whole(rolling_window):
            raise ValueError(f"rolling_window must be None or an integer >= 1, got {rolling_window!r}")
        if not isinstance(clip_during_calibration, bool):
            raise ValueError(f"clip_during_calibration must be a bool, got {clip_during_calibration!r}")
        self.percentile = float(percentile)
        self.calibration_steps = calibration_steps
        self.clip_during_calibration = clip_during_calibration
        self.rolling_window = rolling_window
        self.calibration_norms: list[float] = []
        self.window: deque[float] = deque(maxlen=rolling_window)
        self.calibrated_threshold: float | None = None
        self._threshold: float | None = None

    def describe(self) -> str:
        later = f"the last {self.rolling_window} (AutoClip)" if self.rolling_window else None
        if self.clip_during_calibration:
            return (f"clip to the {self.percentile:g}th percentile of the norms so far for {self.calibration_steps} "
                    f"steps, then of {later or f'those {self.calibration_steps}'}")
        text = f"clip to the {self.percentile:g}th percentile of the first {self.calibration_steps} steps' norms " \
               "(those unclipped)"
        return text + (f", then of {later}" if later else "")

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "percentile": self.percentile, "calibration_steps": self.calibration_steps,
                "clip_during_calibration": self.clip_during_calibration, "rolling_window": self.rolling_window}

    @property
    def clips_here(self) -> bool:
        return True

    @property
    def threshold(self) -> Optional[float]:
        return self._threshold

    def threshold_for(self, norm: float) -> Optional[float]:
        if self.rolling_window is not None:
            self.window.append(norm)  # the pre-clip norm, so clipping cannot drag the threshold down
        if len(self.calibration_norms) < self.calibration_steps:
            # Recorded before the threshold is taken, as AutoClip does: the first step is never
            # clipped (a percentile of one norm is that norm), a new largest norm always is.
            self.calibration_norms.append(norm)
            if len(self.calibration_norms) == self.calibration_steps:
                self.calibrated_threshold = percentile_threshold(self.calibration_norms, self.percentile)
                self._threshold = self.calibrated_threshold
            elif self.clip_during_calibration:
                self._threshold = percentile_threshold(self.calibration_norms, self.percentile)
            return self._threshold if self.clip_during_calibration else None
        if self.rolling_window is not None:
            self._threshold = percentile_threshold(self.window, self.percentile)
        return self._threshold

    def state_dict(self) -> dict[str, Any]:
        return {"calibration_norms": list(self.calibration_norms), "window": list(self.window),
                "calibrated_threshold": self.calibrated_threshold, "threshold": self._threshold}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calibration_norms = [float(n) for n in state["calibration_norms"]]
        self.window = deque((float(n) for n in state["window"]), maxlen=self.rolling_window)
        self.calibrated_threshold = state["calibrated_threshold"]
        self._threshold = state["threshold"]

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "calibrated_threshold": self.calibrated_threshold}


def _positive_finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# --- the norms -------------------------------------------------------------------------------------

def percentile_threshold(norms: Sequence[float], percentile: float) -> float:
    """The `percentile` of `norms` with linear interpolation, exactly as `numpy.percentile`."""
    values = np.asarray(list(norms), dtype=np.float64)
    if values.size == 0:
        raise ValueError("cannot take a percentile of no norms")
    if not 0.0 <= percentile <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {percentile}")
    return float(np.percentile(values, percentile, method="linear"))


def global_grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of all existing gradients taken together, as `clip_grad_norm_` computes it, without
    clipping. Parameters without a gradient are skipped; with none at all the norm is 0."""
    grads = [p.grad for p in parameters if p.grad is not None]
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


def _scale_grads(params: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    if hasattr(torch.nn.utils, "clip_grads_with_norm_"):  # torch >= 2.6
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)
        return
    coef = torch.clamp(max_norm / (total_norm + _EPS), max=1.0)
    for grad in [p.grad for p in params if p.grad is not None]:
        grad.detach().mul_(coef.to(grad.device))


# --- the callback ----------------------------------------------------------------------------------

class GradientClipping(Callback):
    """Records the global gradient norm before each optimizer step and clips it as `rule` says (the
    rules Lightning applies are given to the Trainer by the run: `rule.trainer_arguments()`).

    Non-finite norms (fp16 overflow steps, which the GradScaler skips anyway) are counted but never
    recorded and never clipped here: one inf would poison a percentile, and clamping an inf gradient
    would only hide the overflow. The callback holds one history of norms, so a rule that clips here
    takes a single optimizer. The counters `steps_seen`, `steps_clipped` and `nonfinite_steps`, and
    `summary()`, say what it did.
    """

    def __init__(self, rule: ClippingRule | None = None,
                 log: Annotated[bool, Doc("log clip/grad_norm, clip/threshold and clip/clipped every step")] = True
                 ) -> None:
        self.rule = rule if rule is not None else Percentile()
        self.log = log
        self.steps_seen = 0
        self.steps_clipped = 0
        self.nonfinite_steps = 0
        self._sharded = False  # set at fit start: FSDP holds the gradients in shares (see on_fit_start)
        self._observing = True  # off where the gradients are out of reach (DeepSpeed's, for Lightning's rules)

    @property
    def mode(self) -> str:
        return self.rule.mode

    @property
    def threshold(self) -> Optional[float]:
        return self.rule.threshold

    def describe(self) -> str:
        return self.rule.describe()

    # -- the work, usable without a Trainer --------------------------------------------------------

    def observe_and_clip(self, parameters: Iterable[torch.Tensor],
                         sharded: bool = False) -> tuple[float, float | None, bool]:
        """Observe the global gradient norm of `parameters`, record it and clip in place as the rule
        says. Returns (the pre-clip norm, the threshold in force after this step, None while an
        unclipped calibration lasts, whether the gradients were changed: by this callback, or by
        Lightning next). `sharded`: each process holds a disjoint share of the gradients (FSDP), so
        the norms of the shares are combined over the process group first, and every process clips
        with the same factor."""
        params = [p for p in parameters if p.grad is not None]
        total = global_grad_norm(params)
        if sharded:
            total = _combine_shares(total, 2.0)
        largest = math.nan
        if self.rule.mode == "value":
            # One device sync for both numbers: the norm for the log and the largest element for
            # whether the clamp changes anything.
            peak = global_grad_norm(params, float("inf")).to(total.device)
            if sharded:
                peak = _combine_shares(peak, float("inf"))
            norm, largest = torch.stack([total.float(), peak.float()]).tolist()
        else:
            norm = total.item()
        self.steps_seen += 1
        if not math.isfinite(norm):
            self.nonfinite_steps += 1
            return norm, self.rule.threshold, False
        if not self.rule.clips_here:
            clipped = self.rule.exceeded(norm, largest)
            self.steps_clipped += int(clipped)
            return norm, self.rule.threshold, clipped
        threshold = self.rule.threshold_for(norm)
        clipped = threshold is not None and norm > threshold
        if clipped:
            assert threshold is not None
            _scale_grads(params, threshold, total)
            self.steps_clipped += 1
        return norm, self.rule.threshold, clipped

    def summary(self) -> dict[str, Any]:
        return {**self.rule.summary(), "steps_clipped": self.steps_clipped, "steps_observed": self.steps_seen,
                "nonfinite_steps": self.nonfinite_steps}

    # -- Lightning hooks ---------------------------------------------------------------------------

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.rule.mode == "off":
            return
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            fused = [type(o).__name__ for o in trainer.optimizers if getattr(o, "_step_supports_amp_scaling", False)]
            if fused:
                # Lightning does not unscale for these (their step() does it), so the gradients
                # would be multiplied by the loss scale; unscaling here would unscale them twice.
                raise RuntimeError(
                    f"clipping={self.rule.mode} needs unscaled gradients, but with fp16 AMP the optimizer(s) "
                    f"{fused} unscale inside step() (fused=True). Use a foreach (non-fused) optimizer with fp16, "
                    "or bf16 precision, or clipping=off.")
        if self.rule.clips_here and len(trainer.optimizers) > 1:
            raise RuntimeError(
                f"clipping={self.rule.mode} keeps one history of norms but the module has "
                f"{len(trainer.optimizers)} optimizers; their norms would be mixed into one threshold.")
        if self.rule.clips_here and trainer.gradient_clip_val:
            raise RuntimeError(
                f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) clips again after "
                f"clipping={self.rule.mode}; use one of the two.")
        # FSDP: each rank holds a shard of the gradients; their norms are combined before use.
        self._sharded = isinstance(trainer.strategy, FSDPStrategy) and trainer.world_size > 1
        if isinstance(trainer.strategy, DeepSpeedStrategy):
            if self.rule.clips_here:  # DeepSpeed keeps its gradients in its own buffers, out of reach
                raise RuntimeError(f"clipping={self.rule.mode} cannot see DeepSpeed's partitioned gradients; "
                                   "use clipping=fixed_norm, which DeepSpeed applies itself.")
            self._observing = False

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        if self.rule.mode == "off" or not self._observing:
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
        return {"settings": self.rule.settings(), **self.rule.state_dict(), "steps_seen": self.steps_seen,
                "steps_clipped": self.steps_clipped, "nonfinite_steps": self.nonfinite_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        wanted = self.rule.settings()
        # Checkpoints written before clip_during_calibration existed recorded their calibration
        # unclipped; those written before the rules were classes also carried the other rules' keys.
        saved = {"clip_during_calibration": False, **state_dict["settings"]}
        if {key: saved.get(key) for key in wanted} != wanted:
            # A recording made under other settings is not a continuation of this run.
            raise ValueError(f"GradientClipping state was saved with {state_dict['settings']} but this run uses "
                             f"{wanted}; match the settings or start without the checkpoint.")
        self.rule.load_state_dict(state_dict)
        self.steps_seen = int(state_dict["steps_seen"])
        self.steps_clipped = int(state_dict["steps_clipped"])
        self.nonfinite_steps = int(state_dict["nonfinite_steps"])


def validate(values: dict[str, Any]) -> dict[str, Any]:
    checked = check_target("clipping", values)
    rule = locate_target("clipping", checked["_target_"])
    if not (isinstance(rule, type) and issubclass(rule, ClippingRule)):
        raise UserError("clipping._target_", f"'{checked['_target_']}' is not a clipping rule",
                        "a subclass of trainer.groups.clipping.ClippingRule (Percentile, FixedNorm, Value, Off)")
    return checked


GROUP = ConfigGroup("clipping", __name__, "gradient clipping (95th percentile by default)", validate, target=True)
