"""The task group's rules: what its `_target_` may be, what it is told, and what it refuses in one
line before anything is built."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from trainer.configuration.spec import choice_config
from trainer.data.base import DataInfo, ImageRecord, TokenRecord
from trainer.groups.task import build_definition, check_task, objective_of, validate
from trainer.infra.errors import UserError
from trainer.tasks.protocol import TaskDefinition

IMAGES = DataInfo(ImageRecord(in_channels=1, image_size=(8, 8)), sizes={"train": 10}, num_classes=3)
TOKENS = DataInfo(TokenRecord(vocab_size=17, sequence_length=8), sizes={"train": 10})


class CountsPixels(TaskDefinition):
    unit: ClassVar[str] = "pixels"


class Picky(TaskDefinition):
    def loss(self, outputs: Any, targets: Any, training: bool) -> Any:
        return outputs.mean()

    def refusals(self, settings: Any) -> list[tuple[str, str, str]]:
        return [("compile.mode", "not with me", "off")] if settings["compile"]["mode"] != "off" else []


def regularization(**values: Any) -> Any:
    return choice_config("regularization", "off", **values)


@pytest.mark.parametrize("target, message", [
    ("trainer.models.small_cnn.SmallCNN", "task._target_: 'trainer.models.small_cnn.SmallCNN' is not a task definition"),
    (f"{__name__}.CountsPixels", "counts batches in 'pixels'"),
])
def test_a_target_that_is_not_a_task_of_a_known_unit_is_one_line(target, message):
    with pytest.raises(UserError) as raised:
        validate({"_target_": target})
    assert message in str(raised.value)


def test_the_definition_is_bound_to_the_data_and_refuses_another_kind():
    language = build_definition(choice_config("task", "language_model"), TOKENS, regularization())
    assert language.vocab_size == 17 and language.units_per_sample() == 8
    with pytest.raises(UserError) as raised:
        build_definition(choice_config("task", "language_model"), IMAGES, regularization())
    assert str(raised.value).startswith("task: LanguageModel cannot learn from images")


def test_regularization_a_task_does_not_take_is_refused_and_what_it_takes_reaches_it():
    with pytest.raises(UserError) as raised:
        build_definition(choice_config("task", "language_model"), TOKENS, regularization(mixup_alpha=0.8))
    assert str(raised.value).startswith("regularization: LanguageModel cannot mix batches")
    smoothed = build_definition(choice_config("task", "language_model"), TOKENS, regularization(label_smoothing=0.1))
    assert smoothed.label_smoothing == 0.1
    classes = build_definition(choice_config("task", "classification"), IMAGES, regularization(mixup_alpha=0.8))
    assert classes.mixing is not None


def test_a_tasks_own_refusal_is_one_line():
    with pytest.raises(UserError) as raised:
        check_task(Picky(), {"compile": {"mode": "default"}})
    assert str(raised.value) == "compile.mode: not with me; allowed: off"
    check_task(Picky(), {"compile": {"mode": "off"}})


def test_objective_auto_is_the_tasks_own():
    assert objective_of(choice_config("task", "classification"), "auto") == "val/acc"
    assert objective_of(choice_config("task", "language_model"), "auto") == "val/perplexity"
    assert objective_of(choice_config("task", "language_model"), "val/loss") == "val/loss"
