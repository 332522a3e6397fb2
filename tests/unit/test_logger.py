"""What the loggers are told about a run (trainer/groups/logger.py): a wandb run is named after the run,
grouped by the multirun it belongs to and tagged with its recipe and group choices, unless the config
or wandb's own WANDB_* variables say otherwise (tags are added to theirs), and lands in the
WANDB_PROJECT; the hyper-parameters are the resolved config, the group choices and the plan's
derived values, as plain values. wandb runs offline, its files under tmp_path."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

import pytest
from lightning.pytorch.loggers import WandbLogger
from omegaconf import OmegaConf

from tests.helpers import compose
from trainer.groups.logger import (RunLabels, _wandb_has_key, build_loggers, check_loggers, finish_loggers,
                                   logger_ids, run_hyperparameters, run_labels, start_loggers, wandb_key_problem,
                                   wandb_mode, wandb_settings)
from trainer.infra.errors import UserError


def test_labels_name_the_run_group_a_multirun_by_its_folder_and_tag_what_the_run_is(tmp_path):
    root = tmp_path / "outputs"
    sweep = root / "multirun" / "2026-01-02" / "03-04-05-000006"
    choices = {"data": "digits", "model": "small_cnn", "recipe": "team/fast", "ladder": "resnet18_cpu",
               "logger": "wandb", "checkpointing": "default", "hparams_search": "digits_optuna"}
    labels = run_labels("team/fast-lr=0.1", choices, sweep, root)
    assert labels.name == "team/fast-lr=0.1"
    assert labels.group == "multirun/2026-01-02/03-04-05-000006"
    # what the run is, not how it is recorded or launched
    assert labels.tags == ("recipe:team/fast", "ladder:resnet18_cpu", "data:digits", "model:small_cnn")
    assert run_labels("one", choices, None, root).group is None  # a single run has no group
    assert run_labels("one", {}, tmp_path / "elsewhere", root).group == str(tmp_path / "elsewhere")


def test_the_wandb_project_comes_from_WANDB_PROJECT_when_set(monkeypatch):
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    assert compose(["logger=wandb"]).logger.wandb.project == "trainer"
    monkeypatch.setenv("WANDB_PROJECT", "team-vision")
    assert compose(["logger=wandb"]).logger.wandb.project == "team-vision"
    # an explicit setting still wins
    assert compose(["logger=wandb", "logger.wandb.project=mine"]).logger.wandb.project == "mine"


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "team-vision")
    for name in ("WANDB_DIR", "WANDB_NAME", "WANDB_RUN_GROUP", "WANDB_TAGS", "WANDB_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


def wandb_spec(*overrides: str) -> dict:
    return OmegaConf.to_container(compose(["logger=wandb", *overrides]).logger, resolve=True)


LABELS = RunLabels("digits-small_cnn", "multirun/2026-01-02/03-04-05-000006", ("data:digits", "model:small_cnn"))


def test_a_wandb_run_gets_the_runs_name_group_tags_and_hyperparameters(tmp_path, offline_wandb):
    [logger] = build_loggers(wandb_spec(), tmp_path, {"wandb": "abcd1234"}, LABELS)
    try:
        run = logger.experiment
        assert (run.project, run.name, run.group, tuple(run.tags)) == (
            "team-vision", LABELS.name, LABELS.group, LABELS.tags)
        assert run.id == "abcd1234"
        logger.log_hyperparams(run_hyperparameters({"optimizer": {"lr": 0.004}}, {"optimizer.lr": 0.0005}))
        assert run.config["optimizer"]["lr"] == 0.004 and run.config["derived"]["optimizer.lr"] == 0.0005
    finally:
        finish_loggers([logger], failed=False)
    assert list((tmp_path / "wandb").glob("offline-run-*-abcd1234"))  # in the run folder


def test_a_name_or_group_set_in_the_config_wins_and_its_tags_are_kept(tmp_path, offline_wandb):
    spec = wandb_spec("logger.wandb.name=mine", "logger.wandb.group=my-group", "logger.wandb.tags=[a,b]")
    [logger] = build_loggers(spec, tmp_path, {"wandb": "efgh5678"}, LABELS)
    try:
        run = logger.experiment
        assert (run.name, run.group, tuple(run.tags)) == ("mine", "my-group", ("a", "b", *LABELS.tags))
    finally:
        finish_loggers([logger], failed=False)


def test_wandbs_own_variables_win_and_its_tags_are_added_to(tmp_path, offline_wandb, monkeypatch):
    monkeypatch.setenv("WANDB_NAME", "from-env")
    monkeypatch.setenv("WANDB_RUN_GROUP", "env-group")
    monkeypatch.setenv("WANDB_TAGS", "nightly, team-a")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "scratch"))
    (tmp_path / "scratch").mkdir()
    [logger] = build_loggers(wandb_spec(), tmp_path / "run", {"wandb": "ijkl9012"}, LABELS)
    try:
        run = logger.experiment
        assert (run.name, run.group) == ("from-env", "env-group")
        assert tuple(run.tags) == ("nightly", "team-a", *LABELS.tags)
    finally:
        finish_loggers([logger], failed=False)
    assert list((tmp_path / "scratch" / "wandb").glob("offline-run-*-ijkl9012"))  # WANDB_DIR, not the run folder


def test_wandb_settings_fill_in_only_what_neither_the_config_nor_the_environment_sets():
    spec = {"_target_": "lightning.pytorch.loggers.WandbLogger", "name": None, "group": None, "tags": None}
    assert wandb_settings(spec, LABELS, "/runs/1", {}) == {
        "name": LABELS.name, "group": LABELS.group, "save_dir": "/runs/1", "tags": list(LABELS.tags)}
    environ = {"WANDB_NAME": "n", "WANDB_RUN_GROUP": "g", "WANDB_DIR": "/scratch", "WANDB_TAGS": "x,,data:digits"}
    assert wandb_settings(spec, LABELS, "/runs/1", environ) == {
        "name": "n", "group": "g", "save_dir": "/scratch", "tags": ["x", "data:digits", "model:small_cnn"]}
    assert wandb_settings({**spec, "tags": ["mine"]}, RunLabels(), "/runs/1", {})["tags"] == ["mine"]


def test_the_wandb_run_id_is_the_configured_one_then_WANDB_RUN_ID_then_the_resumed_runs():
    spec = {"wandb": {"_target_": "lightning.pytorch.loggers.WandbLogger"}}
    assert logger_ids(spec, {"wandb": "resumed1"}, {"WANDB_RUN_ID": "fromenv1"}) == {"wandb": "fromenv1"}
    assert logger_ids(spec, {"wandb": "resumed1"}, {}) == {"wandb": "resumed1"}
    assert logger_ids({"wandb": {**spec["wandb"], "id": "mine0001"}}, {}, {"WANDB_RUN_ID": "x"}) == {"wandb": "mine0001"}
    assert len(logger_ids(spec, {}, {})["wandb"]) == 8


def test_hyperparameters_are_the_resolved_config_and_the_derived_values_as_plain_values():
    resolved = {"data": {"batch_size": 64, "shape": (3, 32, 32), "root": Path("/data")},
                "optimizer": {"lr": 0.004, "betas": [0.9, 0.999]}, "run": {"name": None}}
    hyperparameters = run_hyperparameters(resolved, {"optimizer.lr": 0.002, "global_batch_size": 128,
                                                     "precision": "bf16-mixed", "data.prefetch_factor": None},
                                          {"data": "digits", "recipe": "team/fast"})
    assert hyperparameters == {
        "data": {"batch_size": 64, "shape": [3, 32, 32], "root": "/data"},
        "optimizer": {"lr": 0.004, "betas": [0.9, 0.999]}, "run": {"name": None},
        "choices": {"data": "digits", "recipe": "team/fast"},
        "derived": {"optimizer.lr": 0.002, "global_batch_size": 128, "precision": "bf16-mixed",
                    "data.prefetch_factor": None}}


# A wandb run that sends to a server needs an API key; the check asks wandb's own credential search
# (environment, netrc, settings) without prompting or the network, and is told its answer here.
WANDB = {"_target_": "lightning.pytorch.loggers.WandbLogger", "offline": False}


def _no_key() -> bool:
    return False


def _online() -> str | None:
    return None


def test_a_wandb_run_online_without_a_key_is_refused_with_the_remedy(tmp_path, monkeypatch):
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))  # wandb's own search finds nothing either
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    problem = wandb_key_problem(WANDB, {}, has_key=_no_key, configured_mode=_online)
    assert problem is not None and "no API key" in problem and "online" in problem
    with pytest.raises(UserError) as refused:
        check_loggers({"wandb": WANDB}, {"WANDB_MODE": "online", "HOME": "/nowhere"})
    line = refused.value.line()
    assert line.startswith("logger.wandb: wandb has no API key") and "\n" not in line
    assert "WANDB_API_KEY" in line and "WANDB_MODE=offline" in line and "logger.wandb.offline=true" in line


@pytest.mark.parametrize("spec, environ", [
    ({**WANDB, "offline": True}, {}),                    # the config's offline switch
    ({**WANDB, "mode": "disabled"}, {}),                 # a mode passed on to wandb.init
    (WANDB, {"WANDB_MODE": "offline"}),
    (WANDB, {"WANDB_MODE": "dryrun"}),                   # offline's old name
    (WANDB, {"WANDB_DISABLED": "true"}),
    (WANDB, {"WANDB_API_KEY": "k" * 40}),                # a key in the environment: wandb.init checks it
    (WANDB, {"WANDB_IDENTITY_TOKEN_FILE": "/token"}),
])
def test_a_wandb_run_that_needs_no_key_or_has_one_is_not_refused(spec, environ):
    assert wandb_key_problem(spec, environ, has_key=_no_key, configured_mode=_online) is None


def test_wandbs_own_answers_count_a_netrc_key_an_offline_setting_and_an_unknown_api():
    # `wandb login` (a netrc entry) or a key in wandb's settings: wandb's search finds it
    assert wandb_key_problem(WANDB, {}, has_key=lambda: True, configured_mode=_online) is None
    # an API this wandb lacks: not refused here (wandb.init's own refusal is one line at start_loggers)
    assert wandb_key_problem(WANDB, {}, has_key=lambda: None, configured_mode=_online) is None
    # `wandb offline` wrote the mode into wandb's settings file
    assert wandb_key_problem(WANDB, {}, has_key=_no_key, configured_mode=lambda: "offline") is None
    # the config and the environment win over the settings file
    assert wandb_mode(WANDB, {"WANDB_MODE": "online"}, lambda: "offline") == "online"
    assert wandb_mode({**WANDB, "offline": True}, {"WANDB_MODE": "online"}) == "offline"


def test_wandbs_credential_search_finds_a_netrc_entry_without_the_network(tmp_path, monkeypatch):
    from wandb.sdk import wandb_setup

    host = urlsplit(wandb_setup.singleton().settings.base_url).hostname
    netrc = tmp_path / ".netrc"
    netrc.write_text(f"machine {host}\n  login user\n  password {'k' * 40}\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert _wandb_has_key() is True
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    assert _wandb_has_key() is False


class _RefusingWandbLogger(WandbLogger):
    """wandb.init failing as it does without a network."""

    @property
    def experiment(self):
        from wandb.errors import CommError

        raise CommError("Failed to get resume status for run abcd1234: context deadline exceeded\nmore detail")


def test_a_wandb_run_that_cannot_start_is_one_line_naming_the_logger_and_wandbs_message(tmp_path, offline_wandb):
    logger = _RefusingWandbLogger(save_dir=str(tmp_path), offline=True)
    with pytest.raises(UserError) as refused:
        start_loggers([logger], {"wandb": WANDB})
    line = refused.value.line()
    assert line.startswith("logger.wandb: WandbLogger could not be set up: CommError: Failed to get resume status")
    assert "more detail" not in line and "WANDB_MODE=offline" in line


def test_a_logger_whose_folder_cannot_be_written_is_refused_when_built(tmp_path):
    (tmp_path / "csv").write_text("a file where the csv logger's folder goes")
    spec = {"csv": {"_target_": "lightning.pytorch.loggers.CSVLogger", "name": "csv", "version": ""}}
    with pytest.raises(UserError) as refused:
        build_loggers(spec, tmp_path)
    assert refused.value.line().startswith(f"logger.csv: cannot write its logs to {tmp_path / 'csv'}")
    tensorboard = {"tb": {"_target_": "lightning.pytorch.loggers.TensorBoardLogger", "name": "tb", "version": ""}}
    with pytest.raises(UserError, match="logger.tb: cannot write"):
        build_loggers(tensorboard, tmp_path / "csv" / "below")
    assert build_loggers(spec, tmp_path / "fresh")  # a folder still to be made is fine
