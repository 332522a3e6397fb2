"""The time-to-accuracy race's rule on made-up epoch lines and rounds (benchmarks/time_to_accuracy.py,
nothing trained): a side's time is its first evaluation at or above a target fixed before the runs;
the ratio's median, range and seeded bootstrap interval; a miss is counted, never dropped; a job
beside other load is flagged and left out; the report is written again from the JSON alone; and the
reference's schedule flags follow torchvision's reference script."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import benchmark

tta = benchmark("time_to_accuracy")
reference = benchmark("reference_classification")

INF = math.inf


def epoch_lines(*accs: float, seconds_each: float = 6.0) -> list[dict]:
    return [{"epoch": n, "train_s": round(n * seconds_each, 2), "val_acc": acc} for n, acc in enumerate(accs, 1)]


def job(time_s: float | None, *, train_s: float = 50.0, loads: tuple[float, float] = (1.0, 2.0),
        limit: float = 2.5, best: float = 0.8) -> dict:
    """One side's record in a round, as race() writes it; time_s None: it missed the target."""
    return {"command": ["python", "x.py", "--seed", "0"], "started_utc": "2026-12-04T10:00:00+00:00",
            "duration_s": train_s + 6.0, "load_start": loads[0], "load_end": loads[1], "settled_s": 0.0,
            "beside_other_load": tta.beside_other_load(*loads, limit), "reached": time_s is not None,
            "time_s": time_s, "epoch": 4 if time_s is not None else None,
            "val_acc_at_target": 0.86 if time_s is not None else None, "best_val_acc": best if time_s is None else 0.95,
            "final_val_acc": 0.9 if time_s is not None else best, "train_s": train_s, "epochs_trained": 8}


def record(pairs: list[tuple[dict, dict]]) -> dict:
    settings = {"command_line": "python benchmarks/time_to_accuracy.py", "target": 0.85, "epochs": 8,
                "rounds": len(pairs), "quick": False, "reference_args": tta.DEFAULT_REFERENCE_ARGS,
                "ours_overrides": [], "workers": 1, "cpus": 2, "cpu": "a test CPU", "load_limit": 2.5,
                "settle_s": 20.0, "bootstrap_seed": 0, "started_utc": "2026-12-04T10:00:00+00:00"}
    rounds = [{"round": i + 1, "seed": i, "reference": ref, "ours": ours} for i, (ref, ours) in enumerate(pairs)]
    return {"settings": settings, "folder": {"train": 1438, "val": 359}, "rounds": rounds}


def five_rounds() -> dict:
    """Ratios 0.40, 0.50, 0.60, 0.55, 0.45 (median 0.50)."""
    return record([(job(50.0), job(20.0)), (job(40.0), job(20.0)), (job(30.0), job(18.0)),
                   (job(40.0), job(22.0)), (job(40.0), job(18.0))])


# --- the rule -------------------------------------------------------------------------------------

def test_the_time_is_the_first_evaluation_at_or_above_the_target():
    lines = epoch_lines(0.5, 0.84, 0.86, 0.80, 0.91)
    assert tta.first_at_target(lines, 0.85) == {"time_s": 18.0, "epoch": 3, "val_acc": 0.86}
    # at the target counts; a later, higher epoch does not move the time
    assert tta.first_at_target(lines, 0.84)["epoch"] == 2
    assert tta.first_at_target(lines, 0.95) is None


def test_the_reference_result_reads_its_epoch_lines_against_the_fixed_target():
    lines = epoch_lines(0.3, 0.87, 0.83)
    final = {"final": True, "epochs": 3, "train_s": 18.0, "val_acc": 0.83, "lr": 0.025}
    stdout = "a warning line\n" + "\n".join(json.dumps(x) for x in [*lines, final]) + "\n"
    result = tta.reference_result(stdout, 0.85)
    assert (result["reached"], result["time_s"], result["epoch"]) == (True, 12.0, 2)
    # the time is the first at the target, not the end of the budget, and not its final accuracy
    assert result["train_s"] == 18.0 and result["final_val_acc"] == 0.83 and result["best_val_acc"] == 0.87
    missed = tta.reference_result(stdout, 0.9)
    assert (missed["reached"], missed["time_s"], missed["epoch"]) == (False, None, None)


