"""The diagnosis verdict from timings: each of the four kinds (input-, host-overhead-,
optimizer-, compute-bound) with the switches it names; the shares add up to the full step; the
timer calls the step for its warm-up and for every timed repeat; the worker sweep covers 0, the
powers of two and the CPU count."""

from __future__ import annotations

import pytest
import torch

from trainer.measure.diagnose import Timings, median_ms, report_lines, shares, sweep_workers, verdict

GPU = {"accelerator": "cuda", "precision": "32-true", "tf32": False, "channels_last": False, "compile": "off",
       "optimizer_implementation": "foreach", "num_workers": 2, "pin_memory": True, "device_normalize": True,
       "convolutional": True, "best_workers": 8}


def timings(data, forward, fb, step, full):
    return Timings(64, data, forward, fb, step, full)


def test_a_loader_slower_than_the_model_is_input_bound_and_names_the_best_worker_count():
    v = verdict(timings(data=50, forward=5, fb=15, step=18, full=52), dict(GPU))
    assert v.kind == "input-bound"
    assert v.try_next[0] == "data.num_workers=8 (fastest in the sweep)"


def test_host_finished_batches_are_named_when_input_bound():
    v = verdict(timings(50, 5, 15, 18, 52), {**GPU, "best_workers": 2, "device_normalize": False})
    assert v.kind == "input-bound" and any(t.startswith("data.device_normalize=true") for t in v.try_next)


def test_a_step_mostly_outside_data_and_arithmetic_is_host_overhead_bound():
    v = verdict(timings(data=1, forward=2, fb=5, step=6, full=20), dict(GPU))
    assert v.kind == "host-overhead-bound"
    assert v.try_next[0].startswith("compile=reduce_overhead")


def test_a_heavy_optimizer_step_is_optimizer_bound():
    v = verdict(timings(data=1, forward=3, fb=8, step=14, full=15), {**GPU, "optimizer_implementation": "for_loop"})
    assert v.kind == "optimizer-bound"
    assert v.try_next[:2] == ["optimizer.implementation=fused", "optimizer.implementation=foreach"]


def test_otherwise_compute_bound_with_the_practices_not_yet_on():
    v = verdict(timings(data=1, forward=10, fb=30, step=33, full=35), dict(GPU))
    assert v.kind == "compute-bound"
    assert v.try_next[:4] == ["precision=bf16_mixed (or fp16_mixed on GPUs without bf16)",
                              "precision.channels_last=true", "compile=default", "precision.tf32=true"]
    on = verdict(timings(1, 10, 30, 33, 35), {**GPU, "precision": "bf16-mixed", "channels_last": True,
                                              "compile": "default"})
    assert not any(t.startswith(("precision", "compile")) for t in on.try_next)


def test_compute_bound_on_cpu_says_the_arithmetic_is_the_limit():
    v = verdict(timings(1, 10, 30, 33, 35), {**GPU, "accelerator": "cpu"})
    assert v.kind == "compute-bound" and v.try_next[0].startswith("a GPU")


def test_shares_add_up_to_the_full_step():
    t = timings(data=1, forward=10, fb=30, step=33, full=40)
    assert sum(shares(t).values()) == pytest.approx(1.0)
    assert (t.backward_ms, t.optimizer_ms, t.remainder_ms) == (20, 3, 7)


def test_median_ms_times_each_call():
    calls = []
    ms = median_ms(lambda: calls.append(1), torch.device("cpu"), warmup=2, repeats=5)
    assert len(calls) == 7 and ms >= 0


def test_the_worker_sweep_covers_zero_powers_of_two_and_the_cpu_count():
    from trainer.data.digits import DigitsDataModule

    data = DigitsDataModule(batch_size=64)
    data.setup("fit")
    data.apply_loader(data.loader_settings(cuda=False))
    before = data.loader
    results = sweep_workers(data, torch.device("cpu"), steps=2, cpus=2)
    assert [r["num_workers"] for r in results] == [0, 1, 2]
    assert all(r["samples_per_s"] > 0 for r in results)
    assert data.loader is before  # the run's own settings are put back


def test_a_verdict_within_the_noise_of_its_threshold_says_it_is_borderline():
    """Host overhead at 31% of the step against the 30% threshold: clear with quiet timings, borderline
    when the timings' noise could move it across; a compute-bound verdict whose host overhead just
    missed its threshold names that candidate."""
    quiet = Timings(64, 1, 10, 30, 33, 48, noise_ms={"data": 0.1, "forward_backward": 0.1, "step": 0.1, "full": 0.1})
    assert verdict(quiet, dict(GPU)).kind == "host-overhead-bound" and verdict(quiet, dict(GPU)).borderline is None
    noisy = Timings(64, 1, 10, 30, 33, 48, noise_ms={"data": 0.1, "forward_backward": 1, "step": 2, "full": 3})
    v = verdict(noisy, dict(GPU))
    assert v.kind == "host-overhead-bound" and v.borderline.startswith("host-overhead-bound by 0.60 ms")
    missed = Timings(64, 1, 10, 30, 33, 46.5, noise_ms={"data": 0.1, "forward_backward": 1, "step": 2, "full": 3})
    v = verdict(missed, dict(GPU))
    assert v.kind == "compute-bound" and "a rerun may say host-overhead-bound" in v.borderline
    lines = report_lines(missed, v, [])
    assert lines[-1].startswith("borderline: host-overhead-bound missed by")


def test_memory_bound_operators_get_the_switches_that_shrink_them():
    from trainer.measure.diagnose import memory_bound_help, operator_lines
    from trainer.measure.profile import Op, breakdown

    ops = [Op("aten::mkldnn_convolution", 4000), Op("aten::native_batch_norm", 2000), Op("aten::relu", 1000),
           Op("aten::_foreach_add_", 2000, optimizer=True)]
    result = breakdown(ops, 1, 10.0, False, 4)
    assert result.memory_bound_share() == pytest.approx(0.5)
    helps = memory_bound_help(result, dict(GPU))
    assert [h.split(":")[0] for h in helps] == ["compile=default", "optimizer.implementation=fused",
                                                "precision.channels_last=true"]
    assert memory_bound_help(result, {**GPU, "compile": "default", "optimizer_implementation": "fused",
                                      "channels_last": True}) == []
    assert "memory-bound operators take 50% of the model's step" in operator_lines(result, dict(GPU))
