"""The throughput meter: warm-up skipped, windows of whole steps, a device sync only at window
edges, MFU only where both FLOPs and the peak are known (and on the one bf16 scale where that peak
is), each window's rates handed once to the loggers' step log."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import trainer.callbacks.throughput as throughput
from trainer.callbacks.throughput import ThroughputMeter


class FakeModule:
    device = torch.device("cpu")

    def __init__(self):
        self.logged = []

    def log(self, name, value, **kwargs):
        self.logged.append((name, value))


@pytest.fixture
def clock(monkeypatch):
    """A fake clock advancing 0.5 s per step, and a count of device syncs."""
    state = SimpleNamespace(now=0.0, syncs=0)
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: state.now)
    monkeypatch.setattr(throughput, "synchronize", lambda device: setattr(state, "syncs", state.syncs + 1))
    return state


def steps(meter, module, clock, n, batch=8):
    for _ in range(n):
        clock.now += 0.5
        meter.on_train_batch_end(None, module, {}, torch.zeros(batch, 1), 0)


def test_windows_after_warm_up_sync_only_at_their_edges(clock):
    meter, module = ThroughputMeter(warmup_steps=5, window_steps=10), FakeModule()
    steps(meter, module, clock, 5 + 1 + 20)
    assert meter.window_rates == [16.0, 16.0]  # 10 steps x 8 samples / 5 s
    assert clock.syncs == 3  # the anchor and two window ends, not one per step
    assert module.logged == []  # nothing through self.log (trainer/callbacks/step_log.py writes them)
    assert meter.logged_values() == {"perf/samples_per_s": 16.0}  # the latest window's, once
    assert meter.logged_values() == {}
    s = meter.summary()
    assert s["samples_per_s"] == 16.0 and s["mfu"] is None


def test_mfu_is_reported_and_logged_when_flops_and_peak_are_known(clock):
    meter = ThroughputMeter(warmup_steps=0, window_steps=4, flops_per_sample=1e9, peak_flops=1e12,
                            bf16_peak_flops=4e12)
    module = FakeModule()
    steps(meter, module, clock, 1 + 4)
    summary = meter.summary()
    assert summary["mfu"] == pytest.approx(16.0 * 1e9 / 1e12)
    # Against the one stated peak too, whatever the precision's own (here an fp32 run's 1e12).
    assert summary["mfu_bf16_peak"] == pytest.approx(16.0 * 1e9 / 4e12) and summary["bf16_peak_flops"] == 4e12
    assert meter.logged_values()["perf/mfu"] == pytest.approx(0.016)


def test_without_a_known_bf16_peak_its_mfu_is_left_out(clock):
    meter = ThroughputMeter(warmup_steps=0, window_steps=4, flops_per_sample=1e9, peak_flops=1e12)
    steps(meter, FakeModule(), clock, 1 + 4)
    assert meter.summary()["mfu_bf16_peak"] is None and meter.summary()["mfu"] is not None


def test_a_run_too_short_for_a_window_pools_its_steps_at_the_next_pause(clock):
    meter, module = ThroughputMeter(warmup_steps=2, window_steps=10), FakeModule()
    steps(meter, module, clock, 2 + 1 + 4)
    meter.on_train_end(None, module)
    s = meter.summary()
    assert s["windows"] == 0 and s["samples_per_s"] == pytest.approx(32 / 2.0)
    assert "too short" in s["method"]


def test_a_language_models_rate_and_mfu_are_per_token_summed_on_the_device(clock):
    """With a unit other than samples, the units of each batch (a device tensor: padding left out)
    are added up on the device and read once a window; tokens/s is reported beside samples/s and
    MFU uses it with the FLOPs per token."""
    read = []

    def units_of(batch):
        count = torch.tensor(6)  # 6 real tokens of the batch's 8 x 1
        read.append(count)
        return count

    meter = ThroughputMeter(warmup_steps=0, window_steps=4, flops_per_sample=1e6, peak_flops=1e12, unit="tokens",
                            units_of=units_of)
    module = FakeModule()
    steps(meter, module, clock, 1 + 4)
    s = meter.summary()
    assert s["samples_per_s"] == 16.0 and s["tokens_per_s"] == pytest.approx(4 * 6 / 2.0)
    assert s["unit"] == "tokens" and s["flops_per_token"] == 1e6 and "flops_per_sample" not in s
    assert s["mfu"] == pytest.approx(12.0 * 1e6 / 1e12)
    assert meter.logged_values()["perf/tokens_per_s"] == pytest.approx(12.0)
    assert clock.syncs == 2 and len(read) == 4  # counted every step, synchronized only at the window's edges
