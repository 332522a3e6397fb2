"""The ladder as one multirun with its comparison, and the diagnosis of a composed config:
`+ladder=resnet18_cpu` (shrunk by the command line) runs one job per stage in ladder order and
its comparison, printed and saved as .md and .png, names every stage in order;
`python -m trainer.measure.comparison` rewrites it; `diagnose=true` writes its five timings, verdict and
worker sweep (skipped with a note for data made on the device) and no summary.json."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import REPO, python_forked, run_in_process, train_forked, write_digit_pngs

pytestmark = pytest.mark.run

STAGES = ["resnet50_baseline", "resnet50_data", "resnet50_amp", "resnet50_channels_last", "resnet50_compile",
          "resnet50_optimized"]


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    sweep = tmp_path_factory.mktemp("ladder")
    proc = python_forked(
        [str(REPO / "train.py"), "-m", "+ladder=resnet18_cpu", "model=small_cnn", "data=synthetic",
         "data.shape=[3,8,8]", "data.batch_size=4", "data.train_samples=64", "data.val_samples=8", "trainer.max_steps=16",
         "progress=off", f"hydra.sweep.dir={sweep}"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep, proc


def test_each_stage_is_one_job_in_ladder_order(ladder):
    sweep, _ = ladder
    summaries = [json.loads((sweep / str(i) / "summary.json").read_text()) for i in range(len(STAGES))]
    assert [s["choices"]["recipe"] for s in summaries] == STAGES
    assert all(s["status"] == "completed" and s["ladder"] == "resnet18_cpu" for s in summaries)
    # the command line shrinks every stage: it wins over the ladder's own sizes
    assert all(s["steps"] == 16 and s["data"]["image_size"] == [8, 8] for s in summaries)
    assert all(s["throughput"]["windows"] == 1 for s in summaries)


def test_the_comparison_is_printed_and_saved_as_markdown_and_png(ladder):
    sweep, proc = ladder
    markdown = (sweep / "comparison.md").read_text()
    rows = [line for line in markdown.splitlines() if line.startswith("| resnet50_")]
    assert [row.split("|")[1].strip() for row in rows] == STAGES
    assert rows[0].split("|")[4].strip() == "1.00x"
    assert "precision.channels_last=true" in rows[3]
    assert (sweep / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| resnet50_optimized |" in proc.stdout


def test_the_report_command_rewrites_the_comparison(ladder):
    sweep, _ = ladder
    (sweep / "comparison.md").unlink()
    proc = python_forked(["-m", "trainer.measure.comparison", str(sweep)], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (sweep / "comparison.md").is_file() and "resnet50_compile" in proc.stdout


def test_diagnose_times_the_parts_of_a_step_and_sweeps_the_workers(tmp_path):
    from trainer.data.loader import usable_cpus

    assert run_in_process(["diagnose=true", "diagnose_steps=4", "trainer.max_epochs=1"], tmp_path) is None
    record = json.loads((tmp_path / "diagnosis.json").read_text())
    ms = record["ms_per_step"]
    assert set(ms) == {"data_pipeline", "forward", "forward_backward", "forward_backward_optimizer", "full_step"}
    assert all(v > 0 for v in ms.values())
    assert ms["forward"] < ms["forward_backward"]
    assert record["verdict"] in {"input-bound", "compute-bound", "optimizer-bound", "host-overhead-bound"}
    assert record["try_next"]
    workers = [w["num_workers"] for w in record["worker_sweep"]]
    assert workers[0] == 0 and workers[-1] == usable_cpus()
    assert (tmp_path / "diagnosis.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "summary.json").exists()  # a diagnosis does not pretend to be a training run
    # the profiled operators of the model's step, and the noise that says when a verdict is borderline
    operators = record["operators"]
    assert 0.9 <= sum(operators["shares"].values()) + operators["outside_operators"] <= 1.1
    assert operators["shares"]["convolution/matmul"] > 0 and 0 < operators["memory_bound_share"] < 1
    assert set(record["noise_ms"]) == {"data", "forward", "forward_backward", "step", "full"}
    assert "borderline" in record


def test_diagnose_on_device_made_data_skips_the_worker_sweep_and_says_why(tmp_path):
    run_in_process(["diagnose=true", "diagnose_steps=3", "data=synthetic", "data.shape=[3,8,8]",
                    "data.batch_size=8", "data.train_samples=64"], tmp_path)
    record = json.loads((tmp_path / "diagnosis.json").read_text())
    assert record["worker_sweep"] == [] and any("worker sweep skipped" in n for n in record["notes"])


def test_diagnose_on_an_image_folder_compares_the_decode_modes(tmp_path):
    """The diagnosis times the data pipeline in each decode mode and records the fastest; when the
    run is input-bound and another mode is faster, the advice names it."""
    root = tmp_path / "jpegs"
    write_digit_pngs(root, {"train": 12, "val": 4}, size=32, suffix=".jpg")
    run_in_process(["diagnose=true", "diagnose_steps=3", "data=imagefolder", f"data.root={root}", "data.image_size=32",
                    "data.batch_size=16", "data.num_workers=0", "data.decode=pil", "trainer.accelerator=cpu",
                    "trainer.max_epochs=1"], tmp_path / "run")
    record = json.loads((tmp_path / "run" / "diagnosis.json").read_text())
    sweep = {d["decode"]: d["samples_per_s"] for d in record["decode_sweep"]}
    assert set(sweep) == {"pil", "fast", "device"} and all(rate > 0 for rate in sweep.values())
    assert record["context"]["decode"] == "pil"
    fastest = max(sweep, key=sweep.get)
    if record["verdict"] == "input-bound" and fastest != "pil":
        assert any(t.startswith(f"data.decode={fastest}") for t in record["try_next"])


def test_profile_records_steps_of_the_real_loop_and_writes_its_tables(tmp_path):
    """profile=true: a trace Perfetto and TensorBoard open (valid JSON with events), ops.md with the
    category table, profile.json whose shares and time outside operators add up to about the step,
    roofline.png; no training, so no summary.json."""
    assert run_in_process(["profile=true", "profile_steps=3", "data.batch_size=32"], tmp_path) is None
    folder = tmp_path / "profile"
    traces = list(folder.glob("*.pt.trace.json"))
    assert len(traces) == 1
    trace = json.loads(traces[0].read_text())
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert any(name.startswith("ProfilerStep") for name in names) and "trainer: forward" in names
    record = json.loads((folder / "profile.json").read_text())
    assert record["steps"] == 3 and record["step_ms"] > 0
    shares = sum(c["share"] for c in record["categories"]) + record["outside_operators"]["share"]
    assert 0.9 <= shares <= 1.1
    categories = {c["category"]: c for c in record["categories"]}
    assert {"convolution/matmul", "normalization", "optimizer"} <= set(categories)
    conv = categories["convolution/matmul"]
    assert conv["backward_ms"] > 0 and conv["forward_ms"] > 0 and conv["flops_per_s"] > 0 and conv["intensity"] > 0
    assert 0 < record["memory_bound_share"] < 1 and record["roof"]["how"].startswith(("measured here", "H", "A"))
    assert "| convolution/matmul |" in (folder / "ops.md").read_text()
    # The step's phases marked for Nsight Systems on CUDA only; a CPU run says so.
    assert record["nvtx"].startswith("NVTX ranges: on" if torch.cuda.is_available() else "NVTX ranges: off (no CUDA)")
    assert record["nvtx"] in (folder / "ops.md").read_text()
    assert (folder / "roofline.png").read_bytes()[:4] == b"\x89PNG"
    assert not (tmp_path / "summary.json").exists()


def test_profile_and_diagnose_together_are_one_line(tmp_path):
    result = train_forked(["profile=true", "diagnose=true"], tmp_path)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == (
        "error: profile: diagnose=true and profile=true both replace training; allowed: one of them")


def test_memory_plan_is_measured_before_training_printed_stored_and_drawn(tmp_path, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="trainer"):
        summary = run_in_process(["memory_plan=true", "trainer.max_epochs=1", "trainer.accelerator=cpu"], tmp_path)
    plan = summary["memory_plan"]
    assert set(plan["bytes"]) == {"weights", "gradients", "optimizer state", "activations", "optimizer step scratch"}
    assert plan["batch_size"] == 64 and plan["activations_per_sample"] > 0 and plan["measured_peak"] > 0
    assert {p["practice"] for p in plan["practices"]} >= {"bf16 activations", "half the batch, twice the accumulation"}
    assert any(r.getMessage().startswith("memory plan at batch 64 on cpu") for r in caplog.records)
    assert (tmp_path / "memory_plan.png").read_bytes()[:4] == b"\x89PNG"
    assert summary["status"] == "completed"


def test_batch_size_auto_on_the_cpu_fits_the_budget_and_rederives_lr_and_weight_decay(tmp_path, caplog):
    """The finder's batch is a multiple of 8 within the budget (the next multiple would not fit, by
    the measured plan), and the plan's lr and weight decay follow it by their rules, printed with
    their derivations at start."""
    import logging
    import math

    with caplog.at_level(logging.INFO, logger="trainer"):
        summary = run_in_process(["data.batch_size=auto", "data.memory_budget_gb=0.02", "trainer.max_epochs=1",
                                  "trainer.accelerator=cpu"], tmp_path)
    derived = summary["derived"]
    batch = derived["data.batch_size"]["value"]
    assert batch % 8 == 0 and 8 <= batch and derived["data.batch_size"]["how"].startswith(f"auto -> {batch}: ")
    assert summary["hyperparameters"]["batch_size"] == batch == summary["hyperparameters"]["global_batch_size"]
    assert derived["optimizer.lr"]["value"] == pytest.approx(0.004 * math.sqrt(batch / 256), rel=1e-6)
    assert derived["optimizer.weight_decay"]["value"] == pytest.approx(0.2 * math.sqrt(batch / 256), rel=1e-6)
    assert json.loads((tmp_path / "batch_size_auto.json").read_text())["batch_size"] == batch
    start_up = [r.getMessage() for r in caplog.records]
    assert any(line.strip().startswith("data.batch_size") and "auto ->" in line for line in start_up)


def test_batch_size_auto_on_the_cpu_without_a_budget_is_one_line(tmp_path):
    result = train_forked(["data.batch_size=auto", "trainer.accelerator=cpu"], tmp_path)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith(
        "error: data.memory_budget_gb: missing: data.batch_size=auto on a CPU sizes the batch to a memory budget")
