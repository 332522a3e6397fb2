"""The non-finite guard: a step whose loss or gradients hold NaN or Inf is skipped, not applied.

Its behaviour is in docs/reliability.md ("The non-finite guard"). The check and the skip happen on
the device, so the host never waits for a step: the flag comes from the gradients' norms
(trainer/infra/step_gradients.py) and the loss, and reaches the optimizer as a GradScaler's does: a
fused optimizer takes `found_inf`, any other is stepped and put back (trainer/infra/step_undo.py).
Each step writes one row of a table on the device (`StepTable`); the host counts the rows at
Lightning's log steps, at epoch ends and at checkpoints (`read_counters`), and that is when
`max_consecutive` bad steps in a row stop the run. Under an fp16 GradScaler overflows are routine,
so the guard stops only once the scale is below 1 and steps still overflow."""

from __future__ import annotations

import logging
import math
import warnings
import weakref
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from trainer.callbacks.steps import at_log_step
from trainer.infra.errors import UserError
from trainer.infra.on_device import read_together
from trainer.infra.schema import AT_LEAST_ONE, ConfigGroup, Doc, check_target
from trainer.infra.step_gradients import StepGradients, step_gradients, steps_in_kernel
from trainer.infra.step_undo import StepUndo, state_before_step, zero_new_state

log = logging.getLogger("trainer")

#: Steps recorded in `skipped_at`.
RECORDED_SKIPS = 100
#: Rows of the table when Lightning never logs (log_every_n_steps=0): a read every this many steps.
ROWS_WITHOUT_LOGGING = 1000
#: float32's largest value: a step's norms and loss summing past it are counted bad, as flagged.
FLOAT32_MAX = torch.finfo(torch.float32).max


class NonFiniteTraining(UserError):
    """Training diverged: too many consecutive steps with non-finite loss or gradients."""


