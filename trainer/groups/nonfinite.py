"""The non-finite guard: a step whose loss or gradients hold NaN or Inf is skipped, not applied.

Its behaviour is in docs/reliability.md ("The non-finite guard"). The check and the skip happen on
the device, so the host never waits for a step: the flag is one reduction over the gradients' norms
and the loss, and the optimizer is told through the same route a GradScaler uses. A fused optimizer
(`optimizer.implementation=fused`, the default on CUDA) takes `found_inf` and leaves weights, state
and step counts untouched; any other optimizer is stepped and then put back where the flag is set
(`torch.where` against a copy of its parameters and state taken before the step). The counters and
the first bad parameter are kept on the device and read at Lightning's log intervals, at epoch ends
and at checkpoints (`read_counters`): that is when `max_consecutive` bad steps in a row stop the run
(`max_run`, the longest run since the last read, so a run of bad steps between two reads is not
missed). Under an fp16 GradScaler overflows are routine, so the guard only counts and stops once
the scale is below 1 and steps still overflow, which no loss scaling can cure."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Optional

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from trainer.callbacks.steps import at_log_step
from trainer.infra.errors import UserError
from trainer.infra.on_device import DeviceValues, read_together
from trainer.infra.schema import AT_LEAST_ONE, ConfigGroup, Doc, check_target

#: Steps recorded in `skipped_at`.
RECORDED_SKIPS = 100


class NonFiniteTraining(UserError):
    """Training diverged: too many consecutive steps with non-finite loss or gradients."""


def takes_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` reads `found_inf` and skips on the device, as fused kernels do for
    a GradScaler (torch.optim's fused Adam, AdamW, SGD, Adagrad)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and bool(optimizer.defaults.get("fused"))


class _PutBack:
    """A copy of an optimizer's parameters and state taken before its step, and the step undone
    where a device flag is set: the skip for optimizers without a `found_inf` path.
    State the step creates (the first step's moments and counters) is zeroed instead, which is the
    fresh state of torch's optimizers. The copies are kept between steps, so nothing is allocated
    per step once the state exists."""

    def __init__(self) -> None:
        self._copies: dict[int, torch.Tensor] = {}
        self._before: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._params: list[torch.Tensor] = []
        self._key: Any = None
        self._sources: list[torch.Tensor] = []
        self._targets: list[torch.Tensor] = []
        self._originals: list[torch.Tensor] = []
        self._optimizer: Optional[torch.optim.Optimizer] = None
        self.host_flag_reason: Optional[str] = None

    def take(self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
        # torch's optimizers update their state in place, so from the second step on the same
        # tensors come back: the lists are kept while the parameters, the number of state entries
        # and the first parameter's state tensors are the same ones (a loaded state dict is not).
        first = optimizer.state.get(params[0], {}) if params else {}
        key = (tuple(map(id, params)), len(optimizer.state), tuple(id(v) for v in first.values()))
        if key == self._key and self._sources:
            torch._foreach_copy_(self._targets, self._sources)
            self._before = list(zip(self._originals, self._targets))
            return
        self._key = key
        tensors = list(params)
        for p in params:
            tensors.extend(v for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor))
        self._before = []
        sources, targets = [], []
        for t in tensors:
            copy = self._copies.get(id(t))
            if copy is None or copy.shape != t.shape or copy.dtype != t.dtype or copy.device != t.device:
                copy = self._copies[id(t)] = torch.empty_like(t, memory_format=torch.preserve_format)
            self._before.append((t, copy))
            sources.append(t.detach())
            targets.append(copy)
        if targets:
            torch._foreach_copy_(targets, sources)
        self._sources, self._targets, self._originals = sources, targets, tensors
        self._params = params
        self._optimizer = optimizer

    def undo_where(self, flag: torch.Tensor) -> None:
        """After the step: every tensor back to its copy where `flag` (0-d bool) is set."""
        assert self._optimizer is not None, "take a copy first"
        known = {id(t) for t, _ in self._before}
        flags: dict[torch.device, torch.Tensor] = {}

        def flag_on(device: torch.device) -> torch.Tensor:
            if device not in flags:
                if device != flag.device and device.type == "cpu" and flag.device.type != "cpu":
                    # torch's non-fused Adam family keeps its step counts on the CPU (unless
                    # capturable): putting them back needs the flag there, one wait per step.
                    self.host_flag_reason = "the optimizer keeps state on the CPU (step counts)"
                flags[device] = flag.to(device)
            return flags[device]

        # Floating tensors: a NaN a bad step left is zeroed, then one foreach lerp per device and
        # dtype with the flag as weight: torch's lerp is `start + w (end - start)` below w = 0.5 and
        # `end - (end - start)(1 - w)` above, so w = 0 keeps the stepped tensor and w = 1 gives the
        # copy, both exactly, with one pass instead of a `where` and a copy per tensor.
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        with torch.no_grad():
            for t, copy in self._before:
                if t.is_floating_point():
                    torch.nan_to_num_(t, nan=0.0, posinf=0.0, neginf=0.0)
                    stepped, copies = groups.setdefault((t.device, t.dtype), ([], []))
                    stepped.append(t)
                    copies.append(copy)
                else:
                    t.copy_(torch.where(flag_on(t.device), copy, t))
            for (device, dtype), (stepped, copies) in groups.items():
                torch._foreach_lerp_(stepped, copies, flag_on(device).to(dtype))  # type: ignore[call-overload]
        _zero_new_state(self._optimizer, self._params, known, flag_on)
        self._before = []


def _zero_new_state(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], known: set[int],
                    flag_on: Callable[[torch.device], torch.Tensor]) -> None:
    """Zero, where the flag (`flag_on(device)`) is set, the state tensors a step created (not in
    `known`): the fresh state of torch's optimizers (zero moments and step counts; a zero momentum
    buffer acts as none)."""
    with torch.no_grad():
        for p in params:
            for v in optimizer.state.get(p, {}).values():
                if isinstance(v, torch.Tensor) and id(v) not in known:
                    v.masked_fill_(flag_on(v.device), 0)


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
        # The host's copy, brought up to date by `read_counters`.
        self.skipped_steps = 0
        self.consecutive = 0
        self.first_nonfinite: dict[str, Any] | None = None
        self.skipped_at: list[int] = []  # the first RECORDED_SKIPS skipped steps, for the record
        self.diagnostic_checkpoint: str | None = None
        self._loss: torch.Tensor | None = None
        # On the device: skipped, consecutive, longest run since the last read, the latest run's
        # first step; and which tensors were finite at that step (`_count`).
        self._counters: Optional[torch.Tensor] = None
        self._first_flags: Optional[torch.Tensor] = None
        self._skips = DeviceValues(RECORDED_SKIPS)
        self._names: list[str] = []
        self._positions: dict[tuple[int, ...], torch.Tensor] = {}
        # Per optimizer, until its step ends: the flag, and the put-back, or (found_inf) the
        # parameters and the ids of the state tensors that existed before the step.
        self._pending: dict[int, tuple[torch.Tensor, _PutBack | tuple[list[torch.Tensor], set[int]]]] = {}
        self._put_back: dict[int, _PutBack] = {}
        self._hooked: set[int] = set()
        self._steps_since_read = 0
        self._warned_host_flag = False

    # -- the step (device only) --------------------------------------------------------------------

    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        self._loss = loss.detach()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        if self.mode == "off":
            return
        named = list(pl_module.named_parameters())
        if [n for n, _ in named] != self._names:
            self._names, self._positions = [n for n, _ in named], {}
        with_grad = [i for i, (_, p) in enumerate(named) if p.grad is not None]
        if not with_grad:
            return  # backward was skipped: nothing to check
        grads = [g for i in with_grad if (g := named[i][1].grad) is not None]
        device = grads[0].device
        finite_each = self._finite_each(grads, device)
        loss_finite = torch.isfinite(self._loss.float()).all().to(device) if self._loss is not None \
            else torch.ones((), dtype=torch.bool, device=device)
        self._loss = None
        local_bad = ~(finite_each.all() & loss_finite)
        bad = _any_process(local_bad) if trainer.world_size > 1 else local_bad
        # Every process skips (or stops) together: DDP's gradients agree after their all-reduce, but
        # a loss is each process's own, and a process that stepped alone would leave the replicas apart.
        self._count(trainer, bad, finite_each, loss_finite, tuple(with_grad))
        assert self._counters is not None
        pl_module.log("nonfinite/skipped", self._counters[0].float(), on_step=True, on_epoch=False, batch_size=1)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        if scaler is not None and scaler.is_enabled():
            return  # the GradScaler skips overflowing steps itself
        params: list[torch.Tensor] = [named[i][1] for i in with_grad]
        self._hook(optimizer)
        if takes_found_inf(optimizer):
            optimizer.found_inf = bad.float()  # type: ignore[attr-defined]  # read by the fused kernel: no update, state and step counts kept
            self._pending[id(optimizer)] = (bad, (params, {id(v) for p in params
                                                           for v in optimizer.state.get(p, {}).values()}))
        else:
            put_back = self._put_back.setdefault(id(optimizer), _PutBack())
            put_back.take(optimizer, params)
            self._pending[id(optimizer)] = (bad, put_back)

    def _hook(self, optimizer: torch.optim.Optimizer) -> None:
        if id(optimizer) not in self._hooked:
            optimizer.register_step_post_hook(self._after_step)
            self._hooked.add(id(optimizer))

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        pending = self._pending.pop(id(optimizer), None)
        if pending is None:
            return
        bad, put_back = pending
        if not isinstance(put_back, _PutBack):
            del optimizer.found_inf  # type: ignore[attr-defined]  # a later step (or a GradScaler) must not see this one's flag
            # State the skipped step created is left as the kernel allocated it (fused SGD's momentum
            # buffers uninitialized): zeroed, it is the fresh state.
            params, known = put_back
            _zero_new_state(optimizer, params, known, lambda device: bad.to(device))
            return
        put_back.undo_where(bad)
        if put_back.host_flag_reason and not self._warned_host_flag:
            self._warned_host_flag = True
            warnings.warn(f"nonfinite=skip: {put_back.host_flag_reason}, so each step waits for the device once; "
                          "optimizer.implementation=fused skips on the device", stacklevel=2)

    @staticmethod
    def _finite_each(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        # The norm of a tensor is finite exactly when all its elements are: one reduction per tensor
        # (a single foreach kernel where available).
        norms = torch._foreach_norm(grads) if hasattr(torch, "_foreach_norm") else [g.norm() for g in grads]
        if all(n.device == device and n.dtype == torch.float32 for n in norms):
            return torch.isfinite(torch.stack(norms))
        return torch.isfinite(torch.stack([n.float().to(device) for n in norms]))

    def _count(self, trainer: L.Trainer, bad: torch.Tensor, finite_each: torch.Tensor,
               loss_finite: torch.Tensor, with_grad: tuple[int, ...]) -> None:
        device = bad.device
        if self._counters is None or self._counters.device != device:
            held = [self.skipped_steps, self.consecutive, self.consecutive, -1]
            self._counters = torch.tensor(held, dtype=torch.long, device=device)
        # Which tensors were finite at the step that began the latest run of bad steps: every
        # parameter in module order, then the loss. The name is found from it when the host reads.
        flags = torch.cat([finite_each, loss_finite.reshape(1)])
        if len(with_grad) != len(self._names):
            full = torch.ones(len(self._names) + 1, dtype=torch.bool, device=device)
            flags = full.index_copy_(0, self._position_index(with_grad, device), flags)
        if self._first_flags is None or self._first_flags.device != device or len(self._first_flags) != len(flags):
            self._first_flags = torch.ones_like(flags)
        skipped, consecutive, longest, first_step = self._counters.unbind()
        bad_long = bad.long()
        consecutive = (consecutive + 1) * bad_long
        starts = consecutive == 1
        step = torch.full_like(first_step, int(trainer.global_step))
        self._skips.append(step, bad)
        self._first_flags.copy_(torch.where(starts, flags, self._first_flags))
        self._counters.copy_(torch.stack([skipped + bad_long, consecutive, torch.maximum(longest, consecutive),
                                          torch.where(starts, step, first_step)]))
        self._steps_since_read += 1

    def _position_index(self, with_grad: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """Where the checked tensors (the parameters with gradients, then the loss) go among all."""
        if with_grad not in self._positions:
            self._positions[with_grad] = torch.tensor([*with_grad, len(self._names)], dtype=torch.long, device=device)
        return self._positions[with_grad]

    # -- the reads, at intervals -------------------------------------------------------------------

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # At Lightning's own log steps, when it reads the logged values too.
        if self.mode == "off" or not self._steps_since_read or not at_log_step(trainer):
            return
        self._stop_if_diverged(trainer, self.read_counters())

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.mode != "off" and self._steps_since_read:
            self._stop_if_diverged(trainer, self.read_counters())

    def read_counters(self) -> int:
        """Bring the host's copy up to date in one read; returns the longest run of bad steps since
        the last read."""
        if self._counters is None:
            return 0
        values = {"counters": self._counters, "skips": self._skips.count()}
        if self._first_flags is not None:
            values["first"] = self._first_flags
        got = read_together(values)
        skipped, consecutive, longest, first_step = (int(v) for v in got["counters"])
        if got["skips"][0]:
            self.skipped_at = [int(s) for s in self._skips.host_values()]
        self._counters[2].copy_(self._counters[1])  # the next read's run starts from the current one
        self.skipped_steps, self.consecutive = skipped, consecutive
        if first_step >= 0:
            self.first_nonfinite = {"step": first_step, "parameter": self._parameter_name(got.get("first", []))}
        self._steps_since_read = 0
        return longest

    def _parameter_name(self, finite: list[float]) -> str:
        """The first parameter, in module order, whose gradient was not finite; else the loss; else
        (all finite here) another process's."""
        for index, ok in enumerate(finite[:-1]):
            if not ok:
                return self._names[index] if index < len(self._names) else f"(parameter {index})"
        if finite and not finite[-1]:
            return "(the loss; every gradient was finite)"
        return "(another process's loss or gradient shard; this process's were finite)"

    def _stop_if_diverged(self, trainer: L.Trainer, longest: int) -> None:
        """Stop when the longest run of bad steps since the last read reached `max_consecutive`."""
        if longest < self.max_consecutive:
            return
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        scaled = scaler is not None and scaler.is_enabled()
        if scaled and scaler is not None and scaler.get_scale() >= 1.0:
            return
        self._stop(trainer, longest)

    def _stop(self, trainer: L.Trainer, run: int) -> None:
        assert self.first_nonfinite is not None
        path = Path(trainer.default_root_dir) / "checkpoints" / f"nonfinite-step{int(trainer.global_step):06d}.ckpt"
        path.parent.mkdir(parents=True, exist_ok=True)
        trainer.save_checkpoint(str(path), weights_only=False)  # full (resumable); said, not defaulted
        self.diagnostic_checkpoint = str(path)
        first = self.first_nonfinite
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
                "diagnostic_checkpoint": self.diagnostic_checkpoint}

    def state_dict(self) -> dict[str, Any]:
        self.read_counters()
        return {"skipped_steps": self.skipped_steps, "consecutive": self.consecutive,
                "first_nonfinite": self.first_nonfinite, "skipped_at": list(self.skipped_at)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped_steps = int(state_dict["skipped_steps"])
        self.consecutive = int(state_dict["consecutive"])
        self.first_nonfinite = state_dict["first_nonfinite"]
        self.skipped_at = [int(s) for s in state_dict["skipped_at"]]
        self._skips.load([float(s) for s in self.skipped_at])
        self._counters = None
        self._first_flags = None


def _any_process(flag: torch.Tensor) -> torch.Tensor:
    """`flag` or-ed over every process, on the device (an all-reduce the step's stream waits on; the
    host does not)."""
    if not (dist.is_available() and dist.is_initialized()):
        return flag
    joined = flag.to(torch.int32)
    dist.all_reduce(joined, op=dist.ReduceOp.MAX)
    return joined.bool()


GROUP = ConfigGroup("nonfinite", __name__, "the guard that skips NaN/Inf steps", lambda values: check_target("nonfinite", values), target=True)