def test_ours_is_read_from_summary_json_with_epochs_counted_from_one():
    summary = {"target": {"metric": "val/acc", "value": 0.85, "mode": "max", "reached": True, "best": 0.95,
                          "wall_s": 16.7, "steps": 66, "samples": 4224, "epoch": 2, "value_reached": 0.9025},
               "metrics": {"val": {"acc": 0.95}}, "fit_time_s": 44.0, "epochs": 8}
    result = tta.ours_result(summary)
    assert (result["reached"], result["time_s"], result["epoch"], result["train_s"]) == (True, 16.7, 3, 44.0)
    summary["target"] = {"metric": "val/acc", "value": 0.99, "mode": "max", "reached": False, "best": 0.95}
    assert (tta.ours_result(summary)["reached"], tta.ours_result(summary)["time_s"]) == (False, None)


def test_both_commands_carry_the_same_budget_and_seed_and_the_reference_its_own_flags(tmp_path, capsys):
    ref = tta.reference_command(tmp_path, 8, 1, 3, tta.DEFAULT_REFERENCE_ARGS)
    assert ref[ref.index("--epochs") + 1] == "8" and ref[ref.index("--seed") + 1] == "3"
    assert ref[-10:] == ["--lr-scheduler", "cosineannealinglr", "--lr-warmup-epochs", "1", "--lr-warmup-method",
                         "linear", "--lr-warmup-decay", "0.01", "--label-smoothing", "0.1"]
    ours = tta.ours_command(tmp_path, 0.85, 8, tmp_path / "run", 3, ["data.num_workers=1"])
    assert {"trainer.max_epochs=8", "target.value=0.85", "target.metric=val/acc", "seed=3"} <= set(ours)
    assert ours[-1] == "data.num_workers=1"
    # the defaults the report is about: 5 rounds, 8 epochs, target 0.85; --quick is CI's one tiny round
    args = tta.parse_args([])
    assert (args.rounds, args.epochs, args.target, args.out) == (5, 8, 0.85, tta.RESULTS)
    quick = tta.parse_args(["--quick"])
    assert (quick.rounds, quick.epochs, quick.out) == (1, 1, tta.QUICK_OUT)
    assert args.reference_args == tta.DEFAULT_REFERENCE_ARGS
    assert "--lr-warmup-epochs" not in quick.reference_args  # one epoch: no room for a warmup before the cosine
    assert tta.parse_args(["--reference-args=", "--target", "0.9"]).reference_args == ""
    with pytest.raises(SystemExit):
        tta.parse_args(["--target", "85"])
    # flags the reference would refuse stop the race before it starts
    with pytest.raises(SystemExit):
        tta.parse_args(["--epochs", "1"])
    assert "refused by reference_classification.py" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tta.parse_args(["--reference-args=--lr-scheduler exponentiallr"])


# --- the arithmetic -------------------------------------------------------------------------------

def test_the_ratio_per_round_its_median_range_and_a_seeded_interval():
    data = five_rounds()
    figures = tta.summarize(data)
    ratio = figures["ratio"]
    assert [round(ratio["per_round"][str(n)], 4) for n in range(1, 6)] == [0.4, 0.5, 0.6, 0.55, 0.45]
    assert ratio["median"] == pytest.approx(0.5)
    assert ratio["range"] == pytest.approx((0.4, 0.6))
    low, high = ratio["interval"]
    assert 0.4 <= low <= 0.5 <= high <= 0.6 and low < high
    assert tta.summarize(data)["ratio"]["interval"] == ratio["interval"]  # seeded: the same every time
    assert figures["reference"]["median_s"] == 40.0 and figures["reference"]["range_s"] == (30.0, 50.0)
    assert figures["ours"]["median_s"] == 20.0 and figures["ours"]["range_s"] == (18.0, 22.0)
    # fewer than 5 rounds: no interval
    assert tta.summarize(record([(job(50.0), job(20.0))] * 4))["ratio"]["interval"] is None


