"""Sweeps: a failed job does not end a multirun (the others run, the table is written, each job
has a wandb run of its own), an Optuna study records failed trials, lives in SQLite and continues
its trial count when the command is run again, submitit's local launcher (the SLURM launcher's
path) runs a two-job multirun, and a sweep over seeds ends with each setting's mean, spread and n,
and its difference from the first with an interval. A sweep submitted again with resume=if_any
trains nothing: each job says its run completed, and the table is the same."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import train_forked

pytestmark = pytest.mark.run

TINY_DIGITS = ["trainer.max_epochs=1", "trainer.limit_train_batches=3", "trainer.limit_val_batches=1",
               "trainer.limit_test_batches=1", "checkpointing=off", "progress=off"]


def test_a_failed_job_does_not_end_a_plain_multirun_and_each_job_has_its_own_wandb_run(tmp_path):
    sweep = tmp_path / "sweep"
    result = train_forked(["-m", "data.batch_size=16,5000,32", *TINY_DIGITS, "logger=[csv,wandb]",
                           f"hydra.sweep.dir={sweep}"], tmp_path / "x",
                          setup=lambda: os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true"))
    assert result.returncode == 0, result
    assert "error: data.batch_size: 5000 is larger than the training split" in result.stdout + result.stderr
    for job in ("0", "2"):
        assert json.loads((sweep / job / "summary.json").read_text())["status"] == "completed"
        # The run of job 0 was finished, so job 2 logged into a run of its own, in its own folder.
        run_id = json.loads((sweep / job / "run.json").read_text())["logger_ids"]["wandb"]
        assert list((sweep / job / "wandb").glob(f"offline-run-*-{run_id}"))
    table = (sweep / "comparison.md").read_text()
    assert "data.batch_size=16" in table and "data.batch_size=5000" in table and "(no summary.json)" in table


def test_optuna_study_records_failed_trials_and_resumes_its_count(tmp_path):
    import optuna
    # A team's search config on the search path, built on the shipped one: a batch size of 5000 is
    # larger than the training split, so those trials fail.
    (tmp_path / "conf" / "hparams_search").mkdir(parents=True)
    (tmp_path / "conf" / "hparams_search" / "tiny.yaml").write_text(
        "# @package _global_\ndefaults:\n  - digits_optuna\nhydra:\n  sweeper:\n    study_name: tiny\n"
        "    params:\n      data.batch_size: choice(16, 5000)\n")
    command = ["hparams_search=tiny", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", f"run.root={tmp_path}",
               *TINY_DIGITS]
    storage = f"sqlite:///{tmp_path}/optuna/digits_optuna.db"

    first = train_forked([*command, "hydra.sweeper.n_trials=3", "hydra.sweeper.sampler.seed=42",
                          f"hydra.sweep.dir={tmp_path / 'first'}"], tmp_path / "x")
    assert first.returncode == 0, first
    trials = optuna.load_study(study_name="tiny", storage=storage).trials
    states = [t.state.name for t in trials]
    assert len(trials) == 3 and "FAIL" in states and "COMPLETE" in states, states
    assert all(t.params["data.batch_size"] == 5000 for t in trials if t.state.name == "FAIL")
    assert all(0.0 <= t.value <= 1.0 for t in trials if t.state.name == "COMPLETE")  # val/acc
    assert (tmp_path / "first" / "optimization_results.yaml").is_file()
    assert (tmp_path / "first" / "comparison.md").is_file()

    again = train_forked([*command, "hydra.sweeper.n_trials=2", "hydra.sweeper.sampler.seed=43",
                          f"hydra.sweep.dir={tmp_path / 'again'}"], tmp_path / "y")
    assert again.returncode == 0, again
    trials = optuna.load_study(study_name="tiny", storage=storage).trials
    assert [t.number for t in trials] == [0, 1, 2, 3, 4]


def test_submitit_local_launcher_runs_a_two_job_multirun(tmp_path):
    # The SLURM launcher's code path (hydra-submitit-launcher), with each job in a process of its own.
    sweep = tmp_path / "sweep"
    result = train_forked(["-m", "hydra/launcher=local", "data.batch_size=32,64", *TINY_DIGITS,
                           f"hydra.sweep.dir={sweep}"], tmp_path / "x", timeout=300)
    assert result.returncode == 0, result
    for job, batch in (("0", 32), ("1", 64)):
        summary = json.loads((sweep / job / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["hyperparameters"]["batch_size"] == batch
    assert list((sweep / ".submitit").iterdir())  # submitit's own job records
    assert "data.batch_size=64" in (sweep / "comparison.md").read_text()


def test_a_sweep_with_a_target_compares_time_to_it(tmp_path):
    """Two lrs, 2 epochs, a target of val/acc 0.2 that both reach: each summary records when, and the
    table has "time to target" and "speed-up to target" beside samples/s."""
    sweep = tmp_path / "sweep"
    result = train_forked(["-m", "optimizer.lr=0.002,0.004", "trainer.max_epochs=2", "checkpointing=off",
                           "progress=off", "target.metric=val/acc", "target.value=0.2", f"hydra.sweep.dir={sweep}"],
                          tmp_path / "x")
    assert result.returncode == 0, result
    targets = [json.loads((sweep / job / "summary.json").read_text())["target"] for job in ("0", "1")]
    assert all(t["reached"] and t["wall_s"] > 0 and t["steps"] > 0 for t in targets)
    table = (sweep / "comparison.md").read_text()
    assert "| time to target | speed-up to target |" in table and "| 1.00x |" in table


def test_a_sweep_over_seeds_ends_with_mean_spread_and_n_and_runs_again_as_a_no_op(tmp_path):
    sweep = tmp_path / "sweep"
    command = ["-m", "seed=1,2,3", "optimizer.lr=0.002,0.004", *TINY_DIGITS, f"run.root={tmp_path}"]
    result = train_forked([*command, f"hydra.sweep.dir={sweep}"], tmp_path / "x")
    assert result.returncode == 0, result
    markdown = (sweep / "comparison.md").read_text()
    over_seeds = markdown.split("## Over seeds", 1)[1].split("## Every job", 1)[0]
    assert "| optimizer.lr=0.002 | 1, 2, 3 | 3 of 3 |" in over_seeds and over_seeds.count("(n=3)") >= 8
    assert "| optimizer.lr=0.004 | " in over_seeds.split("Difference from the first setting", 1)[1]
    assert "over seeds:" in result.stdout  # printed at the end of the sweep too

    again = train_forked([*command, "resume=if_any", f"hydra.sweep.dir={tmp_path / 'again'}"], tmp_path / "y")
    assert again.returncode == 0, again
    assert (again.stdout + again.stderr).count("already completed") == 6
    assert (tmp_path / "again" / "comparison.md").read_text().split("## Over seeds", 1)[1].split("## Every", 1)[0] \
        == over_seeds
