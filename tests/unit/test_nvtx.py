"""NVTX ranges of profile=true (trainer/callbacks/nvtx.py): inert on a CPU run; where it marks (a
stand-in NVTX here), a real Lightning fit's steps go data -> forward -> backward -> optimizer, one
range open at a time, and every range pushed is popped, also when the fit stops on an exception."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from trainer.callbacks.nvtx import NvtxRanges, nvtx_available


class RecordingNvtx:
    """What NvtxRanges uses of torch.cuda.nvtx, recording the calls and the open depth."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.depth = self.deepest = 0

    def range_push(self, name: str) -> None:
        self.calls.append(name)
        self.depth += 1
        self.deepest = max(self.deepest, self.depth)

    def range_pop(self) -> None:
        assert self.depth > 0, "popped a range that was never pushed"
        self.calls.append("pop")
        self.depth -= 1

    def pushed(self) -> list[str]:
        return [c for c in self.calls if c != "pop"]


def fit(model: L.LightningModule, ranges: NvtxRanges, steps: int) -> None:
    trainer = L.Trainer(accelerator="cpu", max_steps=steps, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[ranges])
    trainer.fit(model)


def test_on_a_cpu_run_it_marks_nothing(monkeypatch):
    recorder = RecordingNvtx()
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", recorder.range_push)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", recorder.range_pop)
    ranges = NvtxRanges(torch.device("cpu"))
    assert not ranges.enabled and ranges.status == "NVTX ranges: off (no CUDA)"
    fit(BoringModel(), ranges, steps=2)
    assert recorder.calls == [] and ranges.depth == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer where there is no CUDA")
def test_without_cuda_nvtx_is_off_whatever_the_device():
    assert nvtx_available() == (False, "NVTX ranges: off (no CUDA)")
    assert nvtx_available(torch.device("cuda", 0)) == (False, "NVTX ranges: off (no CUDA)")


def test_each_step_goes_through_its_phases_one_range_at_a_time():
    recorder = RecordingNvtx()
    ranges = NvtxRanges(enabled=True, nvtx=recorder)
    fit(BoringModel(), ranges, steps=3)
    assert recorder.pushed() == ["data", *["forward", "backward", "optimizer", "data"] * 3]
    assert recorder.depth == 0 and ranges.depth == 0 and recorder.deepest == 1
    assert recorder.calls.count("pop") == len(recorder.pushed())


class FailsAtStep(BoringModel):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            raise RuntimeError("a step that fails")
        return super().training_step(batch, batch_idx)


def test_the_ranges_stay_balanced_when_the_fit_stops_on_an_exception():
    recorder = RecordingNvtx()
    ranges = NvtxRanges(enabled=True, nvtx=recorder)
    with pytest.raises(RuntimeError, match="a step that fails"):
        fit(FailsAtStep(), ranges, steps=5)
    assert recorder.pushed()[-1] == "forward"  # the failing step's forward, closed by on_exception
    assert recorder.depth == 0 and ranges.depth == 0


def test_a_skipped_step_closes_its_forward_at_the_step_end():
    recorder = RecordingNvtx()
    ranges = NvtxRanges(enabled=True, nvtx=recorder)
    ranges.on_train_epoch_start(None, None)  # type: ignore[arg-type]
    ranges.on_train_batch_start(None, None, None, 0)  # type: ignore[arg-type]
    ranges.on_train_batch_end(None, None, None, None, 0)  # type: ignore[arg-type] - no backward: skipped
    ranges.teardown(None, None, "fit")  # type: ignore[arg-type]
    assert recorder.calls == ["data", "pop", "forward", "pop", "data", "pop"]
