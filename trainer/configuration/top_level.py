"""The run's top-level keys (conf/train.yaml: seed, resume, progress, ...; the `run` and `target`
mappings) and the composed config made plain: what can be checked with neither torch nor Lightning
imported. `trainer.configuration.spec.validate` checks them with every group;
`trainer.configuration.early_checks` checks them before the command line imports the run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Mapping, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.infra.errors import UserError
from trainer.infra.schema import NON_NEGATIVE, POSITIVE, Doc, Range, check_keys, check_mapping, schema_of_dataclass


@dataclass
class TopLevelKeys:
    """The top-level keys of conf/train.yaml (seed, resume, progress, ...): `spec.top`. The `run`
    mapping (name, root) is `RunIdentity`: `spec.identity`."""

    seed: Annotated[int, NON_NEGATIVE, Doc("seeds Python, NumPy, torch and the loader workers")]
    progress: Annotated[Literal["auto", "rich", "plain", "off"],
                        Doc("auto: a Rich bar on a terminal, plain lines in logs and pipes")]
    progress_every_s: Annotated[float, POSITIVE, Doc("plain progress: at most one line per this many seconds")]
    diagnose: Annotated[bool, Doc("time the parts of a training step instead of training (trainer/measure/diagnose.py)")]
    diagnose_steps: Annotated[int, Range(ge=3), Doc("timed steps per measurement of the diagnosis")]
    profile: Annotated[bool, Doc("record a few training steps with torch.profiler instead of training: trace, "
                                 "ops.md by category, roofline (trainer/measure/profile.py)")]
    profile_steps: Annotated[int, Range(ge=1, le=50), Doc("steps the profile keeps (after 3 skipped and 2 warm-up)")]
    memory_plan: Annotated[bool, Doc("measure where a step's memory goes and what each practice would change, "
                                     "before training (trainer/measure/memory.py)")]
    ladder: Annotated[Optional[str], Doc("set by +ladder=NAME: the run is one stage of an optimization ladder")]
    resume: Annotated[Optional[str], Doc("auto: from run.name's newest checkpoint; if_any: the same or fresh; "
                                         "a path; null: fresh")]
    objective: Annotated[str, Doc("what a run returns to a sweeper: split/metric, e.g. val/acc; auto: the "
                                  "task's (val/acc for classification, val/perplexity for a language model)")]

    def check(self, group: str = "") -> None:
        if self.diagnose and self.profile:
            raise UserError("profile", "diagnose=true and profile=true both replace training", "one of them")
        split, _, metric = self.objective.partition("/")
        if self.objective != "auto" and (split not in ("train", "val", "test") or not metric):
            raise UserError("objective", f"'{self.objective}' is not a metric name",
                            "auto, or split/metric with split train, val or test: val/acc, val/loss, test/acc, "
                            "train/loss")


@dataclass
class RunIdentity:
    """The `run` mapping: a run's stable name (its checkpoints are found by it after a requeue puts
    it in a new folder) and the folder under which runs are kept."""

    name: Annotated[Optional[str], Doc("the run's stable identity (null: the recipe or data-model, plus the "
                                       "overrides that change the result)")]
    root: Annotated[str, Doc("runs are kept, and resume=auto searches, under this folder")]


@dataclass
class TargetConfig:
    """The `target` mapping: time to accuracy (trainer/callbacks/target.py)."""

    metric: Annotated[Optional[str], Doc("split/metric to reach, e.g. val/acc (null: no target)")]
    value: Annotated[Optional[float], Doc("the value the metric must reach")]
    mode: Annotated[Literal["auto", "max", "min"], Doc("max: reached at or above value, min: at or below; "
                                                       "auto: min for a loss, else max")]

    def check(self, group: str = "") -> None:
        if self.metric is None and self.value is None:
            return
        if self.metric is None or self.value is None:
            raise UserError("target.metric" if self.metric is None else "target.value", "missing: a target needs "
                            "both", "target.metric=val/acc target.value=0.98")
        split, _, name = self.metric.partition("/")
        if split not in ("train", "val") or not name:
            raise UserError("target.metric", f"'{self.metric}' is not a metric measured while training",
                            "val/acc, val/loss or train/loss (the test split is evaluated once, at the end)")


def top_level_keys(plain: Mapping[str, Any]) -> TopLevelKeys:
    top_level = schema_of_dataclass(TopLevelKeys)
    values = {k: plain[k] for k in top_level.fields if k in plain}
    keys = TopLevelKeys(**check_mapping("", values, top_level, "the run's top-level keys (conf/train.yaml)"))
    keys.check()
    return keys


def target_config(values: Mapping[str, Any]) -> TargetConfig:
    if not isinstance(values, Mapping):
        raise UserError("target", "not a mapping", "target.metric=val/acc target.value=0.98")
    return check_keys("target", dict(values), TargetConfig)


def identity(values: Mapping[str, Any]) -> RunIdentity:
    values = dict(values)
    if isinstance(values.get("name"), (int, float)) and not isinstance(values["name"], bool):
        values["name"] = str(values["name"])  # run.name=2024 is a name, not a number
    identity = check_keys("run", values, RunIdentity)
    if identity.name is not None and not identity.name.strip():
        raise UserError("run.name", "is empty", "a name for the run (or leave it unset for the default)")
    return identity


def to_plain(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """Resolve interpolations into plain containers; a broken interpolation is a user error."""
    if not isinstance(cfg, DictConfig):
        return dict(cfg)
    plain: dict[str, Any] = {}
    for key in cfg.keys():
        if key == "hydra":
            continue
        try:
            node = cfg[key]
            if isinstance(node, (DictConfig, ListConfig)):
                node = OmegaConf.to_container(node, resolve=True, throw_on_missing=True)
            plain[str(key)] = node
        except OmegaConfBaseException as ex:
            where = getattr(ex, "full_key", None) or str(key)
            raise UserError(str(where), _omegaconf_problem(ex)) from None
    return plain


def _omegaconf_problem(ex: OmegaConfBaseException) -> str:
    if type(ex).__name__ == "MissingMandatoryValue":
        return "missing mandatory value (???); set it on the command line or in the config"
    return str(getattr(ex, "msg", None) or ex).splitlines()[0]
