"""diagnose=true and profile=true under DDP, the arithmetic: the exposed all-reduce is the median of
paired differences (step minus the same step under no_sync), its share is of the full step and it
comes out of the diagnosis's remainder, a step mostly waiting on it is communication-bound, the
profile's all-reduce line counts the all-reduce's operators only, and the strategies the
measurements cannot run under are refused in one line. The two-process runs are
tests/run/test_ddp_measuring.py."""

from __future__ import annotations

import pytest

from trainer.groups.communication import check_measurable
from trainer.infra.errors import UserError
from trainer.measure.communication import (CommunicationTiming, communication_lines, exposed_from_pairs, share_of,
                                           timing_from)
from trainer.measure.diagnose import Timings, borderline, report_lines, shares, verdict
from trainer.measure.profile import Op, all_reduce_line, all_reduce_ms

CPU = {"accelerator": "cpu", "precision": "32-true", "compile": "off", "optimizer_implementation": "foreach",
       "num_workers": 0, "device_normalize": True, "gradient_compression": "none", "processes": 2}


def test_the_exposed_all_reduce_is_the_median_of_the_pairs_differences():
    synced, unsynced = [10.0, 12.0, 11.0, 30.0, 10.5], [8.0, 9.5, 9.0, 27.0, 8.5]
    median, noise = exposed_from_pairs(synced, unsynced)
    assert median == pytest.approx(2.0)  # differences 2, 2.5, 2, 3, 2: the slow pair moves both halves
    assert noise == pytest.approx((2.75 - 2.0) / 2)  # the differences' quartiles (statistics.quantiles): 2, 2.75
    with pytest.raises(ValueError):
        exposed_from_pairs([1.0, 2.0], [1.0])


def test_timing_from_the_samples_and_its_shares_of_the_full_step():
    timing = timing_from([10.0, 11.0, 12.0], [8.0, 9.0, 9.5], [1.0, 3.0, 2.0], processes=2, backend="gloo",
                         gradient_bytes=4_000_000, dtype="float32")
    assert (timing.synced_ms, timing.unsynced_ms, timing.exposed_ms, timing.alone_ms) == (11.0, 9.0, 2.0, 2.0)
    assert timing.pairs == 3 and timing.bandwidth_gb_s == pytest.approx(4_000_000 / 0.002 / 1e9)
    record = timing.record(full_ms=20.0)
    assert record["exposed_share_of_full_step"] == pytest.approx(0.1)
    assert record["alone_share_of_full_step"] == pytest.approx(0.1)
    assert share_of(1.0, 0.0) == 0.0


def _timing(exposed: float, noise: float = 0.1, alone: float = 2.0) -> CommunicationTiming:
    return CommunicationTiming(2, "gloo", 400_000, "float32", 5, 10 + exposed, 10.0, exposed, noise, alone, 0.05)


def test_the_diagnosis_prints_both_figures_with_their_share():
    lines = communication_lines(_timing(1.5), full_ms=15.0)
    assert lines[0].startswith("gradient all-reduce (2 processes on gloo, 0.38 MiB of float32 gradients")
    assert "1.50 ms" in lines[1] and "10% of the full step" in lines[1]
    assert "2.00 ms" in lines[2] and "13% of the full step" in lines[2] and "GB/s" in lines[2]
    hidden = communication_lines(_timing(-0.05, noise=0.2), full_ms=15.0)
    assert "0% of the full step" in hidden[1] and hidden[-1].startswith("note: the exposed all-reduce is within its noise")


def test_the_exposed_all_reduce_comes_out_of_the_remainder_and_gets_its_share():
    t = Timings(64, 1, 10, 30, 33, 45, communication_ms=5.0)
    assert t.remainder_ms == 7
    parts = shares(t)
    assert parts["all-reduce (exposed)"] == pytest.approx(5 / 45)
    assert sum(parts.values()) == pytest.approx(1.0)
    assert "all-reduce (exposed)" not in shares(Timings(64, 1, 10, 30, 33, 45))  # one process: no such part


