"""Every YAML in conf/ and recipes/ composes and validates to the values it holds; the YAML files are
the only source of the framework groups' values (their dataclasses hold types, bounds and docs,
and no defaults); every config group is declared by the module that owns it
(trainer/architecture.py lists them all)."""

import dataclasses
import importlib

import pytest
from omegaconf import OmegaConf

from tests.helpers import CONF, RECIPES, REPO, compose
from trainer.architecture import ALL_GROUPS
from trainer.configuration.diff import flatten
from trainer.configuration.spec import RunIdentity, TargetConfig, TopLevelKeys, choice_config, validate
from trainer.groups.communication import KEYS as COMMUNICATION_KEYS
from trainer.infra.schema import schema_of_dataclass

GROUP_DIRS = sorted(p for p in CONF.iterdir() if p.is_dir() and p.name != "hydra")
CHOICES = [(group.name, f.stem) for group in GROUP_DIRS for f in sorted(group.glob("*.yaml"))]
# Choices that need a value only the person can give.
EXTRA = {("model", "custom"): ["model._target_=tests.helpers.TinyMLP"]}
# Groups with no default: added with +group=choice.
OPTIONAL_GROUPS = {"ladder"}
# Groups that configure Hydra's sweep: of the run they set only the objective.
SWEEP_GROUPS = {"hparams_search"}


#: The groups whose keys include the fields of a dataclass of the framework's.
KEYED_GROUPS = {group.name: group for group in ALL_GROUPS if group.keys is not None}


def test_every_config_group_is_declared_by_the_module_that_owns_it():
    groups = {g.name for g in GROUP_DIRS} | {"recipe"}
    assert groups == {group.name for group in ALL_GROUPS}, "a group without a declaration, or one without a folder"
    for group in ALL_GROUPS:
        assert (REPO / group.where).exists(), f"{group.name}: {group.where} does not exist"
        assert importlib.import_module(group.module).GROUP is group and group.chooses


@pytest.mark.parametrize("group, choice", CHOICES, ids=[f"{g}={c}" for g, c in CHOICES])
def test_group_choice_composes_and_validates_to_its_own_values(group, choice):
    prefix = "+" if group in OPTIONAL_GROUPS else ""
    cfg = compose([f"{prefix}{group}={choice}", *EXTRA.get((group, choice), [])])
    spec = validate(cfg)
    if group == "ladder":
        assert spec.top.ladder == choice
    elif group == "trainer":
        trainer_cfg = OmegaConf.to_container(cfg.trainer)
        # The gradient compression keys are the framework's (spec.communication), not Trainer arguments.
        assert spec.trainer == {k: v for k, v in trainer_cfg.items() if k not in COMMUNICATION_KEYS}
        assert dataclasses.asdict(spec.communication) == {k: trainer_cfg[k] for k in COMMUNICATION_KEYS}
    elif group in KEYED_GROUPS:
        assert dataclasses.asdict(getattr(spec, group)) == dataclasses.asdict(choice_config(group, choice))
    elif group == "data":
        composed = OmegaConf.to_container(cfg.data)
        assert spec.data["_target_"] == composed["_target_"] and spec.data["batch_size"] == composed["batch_size"]
    elif group == "model":
        assert spec.model["_target_"] == cfg.model._target_
    elif group in ("clipping", "nonfinite", "task"):
        assert getattr(spec, group) == OmegaConf.to_container(cfg[group])
    elif group == "logger":
        assert list(spec.loggers) == [choice]
    elif group == "callbacks":
        assert spec.callbacks == OmegaConf.to_container(cfg.callbacks)
        # A choice names its main callback first; device_stats adds the NVML utilisation sampler too.
        also = {"device_stats": ["utilisation"]}.get(choice, [])
        assert list(spec.callbacks) == ([] if choice == "none" else [choice, *also])
    else:
        assert group in SWEEP_GROUPS, f"no check for group {group}"
        assert spec.top.objective == OmegaConf.load(CONF / group / f"{choice}.yaml").objective


@pytest.mark.parametrize("group, choice", [(g, c) for g, c in CHOICES if g in KEYED_GROUPS],
                         ids=[f"{g}={c}" for g, c in CHOICES if g in KEYED_GROUPS])
def test_each_framework_group_yaml_sets_every_field_of_its_dataclass(group, choice):
    """The YAML holds every value (a missing key would have no default to fall back on), no key the
    dataclass lacks unless a `_target_` takes it, and every field has its one-line doc for --help."""
    values = OmegaConf.to_container(compose([f"{group}={choice}"])[group])
    declared = KEYED_GROUPS[group]
    fields = schema_of_dataclass(declared.keys).fields
    assert set(fields) <= set(values)
    # A group whose choices also hold a callable's arguments (a `_target_`'s, the Trainer's) has more keys.
    assert declared.target or declared.signature is not None or set(values) == set(fields)
    assert all(field.doc for field in fields.values()), [name for name, f in fields.items() if not f.doc]


def test_the_top_level_keys_of_train_yaml_are_the_run_schema():
    cfg = OmegaConf.to_container(OmegaConf.load(CONF / "train.yaml"))
    top_level = {k for k, v in cfg.items() if not isinstance(v, (dict, list)) and k != "defaults"}
    assert top_level == set(schema_of_dataclass(TopLevelKeys).fields)
    assert set(cfg["run"]) == set(schema_of_dataclass(RunIdentity).fields)
    assert set(cfg["target"]) == set(schema_of_dataclass(TargetConfig).fields)


def test_no_schema_dataclass_carries_a_default_value():
    classes = [TopLevelKeys, RunIdentity, TargetConfig] + [group.keys for group in KEYED_GROUPS.values()]
    for cls in classes:
        with_default = [f.name for f in dataclasses.fields(cls)
                        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING]
        assert with_default == [], f"{cls.__name__} holds values that belong in its YAML: {with_default}"


RECIPE_NAMES = sorted(p.stem for p in RECIPES.glob("*.yaml"))


def test_the_quickstart_recipe_is_shipped():
    assert "digits_quickstart" in RECIPE_NAMES


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_recipe_composes_and_validates_with_its_own_values(recipe):
    text = (RECIPES / f"{recipe}.yaml").read_text()
    assert "# @package _global_" in text, "a recipe must be global to override groups"
    spec = validate(compose([f"+recipe={recipe}"]))
    own = OmegaConf.to_container(OmegaConf.load(RECIPES / f"{recipe}.yaml"), resolve=False)
    own.pop("defaults", None)
    resolved = flatten(spec.resolved)
    for key, value in flatten(own).items():
        if isinstance(value, str) and "${" in value:
            continue  # an interpolation: resolved against the rest of the config
        assert resolved[key] == value, f"{recipe}: {key}"


def test_recipe_overrides_reach_the_config():
    assert compose(["+recipe=digits_quickstart"]).trainer.max_epochs == 15
