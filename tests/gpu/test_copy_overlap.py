"""The batch copy on a side stream on CUDA (trainer/data/transfer.py): the copied batch equals the
host batch, and a few training steps with data.copy_overlap=true end on the same weights as with
false (pinned digits batches, deterministic kernels), the overlap having copied every training batch."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.common import BATCH_COPY, GPU, checkpoint, counting_copies, digits_copy_run, wrap
from tests.helpers import run_in_process
from trainer.data.transfer import SideStreamCopy

pytestmark = [*GPU]

STEPS = 6


def test_the_side_stream_copy_equals_the_host_batch():
    host = {"images": torch.randint(0, 255, (64, 3, 32, 32), dtype=torch.uint8).pin_memory(),
            "labels": (torch.arange(64).pin_memory(), torch.randn(64, 7).pin_memory())}
    copier = SideStreamCopy()
    device = torch.device("cuda", torch.cuda.current_device())
    moved = copier(host, device)
    # Read on the compute stream, which waits for the copy: no synchronize needed for correctness.
    assert torch.equal(moved["images"].cpu(), host["images"])
    assert torch.equal(moved["labels"][0].cpu(), host["labels"][0])
    assert torch.equal(moved["labels"][1].cpu(), host["labels"][1])
    assert moved["images"].device == device and copier.overlapped == 1
    pageable = torch.ones(3)  # not pinned: Lightning's move
    assert torch.equal(copier(pageable, device).cpu(), pageable) and copier.plain == 1


def run_digits(tmp_path, overlap: bool) -> tuple[dict, dict]:
    run_dir = tmp_path / f"overlap_{overlap}"
    summary = run_in_process(digits_copy_run(STEPS, overlap), run_dir)
    assert summary is not None and summary["status"] == "completed", summary
    return summary, checkpoint(run_dir / "checkpoints" / "last.ckpt")["state_dict"]


def test_training_with_the_overlap_matches_training_without(tmp_path, monkeypatch):
    calls: list[str] = []
    wrap(monkeypatch, BATCH_COPY, counting_copies(calls))
    with_overlap, weights_with = run_digits(tmp_path, True)
    assert with_overlap["derived"]["data.copy_overlap"]["value"] is True
    assert calls.count("overlapped") >= STEPS and "plain" not in calls
    calls.clear()
    without, weights_without = run_digits(tmp_path, False)
    assert without["derived"]["data.copy_overlap"]["value"] is False and calls == []
    assert weights_with.keys() == weights_without.keys()
    for key in weights_with:
        assert torch.equal(weights_with[key], weights_without[key]), key
    assert with_overlap["loss"]["first"] == pytest.approx(without["loss"]["first"])
