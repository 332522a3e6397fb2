"""Seeds as a dimension of a sweep, on hand-written sweep folders: jobs that differ only in `seed`
are one setting, with the mean, standard deviation and n of each number; each setting's difference
from the first has Welch's 95% interval and is called within or beyond the noise; a setting's
name is its recipe and the overrides that vary between settings; a sweep without repeats keeps
its per-job report alone."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from trainer.measure.comparison import load_jobs, settings_of, comparison_rows, write_comparison
from trainer.measure.seed_groups import Spread, difference, setting_of

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_welch_interval_by_hand():
    # means 2 and 5, variances 1 and 1, n 3 and 3: se = sqrt(2/3), df = 4, t(0.975, 4) = 2.7764
    found = difference([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    half = 2.7764451 * math.sqrt(2 / 3)
    assert found.value == pytest.approx(3.0)
    assert (found.low, found.high) == (pytest.approx(3.0 - half, abs=1e-5), pytest.approx(3.0 + half, abs=1e-5))
    assert found.within_noise is False and "beyond the noise" in found.text("{:.2f}")
    assert found.text("{:.2f}").startswith("+3.00 [+0.73, +5.27]")


def test_a_difference_the_seeds_alone_could_give_is_within_the_noise():
    found = difference([0.90, 0.95, 1.00], [0.92, 0.97, 0.96])
    assert found.within_noise is True and found.text("{:.4f}").endswith("within the noise")
    one_seed = difference([0.9], [0.95])
    assert one_seed.within_noise is None and "fewer than 2 seeds" in one_seed.text("{:.4f}")
    assert difference([], [0.9]) is None


def test_spread_is_mean_sd_and_n_of_the_values_there_are():
    spread = Spread.of([1.0, None, 3.0, float("nan")])
    assert (spread.n, spread.mean, spread.sd) == (2, 2.0, pytest.approx(math.sqrt(2)))
    assert spread.text("{:.1f}") == "2.0 ± 1.4 (n=2)"
    assert Spread.of([5.0]).text("{:.1f}") == "5.0 (n=1)" and Spread.of([]).text("{:.1f}") == "-"


def test_the_seed_is_what_sets_jobs_apart_and_nothing_else():
    assert setting_of(["seed=1", "optimizer.lr=0.1", "+seed=3"]) == ("optimizer.lr=0.1",)


def write_job(sweep: Path, number: int, overrides: list[str], val_acc: float, rate: float, status: str = "completed"):
    folder = sweep / str(number)
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({
        "status": status, "overrides": overrides, "choices": {"data": "digits"},
        "throughput": {"samples_per_s": rate}, "peak_memory": {"bytes": 2**20},
        "loss": {"final": 0.5, "spread": 0.01}, "metrics": {"val": {"acc": val_acc}, "test": {"acc": val_acc}}}))


@pytest.fixture
def seeded_sweep(tmp_path: Path) -> Path:
    """Two settings (lr 0.001 and 0.1) of three seeds each; the second is far worse, beyond the noise."""
    sweep = tmp_path / "sweep"
    number = 0
    for lr, accs in (("0.001", (0.97, 0.98, 0.975)), ("0.1", (0.50, 0.55, 0.52))):
        for seed, acc in zip((1, 2, 3), accs):
            write_job(sweep, number, [f"seed={seed}", f"optimizer.lr={lr}", "trainer.max_epochs=2"], acc, 1000 + number)
            number += 1
    return sweep


def test_jobs_that_differ_only_in_seed_are_one_setting(seeded_sweep: Path):
    jobs = load_jobs(seeded_sweep)
    settings = settings_of(comparison_rows(jobs), jobs)
    assert [s.name for s in settings] == ["optimizer.lr=0.001", "optimizer.lr=0.1"]
    assert [s.seeds for s in settings] == [("1", "2", "3")] * 2
    first = settings[0].spreads["val_acc"]
    assert first.n == 3 and first.mean == pytest.approx(0.975) and first.sd == pytest.approx(0.005)


def test_the_report_opens_with_the_settings_and_their_differences(seeded_sweep: Path):
    markdown_path, chart_path, markdown = write_comparison(seeded_sweep)
    over_seeds = markdown.split("## Over seeds", 1)[1].split("## Every job", 1)[0]
    assert "| optimizer.lr=0.001 | 1, 2, 3 | 3 of 3 | 0.9750 ± 0.0050 (n=3) |" in over_seeds
    row = next(line for line in over_seeds.splitlines() if line.startswith("| optimizer.lr=0.1 | -0."))
    assert "beyond the noise" in row  # -0.45 in val accuracy over three seeds each
    assert chart_path.read_bytes().startswith(PNG_MAGIC)
    every_job = markdown.split("## Every job", 1)[1].split("## Details", 1)[0]
    assert every_job.count("| seed=") == 6  # and each job keeps its own row


def test_a_failed_seed_is_counted_not_averaged(tmp_path: Path):
    sweep = tmp_path / "sweep"
    write_job(sweep, 0, ["seed=1", "trainer.max_epochs=2", "run.root=/x"], 0.9, 1000)
    write_job(sweep, 1, ["seed=2", "trainer.max_epochs=2", "run.root=/x"], 0.0, 0, status="failed")
    markdown = write_comparison(sweep)[2]
    # named by what changes the result (run.root does not)
    assert "| trainer.max_epochs=2 | 1, 2 | 1 of 2 | 0.9000 (n=1) |" in markdown


def test_a_sweep_without_repeats_keeps_its_per_job_report(tmp_path: Path):
    sweep = tmp_path / "sweep"
    write_job(sweep, 0, ["optimizer.lr=0.001"], 0.9, 1000)
    write_job(sweep, 1, ["optimizer.lr=0.01"], 0.8, 1000)
    markdown = write_comparison(sweep)[2]
    assert "## Over seeds" not in markdown and "| optimizer.lr=0.001 |" in markdown


def test_settings_without_any_spread_get_no_interval_rather_than_a_zero_width_one():
    # Three seeds at exactly the same quantized accuracy in both settings: nothing is known about
    # the noise, so nothing is called beyond it.
    found = difference([0.9102] * 3, [0.9120] * 3)
    assert found.within_noise is None
    assert "no spread" in found.text("{:.4f}")
