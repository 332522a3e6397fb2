"""The resolve phase on its own, without a Trainer: for a handful of composed specs, the plan holds
the settings and reasons the rules give (device, precision, global batch, batch-scaled lr and weight
decay, kernel, loader, decode, progress output, cuDNN autotuning, the peaks MFU is taken against); and resolve is pure: called
twice on the same inputs it returns equal plans and leaves the spec, the data module and the
network as they were."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from tests.helpers import ON_CPU, compose, planned_run, prepared_run, write_photo_jpegs
from trainer.configuration.spec import validate
from trainer.phases.build import apply_to_data
from trainer.phases import plan as plan_module
from trainer.phases.plan import decide_probe, resolve


def plan_for(overrides: list[str], run_dir):
    return planned_run(compose([*ON_CPU, *overrides]), run_dir).plan


def test_the_default_run_on_a_cpu(tmp_path):
    plan = plan_for(["progress=off"], tmp_path)
    assert (plan.accelerator, plan.devices, plan.precision, plan.global_batch_size) == ("cpu", 1, "32-true", 64)
    # AdamW's lr 0.004 and weight decay 0.2 at batch 256: sqrt rules for both to batch 64
    assert plan.lr == pytest.approx(0.002) and plan.weight_decay == pytest.approx(0.1)
    assert plan.derived["optimizer.lr"].how == "lr 0.004 at batch 256 -> 0.002 at batch 64 (sqrt rule, x0.5)"
    assert plan.optimizer_implementation == "fused" and not plan.channels_last and plan.compile_mode == "off"
    assert plan.loader.num_workers == 0 and "in memory" in plan.derived["data.num_workers"].how
    assert plan.decode == "none" and plan.progress == "off" and plan.cudnn_benchmark is False
    assert not plan.slurm_environment and plan.warnings == ()
    assert plan.derived["clipping"].value == "percentile"


def test_sgd_with_accumulation_scales_with_the_global_batch(tmp_path):
    plan = plan_for(["optimizer=sgd", "data.batch_size=32", "trainer.accumulate_grad_batches=4"], tmp_path)
    assert plan.global_batch_size == 128
    assert plan.derived["global_batch_size"].how == "32 per device x 1 devices x 1 nodes x 4 accumulation"
    assert "sqrt rule" in plan.derived["optimizer.lr"].how and plan.derived["optimizer.lr"].value == pytest.approx(
        0.1 * (128 / 256) ** 0.5)
    linear = plan_for(["optimizer=sgd", "optimizer.lr_scaling=linear", "data.batch_size=32",
                       "trainer.accumulate_grad_batches=4"], tmp_path)
    assert "linear rule, x0.5" in linear.derived["optimizer.lr"].how


def test_sgd_beyond_its_measured_limit_is_warned_by_the_plan_not_by_resolving(tmp_path, caplog):
    plan = plan_for(["optimizer=sgd", "data.batch_size=256", "trainer.accumulate_grad_batches=4"], tmp_path)
    assert plan.global_batch_size == 1024 and any("1,024" in w for w in plan.warnings)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]  # printed by the prepare phase


def test_progress_and_cudnn_autotuning_are_decided_with_their_reasons(tmp_path):
    plan = plan_for(["progress=auto", "+trainer.benchmark=true"], tmp_path)
    # pytest captures stdout: not a terminal
    assert plan.progress == "plain" and plan.derived["progress"].how.startswith("auto -> plain")
    assert plan.cudnn_benchmark is True and "as configured" in plan.derived["trainer.benchmark"].how


def test_resolve_is_pure_and_the_build_phase_applies_the_plan(tmp_path):
    write_photo_jpegs(tmp_path / "images", {"train": 4, "val": 2, "test": 2}, classes=2, size=(48, 40))
    run = prepared_run(compose([*ON_CPU, "data=imagefolder", f"data.root={tmp_path / 'images'}",
                                "data.image_size=32", "data.batch_size=4"]), tmp_path / "run")
    spec, parts = run.spec, run.parts
    spec_before, weights = copy.deepcopy(spec), copy.deepcopy(parts.net.state_dict())
    probe = decide_probe(spec, run.devices, parts)
    assert probe == decide_probe(spec, run.devices, parts)
    first = resolve(spec, probe, parts)
    second = resolve(spec, probe, parts)
    assert first == second
    # The memory the probe read bounds the prefetch depth, not a new reading (a moving figure).
    tight = resolve(spec, dataclasses.replace(probe, available_memory=1), parts)
    assert tight.loader.prefetch_factor == (1 if first.loader.num_workers else None)
    assert ("0.0 GiB available" in tight.derived["data.prefetch_factor"].how) == bool(first.loader.num_workers)
    assert spec == spec_before
    assert parts.datamodule.loader is None and parts.datamodule.decode_in_use is None
    assert all(torch.equal(weights[k], v) for k, v in parts.net.state_dict().items())
    assert first.decode == "fast"  # no CUDA: decoded on the host
    apply_to_data(first, parts.datamodule)
    assert parts.datamodule.loader == first.loader and parts.datamodule.decode_in_use == "fast"


def test_the_spec_is_frozen(tmp_path):
    spec = validate(compose(ON_CPU))
    with pytest.raises(AttributeError):
        spec.data = {}  # type: ignore[misc]


def test_on_a_cpu_neither_peak_is_known_and_the_plan_says_why(tmp_path):
    plan = plan_for(["progress=off"], tmp_path)
    assert plan.peak_flops is None and plan.peak_flops_note == "no known peak for the CPU: MFU left out"
    assert plan.bf16_peak_flops is None
    assert plan.bf16_peak_note == "no known dense bf16 peak for the CPU: MFU against it left out"
    assert plan.derived["device.bf16_peak_flops"].value is None
    assert plan.derived["device.bf16_peak_flops"].how == plan.bf16_peak_note


@pytest.mark.parametrize("precision,tf32,own", [("32-true", False, "H200 SXM fp32 (non-tensor) peak 66.9 TFLOP/s"),
                                                ("32-true", True, "H200 SXM dense tf32 peak 494.7 TFLOP/s"),
                                                ("bf16-mixed", True, "H200 SXM dense bf16 peak 989.4 TFLOP/s")])
def test_on_an_h200_every_precision_also_has_the_bf16_peak(tmp_path, monkeypatch, precision, tf32, own):
    run = planned_run(compose([*ON_CPU, "progress=off"]), tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H200")
    derived: dict = {}
    _, (peak, note), (bf16_peak, bf16_note) = plan_module._flops(run.parts.net, run.parts, "cuda", precision, tf32,
                                                                  derived)
    assert note == f"{own} (NVIDIA datasheet)"
    assert bf16_peak == 989.4e12 and bf16_note == "H200 SXM dense bf16 peak 989.4 TFLOP/s (NVIDIA datasheet)"
    assert derived["device.bf16_peak_flops"].value == "989.4 TFLOP/s"
    assert (peak == bf16_peak) == (precision == "bf16-mixed")
