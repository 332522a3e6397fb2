"""benchmarks/gpu_check.sh --dry-run: every step of the prepared GPU check runs for a few steps on
the CPU (tiny model and images) and writes the files and figures the real check writes, so the
script cannot rot between the sessions that have a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import pytest
import torch

from tests.helpers import REPO

pytestmark = [pytest.mark.run, pytest.mark.slow]

STEPS = ["environment", "step_cost", "ladder", "data_stage", "gpu_tests", "practices", "reduce_overhead", "fsdp",
         "profile_memory", "gpt"]
# Only with --steps, in this order (the order the test asks for, not the script's).
EXTRA_STEPS = ["input_pipeline"]  # progressive_resize and batch_study: their scripts have tests of their own
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


@pytest.fixture(scope="module")
def extras_run(tmp_path_factory):
    """The steps run only when asked (--steps), in the order given: their functions are kept working."""
    out = tmp_path_factory.mktemp("gpu_check_extras")
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env["PYTHON"] = sys.executable
    proc = subprocess.run([str(REPO / "benchmarks" / "gpu_check.sh"), "--dry-run", "--out", str(out), "--steps",
                           ",".join(EXTRA_STEPS)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()[1:]]
    assert [(r[0], r[1]) for r in rows] == [(step, "ok") for step in EXTRA_STEPS]
    assert json.loads((out / "run.json").read_text())["command"].endswith("--steps " + ",".join(EXTRA_STEPS))
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


def test_step_cost_row_interleaves_two_repeats_and_gives_the_budget_verdict(dry_run):
    """The default step's sync cost: one row, the defaults against clipping=off nonfinite=off, two
    repeats with their paired ratios; figures.md's first line is the verdict against the 2% budget."""
    out, _ = dry_run
    record = json.loads((out / "step_cost" / "practices.json").read_text())
    assert record["preset"] == "gpu" and record["repeats"] == 2
    [row] = record["rows"]
    assert row["practice"].startswith("clipping + non-finite guard, decided on the device") and row["status"] == "ok"
    assert row["on"]["switch"] == ["clipping=percentile", "nonfinite=skip"]
    assert row["off"]["switch"] == ["clipping=off", "nonfinite=off"]
    assert len(row["repeat_ratios"]) == 2 and row["budget"] == 0.98 and isinstance(row["within_budget"], bool)
    assert len(row["on"]["runs"]) == len(row["off"]["runs"]) == 2
    assert "the budget >= 0.98x" in (out / "step_cost" / "practices.md").read_text()
    figures = (out / "step_cost" / "figures.md").read_text().splitlines()
    assert figures[0].startswith("the defaults' step cost (clipping + non-finite guard on the device): on/off ")
    assert "the budget (on/off >= 0.98)" in figures[0] and figures[1].startswith("per repeat")


def test_practices_table_has_the_other_rows_with_numbers(dry_run):
    out, _ = dry_run
    record = json.loads((out / "practices" / "practices.json").read_text())
    assert record["preset"] == "gpu" and "trainer.accelerator=cpu" in record["base"]
    names = [row["practice"].split(" (")[0] for row in record["rows"]]
    # The step cost's row is step_cost's, compile's the ladder's and reduce_overhead's.
    assert names == ["mixed precision", "TF32 tensor cores", "channels_last memory format",
                     "fused optimizer kernel vs foreach"]
    for row in record["rows"]:
        assert row["status"] == "ok" and row["ratio"] > 0, row
        assert row["on"]["samples_per_s"] > 0 and row["off"]["samples_per_s"] > 0 and row["on"]["peak_mib"] > 0
    # One run per distinct setting: the base is shared by three rows, fp32 with TF32 by two.
    assert len({run for row in record["rows"] for side in ("on", "off") for run in row[side]["runs"]}) == 5
    table = (out / "practices" / "practices.md").read_text()
    assert table.count("x |") >= 4 and "| MFU on / off |" in table


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


