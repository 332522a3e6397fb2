"""benchmarks/time_to_accuracy.py and the reference recipe it races, for real: the folder is a
stratified 80/20 split of all 1,797 digits as JPEGs; the reference script trains with the race's
flags and reports one JSON line per epoch and its totals; `--quick` (CI's mode) races both sides
once and records every job. The rule and the report's arithmetic on made-up rounds:
tests/unit/test_time_to_accuracy.py."""

from __future__ import annotations

import json
import sys
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


def test_the_reference_recipe_trains_and_reports_each_epoch(tmp_path, capsys):
    """In this process (the benchmark starts it as a script: `reference_result` reads these lines)."""
    import reference_classification

    root = tmp_path / "digits"
    tta.write_digits_folder(root, size=16, per_class=30)
    reference_classification.main([str(root), "--epochs", "2", "--crop", "16", "--workers", "0",
                                   *tta.DEFAULT_REFERENCE_ARGS.split()])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [line["epoch"] for line in lines[:-1]] == [1, 2]
    # one warmup epoch from 1% of lr 0.1 x 64/256, then the cosine's first epoch at the full lr
    assert [line["lr"] for line in lines[:-1]] == pytest.approx([0.00025, 0.025])
    final = lines[-1]
    assert final["final"] and final["epochs"] == 2 and final["lr"] == pytest.approx(0.025)
    assert final["lr_scheduler"] == "cosineannealinglr" and final["label_smoothing"] == 0.1
    assert 0.0 <= final["val_acc"] <= 1.0
    result = tta.reference_result("\n".join(json.dumps(line) for line in lines), 0.0)
    assert (result["reached"], result["epoch"], result["time_s"]) == (True, 1, lines[0]["train_s"])


def test_quick_races_both_sides_once_and_records_every_job(tmp_path):
    out = tmp_path / "quick.md"
    tta.main(["--quick", "--out", str(out)])
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["folder"] == {"train": 160, "val": 40}
    assert data["settings"]["target"] == 0.85 and data["settings"]["epochs"] == 1
    (only,) = data["rounds"]
    assert only["seed"] == 0
    for side in ("reference", "ours"):
        job = only[side]
        assert job["epochs_trained"] == 1 and 0.0 <= job["final_val_acc"] <= 1.0
        assert job["duration_s"] > 0 and job["load_start"] >= 0 and job["started_utc"].endswith("+00:00")
        assert job["beside_other_load"] == (max(job["load_start"], job["load_end"]) > data["settings"]["load_limit"])
    assert only["reference"]["command"][-4:] == ["--lr-scheduler", "cosineannealinglr", "--label-smoothing", "0.1"]
    assert {"trainer.max_epochs=1", "target.value=0.85", "seed=0"} <= set(only["ours"]["command"])
    assert out.read_text() == tta.report(tta.load_record(out.with_suffix(".json")))
    assert not out.with_suffix(".partial.json").exists()
