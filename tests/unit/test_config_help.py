"""`python train.py --help` shows each key of the composed config with the one-line doc of the
schema that checks it: a framework group's dataclass field, a `_target_`'s annotated parameter, or
the ``Args:`` entry of a library's docstring (Lightning's Trainer); each group's line names its
choice and the module that consumes it."""

import lightning
import pytest
from omegaconf import OmegaConf

from tests.helpers import compose
from trainer.configuration.help import annotated_config
from trainer.configuration.key_docs import docstring_args
from trainer.configuration.spec import BY_NAME
from trainer.infra.schema import schema_of_dataclass


@pytest.fixture(scope="module")
def help_text() -> str:
    cfg = OmegaConf.to_container(compose(["optimizer=sgd"]))
    return annotated_config(cfg, {"optimizer": "sgd", "data": "digits"})


def _line(text: str, start: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(start))


def test_a_framework_key_shows_its_value_and_its_dataclass_doc(help_text):
    line = _line(help_text, "  lr_scaling: sqrt")
    assert line.split("# ", 1)[1] == schema_of_dataclass(BY_NAME["optimizer"].keys).fields["lr_scaling"].doc


def test_an_optimizer_argument_shows_the_doc_of_its_class(help_text):
    assert _line(help_text, "  momentum: 0.9").split("# ", 1)[1] == "momentum factor (default: 0)"  # torch's SGD


def test_a_group_line_names_its_choice_and_module(help_text):
    line = _line(help_text, "optimizer:")
    assert "optimizer=sgd" in line and "trainer/groups/optimizer/" in line


def test_target_parameters_and_lightning_arguments_have_docs(help_text):
    assert "per device" in _line(help_text, "  batch_size: 64")
    assert "percentile" in _line(help_text, "  percentile: 95.0")
    assert _line(help_text, "  max_steps:").split("# ", 1)[1].startswith("Stop training after")  # Lightning's docstring
    assert "-1: no limit" in _line(help_text, "  max_epochs:")  # the framework's doc of a Lightning argument


def test_every_key_of_the_default_config_outside_the_trainer_group_is_documented():
    text = annotated_config(OmegaConf.to_container(compose()), {})
    undocumented = [line for line in text.splitlines() if "#" not in line and not line.strip().startswith("_target_")]
    assert undocumented == []


def test_docstring_args_reads_the_first_sentence_of_each_entry():
    args = docstring_args(lightning.Trainer.__init__)
    assert args["accumulate_grad_batches"].startswith("Accumulates gradients over k batches")
    assert "\n" not in args["devices"] and not args["devices"].endswith(".")

    def documented(a, b):
        """Do a thing.

        Args:
            a: The first one. More detail.
            b (int): The second,
                continued here.
        """

    assert docstring_args(documented) == {"a": "The first one", "b": "The second, continued here"}


def test_the_callbacks_group_shows_what_each_entry_builds_with_its_arguments_docs():
    text = annotated_config(OmegaConf.to_container(compose(["callbacks=[early_stopping,ema]"])), {})
    assert BY_NAME["callbacks"].where in _line(text, "callbacks:")
    assert _line(text, "  early_stopping:").endswith("builds lightning.pytorch.callbacks.EarlyStopping")
    assert _line(text, "    patience: 3").split("# ", 1)[1].startswith("number of checks with no improvement")
