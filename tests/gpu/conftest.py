"""Fixtures of the CUDA-only tests: one shared run with every setting on auto, one in fp16 with
GradScaler settings of its own, and the process-wide torch flags put back after each test. The runs
are made by `tests.gpu.common.probed_run`, which tests/run/test_gpu_fixtures_on_cpu.py also runs on
the CPU."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.gpu.common import (AUTO_RUN_STEPS, FP16_RUN_STEPS, ProbedRun, flags_restored, fp16_probe_run, probe_run,
                               probed_run)


@pytest.fixture(autouse=True)
def _process_flags_restored() -> Iterator[None]:
    with flags_restored():
        yield


@pytest.fixture(scope="session")
def auto_run(tmp_path_factory: pytest.TempPathFactory) -> ProbedRun:
    """`ProbeNet` on device-made 32x32 images with precision, channels_last, TF32, optimizer
    kernel and compile all on auto (compile=auto is left off: the compile tests cover it); TF32 and
    cuDNN autotuning all switched off before it starts (the run must switch them on itself)."""
    run = probed_run(probe_run(AUTO_RUN_STEPS), tmp_path_factory.mktemp("auto_run"), "cuda", tf32=False)
    assert run.summary["steps"] == AUTO_RUN_STEPS
    return run


@pytest.fixture(scope="session")
def fp16_run(tmp_path_factory: pytest.TempPathFactory) -> ProbedRun:
    """`ProbeNet` with precision=fp16_mixed and GradScaler settings of its own (`FP16_SCALER`)."""
    run = probed_run(fp16_probe_run(FP16_RUN_STEPS), tmp_path_factory.mktemp("fp16_run"), "cuda")
    assert run.summary["steps"] == FP16_RUN_STEPS
    return run
