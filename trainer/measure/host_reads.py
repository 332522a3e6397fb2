"""Counting the host's reads of tensor values, by whose code made them and at which training step.

A read of a tensor's value on the host (`.item()`, `.tolist()`, `bool(t)`, `float(t)`, `int(t)`,
`.numpy()`, `.cpu()`) waits on CUDA for every kernel queued before it; so does a Python number given
to `LightningModule.log`, which Lightning copies to the device with a blocking copy. `HostReads`
patches those entry points while active and attributes each call to the first frame outside torch's
own code. On the CPU nothing waits, but the same calls are the ones that would: the count is the
same on both. As a callback (`callbacks=host_reads`) it counts during fit and writes
`host_reads.json` in the run folder (docs/diagnosis.md, "Host reads")."""

from __future__ import annotations

import json
import numbers
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Optional

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

_TORCH = str(Path(torch.__file__).parent)
_FRAMEWORK = str(Path(__file__).resolve().parents[1])
_OWNERS = (("lightning", f"{Path(L.__file__).parent}"), ("framework", _FRAMEWORK))
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "cpu")


# torch's thin wrappers of Tensor methods (a read made through them is its caller's).
_WRAPPERS = tuple(str(Path(_TORCH) / name) for name in ("_tensor.py", "_tensor_str.py", "overrides.py"))


def owner_of(frame: Optional[FrameType]) -> tuple[str, str]:
    """Whose code a call was made from, as (owner, "file:line"): torch's own where torch code made
    the read (an optimizer reading its step count), else the first frame outside torch."""
    here = __file__
    while frame is not None and (frame.f_code.co_filename == here or frame.f_code.co_filename.startswith(_WRAPPERS)):
        frame = frame.f_back
    if frame is None:
        return "other", "?"
    name = frame.f_code.co_filename
    where = f"{name}:{frame.f_lineno}"
    if name.startswith(_TORCH):
        return "torch", where
    if "torchmetrics" in name:
        return "torchmetrics", where
    for owner, root in _OWNERS:
        if name.startswith(root):
            return owner, where
    return "other", where


# Lightning's hooks that are not part of one training batch.
_OUTSIDE_STEPS = ("setup", "teardown", "on_fit_start", "on_fit_end", "on_train_start", "on_train_end",
                  "on_save_checkpoint", "on_load_checkpoint", "state_dict", "load_state_dict")


@dataclass
class Read:
    what: str
    owner: str
    where: str
    step: Optional[int]  # the training batch it belongs to (None: outside the training batches)


@dataclass
class HostReads(Callback):
    """Counts host reads while active (`with HostReads() as reads:`); `reads.records` lists them."""

    records: list[Read] = field(default_factory=list)
    _trainer: Optional[L.Trainer] = None
    _saved: dict[str, Any] = field(default_factory=dict)

    def __enter__(self) -> "HostReads":
        for name in READS:
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._counting(name, self._saved[name]))
        self._saved["log"] = L.LightningModule.log
        L.LightningModule.log = self._counting_log(self._saved["log"])  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        L.LightningModule.log = self._saved.pop("log")  # type: ignore[method-assign]
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        self._saved.clear()

    def _record(self, what: str) -> None:
        owner, where = owner_of(sys._getframe(2))  # the caller of the patched entry point
        self.records.append(Read(what, owner, where, self._current_step()))

    def _counting(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self._record(name)
            return original(tensor, *args, **kwargs)

        counted.__name__ = name
        return counted

    def _counting_log(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def log(module: L.LightningModule, name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(value, numbers.Number):  # a number becomes a device tensor: a blocking copy
                self._record("log(number)")
            return original(module, name, value, *args, **kwargs)

        return log

    # -- the step each read belongs to -------------------------------------------------------------

    def _current_step(self) -> Optional[int]:
        """The training batch being run (counted from 0 over the fit), or None outside them: at
        epoch ends, in validation, in set-up and teardown."""
        trainer = self._trainer
        if trainer is None or not trainer.training or trainer.sanity_checking:
            return None
        progress = trainer.fit_loop.epoch_loop.batch_progress.total
        if progress.ready <= progress.completed:
            return None  # between batches (a batch is ready, then run, then completed)
        fx = getattr(trainer.lightning_module, "_current_fx_name", None)
        if fx is not None and ("epoch" in fx or fx in _OUTSIDE_STEPS):
            return None
        # Inside a batch, also where no hook is named: Lightning's own work after the hooks (its
        # logger connector's end of the batch, which reads every progress-bar value).
        return int(progress.ready) - 1

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and not self._saved:
            self._trainer = trainer
            self.__enter__()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or not self._saved:
            return
        self.__exit__()
        if trainer.is_global_zero:
            path = Path(trainer.default_root_dir) / "host_reads.json"
            every = int(trainer.log_every_n_steps)  # type: ignore[attr-defined]
            path.write_text(json.dumps(self.report(every), indent=2) + "\n")

    # -- summaries ---------------------------------------------------------------------------------

    def by_owner(self, step: Optional[Callable[[Optional[int]], bool]] = None) -> Counter[str]:
        return Counter(r.owner for r in self.records if step is None or step(r.step))

    def report(self, log_every_n_steps: int) -> dict[str, Any]:
        """What `host_reads.json` holds: reads by owner inside and outside the training steps, the
        framework's reads per training step, and where each owner's reads were made."""
        per_step: Counter[int] = Counter(r.step for r in self.records
                                         if r.owner == "framework" and r.step is not None)
        return {"log_every_n_steps": log_every_n_steps,
                "in_training_steps": dict(self.by_owner(lambda s: s is not None)),
                "elsewhere": dict(self.by_owner(lambda s: s is None)),
                "framework_per_step": {str(k): v for k, v in sorted(per_step.items())},
                "framework_reads": [{"what": r.what, "where": _relative(r.where), "step": r.step}
                                    for r in self.records if r.owner == "framework"][:2000],
                # Every library's reads inside training steps too (torch's own aside: an optimizer
                # reading its CPU step counts waits for nothing): Lightning's are a wait each as much.
                "library_reads_in_steps": [{"owner": r.owner, "what": r.what, "where": _relative(r.where),
                                            "step": r.step} for r in self.records
                                           if r.owner in ("lightning", "torchmetrics") and r.step is not None][:2000],
                "places": {owner: dict(self.places(owner).most_common(20))
                           for owner in ("framework", "lightning", "torchmetrics", "torch", "other")}}

    def places(self, owner: str) -> Counter[str]:
        """Where `owner`'s reads were made, with counts (the file:line of the call)."""
        return Counter(f"{r.what} at {r.where}" for r in self.records if r.owner == owner)


def _relative(where: str) -> str:
    """A framework file:line from the package's parent folder (trainer/...)."""
    root = str(Path(_FRAMEWORK).parent) + "/"
    return where[len(root):] if where.startswith(root) else where
