"""benchmarks/time_to_accuracy.py and the reference recipe it compares with: the folder is a
stratified 80/20 split of all 1,797 digits as JPEGs; the reference script trains and reports one
JSON line per epoch and its totals; the table reports medians, the ratio to the reference and the
epochs trained (summary.json's 0-based epoch plus one)."""

from __future__ import annotations

import json
import sys
from argparse import Namespace
from pathlib import Path

import pytest
from PIL import Image

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import time_to_accuracy as tta  # noqa: E402

pytestmark = pytest.mark.run


def test_the_folder_is_a_stratified_split_of_every_digit(tmp_path):
    counts = tta.write_digits_folder(tmp_path / "digits", size=16)
    assert counts == {"train": 1438, "val": 359}
    for split, low, high in (("train", 139, 147), ("val", 35, 37)):
        classes = sorted((tmp_path / "digits" / split).iterdir())
        assert [c.name for c in classes] == [f"digit_{i}" for i in range(10)]
        assert all(low <= len(list(c.glob("*.jpg"))) <= high for c in classes)
    sample = next((tmp_path / "digits" / "val" / "digit_3").glob("*.jpg"))
    assert Image.open(sample).size == (16, 16)


def test_the_reference_recipe_trains_and_reports_each_epoch(tmp_path, monkeypatch, capsys):
    """In this process (the benchmark starts it as a script: `run_reference` reads these lines)."""
    import reference_classification

    root = tmp_path / "digits"
    tta.write_digits_folder(root, size=16)
    monkeypatch.setattr(sys, "argv", ["reference_classification.py", str(root), "--epochs", "1", "--crop", "16",
                                      "--workers", "0"])
    reference_classification.main()
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [line["epoch"] for line in lines[:-1]] == [1]
    final = lines[-1]
    assert final["final"] and final["epochs"] == 1 and final["lr"] == pytest.approx(0.025)
    assert 0.0 <= final["val_acc"] <= 1.0


def one_round(ref_s: float, ours_s: float | None) -> dict:
    target = ({"reached": True, "wall_s": ours_s, "epoch": 2, "value_reached": 0.81, "best": 0.9} if ours_s
              else {"reached": False, "wall_s": None, "epoch": None, "value_reached": None, "best": 0.79})
    return {"reference": {"final": {"train_s": ref_s, "val_acc": 0.8}, "process_s": ref_s + 5},
            "ours": {"target": target, "fit_s": 30.0, "val_acc": 0.9, "epochs": 5, "process_s": 40.0}}


def test_the_table_gives_the_median_ratio_and_the_epochs_trained():
    text = tta.table([one_round(50, 20), one_round(40, 20), one_round(60, 30)], Namespace(rounds=3, epochs=8),
                     {"train": 1438, "val": 359})
    assert "**Ratio (ours / reference): 0.50x** (median of the rounds that reached it; rounds: 0.40, 0.50, 0.50)" in text
    assert "| 1 | 50.0 | 0.800 | 20.0 (3) | 30.0, 5 |" in text


def test_a_round_that_never_reached_the_reference_is_said():
    text = tta.table([one_round(50, 20), one_round(40, None)], Namespace(rounds=2, epochs=8),
                     {"train": 1438, "val": 359})
    assert "0.40x** (median of the rounds that reached it; rounds: 0.40); 1 of 2 rounds never reached" in text
    assert "| 2 | 40.0 | 0.800 | not reached (best 0.790) | 30.0, 5 |" in text
