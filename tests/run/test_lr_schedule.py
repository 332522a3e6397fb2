"""scheduler=one_cycle and optimizer.lr=find in real runs on digits.

A one-cycle run's lr at every step is torch's OneCycleLR over the steps Lightning counted, peaking at
the derived lr. A run with optimizer.lr=find writes the range test's record and plot, trains with
the found lr moved to the global batch by the lr rule, and trains exactly as a run given that lr:
the test leaves the network's initial weights, the random generators and the data order alone.
(CPU: the weights are compared bit for bit.)
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch

from tests.helpers import ON_CPU, run_in_process

pytestmark = pytest.mark.run

SHORT = [*ON_CPU, "progress=off", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
         "trainer.num_sanity_val_steps=0", "trainer.log_every_n_steps=1"]


def logged_lrs(run_dir: Path, group: str = "train/lr/pg1") -> list[float]:
    rows = list(csv.DictReader((run_dir / "csv" / "metrics.csv").open()))
    return [float(r[group]) for r in sorted(rows, key=lambda r: int(r["step"])) if r.get(group)]


def test_one_cycle_sets_torch_one_cycle_lr_at_every_step(tmp_path):
    # SGD with Nesterov momentum, 2 epochs of 6 steps: the schedule spans the run's 12 optimizer steps.
    run_dir = tmp_path / "run"
    summary = run_in_process([*SHORT, "optimizer=sgd", "scheduler=one_cycle", "trainer.max_epochs=2",
                              "trainer.limit_train_batches=6", "checkpointing=off"], run_dir)
    lr = summary["derived"]["optimizer.lr"]["value"]
    # The plan names the shape; the length is Lightning's count, made as fit starts (one count only).
    assert summary["derived"]["scheduler"]["how"] == (
        f"lr {lr / 25:.3g} -> peak {lr:.3g} at 25% of the run's steps -> {lr / 25 / 1e4:.3g} (cos); "
        "momentum 0.95 -> 0.85 -> 0.95 (in place of 0.9)")
    assert summary["scheduler"] == {"name": "one_cycle", "optimizer_steps": 12, "how": (
        f"lr {lr / 25:.3g} -> peak {lr:.3g} at 25% of 12 steps -> {lr / 25 / 1e4:.3g} (cos); "
        "momentum 0.95 -> 0.85 -> 0.95 (in place of 0.9)")}
    reference = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr, momentum=0.9, nesterov=True)
    schedule = torch.optim.lr_scheduler.OneCycleLR(reference, max_lr=lr, total_steps=12, pct_start=0.25)
    expected = []
    for _ in range(12):
        expected.append(reference.param_groups[0]["lr"])
        reference.step()
        schedule.step()
    for group in ("train/lr/pg1", "train/lr/pg2"):  # weights with decay, norm weights and biases without
        assert logged_lrs(run_dir, group) == pytest.approx(expected, rel=1e-9)
    assert summary["steps"] == 12


def test_lr_find_trains_with_the_found_lr_moved_to_the_global_batch(tmp_path):
    # Accumulating 2 batches of 64: the test ran at 64, the run's global batch is 128 (AdamW: sqrt rule).
    run_dir = tmp_path / "run"
    summary = run_in_process([*SHORT, "optimizer.lr=find", "optimizer.find_steps=20", "trainer.max_epochs=1",
                              "trainer.limit_train_batches=4", "trainer.accumulate_grad_batches=2",
                              "scheduler=constant", "checkpointing=off"], run_dir)
    record = json.loads((run_dir / "lr_find.json").read_text())
    assert (run_dir / "lr_find.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert record["batch_size"] == 64 and record["steps"] == record["steps_run"] == 20
    assert record["lr"] == record["lrs"][record["suggestion_index"]]
    assert record["loss_at_suggestion"] == record["losses"][record["suggestion_index"]]
    assert 1e-6 <= record["lr"] <= 1.0
    derived = summary["derived"]["optimizer.lr"]
    lr = record["lr"] * math.sqrt(128 / 64)
    assert derived["value"] == pytest.approx(lr, abs=1e-10)  # the plan's values are rounded to 10 places
    assert derived["how"].startswith(f"found by Lightning's lr range test (steepest descent of the smoothed loss at "
                                     f"{record['lr']:.3g}, 20 steps 1e-06..1; lr_find.png) at batch 64 -> ")
    assert "(sqrt rule, x1.414); the sqrt rule from optimizer=adamw's 0.004 at batch 256 would give 0.00283" in \
        derived["how"]
    logged = logged_lrs(run_dir)  # the param groups' lr as each batch starts (a constant schedule)
    assert logged and logged == pytest.approx([lr] * len(logged), rel=1e-12)
    assert summary["hyperparameters"]["lr"] == pytest.approx(lr, rel=1e-12)


def test_lr_find_trains_exactly_as_a_run_given_the_found_lr(tmp_path):
    # The default run (dropout, on-device random shifts: both draw from the global torch RNG) for 6
    # steps; one with optimizer.lr=find, one given its answer. lr_scaling=none: the given lr as it is.
    common = [*SHORT, "trainer.max_epochs=1", "trainer.limit_train_batches=6", "optimizer.lr_scaling=none"]
    found = run_in_process([*common, "optimizer.lr=find", "optimizer.find_steps=20"], tmp_path / "found")
    lr = json.loads((tmp_path / "found" / "lr_find.json").read_text())["lr"]
    given = run_in_process([*common, f"optimizer.lr={lr!r}"], tmp_path / "given")
    assert found["hyperparameters"]["lr"] == given["hyperparameters"]["lr"] == lr

    def weights(run: str) -> dict[str, torch.Tensor]:
        return torch.load(tmp_path / run / "checkpoints" / "last.ckpt", map_location="cpu",
                          weights_only=True)["state_dict"]

    expected, got = weights("given"), weights("found")
    assert expected.keys() == got.keys()
    assert [k for k in expected if not torch.equal(expected[k], got[k])] == []
    assert found["metrics"]["train"] == given["metrics"]["train"]
