"""Which keys differ between two configs: the recipe lineage and the multirun comparison both ask;
and which overrides change what a run computes (a run's default name, a sweep setting's name)."""

from __future__ import annotations

import math
from typing import Any, Sequence


class _Missing:
    """A key absent from one of two configs (distinct from a key whose value is null)."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()

#: Overrides that do not change what a run computes, left out of its default name (a requeued job
#: adds resume=auto; a person may change how progress is shown) and of a sweep setting's name.
NOT_IN_RESULT = ("resume", "run.", "progress", "progress_every_s", "diagnose", "diagnose_steps", "profile",
                 "profile_steps", "memory_plan", "target.", "hydra.", "hparams_search", "objective",
                 "data.num_workers", "data.pin_memory", "data.persistent_workers", "data.prefetch_factor",
                 "logger", "trainer.log_every_n_steps")


def result_overrides(overrides: Sequence[str]) -> list[str]:
    """The overrides that change what a run computes, in order (`NOT_IN_RESULT` left out)."""
    kept = []
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if not any(key == p or (p.endswith(".") and key.startswith(p)) for p in NOT_IN_RESULT):
            kept.append(override)
    return kept


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}, "c": [1, 2]}`` -> ``{"a.b": 1, "c": [1, 2]}``; lists stay whole values."""
    if not isinstance(config, dict):
        return {prefix: config} if prefix else {}
    if not config and prefix:
        return {prefix: {}}  # an empty section is still a setting, e.g. `trainer.plugins: {}`
    flat: dict[str, Any] = {}
    for key, value in config.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict):
            flat.update(flatten(value, dotted))
        else:
            flat[dotted] = value
    return flat


def config_changes(previous_config: dict[str, Any] | None, config: dict[str, Any] | None) -> list[tuple[str, Any, Any]]:
    """Dotted keys whose value differs between two configs, as ``(key, before, after)`` sorted by
    key; a key present on one side only has None on the other."""
    return [(key, None if before is MISSING else before, None if after is MISSING else after)
            for key, before, after in changes_marked(previous_config, config)]


def changes_marked(previous_config: dict[str, Any] | None, config: dict[str, Any] | None) -> list[tuple[str, Any, Any]]:
    """As `config_changes`, with `MISSING` (not None) on the side where a key is absent."""
    before, after = flatten(previous_config or {}), flatten(config or {})
    return [(key, before.get(key, MISSING), after.get(key, MISSING))
            for key in sorted(before.keys() | after.keys())
            if not same(before.get(key, MISSING), after.get(key, MISSING))]


def same(a: Any, b: Any) -> bool:
    # YAML's `true` and `1` compare equal in Python but are different settings.
    if isinstance(a, bool) != isinstance(b, bool):
        return False
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a is b or a == b
