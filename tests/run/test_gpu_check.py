"""benchmarks/gpu_check.sh --dry-run: every step of the prepared GPU check runs for a few steps on
the CPU (tiny model and images) and writes the files and figures the real check writes, so the
script cannot rot between the sessions that have a GPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import pytest
import torch

from tests.helpers import REPO

pytestmark = [pytest.mark.run, pytest.mark.slow]

STEPS = ["environment", "gpu_tests", "practices", "ladder", "input_pipeline", "progressive_resize", "batch_study"]
LADDER = ["resnet50_baseline", "resnet50_data", "resnet50_amp", "resnet50_channels_last", "resnet50_compile",
          "resnet50_optimized"]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHON"] = sys.executable
    proc = subprocess.run([str(REPO / "benchmarks" / "gpu_check.sh"), "--dry-run", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


def test_every_step_ran_and_is_ok(dry_run):
    out, proc = dry_run
    rows = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()]
    assert rows[0] == ["step", "status", "seconds", "budget_s", "limit_s", "exit"]
    assert [r[0] for r in rows[1:]] == STEPS
    # Each step within its limit: its own budget plus what the steps before it left unused.
    assert all(r[1] == "ok" and r[5] == "0" and 0 < float(r[2]) <= float(r[4]) for r in rows[1:]), rows
    assert float(rows[1][4]) == float(rows[1][3]) and all(float(r[4]) >= float(r[3]) for r in rows[1:])
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# GPU check: dry run on the CPU") and "- result: every step ok" in summary
    assert all(f"| {step} | ok |" in summary for step in STEPS)
    assert json.loads((out / "run.json").read_text())["dry_run"] is True
    assert f"summary: {out}/summary.md" in proc.stdout


def test_environment_record(dry_run):
    out, _ = dry_run
    record = json.loads((out / "environment" / "environment.json").read_text())
    assert record["torch"] == torch.__version__ and record["python"].startswith("3.")
    assert isinstance(record["devices"], list) and "PyTorch built with" in record["fingerprint"]["torch_config"]
    assert (out / "environment" / "nvidia-smi.txt").read_text().strip()
    assert "torch " + torch.__version__ in (out / "environment" / "figures.md").read_text()


def test_gpu_tests_are_collected_and_skipped_with_the_reason(dry_run):
    out, _ = dry_run
    suite = ElementTree.parse(out / "gpu_tests" / "junit.xml").getroot()
    suite = suite if suite.tag == "testsuite" else next(suite.iter("testsuite"))
    tests, skipped = int(suite.get("tests")), int(suite.get("skipped"))
    assert tests >= 15 and skipped == tests and int(suite.get("failures")) == int(suite.get("errors")) == 0
    figures = (out / "gpu_tests" / "figures.md").read_text()
    assert f"0 passed, 0 failed, 0 errors, {tests} skipped" in figures and "needs a CUDA GPU" in figures
    assert "skipped" in (out / "gpu_tests" / "pytest.log").read_text()


def test_practices_table_has_every_row_with_numbers(dry_run):
    out, _ = dry_run
    record = json.loads((out / "practices" / "practices.json").read_text())
    assert record["preset"] == "gpu" and "trainer.accelerator=cpu" in record["base"]
    names = [row["practice"].split(" (")[0] for row in record["rows"]]
    assert names == ["mixed precision", "TF32 tensor cores", "channels_last memory format",
                     "fused optimizer kernel vs foreach", "torch.compile"]
    for row in record["rows"]:
        assert row["status"] == "ok" and row["ratio"] > 0, row
        assert row["on"]["samples_per_s"] > 0 and row["off"]["samples_per_s"] > 0 and row["on"]["peak_mib"] > 0
    # One run per distinct setting: the base is shared by four rows, fp32 with TF32 by two.
    assert len({run for row in record["rows"] for side in ("on", "off") for run in row[side]["runs"]}) == 6
    table = (out / "practices" / "practices.md").read_text()
    assert table.count("x |") >= 5 and "| MFU on / off |" in table


def test_ladder_has_img_per_s_for_every_stage(dry_run):
    out, _ = dry_run
    record = json.loads((out / "ladder" / "ladder.json").read_text())
    assert [s["stage"] for s in record["stages"]] == LADDER
    assert all(s["status"] == "completed" and s["samples_per_s"] > 0 and s["steps"] == 8 for s in record["stages"])
    assert record["stages"][0]["speedup"] == 1.0
    table = (out / "ladder" / "ladder_mfu.md").read_text()
    assert "| stage | status | img/s | speed-up | MFU |" in table and table.count("| completed |") == 6
    assert (out / "ladder" / "ladder_resnet50.png").read_bytes()[:4] == b"\x89PNG"
    assert "resnet50_optimized" in (out / "ladder" / "ladder_resnet50.md").read_text()
    assert (out / "ladder" / "figures.md").read_text().startswith("6/6 stages completed")


def test_input_pipeline_step_times_every_decode_mode_and_the_device_side(dry_run):
    """The input-pipeline step's table has every pipeline, and the device mode's decode ran (on the
    CPU in a dry run); its key figures are the verdict lines."""
    out, _ = dry_run
    report = (out / "input_pipeline" / "input_pipeline.md").read_text()
    for row in ("torchvision ImageFolder", "data.decode=pil", "data.decode=fast", "data.decode=device"):
        assert row in report
    assert "device mode, decode + crop + resize of prefetched batches on" in report
    assert (out / "input_pipeline" / "figures.md").read_text().startswith("fast vs standard:")


def test_progressive_resize_step_times_the_step_at_every_size_of_the_schedule(dry_run):
    """The progressive-resizing step's table has a row per size of the default 224 px schedule with
    the fast loader's rate and the step's samples/s; its key figures are the step's rate per size,
    then the schedule's expected time."""
    out, _ = dry_run
    report = (out / "progressive_resize" / "progressive_resize.md").read_text()
    rate = r"([\d,.]+) \([\d,.]+-[\d,.]+\) \| ([\d.]+)x"
    for size in (128, 160, 192, 224):  # ResizeSchedule.of(224, 0.5, (0.5, 0.8), "auto", 16)
        row = re.search(rf"^\| {size} \| [\d.]+ \| \d+ \| {rate} \| - \| - \| {rate} \|$", report, re.MULTILINE)
        assert row and all(float(g.replace(",", "")) > 0 for g in row.groups()), (size, report)
    figures = (out / "progressive_resize" / "figures.md").read_text().splitlines()
    assert figures[0].startswith("step samples/s by size on the CPU: 128 px ") and "224 px" in figures[0]
    assert "expected time of 16 epochs against all at 224 px" in figures[1] and "data.decode=fast" in figures[1]


def test_batch_study_step_measures_both_rules_at_both_batches(dry_run):
    """The batch study step: AdamW's sqrt rule and none at two batches, one seed; its key figures
    are every run's val accuracy, then the verdict lines."""
    out, _ = dry_run
    jobs = json.loads((out / "batch_study" / "batch_scaling_jobs.json").read_text())
    assert sorted((j["batch"], j["lr_rule"]) for j in jobs) == [(32, "none"), (32, "sqrt"), (64, "none"), (64, "sqrt")]
    assert all(j["status"] == "completed" for j in jobs)
    figures = (out / "batch_study" / "figures.md").read_text().splitlines()
    assert figures[0].startswith("4 runs on ") and "batch 64 sqrt 0." in figures[0]
    assert figures[1].startswith("adamw, sqrt rule, val accuracy against batch 64: 32: ")