def test_data_stage_trains_on_real_jpegs_per_decode_mode_and_copy_overlap(dry_run):
    """The data stage: train.py on a folder of JPEG photos, fast with and without the copy overlap and
    device; on the CPU the device mode decodes there and the overlap steps aside, as the plan says."""
    out, _ = dry_run
    record = json.loads((out / "data_stage" / "data_stage.json").read_text())
    assert record["images"] == 40 and record["quick"] is True
    rows = record["rows"]
    assert [r["name"] for r in rows] == ["fast_overlap", "fast_no_overlap", "device_overlap"]
    assert all(r["status"] == "completed" and r["samples_per_s"] > 0 and r["steps"] == 8 for r in rows), rows
    assert [r["settings"]["data.decode"] for r in rows] == ["fast", "fast", "device"]
    assert all(r["settings"]["data.copy_overlap"] is False and r["settings"]["data.num_workers"] == 1 for r in rows)
    assert all("data=imagefolder" in r["overrides"] and "callbacks=device_stats" in r["overrides"] for r in rows)
    assert all(r["device_utilisation"]["sampled"] is False for r in rows)
    assert "| run | status | samples/s | vs first | MFU |" in (out / "data_stage" / "data_stage.md").read_text()
    figures = (out / "data_stage" / "figures.md").read_text().splitlines()
    assert figures[0].startswith("samples/s end to end on 40 JPEGs, ") and "device_overlap " in figures[0]
    assert figures[3].startswith("device_overlap: ") and "decode device, copy_overlap False" in figures[3]


def test_reduce_overhead_fsdp_profile_memory_and_gpt_steps(dry_run):
    """The steps of a few named runs (benchmarks/check_runs.py): their rows and key figures. The dry
    run does not compile (compile=auto: eager on the CPU), and FSDP's refusal without CUDA is its row."""
    out, _ = dry_run
    rows = json.loads((out / "reduce_overhead" / "runs.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["default", "reduce_overhead"]
    assert all(r["status"] == "completed" and r["samples_per_s"] > 0 and r["settings"]["compile"] == "off"
               for r in rows)
    assert (out / "reduce_overhead" / "figures.md").read_text().startswith("reduce_overhead vs default compile: ")

    rows = {r["name"]: r for r in json.loads((out / "fsdp" / "runs.json").read_text())["rows"]}
    assert rows["default"]["status"] == "completed" and rows["default"]["peak_mib"] > 0
    assert rows["fsdp"]["status"] == "refused" and "CUDA" in rows["fsdp"]["error"]
    figures = (out / "fsdp" / "figures.md").read_text()
    assert figures.startswith("trainer=fsdp trainer.devices=1 refused by the framework: ")

    rows = {r["name"]: r for r in json.loads((out / "profile_memory" / "runs.json").read_text())["rows"]}
    assert rows["profile"]["status"] == "measured" and rows["profile"]["profile"]["categories"]
    assert (out / "profile_memory" / "runs" / "profile" / "profile" / "ops.md").is_file()
    plan = rows["memory_plan"]["memory_plan"]
    assert rows["memory_plan"]["status"] == "completed" and plan["batch_size"] == 4 and plan["modelled_peak"] > 0
    figures = (out / "profile_memory" / "figures.md").read_text().splitlines()
    assert figures[0].startswith("profile ") and "ms/step: " in figures[0] and "memory plan at batch 4: peak" in figures[0]
    assert any("NVTX" in line or "nvtx" in line for line in figures[1:]), figures

    [row] = json.loads((out / "gpt" / "runs.json").read_text())["rows"]
    assert row["status"] == "completed" and row["unit"] == "tokens" and row["units_per_s"] > 0
    assert "+recipe=gpt_small" in row["overrides"] and row["steps"] == 8
    assert (out / "gpt" / "figures.md").read_text().startswith("gpt_small: ")


def test_steps_option_refuses_an_unknown_step(tmp_path):
    proc = subprocess.run([str(REPO / "benchmarks" / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path),
                           "--steps", "environment,nope"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no step 'nope'" in proc.stderr


def test_input_pipeline_step_times_every_decode_mode_and_the_device_side(extras_run):
    """The input-pipeline step's table has every pipeline, and the device mode's decode ran (on the
    CPU in a dry run); its key figures are the verdict lines."""
    out, _ = extras_run
    report = (out / "input_pipeline" / "input_pipeline.md").read_text()
    for row in ("torchvision ImageFolder", "data.decode=pil", "data.decode=fast", "data.decode=device"):
        assert row in report
    assert "device mode, decode + crop + resize of prefetched batches on" in report
    assert (out / "input_pipeline" / "figures.md").read_text().startswith("fast vs standard:")
