"""The checks of a composed config that need neither torch nor Lightning, made by the command line
before it imports the run (trainer/cli.py): a bad top-level key, `run.*`, `target.*`, optimizer's own
key (`optimizer.lr`, the batch rules), `compile.*` or `regularization.*` is one line in a fraction of a
second instead of after some 4 s of imports (docs/measured.md, "Time to a bad input's error").

They are the functions `trainer.configuration.spec.validate` calls, not a second set of rules; the run
validates everything again. The other groups' checks need the libraries: they read the signatures of
their `_target_`s and build the optimizer once."""

from __future__ import annotations

from typing import Any, Mapping

from omegaconf import DictConfig

from trainer.configuration.top_level import identity, target_config, to_plain, top_level_keys
from trainer.groups import compile, regularization
from trainer.groups.optimizer.schema import check_own_keys

#: Groups whose whole check needs neither torch nor Lightning (their modules import them where they build).
LIGHT_GROUPS = (compile.GROUP, regularization.GROUP)


def check_before_imports(cfg: DictConfig | Mapping[str, Any]) -> None:
    """Raise the `UserError` a run would raise for the keys checked here; the rest is the run's."""
    plain = to_plain(cfg)
    top_level_keys(plain)
    if isinstance(plain.get("run", {}), Mapping):  # not a mapping: the run's layout check says so
        identity(plain.get("run", {}))
    target_config(plain.get("target") or {})
    if isinstance(plain.get("optimizer"), Mapping):
        check_own_keys(plain["optimizer"])
    for group in LIGHT_GROUPS:
        if group.validate is not None and isinstance(plain.get(group.name), Mapping):
            group.validate(dict(plain[group.name]))