class StepTable:
    """One row per optimizer step since the last read, on the device: the norm of each gradient (in
    the order of that step's parameters), then the loss, as the step had them; with several
    processes, a second table says whether any process's step was bad. The host keeps each row's
    global step and parameters, and tells a bad step from its row when it reads (`take`)."""

    def __init__(self, rows: int) -> None:
        self.capacity = rows
        self._table: Optional[torch.Tensor] = None
        self._rows: list[torch.Tensor] = []
        self._norm_views: list[torch.Tensor] = []  # each row less its last entry (the loss), made once
        self._bad: Optional[torch.Tensor] = None
        self.steps: list[tuple[int, list[torch.Tensor]]] = []  # (global step, parameters) of each row

    @property
    def full(self) -> bool:
        return len(self.steps) >= self.capacity

    def next_row(self, width: int, dtype: torch.dtype, device: torch.device) -> Optional[torch.Tensor]:
        """The row the next step writes (a view of one table made once: the step writes into it with
        `out=`, no copy), or None while rows of another width, dtype or device wait to be read (the
        parameters with a gradient changed): read them (`take`) first."""
        if self._rows and self._rows[0].shape[0] == width and self._rows[0].dtype == dtype \
                and self._rows[0].device == device:
            return self._rows[len(self.steps)]
        if self.steps:
            return None
        self._table = torch.empty(self.capacity, width, dtype=dtype, device=device)
        self._rows = list(self._table.unbind(0))
        self._norm_views = [row[:-1] for row in self._rows]
        self._bad = torch.zeros(self.capacity, dtype=torch.float32, device=device)
        return self._rows[0]

    def norms_view(self) -> torch.Tensor:
        """The row `next_row` gave, less its last entry."""
        return self._norm_views[len(self.steps)]

    def add(self, step: int, params: list[torch.Tensor], bad: Optional[torch.Tensor]) -> None:
        """Count the row `next_row` gave as written for `step`, and, with several processes, keep
        `bad` (0-d float, 1: any process's step was bad)."""
        if bad is not None:
            assert self._bad is not None
            self._bad[len(self.steps)].copy_(bad)
        self.steps.append((step, params))

    def take(self) -> list[tuple[int, list[torch.Tensor], list[float], bool]]:
        """The rows since the last read, oldest first, as (global step, parameters, the row's values,
        whether the step was bad on any process), in one read of the device; the table is empty after."""
        if not self.steps:
            return []
        used = len(self.steps)
        assert self._table is not None and self._bad is not None
        got = read_together({"rows": self._table[:used], "bad": self._bad[:used]})
        width = self._table.shape[1]
        rows = []
        for i, (step, params) in enumerate(self.steps):
            values = got["rows"][i * width:(i + 1) * width]
            rows.append((step, params, values, bool(got["bad"][i]) or _bad_row(values)))
        self._bad.zero_()
        self.steps = []
        return rows


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
        self.skipped_steps = 0  # the host's copy, brought up to date by `read_counters`
        self.consecutive = 0
        #: The first skipped step of the run, and the parameter whose gradient was not finite there.
        self.first_nonfinite: dict[str, Any] | None = None
        self.skipped_at: list[int] = []  # the first RECORDED_SKIPS skipped steps, for the record
        self.last_skipped: int | None = None  # the latest skipped step (skipped_at stops growing)
        self._skipped_before_epoch = 0  # skipped_steps when the epoch began: what its line counts from
        self.diagnostic_checkpoint: str | None = None
        self._run_start: Optional[dict[str, Any]] = None  # where the current run of bad steps began
        self._loss: torch.Tensor | None = None
        self._table: Optional[StepTable] = None
        self._names: dict[int, str] = {}
        # Per optimizer, until its step ends: the flag, and the undo, or (found_inf) the parameters
        # and the ids of the state tensors before the step (None: none can be new).
        self._pending: dict[int, tuple[torch.Tensor, StepUndo | tuple[list[torch.Tensor], Optional[set[int]]]]] = {}
        # Per optimizer, held weakly (an id could be taken by a later optimizer once this one is gone):
        # its put-back; the parameters that all had state (their ids, and the parameters, held so that
        # no other tensor takes those ids); whether it is hooked and takes found_inf.
        self._undo: weakref.WeakKeyDictionary[torch.optim.Optimizer, StepUndo] = weakref.WeakKeyDictionary()
        self._state_complete: weakref.WeakKeyDictionary[
            torch.optim.Optimizer, tuple[tuple[int, ...], list[torch.Tensor]]] = weakref.WeakKeyDictionary()
        self._hooked: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = weakref.WeakKeyDictionary()
        self._warned_host_flag = False

    # -- the step (device only) --------------------------------------------------------------------

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        every = int(getattr(trainer, "log_every_n_steps", 0) or 0)
        self._table = StepTable(every if 0 < every <= ROWS_WITHOUT_LOGGING else ROWS_WITHOUT_LOGGING)

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self.mode != "off":
            self._loss = loss.detach()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        if self.mode == "off":
            return
        step = int(trainer.global_step)
        gradients = step_gradients(optimizer, step)
        if gradients is None:
            return  # backward was skipped: nothing to check
        found = self._record(trainer, pl_module, gradients, step)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            return  # the GradScaler skips overflowing steps itself
        fused = self._hooked.get(optimizer)
        if fused is None:  # an optimizer first seen: its hook, and whether it takes found_inf
            optimizer.register_step_post_hook(self._after_step)
            fused = self._hooked[optimizer] = steps_in_kernel(optimizer)
        params = gradients.params
        if fused:
            optimizer.found_inf = found  # type: ignore[attr-defined]  # read by the fused kernel: no update, state and step counts kept
            # The state before the step, looked at again only when the parameters stepped change
            # (once every one has state, the step can create none).
            key = tuple(map(id, params))
            seen = self._state_complete.get(optimizer)
            known = None if seen is not None and seen[0] == key else state_before_step(optimizer, params)
            if known is None:
                self._state_complete[optimizer] = (key, params)
            self._pending[id(optimizer)] = (found, (params, known))
        else:
            undo = self._undo.get(optimizer)
            if undo is None:
                undo = self._undo[optimizer] = StepUndo()
            undo.take(optimizer, params)
            self._pending[id(optimizer)] = (found, undo)

    def _record(self, trainer: L.Trainer, pl_module: L.LightningModule, gradients: StepGradients,
                step: int) -> torch.Tensor:
        """This step's row of the table (its gradients' norms, then the loss); returns the step's
        flag as a GradScaler's `found_inf` is (0-d float32: 1.0 where the step is bad on any process,
        else 0.0). Four operations: the row written in place (the gradients' norms stacked there, where
        nobody read them before, the loss after them), its sum, the flag's two."""
        loss = self._loss
        self._loss = None
        if self._table is None:
            self.on_train_start(trainer, pl_module)
        assert self._table is not None
        if not self._names:
            self._names = {id(p): name for name, p in pl_module.named_parameters()}
        dtype, device = gradients.dtype, gradients.device
        width = len(gradients.params) + (loss is not None)
        row = self._table.next_row(width, dtype, device)
        if row is None:  # the parameters with a gradient changed: the rows before them are read first
            self._stop_if_diverged(trainer, self.read_counters())
            row = self._table.next_row(width, dtype, device)
            assert row is not None
        if loss is None:
            row.copy_(gradients.norms)
        elif not (loss.dim() == 0 and loss.dtype == dtype and loss.device == device
                  and gradients.stack_into(row, self._table.norms_view(), loss)):
            torch.cat([gradients.norms, loss.reshape(1).to(row)], out=row)
        # Finite exactly when every gradient's norm and the loss are: x - x is 0 for a finite x and NaN for
        # an infinite or NaN one, which nan_to_num makes 1. Summed in float32 (also a half-precision row,
        # which could overflow its own range): a sum past float32's range, norms and a loss far beyond
        # anything trainable, counts as bad too (the clipping's global norm is infinite long before).
        found = row.sum(dtype=torch.float32)
        found.sub_(found).nan_to_num_(nan=1.0)
        shared = None
        if trainer.world_size > 1:
            # Every process skips (or stops) together: DDP's gradients agree after their all-reduce, but
            # a loss is each process's own, and a process that stepped alone would leave the replicas apart.
            found = shared = _any_process(found)
        self._table.add(step, gradients.params, shared)
        return found

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        pending = self._pending.pop(id(optimizer), None)
        if pending is None:
            return
        found, undo = pending
        if not isinstance(undo, StepUndo):
            del optimizer.found_inf  # type: ignore[attr-defined]  # a later step (or a GradScaler) must not see this one's flag
            # State the skipped step created is left as the kernel allocated it (fused SGD's momentum
            # buffers uninitialized): zeroed, it is the fresh state.
            params, known = undo
            if known is not None:
                zero_new_state(optimizer, params, known, lambda device: found.bool().to(device))
            return
        undo.undo_where(found.bool())
        if undo.host_flag_reason and not self._warned_host_flag:
            self._warned_host_flag = True
            warnings.warn(f"nonfinite=skip: {undo.host_flag_reason}, so each step waits for the device once; "
                          "optimizer.implementation=fused skips on the device", stacklevel=2)

    # -- the reads, at intervals -------------------------------------------------------------------

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # At Lightning's own log steps, when it reads the logged values too (or when the table is full).
        if self._table is None or not self._table.steps or not (at_log_step(trainer) or self._table.full):
            return
        self._stop_if_diverged(trainer, self.read_counters())

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._skipped_before_epoch = self.skipped_steps

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._table is not None and self._table.steps:
            self._stop_if_diverged(trainer, self.read_counters())
        skipped = self.skipped_steps - self._skipped_before_epoch
        if skipped and trainer.is_global_zero:
            log.warning(self.epoch_line(skipped, int(trainer.current_epoch) + 1))

    def epoch_line(self, skipped: int, epoch: int) -> str:
        """What the screen says at the end of an epoch with skipped steps: a NaN in its train/loss
        is explained there, not left to summary.json."""
        first = self.first_nonfinite or {}
        steps = "1 step" if skipped == 1 else f"{skipped} steps"
        latest = f", the latest at step {self.last_skipped}" if self.skipped_steps > 1 else ""
        return (f"nonfinite: {steps} of epoch {epoch} skipped (a NaN/Inf loss or gradient; the weights left as they "
                f"were, train/loss's epoch mean includes it); {self.skipped_steps} in the run, the first at step "
                f"{first.get('step')} in {first.get('parameter')}{latest}")

    def logged_values(self) -> dict[str, float]:
        """For the loggers at log steps (trainer/callbacks/step_log.py): the steps skipped so far, as
        the read of this log step left them."""
        return {} if self.mode == "off" else {"nonfinite/skipped": float(self.skipped_steps)}

    def read_counters(self) -> int:
        """Bring the host's copy up to date in one read; returns the longest run of bad steps since
        the last read (counting the run it continues)."""
        longest = 0
        for step, params, values, bad in self._table.take() if self._table is not None else []:
            if not bad:
                self.consecutive, self._run_start = 0, None
                continue
            self.skipped_steps += 1
            self.last_skipped = step
            if len(self.skipped_at) < RECORDED_SKIPS:
                self.skipped_at.append(step)
            if self.consecutive == 0:
                self._run_start = {"step": step, "parameter": self._parameter_name(params, values)}
                if self.first_nonfinite is None:
                    self.first_nonfinite = self._run_start
            self.consecutive += 1
            longest = max(longest, self.consecutive)
        return longest

    def _parameter_name(self, params: list[torch.Tensor], values: list[float]) -> str:
        """The first parameter, in module order, whose gradient was not finite; else the loss; else
        (all finite here) another process's."""
        bad = [self._names.get(id(p), "(a parameter outside the module)")
               for p, norm in zip(params, values) if not math.isfinite(norm)]
        if bad:
            order = {name: index for index, name in enumerate(self._names.values())}
            return min(bad, key=lambda name: order.get(name, len(order)))
        if len(values) > len(params) and not math.isfinite(values[len(params)]):
            return "(the loss; every gradient was finite)"
        if _bad_row(values):
            return "(the norms and the loss together: each finite, their sum past float32's range)"
        return "(another process's loss or gradient shard; this process's were finite)"

    def _stop_if_diverged(self, trainer: L.Trainer, longest: int) -> None:
        """Stop when the longest run of bad steps since the last read reached `max_consecutive`."""
        if longest < self.max_consecutive:
            return
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled() and scaler.get_scale() >= 1.0:
            return
        self._stop(trainer, longest)

    def _stop(self, trainer: L.Trainer, run: int) -> None:
        first = self._run_start or self.first_nonfinite
        assert first is not None
        path = Path(trainer.default_root_dir) / "checkpoints" / f"nonfinite-step{int(trainer.global_step):06d}.ckpt"
        path.parent.mkdir(parents=True, exist_ok=True)
        trainer.save_checkpoint(str(path), weights_only=False)  # full (resumable); said, not defaulted
        self.diagnostic_checkpoint = str(path)
        raise NonFiniteTraining(
            "training",
            f"{run} steps in a row had a non-finite loss or gradient (the first in "
            f"{first['parameter']} at step {first['step']}); the weights of the last good step are in {path}",
            "a lower optimizer.lr, clipping=fixed_norm, precision=fp32, or a larger nonfinite.max_consecutive")

    # -- records -----------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        self.read_counters()
        return {"mode": self.mode, "max_consecutive": self.max_consecutive, "skipped_steps": self.skipped_steps,
                "skipped_at": list(self.skipped_at), "first_nonfinite": self.first_nonfinite,
                "last_skipped": self.last_skipped, "diagnostic_checkpoint": self.diagnostic_checkpoint}

    def state_dict(self) -> dict[str, Any]:
        self.read_counters()
        return {"skipped_steps": self.skipped_steps, "consecutive": self.consecutive,
                "first_nonfinite": self.first_nonfinite, "skipped_at": list(self.skipped_at),
                "last_skipped": self.last_skipped, "run_start": self._run_start}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps = int(state_dict["skipped_steps"])
        self.consecutive = int(state_dict["consecutive"])
        self.first_nonfinite = state_dict["first_nonfinite"]
        self.skipped_at = [int(s) for s in state_dict["skipped_at"]]
        # (checkpoints written before it was kept: the last recorded skip)
        last = state_dict.get("last_skipped", self.skipped_at[-1] if self.skipped_at else None)
        self.last_skipped = None if last is None else int(last)
        self._run_start = state_dict.get("run_start", self.first_nonfinite if self.consecutive else None)
        if self._table is not None:
            self._table.steps = []  # rows of a step the checkpoint came after: already counted in it


def _bad_row(values: list[float]) -> bool:
    """Whether a step with this row was bad, as its flag said (`NonFiniteGuard._record`): a value not
    finite, or values that sum past float32's range."""
    return not all(map(math.isfinite, values)) or math.fsum(values) > FLOAT32_MAX


def _any_process(flag: torch.Tensor) -> torch.Tensor:
    """`flag` (0-d float, 1.0 or 0.0) or-ed over every process, in place, on the device (an all-reduce
    the step's stream waits on; the host does not)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag


GROUP = ConfigGroup("nonfinite", __name__, "the guard that skips NaN/Inf steps", lambda values: check_target("nonfinite", values), target=True)
