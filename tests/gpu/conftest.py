"""Fixtures of the CUDA-only tests: one shared run with every setting on auto, and the process-wide
torch flags put back after each test."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from tests.gpu.common import (AUTO_RUN_STEPS, FP16_RUN_STEPS, FP16_SCALER, ProbeNet, TorchFlags, flags_restored,
                               probe_run, set_tf32)
from tests.helpers import run_in_process


@pytest.fixture(autouse=True)
def _process_flags_restored() -> Iterator[None]:
    with flags_restored():
        yield


@dataclass(frozen=True)
class AutoRun:
    """The default-settings CUDA run several tests read: what it wrote and what it saw."""

    summary: dict[str, Any]
    run_dir: Path
    net: ProbeNet
    #: TF32 and cuDNN autotuning were all switched off before the run started.
    flags_after: TorchFlags
    #: (dtype of the loss, autocast on) for every training step, read as the task computed it.
    losses: list[tuple[torch.dtype, bool]]


@pytest.fixture(scope="session")
def auto_run(tmp_path_factory: pytest.TempPathFactory) -> AutoRun:
    """`ProbeNet` on device-made 32x32 images with precision, channels_last, TF32, optimizer
    kernel and compile all on auto (compile=auto is left off: the compile tests cover it)."""
    from trainer.task import ClassificationTask

    run_dir = tmp_path_factory.mktemp("auto_run")
    losses: list[tuple[torch.dtype, bool]] = []
    original = ClassificationTask.evaluation_loss

    def evaluation_loss(self: Any, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = original(self, logits, labels)
        if self.training:
            losses.append((loss.dtype, torch.is_autocast_enabled("cuda")))
        return loss

    with flags_restored(), pytest.MonkeyPatch.context() as patch:
        set_tf32(False)  # the run must switch them on itself
        patch.setattr(ClassificationTask, "evaluation_loss", evaluation_loss)
        summary = run_in_process(probe_run(AUTO_RUN_STEPS), run_dir)
        flags_after = TorchFlags.now()
    assert summary is not None and summary["status"] == "completed", summary
    assert summary["steps"] == AUTO_RUN_STEPS
    return AutoRun(summary, run_dir, ProbeNet.last(), flags_after, losses)


@dataclass(frozen=True)
class Fp16Run:
    summary: dict[str, Any]
    run_dir: Path
    net: ProbeNet
    #: The Trainer's precision plugin and its GradScaler as the run's fit started.
    plugin: dict[str, Any]


@pytest.fixture(scope="session")
def fp16_run(tmp_path_factory: pytest.TempPathFactory) -> Fp16Run:
    """`ProbeNet` with precision=fp16_mixed and GradScaler settings of its own."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    from trainer.task import ClassificationTask

    run_dir = tmp_path_factory.mktemp("fp16_run")
    plugin: dict[str, Any] = {}

    def on_fit_start(self: Any) -> None:
        precision = self.trainer.precision_plugin
        scaler = getattr(precision, "scaler", None)
        plugin.update(mixed_precision=isinstance(precision, MixedPrecision), precision=getattr(precision, "precision", None),
                      grad_scaler=isinstance(scaler, torch.amp.GradScaler))
        if scaler is not None:
            plugin.update(enabled=scaler.is_enabled(), init_scale=scaler.get_scale(),
                          growth_factor=scaler.get_growth_factor(), backoff_factor=scaler.get_backoff_factor(),
                          growth_interval=scaler.get_growth_interval())

    overrides = [*probe_run(FP16_RUN_STEPS, batch=64), "precision=fp16_mixed",
                 f"precision.scaler_init_scale={FP16_SCALER['init_scale']}",
                 f"precision.scaler_growth_factor={FP16_SCALER['growth_factor']}",
                 f"precision.scaler_backoff_factor={FP16_SCALER['backoff_factor']}",
                 f"precision.scaler_growth_interval={FP16_SCALER['growth_interval']}"]
    with flags_restored(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(ClassificationTask, "on_fit_start", on_fit_start)
        summary = run_in_process(overrides, run_dir)
    assert summary is not None and summary["status"] == "completed", summary
    assert summary["steps"] == FP16_RUN_STEPS
    return Fp16Run(summary, run_dir, ProbeNet.last(), plugin)
