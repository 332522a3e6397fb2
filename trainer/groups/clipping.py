"""The `clipping` group: gradient clipping, one rule class per choice, and the callback that records
(and, for the rules Lightning does not know, applies) it.

A choice names its rule as `_target_` (conf/clipping/NAME.yaml); the rule's arguments are its keys.
A new rule is one subclass of `ClippingRule`: what it says (`describe`, `settings`) and either the
Trainer arguments with which Lightning clips (`trainer_arguments`: the fixed norm and the value
clamp) or the threshold this callback clips the global norm to at each step (`threshold_for`, with
the state it keeps). The default, `Percentile`, learns its threshold from the run itself
(docs/practices.md, "Gradient clipping", has the why and the study).

Order of events in Lightning 2.x, which this relies on (tests/unit/test_clipping.py pins it): the
precision plugin runs the closure (forward + backward), then with fp16 AMP calls
`scaler.unscale_(optimizer)`, then fires `on_before_optimizer_step`, then applies the Trainer's own
clipping, then steps (`lightning/pytorch/plugins/precision/precision.py::Precision._after_closure`).
So the gradients seen here are unscaled and not yet clipped by Lightning, except for optimizers
that unscale inside their own `step()` (fused ones): those are refused at fit start. Without a
GradScaler, a fused optimizer's kernel applies this callback's factor as it steps
(`GradientClipping._kernel_scales`): a callback after this one in `on_before_optimizer_step` sees the
gradients unclipped there, clipped after the step.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Sequence
from typing import Annotated, Any, ClassVar, NamedTuple, Optional

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

from trainer.callbacks.steps import at_log_step
from trainer.infra.errors import UserError
from trainer.infra.on_device import DeviceValues, read_together, scalar, value_dtype
from trainer.infra.schema import ConfigGroup, Doc, check_target, locate_target
from trainer.infra.step_gradients import StepGradients, of_parameters, step_gradients, steps_in_kernel

# clip_grad_norm_ adds this to the norm before dividing, so a clipped update lands just under the
# threshold rather than exactly on it.
_EPS = 1e-6
#: Steps whose norms the short path (a fixed bound) keeps on the device before it counts them.
FIXED_ROWS = 64


# --- the rules -------------------------------------------------------------------------------------

class ClippingRule:
    """One clipping choice. `mode` names it in records; the constructor's arguments are its keys.

    A rule decides on the device: `threshold_for` and `exceeded` take and return tensors, so the
    step never waits for the host (trainer/infra/on_device.py says why)."""

    mode: ClassVar[str] = ""
    #: Whether the callback clips (else Lightning does, or nothing does).
    clips_here: ClassVar[bool] = False

    def describe(self) -> str:
        raise NotImplementedError

    def settings(self) -> dict[str, Any]:
        """What the rule was made with: a checkpoint recorded under other settings is refused."""
        return {"mode": self.mode}

    def trainer_arguments(self) -> dict[str, Any]:
        """Lightning's own clipping, for a rule it knows: the Trainer's arguments (none: the callback clips)."""
        return {}

    @property
    def threshold(self) -> Optional[float]:
        """The bound in force, for the records (None: none yet); a host read."""
        return None

    def threshold_on(self, device: torch.device) -> Optional[torch.Tensor]:
        """The bound in force as a 0-d tensor on `device` for the logs (NaN: none yet; None: the rule
        has no bound)."""
        return None

    def threshold_for(self, norm: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
        """The bound this step's global norm `norm` is clipped to, recording it as the rule needs
        where `finite` holds (a non-finite norm is never recorded). NaN: the step is left as it is."""
        return torch.full_like(norm, math.nan)

    def exceeded(self, norm: torch.Tensor, largest: Optional[torch.Tensor]) -> torch.Tensor:
        """Whether Lightning's clipping changes a step with this global norm and largest element."""
        return torch.zeros((), dtype=torch.bool, device=norm.device)

    def fixed_bound(self, device: torch.device) -> Optional[torch.Tensor]:
        """The bound every step from now on is clipped to, where it no longer changes from step to
        step and nothing is recorded (then a step takes the short path: `GradientClipping._clip_fixed`);
        None while `threshold_for` must see each step."""
        return None

    def settle(self, steps_seen: int) -> None:
        """Called at log steps, where a host read costs nothing extra, with the steps observed so
        far: a rule may learn there what lets its later steps do less."""

    @property
    def settled(self) -> bool:
        """Whether `settle` has nothing left to learn (then it is not asked again)."""
        return True

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
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), self.key: self.bound}

    def trainer_arguments(self) -> dict[str, Any]:
        return {"gradient_clip_val": self.bound, "gradient_clip_algorithm": self.algorithm}

    @property
    def threshold(self) -> Optional[float]:
        return self.bound

    def threshold_on(self, device: torch.device) -> Optional[torch.Tensor]:
        if device not in self._on_device:
            self._on_device[device] = scalar(self.bound, device)
        return self._on_device[device]

    def exceeded(self, norm: torch.Tensor, largest: Optional[torch.Tensor]) -> torch.Tensor:
        measured = largest if self.per_element and largest is not None else norm
        return measured.to(value_dtype(measured.device)) > self.bound


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
    """Clip to a percentile of the run's own global norms: a fixed `max_norm` has to be guessed per
    model, optimizer and batch size; a percentile of the norms the run produces does not. The norms
    of the first `calibration_steps` optimizer steps are recorded, and every later step is clipped
    to the percentile of them (with `rolling_window`, of the last norms instead: AutoClip,
    Seetharaman et al. 2020). During calibration each step is clipped to the percentile of the norms
    so far (AutoClip's rule): a run at a high lr without warmup is lost in its first steps.

    The norms and thresholds live on the device; the properties `calibration_norms`, `window`,
    `threshold` and `calibrated_threshold` read them for the records."""

    mode, clips_here = "percentile", True

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
        self._calibration = DeviceValues(calibration_steps)
        self._window = DeviceValues(rolling_window, ring=True) if rolling_window is not None else None
        # The bound in force and the one calibration ended with, NaN for none yet: on the device once
        # the first norm is seen, host values (from a checkpoint) until then.
        self._bounds: Optional[torch.Tensor] = None
        self._loaded_bounds: tuple[Optional[float], Optional[float]] = (None, None)
        self._calibration_over = False  # known on the host (`settle`)

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

    # -- the records (host reads) ------------------------------------------------------------------

    @property
    def calibration_norms(self) -> list[float]:
        return self._calibration.host_values()

    @property
    def window(self) -> list[float]:
        return self._window.host_values() if self._window is not None else []

    def _host_bounds(self) -> tuple[Optional[float], Optional[float]]:
        if self._bounds is None:
            return self._loaded_bounds
        threshold, calibrated = self._bounds.tolist()
        return (None if math.isnan(threshold) else threshold), (None if math.isnan(calibrated) else calibrated)

    @property
    def threshold(self) -> Optional[float]:
        return self._host_bounds()[0]

    @property
    def calibrated_threshold(self) -> Optional[float]:
        return self._host_bounds()[1]

    # -- the step (device only) --------------------------------------------------------------------

    def _bind(self, device: torch.device) -> torch.Tensor:
        if self._bounds is None or self._bounds.device != device:
            held = self._host_bounds()
            self._bounds = torch.tensor([math.nan if b is None else b for b in held],
                                        dtype=value_dtype(device), device=device)
            self._threshold = self._bounds[0]  # one view, kept: a frozen bound is the same tensor every step
        return self._bounds

    def threshold_on(self, device: torch.device) -> Optional[torch.Tensor]:
        return self._bind(device)[0].clone()

    def settle(self, steps_seen: int) -> None:
        """Learn on the host whether calibration has ended (one read, made at a log step, and only
        once `calibration_steps` steps have been seen, as it cannot end before): from then on a step
        skips the calibration's arithmetic, which can no longer change anything."""
        if not self._calibration_over and self._calibration.bound and steps_seen >= self.calibration_steps:
            self._calibration_over = int(self._calibration.count().item()) >= self.calibration_steps

    @property
    def settled(self) -> bool:
        return self._calibration_over

    def fixed_bound(self, device: torch.device) -> Optional[torch.Tensor]:
        if self._calibration_over and self._window is None:
            self._bind(device)
            return self._threshold  # frozen at the calibrated threshold: nothing to record or compute
        return None

    def threshold_for(self, norm: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
        bounds = self._bind(norm.device)
        threshold = self._threshold
        if self._calibration_over and self._window is None:
            return threshold  # frozen at the calibrated threshold: nothing to record or compute
        value = norm.detach().to(bounds.dtype)
        if self._window is not None:
            self._window.append(value, finite)  # the pre-clip norm, so clipping cannot drag the threshold down
        if self._calibration_over:
            assert self._window is not None  # (a frozen threshold returned above)
            bounds[0].copy_(torch.where(finite, self._window.percentile(self.percentile), threshold))
            return bounds[0]
        calibrated = bounds[1]
        self._calibration.bind(norm.device)
        calibrating = self._calibration.count() < self.calibration_steps
        # Recorded before the threshold is taken, as AutoClip does: the first step is never clipped
        # (a percentile of one norm is that norm), a new largest norm always is.
        recorded = finite & calibrating
        self._calibration.append(value, recorded)
        so_far = self._calibration.percentile(self.percentile)
        completed = recorded & (self._calibration.count() == self.calibration_steps)
        while_calibrating = torch.where(completed, so_far, so_far if self.clip_during_calibration else threshold)
        later = self._window.percentile(self.percentile) if self._window is not None else threshold
        new = torch.where(finite, torch.where(calibrating, while_calibrating, later), threshold)
        bounds.copy_(torch.stack([new, torch.where(completed, so_far, calibrated)]))
        if self.clip_during_calibration:
            return new
        return torch.where(calibrating, torch.full_like(new, math.nan), new)

    # -- checkpoints ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        threshold, calibrated = self._host_bounds()
        return {"calibration_norms": self.calibration_norms, "window": self.window,
                "calibrated_threshold": calibrated, "threshold": threshold}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._calibration.load([float(n) for n in state["calibration_norms"]])
        self._calibration_over = len(state["calibration_norms"]) >= self.calibration_steps
        if self._window is not None:
            self._window.load([float(n) for n in state["window"]])
        bounds = (state["threshold"], state["calibrated_threshold"])
        self._loaded_bounds = (None if bounds[0] is None else float(bounds[0]),
                               None if bounds[1] is None else float(bounds[1]))
        device = self._bounds.device if self._bounds is not None else None
        self._bounds = None
        if device is not None:
            self._bind(device)

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "calibrated_threshold": self.calibrated_threshold}


