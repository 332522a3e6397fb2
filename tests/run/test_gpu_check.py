"""benchmarks/gpu_check.sh --dry-run: every step of the prepared GPU check runs for a few steps on
the CPU (tiny model and images) and writes the files and figures the real check writes, so the
script cannot rot between the sessions that have a GPU.

The script runs as CI runs it, with its Python commands (`$PYTHON`: each step's script, the report's
readers, the ladder's train.py, the GPU tests' pytest) forked from this pytest process by
tests/fork_server.py instead of each importing torch and Lightning in a new interpreter (about 20
commands, 8 s of CPU each): what is checked is the script and the steps' programs, not how an
interpreter starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree

import pytest
import torch

from tests.fork_server import ForkServer
from tests.helpers import REPO

pytestmark = [pytest.mark.run, pytest.mark.slow]

STEPS = ["environment", "overhead", "data_stage", "gpu_tests"]
# Only with --steps, in this order (the order the test asks for, not the script's).
# progressive_resize, batch_study, encoder_kernels and serve_text: their scripts have tests of their own
# (the last three's step functions ran whole in a hand-run dry run, 2026-12-07: 48, 25 and 144 s). step_cost and gpt: their
# scripts are the practices and reduce_overhead steps' (practices.py, check_runs.py), and what they
# measure the default overhead step measures too; their key-figure readers are tested on records of
# the shape those scripts write (so that the dry run takes no longer than before the overhead step).
EXTRA_STEPS = ["ceiling", "ladder", "practices", "reduce_overhead", "fsdp", "profile_memory", "input_pipeline"]
LADDER = ["resnet50_baseline", "resnet50_data", "resnet50_amp", "resnet50_channels_last", "resnet50_compile",
          "resnet50_optimized"]


def _dry_run(out, *steps: str) -> subprocess.CompletedProcess[str]:
    """benchmarks/gpu_check.sh --dry-run --out OUT [--steps ...], its Python commands forked (see above)."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    with ForkServer() as server:
        env["PYTHON"] = str(server.python)
        proc = server.run([str(REPO / "benchmarks" / "gpu_check.sh"), "--dry-run", "--out", str(out), *steps],
                          timeout=600, cwd=REPO, env=env)
        assert server.served >= 2 * (len(steps[1].split(",")) if steps else len(STEPS)), "its commands were forked"
    return proc


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = _dry_run(out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


@pytest.fixture(scope="module")
def extras_run(tmp_path_factory):
    """The steps run only when asked (--steps), in the order given: their functions are kept working."""
    out = tmp_path_factory.mktemp("gpu_check_extras")
    proc = _dry_run(out, "--steps", ",".join(EXTRA_STEPS))
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
    # The overhead step's ratios open the summary, before the table of steps.
    assert summary.index("- overhead: framework/loop on ") < summary.index("| step | status |")


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


def test_step_cost_and_gpt_figures_read_their_scripts_records(tmp_path):
    """The step cost's key figure is the on/off verdict against the 2% budget, then each repeat's
    ratio; gpt's is tokens/s and MFU: read from records as practices.py and check_runs.py write them."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_check_report import figures_gpt, figures_step_cost

    side = {"samples_per_s": 4102.0, "mfu": 0.101, "peak_mib": 6503.0, "failed": 0}
    (tmp_path / "practices.json").write_text(json.dumps({"device": "NVIDIA H200", "repeats": 2, "rows": [{
        "practice": "clipping + non-finite guard, decided on the device (cost; budget 2%)", "status": "ok",
        "on": side, "off": {**side, "samples_per_s": 4041.0}, "ratio": 1.015, "repeat_ratios": [0.984, 1.048],
        "budget": 0.98, "within_budget": True}]}))
    figures = figures_step_cost(tmp_path)
    assert figures[0] == ("the defaults' step cost (clipping + non-finite guard on the device): on/off 1.015x, within "
                          "the budget (on/off >= 0.98); 4,102 vs 4,041 samples/s on NVIDIA H200")
    assert figures[1] == "per repeat (on and off next to each other): 0.984x, 1.048x (2 repeats)"
    (tmp_path / "runs.json").write_text(json.dumps({"rows": [{
        "name": "gpt_small", "status": "completed", "unit": "tokens", "units_per_s": 428470.0, "mfu": 0.286,
        "device": "NVIDIA H200", "steps": 26, "windows": 2, "samples_per_s": 418.4, "peak_mib": 8205.0,
        "settings": {"precision": "bf16-mixed"}, "mfu_note": "H200 SXM dense bf16 peak 989.4 TFLOP/s"}]}))
    assert figures_gpt(tmp_path)[0] == "gpt_small: 428,470 tokens/s, MFU 28.6% on NVIDIA H200 (26 steps, 2 windows)"


def test_serve_text_and_batch_study_figures_read_their_records(tmp_path):
    """The --steps-only serve_text and batch_study steps' key figures, read from records of the shape
    their programs write: the committed CPU load reports, and a GPU batch study's report and jobs."""
    import shutil

    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_check_report import figures_batch_study, figures_serve_text

    for name in ("encoder", "gpt"):
        (tmp_path / name).mkdir()
        shutil.copy(REPO / "benchmarks" / "results" / f"deploy_load_{name}_tiny_text_cpu.json",
                    tmp_path / name / "deploy_load.json")
    lines = figures_serve_text(tmp_path)
    assert lines[0].startswith("encoder at concurrency 1: ") and " QPS, P50 " in lines[0]
    assert any(line.startswith("gpt at concurrency 16: ") and "time to first token P50" in line for line in lines)
    assert sum("server memory: RSS " in line for line in lines) == 2
    (tmp_path / "batch_scaling_gpu.md").write_text("# t\n\n## Verdicts\n\n- sqrt against none at 512: val acc "
                                                    "+0.0100 [-0.0050, +0.0250]\n\n## Runs\n\n- not a verdict\n")
    (tmp_path / "batch_scaling_gpu_jobs.json").write_text(json.dumps([
        {"seed": seed, "machine": "NVIDIA H200"} for seed in (1, 2, 1, 2)]))
    assert figures_batch_study(tmp_path) == ["4 runs, seeds 1, 2, on NVIDIA H200",
                                             "sqrt against none at 512: val acc +0.0100 [-0.0050, +0.0250]"]


def test_practices_table_has_the_other_rows_with_numbers(extras_run):
    out, _ = extras_run
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


def test_ladder_has_img_per_s_for_every_stage(extras_run):
    out, _ = extras_run
    record = json.loads((out / "ladder" / "ladder.json").read_text())
    assert [s["stage"] for s in record["stages"]] == LADDER
    assert all(s["status"] == "completed" and s["samples_per_s"] > 0 and s["steps"] == 8 for s in record["stages"])
    assert record["stages"][0]["speedup"] == 1.0
    table = (out / "ladder" / "ladder_mfu.md").read_text()
    assert "| stage | status | img/s | speed-up | MFU |" in table and table.count("| completed |") == 6
    assert (out / "ladder" / "ladder_resnet50.png").read_bytes()[:4] == b"\x89PNG"
    assert "resnet50_optimized" in (out / "ladder" / "ladder_resnet50.md").read_text()
    assert (out / "ladder" / "figures.md").read_text().startswith("6/6 stages completed")


def test_data_stage_says_which_bounds_each_run_after_the_prefetch_queue_drained(dry_run):
    """The data stage: the step alone on device-made images, the loader alone per decode mode and the
    framework's loop end to end on JPEG files (fast with and without the copy overlap, device), each
    timed over 3 windows that start after the loader's queue (workers x prefetch factor) drained; each
    row names its bound. On the CPU the device mode decodes there and the overlap steps aside."""
    out, _ = dry_run
    record = json.loads((out / "data_stage" / "data_stage.json").read_text())
    assert record["quick"] is True and record["distinct"] == 40 and record["windows"] == 3
    assert record["step_alone"]["samples_per_s"] > 0 and len(record["step_alone"]["window_rates"]) == 3
    assert set(record["loader_alone"]) == {"fast", "device"}
    assert all(len(alone["window_rates"]) == 3 for alone in record["loader_alone"].values())
    rows = record["rows"]
    assert [r["name"] for r in rows] == ["fast_overlap", "fast_no_overlap", "device_overlap"]
    for row in rows:
        assert row["status"] == "completed" and row["samples_per_s"] > 0 and len(row["window_rates"]) == 3, row
        settings = row["settings"]
        assert row["queued_batches"] == settings["data.num_workers"] * settings["data.prefetch_factor"] == 2
        assert row["warmup"] == row["queued_batches"] + 2 and row["steps"] == row["warmup"] + 3 * 3 + 1
        assert row["bound"] == ("input-bound" if row["loader_alone"] < row["step_alone"] else "compute-bound")
        assert row["of_bound"] == pytest.approx(row["samples_per_s"] / min(row["loader_alone"], row["step_alone"]))
        assert row["device_utilisation"]["sampled"] is False and "data=imagefolder" in row["overrides"]
    # Enough files for the warm-up and the windows in one epoch.
    assert record["images"] >= max(r["steps"] for r in rows) * 4
    assert [r["settings"]["data.decode"] for r in rows] == ["fast", "fast", "device"]
    assert all(r["settings"]["data.copy_overlap"] is False for r in rows)
    assert "| run | status | end to end img/s | loader alone | step alone | bound |" in \
        (out / "data_stage" / "data_stage.md").read_text()
    figures = (out / "data_stage" / "figures.md").read_text().splitlines()
    assert figures[0].startswith(f"img/s on {record['images']:,} JPEGs, ") and "step alone " in figures[0]
    assert "device_overlap " in figures[0] and "-bound" in figures[0]
    assert figures[3].startswith("device_overlap: ") and "decode device, copy_overlap False" in figures[3]


def test_overhead_step_times_the_framework_beside_the_hand_loop(dry_run):
    """The overhead step (its dry run: ResNet-50's stand-in eager, GPT-2 small's compiled row eager):
    both sides ran the same work, every repeat gives a ratio, the eager row prices the defaults too,
    and the key figure is framework/loop against the 0.98x goal."""
    out, _ = dry_run
    record = json.loads((out / "overhead" / "overhead.json").read_text())
    assert record["quick"] is True and record["goal"] == 0.98
    eager, compiled = record["rows"]
    assert (eager["row"], eager["stand_in"], compiled["row"], compiled["stand_in"]) == \
        ("resnet50 eager", False, "gpt_small compiled", True)
    for row in (eager, compiled):
        assert row["status"] == "ok" and "error" not in row, row
        assert len(row["ratios"]) == row["repeats"] == 2 and row["ratio"] == pytest.approx(
            sorted(row["ratios"])[0] / 2 + sorted(row["ratios"])[1] / 2)
        assert all(len(rates) == 2 for side in row["window_rates"].values() for rates in side)
        assert row["hand_rate"] > 0 and row["framework_rate"] > 0 and "clipping=off" in row["overrides"]
    assert eager["unit"] == "samples" and compiled["unit"] == "tokens" and compiled["facts"]["compile_mode"] == "off"
    assert eager["defaults_ratio"] > 0 and len(eager["step_cost_ratios"]) == 2 and "defaults_ratio" not in compiled
    assert "| row | framework/loop | goal >= 0.98x |" in (out / "overhead" / "overhead.md").read_text()
    figures = (out / "overhead" / "figures.md").read_text().splitlines()
    assert figures[0].startswith("framework/loop on ") and "goal >= 0.98x met by" in figures[0]
    assert figures[1].startswith("resnet50 eager: ") and "of the bare framework" in figures[1]


def test_ceiling_step_searches_batch_memory_format_then_compile(extras_run):
    """The ceiling step (dry: tiny models, one compile setting run eager): the eager settings, then the
    compile setting at each model's fastest; the key figure is each model's fastest against its goal."""
    out, _ = extras_run
    record = json.loads((out / "ceiling" / "ceiling.json").read_text())
    settings = [r["setting"] for r in record["rows"]]
    assert settings[:3] == ["resnet50 b4 cl off", "resnet50 b4 nchw off", settings[2]] and settings[2].startswith(
        "resnet50 b8 ")
    assert settings[3:5] == ["gpt_small b4 off", "gpt_small b8 off"]
    assert settings[5].startswith("gpt_small ") and settings[5].endswith(" default")
    assert settings[6].startswith("resnet50 ") and settings[6].endswith(" default")
    assert all(r["status"] == "ok" and r["rate"] > 0 for r in record["rows"]) and record["rows"][6]["stand_in"]
    assert record["best"]["resnet50"]["rate"] == max(r["rate"] for r in record["rows"] if r["model"] == "resnet50")
    figures = (out / "ceiling" / "figures.md").read_text().splitlines()
    assert figures[0].startswith("resnet50: fastest ") and "gpt_small: fastest " in figures[0]
    assert "goal >= 5,500 img/s" in figures[0] and "goal >= 45% MFU" in figures[0]


def test_reduce_overhead_fsdp_and_profile_memory_steps(extras_run):
    """The steps of a few named runs (benchmarks/check_runs.py): their rows and key figures. The dry
    run does not compile (compile=auto: eager on the CPU), and FSDP's refusal without CUDA is its row."""
    out, _ = extras_run
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