def test_the_bootstrap_interval_of_the_median():
    assert tta.bootstrap_interval([0.5] * 6) == (0.5, 0.5)
    values = [0.40, 0.50, 0.60, 0.55, 0.45, 0.52, 0.48]
    wide, narrow = tta.bootstrap_interval(values, 0.95), tta.bootstrap_interval(values, 0.5)
    assert wide[0] <= narrow[0] <= 0.50 <= narrow[1] <= wide[1]
    # an infinite ratio (ours missed) stays infinite, it does not turn into NaN
    assert tta.bootstrap_interval([0.4, 0.5, INF, INF, INF])[1] == INF


def test_a_round_where_one_side_misses_is_counted_not_dropped():
    data = record([(job(50.0), job(20.0)), (job(40.0), job(None, best=0.812)), (job(None, train_s=48.0), job(24.0)),
                   (job(None), job(None)), (job(40.0), job(22.0))])
    figures = tta.summarize(data)
    assert figures["ours"]["missed_rounds"] == [2, 4] and figures["reference"]["missed_rounds"] == [3, 4]
    per_round = figures["ratio"]["per_round"]
    assert per_round["2"] == INF                      # ours missed: infinitely slower
    assert per_round["3"] == pytest.approx(24 / 48)   # the reference missed: at most ours / its whole training
    assert "4" not in per_round                       # neither reached: no ratio
    assert figures["ratio"]["rounds_counted"] == 4
    assert figures["ratio"]["median"] == pytest.approx((0.5 + 0.55) / 2)  # 0.4, 0.5, 0.55, inf
    assert figures["ours"]["median_s"] == 24.0 and figures["ours"]["range_s"] == (20.0, INF)  # 20, 22, 24, inf, inf
    text = tta.report(data)
    assert "Missed the target: reference in rounds 3, 4; ours in rounds 2, 4." in text
    assert "| 2 | 1 | 40.0 (epoch 4) | 0.900 | missed (best 0.812) | 0.812 | inf (ours missed) |" in text
    assert "<= 0.50x (reference missed)" in text and "| neither reached |" in text
    assert "| `+recipe=small_images` | 3 of 5 | 24.0 | 20.0-not reached |" in text


def test_mostly_missing_makes_the_median_not_reached():
    data = record([(job(50.0), job(None)), (job(40.0), job(None)), (job(40.0), job(20.0))])
    figures = tta.summarize(data)
    assert figures["ours"]["median_s"] == INF and figures["ratio"]["median"] == INF
    assert "**Ratio (ours / reference): median inf (ours missed)**" in tta.report(data)


# --- the load flag --------------------------------------------------------------------------------

def test_a_job_beside_other_load_is_flagged_and_left_out():
    assert not tta.beside_other_load(2.0, 2.5, 2.5)
    assert tta.beside_other_load(2.6, 1.0, 2.5) and tta.beside_other_load(1.0, 2.51, 2.5)
    data = five_rounds()
    data["rounds"][1]["ours"] = job(10.0, loads=(3.4, 3.9))  # a much faster time, beside other load
    figures = tta.summarize(data)
    assert figures["ours"]["flagged_rounds"] == [2] and figures["ours"]["rounds_counted"] == 4
    assert figures["ours"]["range_s"] == (18.0, 22.0)
    assert "2" not in figures["ratio"]["per_round"] and figures["ratio"]["rounds_counted"] == 4
    assert figures["ratio"]["interval"] is None  # 4 rounds counted
    text = tta.report(data)
    assert "left out of the time figures" in text and "reference in no round; ours in round 2." in text
    assert "| left out (load) |" in text
    assert "10.0 (epoch 4) [beside other load]" in text and "3.40-3.90" in text


def test_waiting_for_the_load_to_settle():
    loads = iter([3.0, 2.8, 2.4, 2.0])
    slept: list[float] = []
    waited = tta.wait_for_quiet(2.5, 20.0, loadavg=lambda: (next(loads), 0.0, 0.0), sleep=slept.append)
    assert waited == 4.0 and slept == [2.0, 2.0]
    assert tta.wait_for_quiet(2.5, 3.0, loadavg=lambda: (9.0, 0.0, 0.0), sleep=lambda s: None) == 4.0  # gives up
    assert tta.wait_for_quiet(2.5, 0.0, loadavg=lambda: (9.0, 0.0, 0.0), sleep=lambda s: None) == 0.0