def _positive_finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# --- the norms -------------------------------------------------------------------------------------

def percentile_threshold(norms: Sequence[float], percentile: float) -> float:
    """The `percentile` of `norms` with linear interpolation, exactly as `numpy.percentile` (on the
    host: for reports; the rules take theirs on the device, `DeviceValues.percentile`)."""
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


class StepRecord(NamedTuple):
    """What the clipping did at one step, as device tensors: the pre-clip global norm, the threshold
    in force after the step (NaN: none yet; None: the rule has none) and whether the gradients were
    changed (by the callback, or by Lightning next)."""

    norm: torch.Tensor
    threshold: Optional[torch.Tensor]
    clipped: torch.Tensor


# --- the callback ----------------------------------------------------------------------------------

class GradientClipping(Callback):
    """Records the global gradient norm before each optimizer step and clips it as `rule` says (the
    rules Lightning applies are given to the Trainer by the run: `rule.trainer_arguments()`).

    Everything a step decides stays on the device (`clip_on_device`), so the host never waits for
    the step. Non-finite norms are counted but never recorded and never clipped here: one inf would
    poison a percentile, and clamping an inf gradient would only hide the overflow. The callback
    holds one history of norms, so a rule that clips here takes a single optimizer."""

    def __init__(self, rule: ClippingRule | None = None,
                 log: Annotated[bool, Doc("log clip/grad_norm, clip/threshold and clip/clipped at log steps")] = True
                 ) -> None:
        self.rule = rule if rule is not None else Percentile()
        self.log = log
        self.steps_seen = 0
        # On the device once a step is seen: steps clipped, and steps with a finite norm since the
        # counter was made (`_counted` steps, after `_counts_base`: what the host held then).
        self._counts: Optional[torch.Tensor] = None
        self._loaded_counts = (0, 0)  # (steps clipped, steps with a non-finite norm) from a checkpoint
        self._counts_base = (0, 0)
        self._counted = 0
        # (the bound, its version, the bound in the norm's dtype, a 1 of that dtype): `_cast_bound`.
        self._bound_cast: Optional[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]] = None
        self._sharded = False  # set at fit start: FSDP holds the gradients in shares (see on_fit_start)
        self._observing = True  # off where the gradients are out of reach (DeepSpeed's, for Lightning's rules)
        # The last step's (norm, clipped); clipped None on the short path, where the fixed bound says it.
        self._last: Optional[tuple[torch.Tensor, Optional[torch.Tensor]]] = None
        # The short path's buffer of pre-clip norms (`_clip_fixed`), counted by `_count_fixed`.
        self._fixed_norms: Optional[torch.Tensor] = None
        self._fixed_rows: list[torch.Tensor] = []
        self._fixed_used = 0
        self._fixed_bound: Optional[torch.Tensor] = None
        # Per optimizer, held weakly: whether its fused kernel applies the factor (`_kernel_scales`).
        self._kernel_hooked: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = weakref.WeakKeyDictionary()

    @property
    def mode(self) -> str:
        return self.rule.mode

    @property
    def threshold(self) -> Optional[float]:
        return self.rule.threshold

    def describe(self) -> str:
        return self.rule.describe()

    def _host_counts(self) -> tuple[int, int]:
        """(steps clipped, steps with a non-finite norm), in one read of the device."""
        self._count_fixed()
        if self._counts is None:
            return self._loaded_counts
        clipped, finite = read_together({"counts": self._counts})["counts"]
        return int(clipped), self._counts_base[1] + self._counted - int(finite)

    @property
    def steps_clipped(self) -> int:
        return self._host_counts()[0]

    @property
    def nonfinite_steps(self) -> int:
        return self._host_counts()[1]

    # -- the work, usable without a Trainer --------------------------------------------------------

    def clip_on_device(self, parameters: Iterable[torch.Tensor], sharded: bool = False) -> StepRecord:
        """Observe the global gradient norm of `parameters`, record it and clip in place as the rule
        says, without reading a value on the host. `sharded`: each process holds a disjoint share of
        the gradients (FSDP), so the norms of the shares are combined over the process group first,
        and every process clips with the same factor."""
        params = [p for p in parameters if p.grad is not None]
        total, clipped = self._clip(of_parameters(params), sharded)
        if clipped is None:  # the short path: a row of its buffer, which later steps write again
            total, clipped = total.clone(), self._clipped_at_fixed_bound(total)
        return StepRecord(total.detach(), self.rule.threshold_on(total.device), clipped)

    def _clip(self, gradients: StepGradients, sharded: bool,
              kernel: Optional[torch.optim.Optimizer] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The work of one step on the device: (the pre-clip global norm, whether the step was
        clipped; None on the short path, where that is `_clipped_at_fixed_bound(norm)`). `kernel`:
        the optimizer about to step, when its fused kernel can apply the factor (`_kernel_scales`)."""
        if self.rule.clips_here and not sharded:
            bound = self.rule.fixed_bound(gradients.norms.device)
            if bound is not None:
                return self._clip_fixed(gradients, bound, kernel), None
        total = gradients.total
        if sharded:
            total = _combine_shares(total, 2.0)
        largest = None
        if self.rule.mode == "value":
            largest = global_grad_norm(gradients.params, float("inf")).to(total.device)
            if sharded:
                largest = _combine_shares(largest, float("inf"))
        self.steps_seen += 1
        counts = self._counter_on(total.device)
        finite = total < math.inf  # a norm is never negative, and NaN compares false
        if self.rule.clips_here:
            bound = self.rule.threshold_for(total, finite)
            clipped = finite & (total > bound)
            self._scale_grads(gradients, bound, total, clipped, kernel)
        else:
            clipped = finite & self.rule.exceeded(total, largest)
        counts.add_(torch.stack([clipped, finite]))
        self._counted += 1
        return total, clipped

    def _counter_on(self, device: torch.device) -> torch.Tensor:
        """The device counter of steps clipped and steps with a finite norm, made on `device` (from
        what the host holds) if it is not there."""
        if self._counts is None or self._counts.device != device:
            self._counts_base = self._host_counts()
            self._counts = torch.tensor([self._counts_base[0], 0], dtype=torch.long, device=device)
            self._counted = 0
        return self._counts

    def _clip_fixed(self, gradients: StepGradients, bound: torch.Tensor,
                    kernel: Optional[torch.optim.Optimizer] = None) -> torch.Tensor:
        """A step once the rule's bound no longer changes: the global norm into the buffer's next row
        and the gradients scaled, seven operations (the norm, the factor's five, one multi-tensor
        multiply per device) where the general path takes eleven, five where the optimizer's fused
        kernel applies the factor (`kernel`); the counting is `_count_fixed`'s. Returns the pre-clip
        global norm (that row)."""
        norms = gradients.norms
        self.steps_seen += 1
        self._counter_on(norms.device)
        buffer = self._fixed_norms
        fits = buffer is not None and buffer.dtype == norms.dtype and buffer.device == norms.device
        if not fits or self._fixed_used == FIXED_ROWS or self._fixed_bound is not bound:
            self._count_fixed()
            if not fits:
                self._fixed_norms = torch.empty(FIXED_ROWS, dtype=norms.dtype, device=norms.device)
                self._fixed_rows = list(self._fixed_norms.unbind(0))
            self._fixed_bound = bound
        total = torch.linalg.vector_norm(norms, out=self._fixed_rows[self._fixed_used])
        self._fixed_used += 1
        cast, one = self._cast_bound(bound, total)
        # clip_grads_with_norm_'s factor, reciprocal(norm + eps) * bound, capped at 1 as clip_grad_norm_
        # caps it; a non-finite norm is made NaN (an infinite one would give 0), and fmin takes the 1
        # over a NaN: such a step is left as it is, as on the general path.
        nan_unless_finite = torch.nan_to_num(total, nan=math.nan, posinf=math.nan)
        if kernel is not None:
            # The kernel divides by the factor's inverse, (norm + eps) / bound floored at 1 (fmax takes
            # the 1 over a NaN, as fmin does above).
            kernel.grad_scale = torch.fmax((nan_unless_finite + _EPS) / cast, one)  # type: ignore[attr-defined]
            return total
        factor = torch.fmin(torch.reciprocal(nan_unless_finite + _EPS) * cast, one)
        self._multiply(gradients, factor)
        return total

    def _clipped_at_fixed_bound(self, norm: torch.Tensor) -> torch.Tensor:
        """Whether a short-path step with this norm was clipped, as the general path decides it."""
        assert self._fixed_bound is not None
        return (norm < math.inf) & (norm > self._fixed_bound)

    def _count_fixed(self) -> None:
        """The short path's buffered steps into the counter: steps clipped, steps with a finite norm."""
        used = self._fixed_used
        if not used:
            return
        assert self._fixed_norms is not None and self._counts is not None
        norms = self._fixed_norms[:used]
        finite = norms < math.inf
        clipped = self._clipped_at_fixed_bound(norms)
        self._counts.add_(torch.stack([clipped.sum(), finite.sum()]))
        self._counted += used
        self._fixed_used = 0

    def _cast_bound(self, bound: torch.Tensor, total_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`bound` in the norm's dtype and a 1 of that dtype, kept while the rule's bound is unchanged
        (the bound itself is held, not its id: a bound made afresh at every step, calibration's, is
        freed after it, and a new tensor could take its id and version 0)."""
        cached = self._bound_cast
        if cached is None or cached[0] is not bound or cached[1] != bound._version or cached[2].dtype != total_norm.dtype:
            cached = self._bound_cast = (bound, bound._version, bound.to(total_norm.dtype),
                                         torch.ones((), dtype=total_norm.dtype, device=total_norm.device))
        return cached[2], cached[3]

    @staticmethod
    def _multiply(gradients: StepGradients, factor: torch.Tensor) -> None:
        for device, grads in gradients.grads_by_device().items():
            torch._foreach_mul_(grads, factor if device == factor.device else factor.to(device))

    def _scale_grads(self, gradients: StepGradients, bound: torch.Tensor, total_norm: torch.Tensor,
                     clipped: torch.Tensor, kernel: Optional[torch.optim.Optimizer] = None) -> None:
        """Multiply every gradient by `bound / (norm + eps)` where `clipped` holds, by 1 elsewhere:
        `clip_grads_with_norm_`'s factor (`reciprocal(norm + eps) * max_norm` in the norm's dtype),
        with a device bound, so the host never learns whether the step was clipped. One multi-tensor
        call per device; none where the optimizer's fused kernel (`kernel`) divides by the factor's
        inverse as it steps."""
        cast, one = self._cast_bound(bound, total_norm)
        if kernel is not None:
            kernel.grad_scale = torch.where(clipped, (total_norm + _EPS) / cast, one)  # type: ignore[attr-defined]
            return
        self._multiply(gradients, torch.where(clipped, torch.reciprocal(total_norm + _EPS) * cast, one))

    def observe_and_clip(self, parameters: Iterable[torch.Tensor],
                         sharded: bool = False) -> tuple[float, float | None, bool]:
        """`clip_on_device`, then the host's copy of what it did: (the pre-clip norm, the threshold
        in force after this step, None while there is none, whether the gradients were changed).
        One read of the device per call: for tools and tests, not for the training step."""
        record = self.clip_on_device(parameters, sharded)
        values = {"norm": record.norm, "clipped": record.clipped}
        if record.threshold is not None:
            values["threshold"] = record.threshold
        got = read_together(values)
        threshold = got.get("threshold", [math.nan])[0]
        return got["norm"][0], (None if math.isnan(threshold) else threshold), bool(got["clipped"][0])

    def summary(self) -> dict[str, Any]:
        clipped, nonfinite = self._host_counts()
        return {**self.rule.summary(), "steps_clipped": clipped, "steps_observed": self.steps_seen,
                "nonfinite_steps": nonfinite}

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
        gradients = step_gradients(optimizer, int(trainer.global_step))
        if gradients is None:
            return  # backward was skipped (training_step returned None): nothing to observe
        self._last = self._clip(gradients, self._sharded, self._kernel_scales(optimizer, gradients))

    def _kernel_scales(self, optimizer: torch.optim.Optimizer, gradients: StepGradients) -> Optional[torch.optim.Optimizer]:
        """`optimizer`, where its step can apply the clipping factor itself, else None. A fused kernel
        (torch.optim's fused Adam, AdamW, SGD, Adagrad) divides each gradient by a GradScaler's
        `grad_scale` as it steps, read after this hook: given the factor's inverse there, the step's
        own pass over the gradients clips them, one multi-tensor multiply fewer. No one else sets it:
        fp16's scaler with a fused optimizer is refused at fit start. Float32 norms on one device only
        (the kernel reads a float32 scale); the attribute goes after the step."""
        if not self.rule.clips_here or self._sharded or gradients.dtype != torch.float32:
            return None  # (a rule Lightning applies scales after this hook: nothing here to hand over)
        hooked = self._kernel_hooked.get(optimizer)
        if hooked is None:
            hooked = self._kernel_hooked[optimizer] = steps_in_kernel(optimizer) and \
                len(gradients.grads_by_device()) == 1 and getattr(optimizer, "grad_scale", None) is None
            if hooked:
                optimizer.register_step_post_hook(_drop_grad_scale)
        return optimizer if hooked else None

    def logged_values(self) -> dict[str, torch.Tensor]:
        """For the loggers at log steps (trainer/callbacks/step_log.py), the last step's pre-clip
        norm, the threshold in force (NaN while there is none yet) and whether it was clipped, as
        device tensors the step log reads together."""
        if not self.log or self._last is None:
            return {}
        norm, clipped = self._last
        if clipped is None:
            clipped = self._clipped_at_fixed_bound(norm)
        values = {"clip/grad_norm": norm.float(), "clip/clipped": clipped.float()}
        threshold = self.rule.threshold_on(norm.device)
        if threshold is not None:
            values["clip/threshold"] = threshold.float()
        return values

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # At Lightning's log steps, where it reads the logged values too.
        if self.rule.clips_here and not self.rule.settled and at_log_step(trainer):
            self.rule.settle(self.steps_seen)

    # -- checkpointing -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        clipped, nonfinite = self._host_counts()
        return {"settings": self.rule.settings(), **self.rule.state_dict(), "steps_seen": self.steps_seen,
                "steps_clipped": clipped, "nonfinite_steps": nonfinite}

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
        self._loaded_counts = (int(state_dict["steps_clipped"]), int(state_dict["nonfinite_steps"]))
        self._counts = None
        self._fixed_used = 0  # steps before the checkpoint's: its counts hold them


def _drop_grad_scale(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After a step: the clipping's factor was that step's alone (a later step without one, or a
    GradScaler, must not see it)."""
    optimizer.__dict__.pop("grad_scale", None)


def validate(values: dict[str, Any]) -> dict[str, Any]:
    checked = check_target("clipping", values)
    rule = locate_target("clipping", checked["_target_"])
    if not (isinstance(rule, type) and issubclass(rule, ClippingRule)):
        raise UserError("clipping._target_", f"'{checked['_target_']}' is not a clipping rule",
                        "a subclass of trainer.groups.clipping.ClippingRule (Percentile, FixedNorm, Value, Off)")
    return checked


GROUP = ConfigGroup("clipping", __name__, "gradient clipping (95th percentile by default)", validate, target=True)
