"""The multirun comparison, on hand-written sweep folders (no training): jobs read in numeric
order, stage names, the config keys each job changed, speed-ups over the first job, failed jobs
and jobs without a summary as rows of their own, the Markdown table and details, the PNG chart,
the `python -m trainer.measure.comparison` command, and the Hydra callback (one line on a failure, a
non-zero exit after the table when no job completed, nothing for a single run); MFU against each
precision's own peak beside MFU against the one bf16 peak, where the jobs have them."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from tests.helpers import python_forked
from trainer.measure.comparison import (
    ComparisonCallback,
    SweepJob,
    comparison_rows,
    load_jobs,
    stage_name,
    to_markdown,
    write_comparison,
)
from trainer.configuration.diff import config_changes
from trainer.infra.errors import UserError

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MiB = 2**20


def config(precision: str = "fp32") -> dict[str, Any]:
    return {
        "seed": 42,
        "data": {"batch_size": 64, "num_workers": 2, "mean": [0.5, 0.5, 0.5]},
        "precision": {"name": precision, "channels_last": False},
        "trainer": {"max_epochs": 1},
    }


def summary(recipe: str | None, samples_per_s: float | None, peak_mib: float, loss: float, acc: float,
            precision: str = "32-true", status: str = "completed") -> dict[str, Any]:
    choices = {"data": "synthetic", "model": "resnet18", "precision": "fp32"}
    if recipe:
        choices["recipe"] = recipe
    return {
        "status": status,
        "choices": choices,
        "overrides": [f"+recipe={recipe}"] if recipe else [],
        "recipe": {"name": recipe, "parent": None, "differs_from_parent": {}},
        "throughput": {"samples_per_s": samples_per_s, "method": "median of 5 windows",
                       "includes": "data wait and step", "mfu": None, "mfu_note": "peak unknown"},
        "peak_memory": {"what": "peak CUDA memory allocated by tensors", "bytes": int(peak_mib * MiB)},
        "loss": {"final": loss, "last_steps": 20, "mean": loss, "spread": 0.0125, "min": loss, "max": loss},
        "metrics": {"val": {"acc": acc, "loss": loss}, "test": {"acc": acc}},
        "derived": {"precision": {"value": precision, "how": f"auto -> {precision}"},
                    "data.num_workers": {"value": 2, "how": "auto -> 2 (2 CPUs)"}},
        "device": {"accelerator": "cuda", "name": "NVIDIA H200"},
    }


def write_job(sweep: Path, number: int, summary_data: dict[str, Any] | None,
              config_data: dict[str, Any] | None) -> Path:
    folder = sweep / str(number)
    folder.mkdir(parents=True)
    if summary_data is not None:
        (folder / "summary.json").write_text(json.dumps(summary_data))
    if config_data is not None:
        (folder / "config_resolved.yaml").write_text(yaml.safe_dump(config_data))
    return folder


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """A ladder of four jobs: baseline, bf16 (twice as fast), a failed compile stage, a job that
    died before writing its summary. Plus things the reader must skip."""
    root = tmp_path / "multirun"
    write_job(root, 0, summary("resnet50_baseline", 100.0, 1000, 1.23456, 0.5), config("fp32"))
    write_job(root, 1, summary("resnet50_bf16", 200.0, 600, 1.2, 0.55, precision="bf16-mixed"),
              config("bf16_mixed"))
    failed = summary("resnet50_compile", 300.0, 500, 1.1, 0.6, precision="bf16-mixed", status="failed")
    failed["error"] = "RuntimeError: CUDA out of memory"
    compile_config = config("bf16_mixed")
    compile_config["compile"] = {"mode": "default"}
    write_job(root, 2, failed, compile_config)
    no_summary = write_job(root, 10, None, None)  # numeric order: 10 comes after 2, not after 1
    (no_summary / ".hydra").mkdir()
    (no_summary / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["+recipe=resnet50_broken"]))
    (root / ".hydra").mkdir()
    (root / "notes").mkdir()
    (root / "multirun.yaml").write_text("{}\n")
    return root


def test_jobs_are_read_in_numeric_order_skipping_other_entries(sweep: Path):
    jobs = load_jobs(sweep)
    assert [j.number for j in jobs] == [0, 1, 2, 10]
    assert jobs[3].summary is None and jobs[3].config is None
    assert jobs[1].config["precision"]["name"] == "bf16_mixed"


def test_stage_names():
    with_recipe = SweepJob(0, Path("0"), summary("resnet50_baseline", 1.0, 1, 1.0, 1.0), None)
    overrides_only = SweepJob(1, Path("1"), {"choices": {"data": "digits"}, "overrides": ["model=resnet18", "data=digits"]},
                         None)
    nothing = SweepJob(7, Path("7"), None, None)
    assert stage_name(with_recipe) == "resnet50_baseline"
    assert stage_name(overrides_only) == "model=resnet18 data=digits"
    assert stage_name(nothing) == "job 7"


def test_config_changes_finds_changed_added_and_removed_keys():
    before = {"a": {"b": 1, "gone": "x"}, "lst": [1, 2], "same": {"k": True}}
    after = {"a": {"b": 2, "new": None}, "lst": [1, 2, 3], "same": {"k": True}, "top": 5}
    assert config_changes(before, after) == [
        ("a.b", 1, 2),
        ("a.gone", "x", None),
        ("a.new", None, None),
        ("lst", [1, 2], [1, 2, 3]),
        ("top", None, 5),
    ]
    assert config_changes(before, before) == []
    # `true` and `1` are different settings even though Python calls them equal.
    assert config_changes({"flag": True}, {"flag": 1}) == [("flag", True, 1)]


def test_rows_speed_up_changes_and_failures(sweep: Path):
    rows = comparison_rows(load_jobs(sweep))
    baseline, bf16, failed, missing = rows
    assert baseline.changed == "(first stage)"
    assert baseline.speedup == pytest.approx(1.0)
    assert bf16.speedup == pytest.approx(2.0)
    assert bf16.changed == "precision.name=bf16_mixed"
    assert bf16.peak_mib == pytest.approx(600)
    assert bf16.final_loss == pytest.approx(1.2) and bf16.loss_spread == pytest.approx(0.0125)
    assert bf16.val_acc == pytest.approx(0.55)
    # A failed job shows its status and no numbers, even where its summary has some.
    assert failed.status == "failed"
    assert (failed.samples_per_s, failed.speedup, failed.peak_mib, failed.final_loss, failed.val_acc) == (
        None, None, None, None, None)
    assert failed.changed == "compile.mode=default"
    assert missing.status == "no summary.json"
    assert missing.stage == "+recipe=resnet50_broken"  # named from Hydra's own overrides.yaml
    assert missing.changed == "(no config_resolved.yaml)"


def test_changes_are_cut_after_four_items(tmp_path: Path):
    many = config("fp32")
    many["trainer"].update(max_epochs=2, a=1, b=2, c=3, d=4)
    write_job(tmp_path, 0, summary("base", 100.0, 1, 1.0, 1.0), config("fp32"))
    write_job(tmp_path, 1, summary("many", 100.0, 1, 1.0, 1.0), many)
    changed = comparison_rows(load_jobs(tmp_path))[1].changed
    # a changed value (max_epochs) comes before keys that were only added
    assert changed == "trainer.max_epochs=2, trainer.a=1, trainer.b=2, trainer.c=3, (+1 more)"


def test_no_speed_up_without_a_baseline_throughput(tmp_path: Path):
    write_job(tmp_path, 0, summary("base", None, 1, 1.0, 1.0), config())
    write_job(tmp_path, 1, summary("next", 150.0, 1, 1.0, 1.0), config("bf16_mixed"))
    rows = comparison_rows(load_jobs(tmp_path))
    assert rows[1].samples_per_s == pytest.approx(150.0) and rows[1].speedup is None


def test_markdown_table_and_details(sweep: Path):
    jobs = load_jobs(sweep)
    markdown = to_markdown(comparison_rows(jobs), jobs)
    lines = markdown.splitlines()
    assert lines[0].startswith("# ") and str(sweep) in lines[0] and "NVIDIA H200" in lines[0]
    assert "median of 5 windows" in markdown and "data wait and step" in markdown
    header = "| stage | what it changed | samples/s | speed-up | peak MiB | final loss | loss spread | val acc | test acc |"
    assert header in lines
    table = [line for line in lines if line.startswith("| ")]
    assert table[1] == "| resnet50_baseline | (first stage) | 100 | 1.00x | 1000 | 1.2346 | 0.0125 | 0.5000 | 0.5000 |"
    assert table[2] == "| resnet50_bf16 | precision.name=bf16_mixed | 200 | 2.00x | 600 | 1.2000 | 0.0125 | 0.5500 | 0.5500 |"
    assert table[3] == "| resnet50_compile (failed) | compile.mode=default | - | - | - | - | - | - | - |"
    assert table[4].startswith("| +recipe=resnet50_broken (no summary.json) | (no config_resolved.yaml) | - |")
    details = markdown.split("## Details", 1)[1]
    assert "- config changes vs job 0:\n  - `precision.name`: `fp32` -> `bf16_mixed`" in details
    # Only the derived value that moved is listed for the second stage.
    assert "- derived values that differ from job 0:\n  - `precision`: `32-true` -> `bf16-mixed` (auto -> bf16-mixed)" \
        in details
    assert "`data.num_workers`: " not in details
    assert "  - `compile.mode`: `(absent)` -> `default`" in details
    assert "error: RuntimeError: CUDA out of memory" in details


def test_thousands_separator(tmp_path: Path):
    write_job(tmp_path, 0, summary("base", 12345.6, 81920.4, 1.0, 1.0), config())
    jobs = load_jobs(tmp_path)
    markdown = to_markdown(comparison_rows(jobs), jobs)
    assert "| base | (first stage) | 12,346 | 1.00x | 81920 |" in markdown


def test_write_comparison_writes_both_files(sweep: Path):
    markdown_path, chart_path, markdown = write_comparison(sweep)
    assert markdown_path == sweep / "comparison.md" and chart_path == sweep / "comparison.png"
    assert markdown_path.read_text() == markdown
    assert chart_path.read_bytes().startswith(PNG_MAGIC)
    assert chart_path.stat().st_size > 5000
    # Temporary files of the atomic writes are gone.
    assert sorted(p.name for p in sweep.iterdir() if p.is_file()) == ["comparison.md", "comparison.png",
                                                                     "multirun.yaml"]
    # Rewriting replaces the files, and the report's own files are not mistaken for jobs.
    assert write_comparison(sweep)[2] == markdown


def test_chart_when_nothing_was_measured(tmp_path: Path):
    write_job(tmp_path, 0, None, None)
    _, chart_path, markdown = write_comparison(tmp_path)
    assert chart_path.read_bytes().startswith(PNG_MAGIC)
    assert "no throughput to compare with" in markdown


def test_empty_or_missing_folder_is_a_user_error(tmp_path: Path):
    with pytest.raises(UserError) as empty:
        write_comparison(tmp_path)
    assert str(tmp_path) in empty.value.line() and "no job folders" in empty.value.line()
    with pytest.raises(UserError, match="is not a folder"):
        write_comparison(tmp_path / "absent")
    assert not (tmp_path / "comparison.md").exists()


def test_cli_writes_and_prints(sweep: Path):
    proc = python_forked(["-m", "trainer.measure.comparison", str(sweep)], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "| resnet50_bf16 | precision.name=bf16_mixed | 200 | 2.00x |" in proc.stdout
    assert str(sweep / "comparison.png") in proc.stdout
    assert (sweep / "comparison.md").is_file()


def test_cli_on_an_empty_folder_exits_2_with_one_line(tmp_path: Path):
    proc = python_forked(["-m", "trainer.measure.comparison", str(tmp_path)], timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ")
    assert str(tmp_path) in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stdout == ""


def hydra_config(sweep_dir: Path, mode: str = "MULTIRUN") -> Any:
    return OmegaConf.create({"hydra": {"mode": mode, "sweep": {"dir": str(sweep_dir)}}})


def test_callback_writes_and_prints_the_table(sweep: Path, capsys: pytest.CaptureFixture[str]):
    ComparisonCallback().on_multirun_end(config=hydra_config(sweep))
    out = capsys.readouterr().out
    assert "| resnet50_bf16 | precision.name=bf16_mixed | 200 | 2.00x |" in out
    assert "## Details" not in out  # the table only; the details are in the file
    assert str(sweep / "comparison.md") in out and str(sweep / "comparison.png") in out
    assert (sweep / "comparison.png").read_bytes().startswith(PNG_MAGIC)


def test_callback_reports_a_failure_as_one_line_without_raising(tmp_path: Path, caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING, logger="trainer"):
        ComparisonCallback().on_multirun_end(config=hydra_config(tmp_path / "missing"))
        ComparisonCallback().on_multirun_end(config=OmegaConf.create({"hydra": {}}))  # no sweep dir at all
    messages = [r.getMessage() for r in caplog.records if r.name == "trainer"]
    assert len(messages) == 2
    assert "comparison report not written" in messages[0] and str(tmp_path / "missing") in messages[0]
    assert all("\n" not in m for m in messages)


def test_a_sweep_in_which_no_job_completed_exits_non_zero_after_its_table(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]):
    sweep = tmp_path / "multirun"
    write_job(sweep, 0, summary("a", None, 10, 1.0, 0.1, status="failed"), config("fp32"))
    write_job(sweep, 1, None, None)  # died before its summary
    with pytest.raises(SystemExit) as caught:
        ComparisonCallback().on_multirun_end(config=hydra_config(sweep))
    assert caught.value.code == 2
    captured = capsys.readouterr()
    assert "(failed)" in captured.out and (sweep / "comparison.md").is_file()
    assert captured.err == f"error: {sweep}: none of the 2 jobs completed (see comparison.md)\n"


def test_callback_does_nothing_for_a_single_run(sweep: Path, capsys: pytest.CaptureFixture[str]):
    ComparisonCallback().on_multirun_end(config=hydra_config(sweep, mode="RUN"))
    assert capsys.readouterr().out == ""
    assert not (sweep / "comparison.md").exists()


def test_a_ladder_with_a_target_shows_time_and_speed_up_to_it(tmp_path: Path):
    """Jobs that name a target: "time to target" and "speed-up to target" beside samples/s; a job that
    never reached it says so with its best value; without targets the columns are not there."""
    root = tmp_path / "multirun"
    first = summary("resnet50_baseline", 100.0, 1000, 0.5, 0.97)
    first["target"] = {"metric": "val/acc", "value": 0.95, "reached": True, "wall_s": 40.0, "best": 0.97}
    faster = summary("resnet50_amp", 180.0, 900, 0.5, 0.96)
    faster["target"] = {"metric": "val/acc", "value": 0.95, "reached": True, "wall_s": 16.0, "best": 0.96}
    never = summary("resnet50_channels_last", 190.0, 900, 0.9, 0.91)
    never["target"] = {"metric": "val/acc", "value": 0.95, "reached": False, "wall_s": None, "best": 0.912}
    for number, data in enumerate((first, faster, never)):
        write_job(root, number, data, config())
    rows = comparison_rows(load_jobs(root))
    assert [r.target_s for r in rows] == [40.0, 16.0, None] and rows[1].target_speedup == pytest.approx(2.5)
    table = to_markdown(rows, load_jobs(root))
    assert "| samples/s | speed-up | time to target | speed-up to target |" in table
    assert "| 16.0 s | 2.50x |" in table and "not reached (best 0.912)" in table
    plain = tmp_path / "plain"
    write_job(plain, 0, summary(None, 100.0, 1000, 0.5, 0.97), config())
    assert "time to target" not in to_markdown(comparison_rows(load_jobs(plain)), load_jobs(plain))


def test_when_the_first_stage_never_reached_the_target_the_speed_up_is_a_lower_bound(tmp_path: Path):
    """The first stage trained 60 s without reaching the target: a stage that reached it in 15 s is
    at least 4x faster to it, shown as "> 4.00x"."""
    root = tmp_path / "multirun"
    first = summary("small_images_baseline", 300.0, 1000, 1.4, 0.84)
    first["fit_time_s"] = 60.0
    first["target"] = {"metric": "val/acc", "value": 0.85, "reached": False, "wall_s": None, "best": 0.847}
    later = summary("small_images", 290.0, 1000, 1.0, 0.95)
    later["target"] = {"metric": "val/acc", "value": 0.85, "reached": True, "wall_s": 15.0, "best": 0.95}
    for number, data in enumerate((first, later)):
        write_job(root, number, data, config())
    rows = comparison_rows(load_jobs(root))
    assert rows[1].target_speedup == pytest.approx(4.0) and rows[1].target_speedup_at_least
    assert "| 15.0 s | > 4.00x |" in to_markdown(rows, load_jobs(root))


def test_other_seeds_of_the_first_setting_get_no_speed_up(tmp_path: Path):
    """Jobs that repeat the first job's setting with another seed: their ratio to it is the spread
    between seeds, so the table shows no speed-up for them and says why; another setting keeps its."""
    root = tmp_path / "multirun"
    for number, (overrides, rate) in enumerate(((["model=a", "seed=1"], 100.0), (["model=a", "seed=2"], 112.0),
                                                (["model=b", "seed=1"], 150.0))):
        data = summary(None, rate, 1000, 0.5, 0.9)
        data["overrides"] = overrides
        write_job(root, number, data, config())
    rows = comparison_rows(load_jobs(root))
    assert rows[1].speedup is None and "only the seed" in rows[1].changed
    assert rows[2].speedup == pytest.approx(1.5)
    assert "1.12x" not in to_markdown(rows, load_jobs(root))


def test_mfu_against_the_bf16_peak_beside_the_precisions_own(tmp_path: Path):
    """The H200 ladder's first and last stages (benchmarks/results/gpu/2026-12-04/ladder_mfu.md): fp32
    at 30.8% of the fp32 peak and bf16 at 11.8% of the bf16 peak; on the one bf16 peak 2.1% and 11.8%.
    A summary written before the meter reported `mfu_bf16_peak` shows "-" there; without any MFU (a
    CPU) the columns are not there."""
    root = tmp_path / "multirun"
    baseline = summary("resnet50_baseline", 847.0, 12248, 7.11, 0.0)
    baseline["throughput"].update(mfu=0.3077, mfu_note="H200 SXM fp32 (non-tensor) peak 66.9 TFLOP/s (NVIDIA datasheet)",
                                  mfu_bf16_peak=0.0208, bf16_peak_flops=989.4e12)
    optimized = summary("resnet50_optimized", 4790.0, 10212, 7.02, 0.0, precision="bf16-mixed")
    optimized["throughput"].update(mfu=0.1176, mfu_note="H200 SXM dense bf16 peak 989.4 TFLOP/s (NVIDIA datasheet)",
                                   mfu_bf16_peak=0.1176, bf16_peak_flops=989.4e12)
    older = summary("resnet50_amp", 2114.0, 8566, 7.12, 0.0, precision="bf16-mixed")
    older["throughput"].update(mfu=0.0519, mfu_note="H200 SXM dense bf16 peak 989.4 TFLOP/s (NVIDIA datasheet)")
    for number, data in enumerate((baseline, optimized, older)):
        write_job(root, number, data, config("bf16_mixed" if number else "fp32"))
    jobs = load_jobs(root)
    rows = comparison_rows(jobs)
    assert [(r.mfu, r.mfu_bf16_peak) for r in rows] == [(0.3077, 0.0208), (0.1176, 0.1176), (0.0519, None)]
    markdown = to_markdown(rows, jobs)
    table = [line for line in markdown.splitlines() if line.startswith("| ")]
    assert table[0] == ("| stage | what it changed | samples/s | speed-up | MFU | MFU (bf16 peak) | peak MiB | final loss "
                        "| loss spread | val acc | test acc |")
    assert table[1].startswith("| resnet50_baseline | (first stage) | 847 | 1.00x | 30.8% | 2.1% | 12248 |")
    assert table[2].startswith("| resnet50_optimized | precision.name=bf16_mixed | 4,790 | 5.66x | 11.8% | 11.8% |")
    assert table[3].startswith("| resnet50_amp | (no config change) | 2,114 | 2.50x | 5.2% | - | 8566 |")
    assert "MFU (bf16 peak): every job against the device's dense bf16 peak" in markdown
    details = markdown.split("## Details", 1)[1]
    assert ("- MFU 30.8% (H200 SXM fp32 (non-tensor) peak 66.9 TFLOP/s (NVIDIA datasheet))\n"
            "- MFU against the dense bf16 peak 2.1% (of 989.4 TFLOP/s)") in details
    assert details.count("against the dense bf16 peak") == 2  # not for the older summary
    failed = summary("resnet50_compile", 3533.0, 10403, 7.1, 0.0, status="failed")
    failed["throughput"].update(mfu=0.087, mfu_bf16_peak=0.087)
    write_job(root, 3, failed, config("bf16_mixed"))
    assert comparison_rows(load_jobs(root))[3].mfu_bf16_peak is None  # a failed job shows no numbers


def test_without_any_mfu_the_table_has_no_mfu_columns(sweep: Path):
    jobs = load_jobs(sweep)
    markdown = to_markdown(comparison_rows(jobs), jobs)
    assert "MFU" not in markdown
