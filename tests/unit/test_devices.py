"""trainer/infra/devices.py's NVML switch: on a machine with no CUDA device, torch's availability
check stops going through NVML (which `import lightning` turns on, and which reopens NVML at every
check: torch's Adam and AdamW check at every step); where a device is visible nothing changes. Both
sides are taken with torch's answers patched, so the test means the same on a GPU machine."""

from __future__ import annotations

import os

import pytest
import torch

from trainer.infra import devices


@pytest.fixture
def nvml_check(monkeypatch):
    monkeypatch.setenv(devices.NVML_CHECK, "1")  # what `import lightning` sets
    return monkeypatch


def test_without_a_cuda_device_the_nvml_check_is_dropped(nvml_check):
    nvml_check.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.stop_nvml_probes_without_cuda()
    assert devices.NVML_CHECK not in os.environ
    assert not devices.stop_nvml_probes_without_cuda()  # once is enough


def test_with_a_cuda_device_the_nvml_check_stays(nvml_check):
    nvml_check.setattr(torch.cuda, "is_available", lambda: True)
    assert not devices.stop_nvml_probes_without_cuda()
    assert os.environ[devices.NVML_CHECK] == "1"


def test_lightning_still_sets_the_check_this_undoes():
    import lightning.fabric

    source = open(lightning.fabric.__file__).read()
    assert f'os.environ["{devices.NVML_CHECK}"] = "1"' in source