def test_a_step_mostly_waiting_on_the_all_reduce_is_communication_bound():
    t = Timings(64, 1, 5, 12, 14, 30, communication_ms=12.0)
    v = verdict(t, dict(CPU))
    assert v.kind == "communication-bound" and "12.0 ms of the 30.0 ms step (40%)" in v.reason
    assert v.try_next[0].startswith("trainer.gradient_compression=fp16")
    compressed = verdict(t, {**CPU, "gradient_compression": "fp16"})
    assert not any(line.startswith("trainer.gradient_compression") for line in compressed.try_next)
    # Without the all-reduce taken out, the same step would have read as host overhead.
    assert verdict(Timings(64, 1, 5, 12, 14, 30), dict(CPU)).kind == "host-overhead-bound"


def test_a_communication_share_near_its_threshold_is_borderline():
    t = Timings(64, 1, 10, 25, 27, 40, noise_ms={"communication": 1.0, "full": 0.5}, communication_ms=12.2)
    assert verdict(t, dict(CPU)).kind == "communication-bound"
    assert borderline(t, "communication-bound").startswith("communication-bound by 0.20 ms")


def test_the_report_says_per_process_and_holds_the_all_reduce_lines():
    t = Timings(64, 1, 10, 30, 33, 45, communication_ms=1.5)
    lines = report_lines(t, verdict(t, dict(CPU)), [], None, _timing(1.5))
    assert lines[0].startswith("diagnosis at batch 64, each of 2 processes")
    assert any(line.startswith("gradient all-reduce (2 processes") for line in lines)
    assert "all-reduce (exposed) 3%" in next(line for line in lines if line.startswith("shares of the full step"))


def test_the_profiles_all_reduce_counts_the_all_reduce_operators_only():
    ops = [Op("c10d::allreduce_", 300), Op("gloo:all_reduce", 2700), Op("c10d::broadcast_", 500),
           Op("torch.distributed.ddp.reducer::copy_bucket_to_grad", 400), Op("aten::sum", 900),
           Op("nccl:all_reduce", 50, self_device_us=4000)]
    assert all_reduce_ms(ops, steps=2, on_device=False) == pytest.approx((300 + 2700 + 50) / 1000 / 2)
    assert all_reduce_ms(ops, steps=2, on_device=True) == pytest.approx(2.0)  # NCCL's kernels' device time
    assert all_reduce_ms([Op("aten::sum", 900)], 1, False) == 0.0
    assert all_reduce_line(1.5, 10.0) == ("all-reduce: 1.50 ms/step, 15.0% of the step (overlapped with backward by "
                                          "DDP's buckets where the device allows)")


@pytest.mark.parametrize("strategy", ["ddp", "auto", "ddp_find_unused_parameters_true",
                                      {"_target_": "lightning.pytorch.strategies.DDPStrategy"},
                                      {"_target_": "trainer.groups.communication.CompressedDDPStrategy"}])
@pytest.mark.parametrize("measuring", ["diagnose", "profile"])
def test_ddp_started_by_script_is_measured(strategy, measuring):
    check_measurable(strategy, 2, measuring)


@pytest.mark.parametrize("strategy, says", [
    ("fsdp", "FSDP and DeepSpeed shard the model"),
    ({"_target_": "lightning.pytorch.strategies.FSDPStrategy"}, "FSDP and DeepSpeed shard the model"),
    ("ddp_spawn", "starts its processes from inside fit (spawn)"),
    ("ddp_fork", "starts its processes from inside fit (fork)"),
    ({"_target_": "lightning.pytorch.strategies.DDPStrategy", "start_method": "spawn"}, "(spawn)"),
])
def test_what_the_measurements_cannot_run_under_is_one_line(strategy, says):
    check_measurable(strategy, 1, "diagnose")  # one process: any strategy string is measured as one process
    with pytest.raises(UserError) as refused:
        check_measurable(strategy, 2, "profile")
    line = str(refused.value)
    assert line.startswith("profile:") and says in line and "\n" not in line and "allowed: trainer=ddp" in line