# --- the report from the JSON ---------------------------------------------------------------------

def test_the_report_is_written_again_from_the_json_alone(tmp_path, monkeypatch):
    data = five_rounds()
    data["rounds"][2]["ours"] = job(None, best=0.84)  # an infinite ratio must survive the JSON
    data["summary"] = tta.summarize(data)
    out = tmp_path / "race.md"
    tta.write_record(data, out.with_suffix(".json"))
    saved = json.loads(out.with_suffix(".json").read_text())  # standard JSON: no Infinity token
    assert saved["summary"]["ratio"]["per_round"]["3"] == "inf"
    monkeypatch.setattr(sys, "argv", ["time_to_accuracy.py"])
    tta.main(["--report-only", "--out", str(out)])
    text = out.read_text()
    assert text == tta.report(data)
    assert "target, val accuracy >= 0.85, was fixed before the runs" in text
    assert "95% percentile-bootstrap interval of the median" in text and "seed 0" in text
    assert tta.DEFAULT_REFERENCE_ARGS in text
    assert "python x.py --seed 0" in text  # round 1's commands
    # an older record (a bare list of rounds) is refused with one line, and nothing is written
    old = tmp_path / "old.md"
    old.with_suffix(".json").write_text("[]")
    with pytest.raises(SystemExit, match="not this benchmark's record"):
        tta.main(["--report-only", "--out", str(old)])
    assert not old.exists()
    with pytest.raises(SystemExit, match="does not exist"):
        tta.main(["--report-only", "--out", str(tmp_path / "none.md")])


# --- the reference's schedule flags ---------------------------------------------------------------

def lrs(argv: list[str], epochs: int) -> list[float]:
    args = reference.parse_args(["root", "--epochs", str(epochs), *argv])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = reference.build_schedule(optimizer, args)
    seen = []
    for _ in range(epochs):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return seen


def test_the_reference_schedule_follows_torchvisions_flags():
    # its default: StepLR every 30 epochs, a constant lr over a short budget
    assert lrs([], 8) == [1.0] * 8
    # cosine over the epochs after a linear warmup of one epoch from 1% (the race's default)
    cosine = lrs(tta.DEFAULT_REFERENCE_ARGS.split(), 8)
    expected = [0.01] + [0.5 * (1 + math.cos(math.pi * k / 7)) for k in range(7)]
    assert cosine == pytest.approx(expected)
    # a constant warmup holds decay x lr for its epochs; a linear one climbs to lr
    assert lrs(["--lr-warmup-epochs", "2"], 4) == pytest.approx([0.01, 0.01, 1.0, 1.0])
    assert lrs(["--lr-warmup-epochs", "2", "--lr-warmup-method", "linear", "--lr-warmup-decay", "0.1"],
               3) == pytest.approx([0.1, 0.55, 1.0])
    assert lrs(["--lr-scheduler", "CosineAnnealingLR"], 4) == pytest.approx(
        [0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)])


def test_the_reference_refuses_a_warmup_that_leaves_no_cosine(capsys):
    with pytest.raises(SystemExit):
        reference.parse_args(["root", "--epochs", "2", "--lr-scheduler", "cosineannealinglr",
                              "--lr-warmup-epochs", "2"])
    assert "--lr-warmup-epochs 2: the cosine needs epochs after the warmup" in capsys.readouterr().err
    assert reference.parse_args(["root", "--label-smoothing", "0.1"]).label_smoothing == 0.1


def test_the_folder_for_quick_keeps_a_few_of_each_digit(tmp_path):
    counts = tta.write_digits_folder(tmp_path / "digits", size=8, per_class=5)
    assert counts == {"train": 40, "val": 10}
    assert all(len(list(folder.glob("*.jpg"))) == 1 for folder in (tmp_path / "digits" / "val").iterdir())
    assert Path(tmp_path / "digits" / "train" / "digit_9").is_dir()
