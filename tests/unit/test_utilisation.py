"""The NVML utilisation sampler (trainer/callbacks/utilisation.py), with a stand-in pynvml: the
summary's arithmetic (means, percentiles, power in watts), the means logged at the log interval,
NVML errors counted without stopping the sampling, the thread stopped and joined at fit's end, the
device found by its PCI address, the summary over the throughput meter's timed windows only (the
whole fit, said so, where there are none or no sample fell inside); and, for real on this machine, the reasons it does not sample
(a CPU run, NVML that will not start), and summary.json's entry when the run has no sampler."""

from __future__ import annotations

import sys
import threading
import time
import types
from typing import Any

import pytest
import torch

from tests.helpers import fake_trainer_with_log_steps

from trainer.callbacks import utilisation
from trainer.callbacks.throughput import ThroughputMeter
from trainer.callbacks.utilisation import (NOT_AMONG_CALLBACKS, UtilisationSampler, device_utilisation, nvml_bus_id,
                                           percentile)


class FakeNVMLError(Exception):
    pass


def fake_pynvml(readings: list[Any], init_error: Exception | None = None) -> types.ModuleType:
    """A pynvml that answers `readings` in turn: (gpu %, memory %, milliwatts), or an exception to raise."""
    nvml = types.ModuleType("pynvml")
    nvml.calls = []  # type: ignore[attr-defined]
    queue = list(readings)
    reading: dict[str, Any] = {}

    def init() -> None:
        nvml.calls.append("init")
        if init_error is not None:
            raise init_error

    def rates(handle: Any) -> Any:
        assert handle == "handle-of-00000000:3b:00.0"
        item = queue.pop(0) if queue else readings[-1]
        if isinstance(item, Exception):
            raise item
        reading["now"] = item
        return types.SimpleNamespace(gpu=item[0], memory=item[1])

    nvml.nvmlInit = init  # type: ignore[attr-defined]
    nvml.nvmlShutdown = lambda: nvml.calls.append("shutdown")  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetHandleByPciBusId = lambda bus: nvml.calls.append(bus) or f"handle-of-{bus}"  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetHandleByUUID = lambda uuid: pytest.fail("found by PCI address first")  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetUtilizationRates = rates  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetPowerUsage = lambda handle: reading["now"][2]  # type: ignore[attr-defined]
    return nvml


@pytest.fixture
def visible_gpu(monkeypatch):
    """torch sees one CUDA device at PCI 0000:3b:00 (this machine has none)."""
    properties = types.SimpleNamespace(name="Fake H200", pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0,
                                       uuid="1234")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: properties)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return properties


def test_the_nvml_address_is_torchs_pci_address(visible_gpu):
    assert nvml_bus_id(visible_gpu) == "00000000:3b:00.0"


def test_the_summary_of_the_samples(visible_gpu, monkeypatch):
    nvml = fake_pynvml([(0, 10, 100_000), (50, 20, 200_000), (100, 30, 300_000), (100, 40, 400_000)])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)  # imported when fit starts
    ticks = iter(range(100))
    sampler = UtilisationSampler(interval_s=60, clock=lambda: float(next(ticks)))
    sampler.start(torch.device("cuda", 0))
    deadline = time.monotonic() + 5
    while not sampler.samples and time.monotonic() < deadline:  # the thread's first sample, at once
        time.sleep(0.01)
    for _ in range(3):
        sampler.sample()
    sampler.stop()
    summary = sampler.summary()
    assert nvml.calls[:2] == ["init", "00000000:3b:00.0"] and nvml.calls[-1] == "shutdown"
    assert summary["sampled"] is True and summary["device"] == "Fake H200" and summary["samples"] == 4
    assert summary["gpu_util_mean"] == 62.5 and summary["gpu_util_p50"] == 75 and summary["gpu_util_p95"] == 100
    assert summary["mem_bw_util_mean"] == 25
    assert summary["power_w_mean"] == 250 and summary["power_w_max"] == 400
    assert summary["errors"] == 0 and summary["seconds"] > 0


def test_the_thread_samples_every_interval_and_is_joined_at_fit_end(visible_gpu):
    sampler = UtilisationSampler(interval_s=0.02, nvml=fake_pynvml([(40, 5, 50_000)]))
    sampler.start(torch.device("cuda", 0))
    thread = sampler._thread
    time.sleep(0.3)
    started = time.monotonic()
    sampler.on_fit_end(None, None)  # type: ignore[arg-type]
    assert time.monotonic() - started < 1
    assert thread is not None and not thread.is_alive() and sampler._thread is None
    count = len(sampler.samples)
    assert count >= 3
    time.sleep(0.1)
    assert len(sampler.samples) == count  # nothing sampled after the stop
    assert not [t for t in threading.enumerate() if t.name == "nvml-utilisation"]


