"""What the CUDA-only tests share: the skip marker, a network that records what reaches it, the
process-wide torch flags a run changes, and the overrides of a short run on device-made images."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator

import pytest
import torch
from torch import nn

#: Every module of tests/gpu/ starts with ``pytestmark = [*GPU]``: selected by ``-m gpu``, skipped
#: with this reason where there is no CUDA device.
GPU = [pytest.mark.gpu,
       pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA GPU (torch.cuda.is_available() is False here); "
                                 "run on a GPU machine: pytest -m gpu, or benchmarks/gpu_check.sh")]


#: The shared auto run (tests/gpu/conftest.py): long enough for the throughput meter, 5 warm-up
#: steps and then a timed window of 10 steps.
AUTO_RUN_STEPS = 24
#: The GradScaler settings the fp16 run configures (none of them the default, so each is seen to arrive).
FP16_SCALER = {"init_scale": 4096.0, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 1000}
FP16_RUN_STEPS = 8


def require_native_bf16() -> None:
    """Skip on GPUs without bf16 tensor cores (precision=auto then picks fp16 with a GradScaler)."""
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip(f"{torch.cuda.get_device_name()} has no native bf16: precision=auto picks 16-mixed there")


@dataclass(frozen=True)
class ForwardRecord:
    """What one training forward call saw, read inside the call (under the run's autocast)."""

    input_channels_last: bool
    input_nchw_contiguous: bool
    conv_weights_channels_last: bool
    autocast: bool
    autocast_dtype: torch.dtype
    logits_dtype: torch.dtype
    matmul_precision: str
    cudnn_allow_tf32: bool
    cudnn_benchmark: bool


class ProbeNet(nn.Module):
    """Conv-BN-ReLU twice (the second with stride 2), a global mean and a linear classifier, which
    records every eager training forward call on CUDA (`records`).

    Plugged in as ``model=custom model._target_=tests.gpu.common.ProbeNet``; the run builds it, so
    the last built instance is kept in `ProbeNet.built` for the test to inspect. No pooling layers:
    under ``trainer.deterministic=true`` CUDA has deterministic kernels for everything here. A
    compiled forward records nothing (`torch.compiler.is_compiling()` is true while Dynamo traces
    it), so empty records after a compiled run mean every training step ran the compiled graph.
    """

    built: ClassVar[list["ProbeNet"]] = []

    def __init__(self, num_classes: int, in_channels: int = 3, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(2 * width),
            nn.ReLU(inplace=True))
        self.classifier = nn.Linear(2 * width, num_classes)
        self.records: list[ForwardRecord] = []
        ProbeNet.built.append(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.classifier(self.features(x).mean((2, 3)))
        if self.training and x.device.type == "cuda" and not torch.compiler.is_compiling():
            self.records.append(ForwardRecord(
                input_channels_last=x.is_contiguous(memory_format=torch.channels_last),
                input_nchw_contiguous=x.is_contiguous(),
                conv_weights_channels_last=all(m.weight.is_contiguous(memory_format=torch.channels_last)
                                               for m in self.modules() if isinstance(m, nn.Conv2d)),
                autocast=torch.is_autocast_enabled("cuda"),
                autocast_dtype=torch.get_autocast_dtype("cuda"),
                logits_dtype=logits.dtype,
                matmul_precision=torch.get_float32_matmul_precision(),
                cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
                cudnn_benchmark=torch.backends.cudnn.benchmark))
        return logits

    @classmethod
    def last(cls) -> "ProbeNet":
        assert cls.built, "the run built no ProbeNet"
        return cls.built[-1]


def probe_run(steps: int, batch: int = 256, image: int = 32, width: int = 32, evaluate: bool = True) -> list[str]:
    """Overrides of a short run of `ProbeNet` on device-made images: `steps` training steps in one
    epoch, then one validation and one test batch (none without `evaluate`); checkpoints written
    (last.ckpt, and the best by val/loss when evaluating)."""
    eval_batches = 1 if evaluate else 0
    return ["model=custom", "model._target_=tests.gpu.common.ProbeNet", f"+model.width={width}",
            "data=synthetic", f"data.shape=[3,{image},{image}]", f"data.batch_size={batch}",
            f"data.train_samples={steps * batch}", f"data.val_samples={batch}", f"data.test_samples={batch}",
            "trainer.max_epochs=1", "trainer.num_sanity_val_steps=0", f"trainer.limit_val_batches={eval_batches}",
            f"trainer.limit_test_batches={eval_batches}", "progress=off"]


@dataclass(frozen=True)
class TorchFlags:
    """The process-wide settings a CUDA run changes (TF32, cuDNN autotuning, determinism)."""

    matmul_precision: str
    cudnn_allow_tf32: bool
    cudnn_benchmark: bool
    cudnn_deterministic: bool
    deterministic_algorithms: bool
    deterministic_warn_only: bool
    cublas_workspace_config: str | None

    @classmethod
    def now(cls) -> "TorchFlags":
        return cls(torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32,
                   torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
                   torch.are_deterministic_algorithms_enabled(),
                   torch.is_deterministic_algorithms_warn_only_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG"))

    def apply(self) -> None:
        torch.set_float32_matmul_precision(self.matmul_precision)
        torch.backends.cudnn.allow_tf32 = self.cudnn_allow_tf32
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        torch.backends.cudnn.deterministic = self.cudnn_deterministic
        torch.use_deterministic_algorithms(self.deterministic_algorithms, warn_only=self.deterministic_warn_only)
        if self.cublas_workspace_config is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = self.cublas_workspace_config


def set_tf32(enabled: bool) -> None:
    """Put TF32 and cuDNN autotuning all on or all off, so that a run is seen to change them."""
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled
    torch.backends.cudnn.benchmark = enabled


@contextlib.contextmanager
def flags_restored() -> Iterator[None]:
    """An in-process run leaves its TF32, autotuning and determinism settings in the process; give
    the tests after it the process as it was."""
    before = TorchFlags.now()
    try:
        yield
    finally:
        before.apply()


def checkpoint(path: Any) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)
