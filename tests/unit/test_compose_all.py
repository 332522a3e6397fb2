"""Every YAML in conf/ and recipes/ composes and validates."""

from pathlib import Path

import pytest

from tests.helpers import CONF, RECIPES, compose
from trainer.config import validate

GROUP_DIRS = sorted(p for p in CONF.iterdir() if p.is_dir() and p.name != "hydra")
CHOICES = [(group.name, f.stem) for group in GROUP_DIRS for f in sorted(group.glob("*.yaml"))]
# Choices that need a value only the person can give.
EXTRA = {("model", "custom"): ["model._target_=tests.helpers.TinyMLP"]}
# Groups with no default: added with +group=choice.
OPTIONAL_GROUPS = {"ladder"}


def test_every_group_has_choices_and_every_file_is_covered():
    assert {g.name for g in GROUP_DIRS} >= {"data", "model", "optimizer", "scheduler", "precision", "compile",
                                            "checkpointing", "logger", "trainer"}
    assert len(CHOICES) == sum(len(list(g.glob("*.yaml"))) for g in GROUP_DIRS)


@pytest.mark.parametrize("group, choice", CHOICES, ids=[f"{g}={c}" for g, c in CHOICES])
def test_group_choice_composes_and_validates(group, choice):
    prefix = "+" if group in OPTIONAL_GROUPS else ""
    spec = validate(compose([f"{prefix}{group}={choice}", *EXTRA.get((group, choice), [])]))
    assert spec is not None
    if group == "ladder":
        assert spec.run.ladder == choice


RECIPE_NAMES = sorted(p.stem for p in RECIPES.glob("*.yaml"))


def test_there_are_recipes():
    assert "digits_quickstart" in RECIPE_NAMES


@pytest.mark.parametrize("recipe", RECIPE_NAMES)
def test_recipe_composes_and_validates(recipe):
    text = (RECIPES / f"{recipe}.yaml").read_text()
    assert "# @package _global_" in text, "a recipe must be global to override groups"
    spec = validate(compose([f"+recipe={recipe}"]))
    assert spec is not None


def test_recipe_overrides_reach_the_config():
    assert compose(["+recipe=digits_quickstart"]).trainer.max_epochs == 15
