"""The default run, `python train.py` with no arguments, on the bundled digits: in its 10 epochs it
reaches test accuracy >= 0.98; summary.json records the choices, split sizes, batch-scaled lr, derived values,
throughput, peak memory, times, steps and which weights were tested; the run folder holds Hydra's
files, config_resolved.yaml, env.json, checkpoints, metrics.csv, train.log, run.json and
curves.png; with stdout in a pipe it prints plain progress lines and no bar."""

import csv
import json

import pytest

from tests.helpers import REPO, train

pytestmark = pytest.mark.run


def auto_device() -> tuple[str, str]:
    """What `trainer.accelerator=auto` and `precision=auto` resolve to on this machine: the default
    run is run as a person runs it, so on a GPU machine it trains on the GPU."""
    import torch

    if not torch.cuda.is_available():
        return "cpu", "32-true"
    return "cuda", "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    result = train([], tmp_path_factory.mktemp("default") / "run")
    assert result.returncode == 0, result
    return result


def test_reaches_test_accuracy_of_at_least_0_98(default_run):
    summary = default_run.summary
    assert summary["status"] == "completed"
    assert summary["metrics"]["test"]["acc"] >= 0.98
    assert summary["metrics"]["val"]["acc"] >= 0.95
    assert summary["metrics"]["train"]["loss"] < 0.1


def test_summary_records_what_ran_and_what_it_cost(default_run):
    summary = default_run.summary
    assert summary["choices"]["data"] == "digits" and summary["choices"]["model"] == "small_cnn"
    assert summary["data"]["sizes"] == {"train": 1257, "val": 270, "test": 270}
    hp = summary["hyperparameters"]
    assert hp["batch_size"] == 64 and hp["global_batch_size"] == 64 and hp["optimizer"] == "adamw"
    accelerator, precision = auto_device()
    assert hp["lr"] == 0.002 and hp["precision"] == precision
    assert summary["derived"]["data.num_workers"]["value"] == 0
    assert "in memory" in summary["derived"]["data.num_workers"]["how"]
    assert summary["throughput"]["samples_per_s"] > 0 and summary["throughput"]["windows"] > 0
    assert summary["peak_memory"]["bytes"] > 0
    assert summary["device"]["accelerator"] == accelerator
    assert 0 < summary["fit_time_s"] < summary["wall_time_s"]
    assert summary["steps"] == 10 * (1257 // 64)  # drop_last: 19 full batches per epoch
    assert summary["tested_weights"].startswith("best checkpoint by val/loss")
    # The callbacks' records are those at the end of training, not the ones testing the best
    # checkpoint restored (the clipping calibration as it was when that checkpoint was written).
    assert summary["clipping"]["steps_observed"] == summary["steps"]


def test_run_folder_holds_config_env_checkpoints_and_logs(default_run):
    run_dir = default_run.run_dir
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert (run_dir / ".hydra" / "overrides.yaml").is_file()
    assert "batch_size: 64" in (run_dir / "config_resolved.yaml").read_text()
    env = json.loads((run_dir / "env.json").read_text())
    for package in ("torch", "torchvision", "lightning", "hydra-core"):
        assert env["versions"][package]
    assert env["python"].startswith("3.")
    assert "PyTorch built with" in env["torch_config"]
    assert env["cpu"]
    if (REPO / ".git").exists():
        assert len(env["git"]["commit"]) == 40
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert len(list((run_dir / "checkpoints").glob("epoch*.ckpt"))) == 1
    rows = list(csv.DictReader((run_dir / "csv" / "metrics.csv").open()))
    assert any(row.get("val/acc") for row in rows)
    assert "epoch 10/10" in (run_dir / "train.log").read_text()
    identity = json.loads((run_dir / "run.json").read_text())
    assert identity["name"] == "digits-small_cnn" and identity["resumed_from"] is None
    curves = (run_dir / "curves.png").read_bytes()
    assert curves.startswith(b"\x89PNG") and len(curves) > 20_000


def test_plain_progress_lines_and_no_bar_when_not_a_terminal(default_run):
    out = default_run.stdout
    epoch_lines = [line for line in out.splitlines() if "] epoch " in line]
    assert len(epoch_lines) == 10
    assert "\r" not in out  # a live bar redraws its line with carriage returns
    assert default_run.stderr.count("Traceback") == 0


def test_one_flop_count_is_printed_the_plans(default_run):
    # Lightning's model summary printed a FLOPs column of zeros and "Total FLOPs: 0" under the plan's
    # count (it counts only with an example_input_array); the framework's summary leaves them out.
    lines = default_run.stdout.splitlines()
    assert len([line for line in lines if "model.flops_per_sample" in line]) == 1
    assert [line for line in lines if "FLOPs" in line or "Total Flops" in line] == []
    assert any("Total params" in line for line in lines)  # the rest of the summary is still there
