"""Precision per device: `auto` is bf16-mixed on GPUs with bf16, fp16-mixed with a GradScaler on
older GPUs and fp32 on CPU; bf16 asked for on a GPU without it is one line; fp16 steps aside on
CPU and says so; channels_last only for convolutional models on CUDA unless asked for; TF32 on
CUDA unless deterministic; the GradScaler settings reach Lightning's precision plugin."""

import pytest
import torch
from torch import nn

from trainer.configuration.spec import choice_config
from trainer.infra.errors import UserError
from trainer.groups.precision import lightning_precision, resolve_channels_last, resolve_precision, resolve_tf32


def test_auto_precision_per_device(monkeypatch):
    assert resolve_precision("auto", "cpu")[0] == "32-true"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_precision("auto", "cuda")[0] == "bf16-mixed"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    precision, how = resolve_precision("auto", "cuda")
    assert precision == "16-mixed" and "GradScaler" in how
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: "Tesla V100")
    with pytest.raises(UserError, match="^precision: bf16_mixed is not supported on Tesla V100"):
        resolve_precision("bf16_mixed", "cuda")


def test_fp16_steps_aside_on_cpu_and_says_so():
    precision, how = resolve_precision("fp16_mixed", "cpu")
    assert precision == "32-true" and "needs CUDA" in how


def test_channels_last_only_for_convolutional_models_on_cuda():
    conv, mlp = nn.Sequential(nn.Conv2d(3, 8, 3)), nn.Sequential(nn.Linear(3, 8))
    assert resolve_channels_last("auto", "cuda", conv)[0] is True
    assert resolve_channels_last("auto", "cpu", conv)[0] is False
    assert resolve_channels_last("auto", "cuda", mlp)[0] is False
    assert resolve_channels_last(True, "cpu", mlp) == (True, "true (as configured)")


def test_tf32_on_cuda_unless_deterministic():
    assert resolve_tf32("auto", "cuda", deterministic=False)[0] is True
    assert resolve_tf32("auto", "cuda", deterministic=True) == (False, "auto -> off (trainer.deterministic=true)")
    assert resolve_tf32("auto", "cpu", deterministic=False)[0] is False
    assert resolve_tf32(False, "cuda", deterministic=False)[0] is False


def test_grad_scaler_settings_reach_the_plugin(monkeypatch):
    # Without a GPU torch builds a disabled scaler that keeps no settings; pretend CUDA is there.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = choice_config("precision", "fp16_mixed", scaler_init_scale=1024.0, scaler_growth_factor=4.0,
                        scaler_backoff_factor=0.25, scaler_growth_interval=50)
    kwargs = lightning_precision("16-mixed", "cuda", cfg)
    scaler = kwargs["plugins"][0].scaler
    assert (scaler._init_scale, scaler._growth_factor, scaler._backoff_factor, scaler._growth_interval) == (
        1024.0, 4.0, 0.25, 50)
    assert lightning_precision("bf16-mixed", "cuda", cfg) == {"precision": "bf16-mixed"}
