"""The loggers write into the run folder: csv and tensorboard at once, and wandb offline (no
account), which continues its run id when the run is resumed. Every logger gets the learning rate
at every step and the resolved config with the plan's derived values as hyper-parameters."""

import csv
import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.helpers import ON_CPU, REPO, TINY, run_in_process, train_forked

pytestmark = pytest.mark.run

SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=5", "checkpointing=off", "progress=plain"]


def test_tensorboard_and_csv_at_once_write_their_files(tmp_path):
    result = train_forked(["logger=[csv,tensorboard]", *SHORT], tmp_path / "run")
    assert result.returncode == 0, result
    events = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert events and sum(e.stat().st_size for e in events) > 0
    assert (tmp_path / "run" / "csv" / "metrics.csv").stat().st_size > 0
    assert result.summary["metrics"]["val"]["acc"] > 0.1


def test_wandb_offline_keeps_its_run_in_the_run_folder_and_its_id_on_resume(tmp_path):
    offline = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    # Forked children (no second import of torch); wandb's own service process is started by each.
    first = train_forked(["logger=wandb", *SHORT, "checkpointing=default", f"run.root={tmp_path}"],
                         tmp_path / "first", setup=lambda: os.environ.update(offline))
    assert first.returncode == 0, first
    run_id = json.loads((tmp_path / "first" / "run.json").read_text())["logger_ids"]["wandb"]
    runs = list((tmp_path / "first" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    # Resumed for one more epoch in a new folder: wandb continues the same run id.
    second = train_forked(["logger=wandb", *SHORT, "checkpointing=default", f"run.root={tmp_path}",
                           "trainer.max_epochs=2", f"resume={tmp_path / 'first' / 'checkpoints' / 'last.ckpt'}"],
                          tmp_path / "second", setup=lambda: os.environ.update(offline))
    assert second.returncode == 0, second
    assert json.loads((tmp_path / "second" / "run.json").read_text())["logger_ids"]["wandb"] == run_id
    assert list((tmp_path / "second" / "wandb").glob(f"offline-run-*-{run_id}"))
    assert second.summary["steps"] == 10 and second.summary["resumed_from"]["global_step"] == 5


# Four steps, two of warmup, so the lr moves at every step: factors 0.5, 1, 1, 0.5 of the effective lr.
LR_RUN = [*TINY, *ON_CPU, "logger=[csv,tensorboard]", "trainer.log_every_n_steps=1", "data.train_samples=16",
          "trainer.max_steps=4", "scheduler=warmup_cosine", "scheduler.warmup=2", "scheduler.min_lr_ratio=0.0"]
LR_FACTORS = [0.5, 1.0, 1.0, 0.5]


def test_csv_and_tensorboard_get_the_lr_per_step_and_the_resolved_config(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    run_dir = tmp_path / "run"
    summary = run_in_process(LR_RUN, run_dir)
    lr = summary["derived"]["optimizer.lr"]["value"]
    expected = [pytest.approx(lr * f) for f in LR_FACTORS]
    resolved = yaml.safe_load((run_dir / "config_resolved.yaml").read_text())

    # csv: one lr per parameter group (weights with decay, norm weights and biases without) per step
    rows = list(csv.DictReader((run_dir / "csv" / "metrics.csv").open()))
    for group in ("train/lr/pg1", "train/lr/pg2"):
        logged = [(int(r["step"]), float(r[group])) for r in rows if r.get(group)]
        assert [s for s, _ in logged] == [0, 1, 2, 3] and [v for _, v in logged] == expected
    # csv's hparams.yaml: the whole resolved config and the derived values, not the module's five
    hparams = yaml.safe_load((run_dir / "csv" / "hparams.yaml").read_text())
    derived = hparams.pop("derived")
    assert hparams.pop("choices")["scheduler"] == "warmup_cosine"  # the group choices, to filter runs by
    assert hparams == resolved
    assert hparams["optimizer"]["lr"] == resolved["optimizer"]["lr"] and hparams["data"]["batch_size"] == 4
    assert derived["optimizer.lr"] == lr and derived["global_batch_size"] == 4
    assert derived["precision"] == summary["derived"]["precision"]["value"]

    # tensorboard: the lr scalars, and the HParams tab's hyper-parameters
    scalars, session, shown = {}, None, None
    for events in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
        try:
            contents = accumulator.PluginTagToContent("hparams").values()
        except KeyError:  # a file without hyper-parameters (the test metrics, written after fit)
            contents = []
        for content in contents:
            data = plugin_data_pb2.HParamsPluginData.FromString(content)
            if data.HasField("session_start_info"):
                session = data.session_start_info.hparams
            if data.HasField("experiment"):
                shown = [info.name.tag for info in data.experiment.metric_infos]
    assert [s for s, _ in scalars["train/lr/pg1"]] == [0, 1, 2, 3]
    assert [v for _, v in scalars["train/lr/pg1"]] == expected
    assert session is not None
    assert session["optimizer/lr"].number_value == pytest.approx(resolved["optimizer"]["lr"])
    assert session["derived/optimizer.lr"].number_value == pytest.approx(lr)
    assert session["data/batch_size"].number_value == 4
    assert session["choices/scheduler"].string_value == "warmup_cosine"
    # beside them, the task's metrics as the run logs them (a team's task names its own)
    assert shown == ["train/loss_epoch", "train/acc", "val/loss", "val/acc", "val/acc5", "test/loss", "test/acc",
                     "test/acc5"]


def test_the_lr_curves_have_the_same_names_with_a_constant_lr(tmp_path):
    # Without a scheduler Lightning would name them after the optimizer (lr-AdamW/pg1).
    overrides = [override for override in LR_RUN if not override.startswith("scheduler")]
    summary = run_in_process([*overrides, "scheduler=constant"], tmp_path / "run")
    lr = summary["derived"]["optimizer.lr"]["value"]
    rows = list(csv.DictReader((tmp_path / "run" / "csv" / "metrics.csv").open()))
    assert not [column for column in rows[0] if column.startswith("lr-")]
    for group in ("train/lr/pg1", "train/lr/pg2"):
        assert [float(r[group]) for r in rows if r.get(group)] == [pytest.approx(lr)] * 4


def test_wandb_without_an_api_key_is_one_line_before_anything_is_built(tmp_path):
    # A fresh interpreter, as a person would run it, with nowhere wandb could find a key: no
    # WANDB_API_KEY, an empty HOME (no netrc, no wandb settings), no WANDB_MODE. wandb is never
    # started, so nothing reaches for the network.
    home, wandb_dir = tmp_path / "home", tmp_path / "wandb_dir"
    home.mkdir()
    wandb_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_FULL_ERROR")) and k != "NETRC"}
    env.update(HOME=str(home), WANDB_DIR=str(wandb_dir), MPLCONFIGDIR=str(tmp_path / "mpl"))
    run_dir = tmp_path / "runs" / "run"
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "logger=wandb", *TINY, *ON_CPU,
                           f"run.root={tmp_path / 'runs'}", f"hydra.run.dir={run_dir}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: logger.wandb: wandb has no API key")
    assert "WANDB_API_KEY" in lines[0] and "WANDB_MODE=offline" in lines[0]
    # refused before the data, the plan or a Trainer: nothing announced, trained or kept
    assert "global_batch_size" not in proc.stdout and "epoch" not in proc.stdout
    assert not run_dir.exists() and not list(wandb_dir.iterdir())