def test_nvml_errors_are_counted_and_sampling_goes_on(visible_gpu):
    sampler = UtilisationSampler(interval_s=60, nvml=fake_pynvml([FakeNVMLError("GPU is lost"), (20, 2, 80_000),
                                                                   FakeNVMLError("timeout"), (40, 4, 120_000)]))
    sampler.start(torch.device("cuda", 0))
    deadline = time.monotonic() + 5
    while not sampler.errors and time.monotonic() < deadline:
        time.sleep(0.01)
    for _ in range(3):
        sampler.sample()
    sampler.stop()
    summary = sampler.summary()
    assert summary["samples"] == 2 and summary["errors"] == 2
    assert summary["gpu_util_mean"] == 30 and summary["last_error"] == "FakeNVMLError: timeout"


def test_every_query_failing_is_not_sampled_with_the_last_error(visible_gpu):
    sampler = UtilisationSampler(interval_s=60, nvml=fake_pynvml([FakeNVMLError("GPU is lost")]))
    sampler.start(torch.device("cuda", 0))
    sampler.stop()
    assert sampler.summary()["sampled"] is False
    assert sampler.summary()["why"].startswith("not sampled: every NVML query failed")


class FakeLogger:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.logged.append((step, metrics))


def test_the_means_since_the_last_log_are_logged_every_log_interval(visible_gpu):
    sampler = UtilisationSampler(interval_s=60, nvml=fake_pynvml([(10, 1, 100_000), (30, 3, 300_000),
                                                                   (50, 5, 500_000)]))
    sampler.start(torch.device("cuda", 0))
    deadline = time.monotonic() + 5
    while not sampler.samples and time.monotonic() < deadline:
        time.sleep(0.01)
    sampler.sample()
    logger = FakeLogger()
    trainer = fake_trainer_with_log_steps(global_step=3, log_every_n_steps=2, loggers=[logger])
    sampler.on_train_batch_end(trainer, None, None, None, 0)  # type: ignore[arg-type]
    assert logger.logged == []  # not a logging step
    trainer.global_step = 4
    sampler.on_train_batch_end(trainer, None, None, None, 0)  # type: ignore[arg-type]
    assert logger.logged == [(4, {"device/gpu_util": 20, "device/mem_bw_util": 2, "device/power_w": 200})]
    sampler.sample()
    trainer.global_step = 6
    sampler.on_train_batch_end(trainer, None, None, None, 0)  # type: ignore[arg-type]
    assert logger.logged[-1] == (6, {"device/gpu_util": 50, "device/mem_bw_util": 5, "device/power_w": 500})
    sampler.stop()


def test_nvml_that_will_not_start_is_said_and_not_raised(visible_gpu):
    sampler = UtilisationSampler(nvml=fake_pynvml([], init_error=FakeNVMLError("Driver Not Loaded")))
    sampler.start(torch.device("cuda", 0))
    assert sampler._thread is None
    assert sampler.summary() == {"sampled": False,
                                 "why": "not sampled: NVML did not start (FakeNVMLError: Driver Not Loaded)"}


