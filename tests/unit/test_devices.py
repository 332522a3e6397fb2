"""trainer/infra/devices.py. The NVML switch: on a machine with no CUDA device, torch's availability
check stops going through NVML (which `import lightning` turns on, and which reopens NVML at every
check: torch's Adam and AdamW check at every step); where a device is visible nothing changes. Both
sides are taken with torch's answers patched, so the test means the same on a GPU machine. And the
devices decided once: what the Trainer is given for each form of `trainer.devices`."""

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


@pytest.mark.parametrize("given, accelerator, visible, count, trainer_devices", [
    (1, "cpu", 0, 1, 1),
    ("auto", "cpu", 0, 1, 1),
    ("auto", "cuda", 4, 4, 4),
    (-1, "cuda", 4, 4, 4),
    ("2", "cuda", 4, 2, 2),
    ([0, 2], "cuda", 4, 2, [0, 2]),
    ("1,3", "cuda", 4, 2, [1, 3]),
    ("1,", "cuda", 4, 1, [1]),
])
def test_the_trainer_gets_the_ids_named_else_the_count_decided(monkeypatch, given, accelerator, visible, count,
                                                               trainer_devices):
    monkeypatch.setattr(devices, "resolve_accelerator", lambda requested: (accelerator, "patched"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    decided = devices.decide_devices({"accelerator": accelerator, "devices": given})
    assert decided.per_node == count and decided.trainer_devices == trainer_devices


@pytest.mark.parametrize("given", ["junk", "0,x", [], [0, "a"], [-1], True, 1.5, ""])
def test_what_names_no_devices_is_one_line_naming_the_key(given):
    with pytest.raises(devices.UserError) as caught:
        devices.parse_devices(given, "cpu")
    assert caught.value.where == "trainer.devices" and "names no devices" in caught.value.problem
