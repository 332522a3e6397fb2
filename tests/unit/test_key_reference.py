"""Each key's doc has one source (its schema); --help, the comments of conf/ and the key tables of
docs/ are produced from it; the tables of docs/architecture.md are what trainer/architecture.py
declares (the layers, every group with its choices and the module that owns it)."""

from __future__ import annotations

import yaml

from trainer.configuration import reference
from trainer.configuration.help import annotated_config
from trainer.configuration.key_docs import callable_docs, group_docs
from trainer.configuration.recipes import CONF_DIR


def test_conf_comments_and_key_tables_are_what_the_schemas_say():
    # The same check as `python -m trainer.configuration.reference`: after changing a Doc, run it
    # with --write.
    assert [str(item) for item in reference.conf_outdated(write=False)] == []
    assert [str(item) for item in reference.docs_outdated(write=False)] == []


def test_the_architecture_page_shows_the_declared_layers_and_groups():
    from trainer.architecture import outdated

    assert not outdated(write=False), "python -m trainer.architecture --write"


def test_a_key_comment_in_conf_is_the_doc_that_help_prints():
    values = yaml.safe_load((CONF_DIR / "optimizer" / "adamw.yaml").read_text())
    help_text = annotated_config({"optimizer": values}, {"optimizer": "adamw"})
    help_doc = next(line for line in help_text.splitlines() if line.strip().startswith("lr:")).split("# ", 1)[1]
    conf_line = next(line for line in (CONF_DIR / "optimizer" / "adamw.yaml").read_text().splitlines()
                     if line.startswith("lr:"))
    assert conf_line.split("# ", 1)[1] == help_doc == group_docs("optimizer", values)["lr"]


def _docs_below(parent):
    if parent and parent[0] == "hydra":
        return None
    if parent == ("logger",):
        return {"name": "the logger's name"}
    return {"lr": "learning rate", "logger": "where metrics go"}


def test_commented_writes_each_doc_and_reports_every_line_it_changed():
    text = "\n".join([
        "# a note on the choice, kept",
        "lr: 0.1   # a stale doc",
        "          # ... continued",
        "momentum: 0.9   # a note on a key without a doc",
        "tag: 'a # in quotes'",
        "logger:",
        "  name: csv",
        "hydra:",
        "  job: {chdir: false}   # Hydra's, left alone",
    ])
    new, problems = reference.commented(text, _docs_below)
    assert new.splitlines() == [
        "# a note on the choice, kept",
        "lr: 0.1                  # learning rate",
        "momentum: 0.9",
        "tag: 'a # in quotes'",
        "logger:                  # where metrics go",
        "  name: csv              # the logger's name",
        "hydra:",
        "  job: {chdir: false}   # Hydra's, left alone",
    ]
    assert [number for number, _ in problems] == [2, 3, 4, 6, 7]
    assert reference.commented(new, _docs_below) == (new, [])  # written once, stable


def test_a_key_whose_doc_differs_between_choices_gets_a_row_for_each():
    rows = list(reference._rows("data", [
        {"_target_": "trainer.data.cifar10.CIFAR10DataModule", "augment": True},
        {"_target_": "trainer.data.imagefolder.ImageFolderDataModule", "augment": "none"},
    ]))
    augment = [row for row in rows if row[0] == "`augment`"]
    assert [row[1:3] for row in augment] == [("`true`", ""), ("", "`none`")]
    assert augment[0][3] != augment[1][3]


def test_a_library_argument_the_framework_gives_a_meaning_is_documented_by_the_framework():
    docs = callable_docs("lightning.pytorch.loggers.WandbLogger")
    assert "recipe:NAME" in docs["tags"]  # passed to wandb.init as **kwargs
    assert "the run's name" in docs["name"]
    ema = callable_docs("lightning.pytorch.callbacks.EMAWeightAveraging")
    assert ema["decay"] and ema["use_buffers"]  # its own and its base class's arguments
