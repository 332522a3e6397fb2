"""Three fast paths in Lightning's per-step host work, for the Trainers the framework builds.

Measured with benchmarks/host_overhead.py (docs/diagnosis.md, "Host time per step"), three parts of
Lightning 2.6's step loop cost far more than the work they do; they are replaced here, deliberately,
with code that does the same work:

- **Callback dispatch** (`lean_dispatch`): Lightning calls every hook of every callback at every
  step, each inside a profiler context and with the callback's state key formatted
  (`call._call_callback_hooks`: about 25 us per callback and hook on one CPU core); here only the
  hooks a callback's class (or the instance) defines beyond `Callback`'s no-ops are called, in the
  same order with the same arguments.
- **Module and strategy hooks** (`lean_module_hook`, `lean_strategy_hook`): Lightning formats a
  debug line whether logged or not, opens a profiler context and sets `pl_module._current_fx_name`
  through `nn.Module.__setattr__` (4 us a set); here the same hook runs with the same bookkeeping,
  the name set as a plain attribute.
- **Moving a logged value's state**: `_ResultCollection.log` moves the value's `_ResultMetric` to its
  device, walking its `__dict__` and deep-copying its metadata (about 0.7 ms a call); `_result_to`
  returns at once when every tensor and metric it holds is already there.

The first two apply to Trainers marked by `mark_lean` (the framework's, trainer/groups/trainer.py)
under Lightning's pass-through profiler (with another, Lightning's own calls name every hook). All
are pinned against the Lightning we admit by tests/unit/test_lean_lightning.py (the functions and
attributes they rely on, and that a run's hooks and logged values are the same with and without)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback, Checkpoint, EarlyStopping
from lightning.pytorch.profilers import PassThroughProfiler
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.connectors.logger_connector import result
from torchmetrics import Metric

#: The attribute that marks a Trainer for the lean dispatch.
LEAN_MARK = "_framework_lean_dispatch"

_lightning_dispatch = call._call_callback_hooks
_lightning_module_hook = call._call_lightning_module_hook
_lightning_strategy_hook = call._call_strategy_hook
_lightning_result_to = result._ResultMetric.to


def mark_lean(trainer: Any) -> None:
    """Let `trainer` take the lean callback dispatch (installed on first use)."""
    install()
    setattr(trainer, LEAN_MARK, True)


def install() -> None:
    """Put the fast paths in place (idempotent; a Trainer without the mark keeps Lightning's calls)."""
    call._call_callback_hooks = lean_dispatch
    call._call_lightning_module_hook = lean_module_hook
    call._call_strategy_hook = lean_strategy_hook
    result._ResultMetric.to = _result_to  # type: ignore[method-assign]


_OVERRIDES: dict[tuple[type, str], bool] = {}


def overrides(cls: type, hook: str) -> bool:
    """Whether callbacks of class `cls` do anything at `hook` (Callback's own methods are no-ops)."""
    known = _OVERRIDES.get((cls, hook))
    if known is None:
        known = _OVERRIDES[(cls, hook)] = getattr(cls, hook, None) is not getattr(Callback, hook, None)
    return known


def lean_dispatch(trainer: Any, hook_name: str, *args: Any, monitoring_callbacks: Optional[bool] = None,
                  **kwargs: Any) -> None:
    """`call._call_callback_hooks` less the calls of hooks a callback does not define."""
    if not _lean(trainer):
        _lightning_dispatch(trainer, hook_name, *args, monitoring_callbacks=monitoring_callbacks, **kwargs)
        return
    callbacks = _defining(trainer, hook_name, monitoring_callbacks)
    if not callbacks:
        return
    pl_module = trainer.lightning_module
    if pl_module:
        # Lightning's bookkeeping of the hook being run (what `self.log` checks), set without
        # nn.Module.__setattr__'s checks: a plain string attribute.
        previous = pl_module._current_fx_name
        object.__setattr__(pl_module, "_current_fx_name", hook_name)
    for callback in callbacks:
        getattr(callback, hook_name)(trainer, pl_module, *args, **kwargs)
    if pl_module:
        object.__setattr__(pl_module, "_current_fx_name", previous)


def _lean(trainer: Any) -> bool:
    """Whether `trainer` takes the fast paths: marked, and no profiler that would name the hooks."""
    return getattr(trainer, LEAN_MARK, False) and isinstance(trainer.profiler, PassThroughProfiler)


def lean_module_hook(trainer: Any, hook_name: str, *args: Any, pl_module: Any = None, **kwargs: Any) -> Any:
    """`call._call_lightning_module_hook` without the debug line, the profiler context and
    nn.Module's attribute checks for the name of the hook being run."""
    if not _lean(trainer):
        return _lightning_module_hook(trainer, hook_name, *args, pl_module=pl_module, **kwargs)
    pl_module = pl_module or trainer.lightning_module
    if pl_module is None:
        raise TypeError("No `LightningModule` is available to call hooks on.")
    fn = getattr(pl_module, hook_name)
    if not callable(fn):
        return None
    return _named_call(pl_module, hook_name, fn, args, kwargs)


def lean_strategy_hook(trainer: Any, hook_name: str, *args: Any, **kwargs: Any) -> Any:
    """`call._call_strategy_hook` as `lean_module_hook` is Lightning's module hook call."""
    if not _lean(trainer):
        return _lightning_strategy_hook(trainer, hook_name, *args, **kwargs)
    fn = getattr(trainer.strategy, hook_name)
    if not callable(fn):
        return None
    return _named_call(trainer.lightning_module, hook_name, fn, args, kwargs)


def _named_call(pl_module: Any, hook_name: str, fn: Any, args: tuple, kwargs: dict) -> Any:
    """`fn(*args, **kwargs)` with `pl_module._current_fx_name` (what `self.log` checks) set to
    `hook_name` meanwhile, as a plain string attribute; like Lightning, not put back if `fn` raises."""
    previous = pl_module._current_fx_name
    object.__setattr__(pl_module, "_current_fx_name", hook_name)
    output = fn(*args, **kwargs)
    object.__setattr__(pl_module, "_current_fx_name", previous)
    return output


def _defining(trainer: Any, hook_name: str, monitoring_callbacks: Optional[bool]) -> list[Callback]:
    """The trainer's callbacks that define `hook_name`, in order, found once per list of callbacks."""
    # The callbacks themselves are the key, held (no later callback can take an id of theirs); tuples
    # compare their items by identity first, and a callback defines no equality of its own.
    present = tuple(trainer.callbacks)
    cache = trainer.__dict__.setdefault("_framework_lean_hooks", {})
    key = (hook_name, monitoring_callbacks)
    found = cache.get(key)
    if found is not None and found[0] == present:
        return found[1]
    callbacks = [c for c in trainer.callbacks if overrides(type(c), hook_name) or hook_name in c.__dict__]
    if monitoring_callbacks is not None:
        # Lightning's own split, by its own rule (ModelCheckpoint and EarlyStopping are "monitoring").
        callbacks = [c for c in callbacks if isinstance(c, (EarlyStopping, Checkpoint)) == monitoring_callbacks]
    cache[key] = (present, callbacks)
    return callbacks


def _result_to(self: Any, *args: Any, **kwargs: Any) -> Any:
    device = args[0] if len(args) == 1 and not kwargs else None
    if isinstance(device, torch.device) and _all_on(self.__dict__, device):
        return self
    return _lightning_result_to(self, *args, **kwargs)


_CONTAINERS = (dict, list, tuple)


def _all_on(values: Any, device: torch.device) -> bool:
    """Whether every tensor and metric among `values` (a `__dict__`, and the dicts, lists and tuples
    in it) is on `device`: what `apply_to_collection(..., move_data_to_device)` would move. Plain
    type tests (a torchmetrics Metric is a module, and isinstance against its ABC is slow)."""
    for value in values.values() if isinstance(values, dict) else values:
        if isinstance(value, torch.Tensor):
            if value.device != device:
                return False
        elif isinstance(value, torch.nn.Module):
            if isinstance(value, Metric) and value.device != device:
                return False
        elif type(value) in _CONTAINERS or isinstance(value, dict):
            if value and not _all_on(value, device):
                return False
    return True
