"""Mixed precision on CUDA.

bf16 (precision=auto on a GPU with bf16 tensor cores, e.g. an H100/H200): the run resolves to
bf16-mixed; inside every training forward autocast is on with dtype bf16 and the logits come out
bf16, while the loss the task computes is fp32; the BatchNorm running statistics stay fp32 (in the
network and in the checkpoint), finite, and were updated once per step.

fp16 (precision=fp16_mixed): the Trainer's precision plugin is Lightning's MixedPrecision carrying a
torch.amp.GradScaler with the configured init scale, growth and backoff factors and interval; the
forward runs under fp16 autocast; the run completes with finite losses, and the scaler state saved
in the checkpoint is the configured one (its scale the init scale times the backoff factor once per
overflowing step, which the non-finite guard counts).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tests.gpu.common import AUTO_RUN_STEPS, FP16_RUN_STEPS, FP16_SCALER, GPU, checkpoint, require_native_bf16

pytestmark = [*GPU]


def test_auto_resolves_to_bf16_mixed(auto_run):
    require_native_bf16()
    assert auto_run.summary["hyperparameters"]["precision"] == "bf16-mixed"
    assert auto_run.summary["derived"]["precision"]["how"].startswith("auto -> bf16-mixed")


def test_bf16_logits_inside_autocast_and_an_fp32_loss(auto_run):
    require_native_bf16()
    records = auto_run.net.records
    assert len(records) == AUTO_RUN_STEPS
    assert all(r.autocast and r.autocast_dtype == torch.bfloat16 for r in records)
    assert all(r.logits_dtype == torch.bfloat16 for r in records)
    assert auto_run.losses == [(torch.float32, True)] * AUTO_RUN_STEPS


def test_batchnorm_running_statistics_stay_fp32(auto_run):
    require_native_bf16()
    norms = [m for m in auto_run.net.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(norms) == 2
    for bn in norms:
        assert bn.running_mean.dtype == bn.running_var.dtype == torch.float32
        assert bool(torch.isfinite(bn.running_mean).all() and torch.isfinite(bn.running_var).all())
        assert bool(bn.running_mean.abs().sum() > 0)  # updated from its zero start
        assert int(bn.num_batches_tracked) == AUTO_RUN_STEPS
    state = checkpoint(auto_run.run_dir / "checkpoints" / "last.ckpt")["state_dict"]
    stats = {k: v for k, v in state.items() if k.endswith(("running_mean", "running_var"))}
    assert len(stats) == 4 and all(v.dtype == torch.float32 for v in stats.values()), stats.keys()


def test_fp16_carries_the_configured_grad_scaler(fp16_run):
    plugin = fp16_run.plugin
    assert plugin["mixed_precision"] and plugin["precision"] == "16-mixed" and plugin["grad_scaler"], plugin
    assert plugin["enabled"] is True
    assert {k: plugin[k] for k in FP16_SCALER} == FP16_SCALER
    assert fp16_run.summary["hyperparameters"]["precision"] == "16-mixed"


def test_fp16_forward_under_fp16_autocast(fp16_run):
    records = fp16_run.net.records
    assert len(records) == FP16_RUN_STEPS
    assert all(r.autocast and r.autocast_dtype == torch.float16 and r.logits_dtype == torch.float16
               for r in records)


def test_fp16_run_completes_with_finite_losses_and_saves_the_scaler_state(fp16_run):
    loss = fp16_run.summary["loss"]
    assert len(loss["first"]) == FP16_RUN_STEPS and all(math.isfinite(v) for v in loss["first"]), loss
    assert math.isfinite(loss["final"]) and loss["non_finite"] == 0, loss
    saved = checkpoint(fp16_run.run_dir / "checkpoints" / "last.ckpt")["MixedPrecision"]
    assert (saved["growth_factor"], saved["backoff_factor"], saved["growth_interval"]) == (
        FP16_SCALER["growth_factor"], FP16_SCALER["backoff_factor"], FP16_SCALER["growth_interval"])
    overflowed = fp16_run.summary["nonfinite"]["skipped_steps"]
    assert overflowed < FP16_RUN_STEPS
    assert saved["scale"] == FP16_SCALER["init_scale"] * FP16_SCALER["backoff_factor"] ** overflowed