def test_without_pynvml_it_says_what_to_install(visible_gpu, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    sampler = UtilisationSampler()
    sampler.start(torch.device("cuda", 0))
    assert "pip install nvidia-ml-py" in sampler.summary()["why"]


def test_on_this_cpu_machine_it_does_not_sample_and_says_why():
    sampler = UtilisationSampler()
    trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(root_device=torch.device("cpu")))
    sampler.on_fit_start(trainer, None)  # type: ignore[arg-type]
    sampler.on_fit_end(trainer, None)  # type: ignore[arg-type]
    assert device_utilisation([object(), sampler]) == {"sampled": False,
                                                       "why": "not sampled: the run is on cpu, not CUDA"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks NVML failing to start where there is no GPU")
def test_the_real_pynvml_without_a_gpu_does_not_sample(visible_gpu):
    pytest.importorskip("pynvml")
    sampler = UtilisationSampler()
    sampler.start(torch.device("cuda", 0))
    assert sampler._thread is None
    assert sampler.summary()["why"].startswith("not sampled: NVML did not start (NVMLError")


def test_a_run_without_the_sampler_says_which_choice_samples():
    assert device_utilisation([object()]) == {"sampled": False, "why": NOT_AMONG_CALLBACKS}
    assert NOT_AMONG_CALLBACKS == "not sampled: callbacks=device_stats samples it on CUDA"


def test_percentiles_interpolate_between_ranks():
    assert percentile([1.0], 95) == 1.0
    assert percentile([0.0, 10.0], 50) == 5.0
    assert percentile([float(v) for v in range(101)], 95) == 95.0
    assert utilisation.percentile([0.0, 100.0, 100.0], 95) == 100.0


def sampled_at(times_and_readings: list[tuple[float, tuple[int, int, int]]]) -> UtilisationSampler:
    """A stopped sampler holding one sample per (time, reading): the first taken by its thread at
    start, the others by hand, the clock set to each time before it is read."""
    now = [times_and_readings[0][0]]
    sampler = UtilisationSampler(interval_s=60, nvml=fake_pynvml([r for _, r in times_and_readings]),
                                 clock=lambda: now[0])
    sampler.start(torch.device("cuda", 0))
    deadline = time.monotonic() + 5
    while not sampler.samples and time.monotonic() < deadline:
        time.sleep(0.01)
    for at, _ in times_and_readings[1:]:
        now[0] = at
        sampler.sample()
    sampler.stop()
    return sampler


# The start-up (loaders, autotuning, warm-up) at 5% busy, then two timed windows at 90% and 100%.
STARTUP_THEN_WINDOWS = [(0.0, (5, 1, 100_000)), (0.5, (5, 1, 100_000)), (1.0, (10, 2, 150_000)),
                        (2.0, (90, 40, 600_000)), (2.5, (80, 30, 500_000)), (3.2, (100, 50, 700_000)),
                        (4.0, (0, 0, 90_000))]


def test_the_summary_is_over_the_throughput_meters_windows_only(visible_gpu):
    sampler = sampled_at(STARTUP_THEN_WINDOWS)
    assert [s.at for s in sampler.samples] == [0.0, 0.5, 1.0, 2.0, 2.5, 3.2, 4.0]
    summary = sampler.summary([(1.8, 2.6), (3.0, 3.5)])
    assert summary["over"] == "the throughput meter's 2 timed windows (1.3 s)"
    assert summary["samples"] == 3 and summary["seconds"] == pytest.approx(1.3)
    assert summary["gpu_util_mean"] == 90 and summary["gpu_util_p50"] == 90
    assert summary["mem_bw_util_mean"] == 40 and summary["power_w_mean"] == 600 and summary["power_w_max"] == 700
    # The fit's means beside them: the start-up pulls them down, as it did on the H200 (15-18%).
    whole = summary["whole_fit"]
    assert whole["samples"] == 7 and whole["seconds"] == 4.0
    assert whole["gpu_util_mean"] == pytest.approx(290 / 7)


def test_without_windows_the_summary_is_over_the_whole_fit_and_says_so(visible_gpu):
    sampler = sampled_at(STARTUP_THEN_WINDOWS)
    summary = sampler.summary()
    assert summary["over"] == "the whole fit (4.0 s): the throughput meter timed no window"
    assert summary["samples"] == 7 and summary["seconds"] == 4.0 and "whole_fit" not in summary
    assert summary["gpu_util_mean"] == pytest.approx(290 / 7)


def test_a_window_between_two_samples_falls_back_to_the_whole_fit_with_why(visible_gpu):
    # A 16-step run on an H200 times one window of ~0.3 s: shorter than the interval, it may hold no sample.
    sampler = sampled_at(STARTUP_THEN_WINDOWS)
    summary = sampler.summary([(2.6, 2.9)])
    assert summary["over"] == ("the whole fit (4.0 s): no sample fell inside the throughput meter's 1 timed window "
                               "(0.30 s, a sample every 60 s)")
    assert summary["samples"] == 7 and "whole_fit" not in summary


def test_summary_json_finds_the_meters_windows_among_the_callbacks(visible_gpu):
    sampler = sampled_at(STARTUP_THEN_WINDOWS)
    meter = ThroughputMeter()
    meter.window_spans = [(1.9, 2.1)]
    summary = device_utilisation([meter, object(), sampler])
    assert summary["over"] == "the throughput meter's 1 timed window (0.2 s)"
    assert summary["samples"] == 1 and summary["gpu_util_mean"] == 90
    assert device_utilisation([sampler])["over"].endswith("the throughput meter timed no window")


def test_samples_are_stamped_on_the_meters_clock(visible_gpu):
    sampler = UtilisationSampler(interval_s=60, nvml=fake_pynvml([(40, 5, 50_000)]))
    before = time.perf_counter()
    sampler.start(torch.device("cuda", 0))
    sampler.sample()
    sampler.stop()
    after = time.perf_counter()
    assert sampler.samples and all(before <= s.at <= after for s in sampler.samples)
