"""The `precision` group: which Lightning precision plugin runs, and why."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Annotated, Any, Iterator, Literal, Union

import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from trainer.infra.errors import UserError
from trainer.infra.schema import AT_LEAST_ONE, POSITIVE, ConfigGroup, Doc, Range, check_keys

AutoBool = Union[bool, Literal["auto"]]

LIGHTNING_PRECISION = {"fp32": "32-true", "bf16_mixed": "bf16-mixed", "fp16_mixed": "16-mixed"}


PrecisionName = Literal["auto", "fp32", "bf16_mixed", "fp16_mixed"]


@dataclass
class PrecisionConfig:
    """Numeric format and memory layout. GradScaler settings apply to fp16_mixed only."""

    name: Annotated[PrecisionName, Doc("auto, fp32, bf16_mixed or fp16_mixed; auto: bf16-mixed on GPUs with bf16, "
                                       "fp16-mixed + GradScaler on older GPUs, fp32 elsewhere")]
    channels_last: Annotated[AutoBool, Doc("NHWC memory format; auto: on for convolutional models on CUDA")]
    tf32: Annotated[AutoBool, Doc("TF32 matmuls and cuDNN autotuning; auto: on with CUDA unless trainer.deterministic")]
    scaler_init_scale: Annotated[float, POSITIVE, Doc("fp16 GradScaler: the first loss scale")]
    scaler_growth_factor: Annotated[float, Range(gt=1), Doc("fp16 GradScaler: scale x this after growth_interval "
                                                            "clean steps")]
    scaler_backoff_factor: Annotated[float, Range(gt=0, lt=1), Doc("fp16 GradScaler: scale x this after an overflow")]
    scaler_growth_interval: Annotated[int, AT_LEAST_ONE, Doc("fp16 GradScaler: clean steps before the scale grows")]


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype activations are computed in under Lightning's precision string: bf16 for "bf16-*",
    fp16 for "16-*", else fp32."""
    if str(precision).startswith("bf16"):
        return torch.bfloat16
    if str(precision).startswith("16"):
        return torch.float16
    return torch.float32


def resolve_precision(name: str, accelerator: str) -> tuple[str, str]:
    """Return the Lightning precision string and a one-line derivation.
    ``auto``: bf16-mixed on CUDA devices with bf16 support (no GradScaler needed), fp16-mixed with
    a GradScaler on older CUDA devices, fp32 elsewhere."""
    cuda = accelerator == "cuda"
    bf16_ok = cuda and torch.cuda.is_bf16_supported()
    if name == "auto":
        if bf16_ok:
            return "bf16-mixed", "auto -> bf16-mixed (the GPU supports bf16)"
        if cuda:
            return "16-mixed", "auto -> 16-mixed with a GradScaler (the GPU has no bf16)"
        # Measured on a 2-core CPU (benchmarks/practices.py): bf16 autocast ran at 0.08x-0.09x of fp32.
        return "32-true", "auto -> 32-true (no CUDA device; bf16 autocast measured far slower on CPU)"
    if name == "fp16_mixed" and not cuda:
        # fp16 autocast with a GradScaler is a CUDA practice; a recipe written for a GPU still
        # runs here, in fp32, and says so.
        return "32-true", f"fp16_mixed -> 32-true (fp16 with a GradScaler needs CUDA; accelerator {accelerator})"
    if name == "bf16_mixed" and cuda and not bf16_ok:
        raise UserError("precision", f"bf16_mixed is not supported on {torch.cuda.get_device_name()}",
                        "fp16_mixed, fp32, auto")
    return LIGHTNING_PRECISION[name], f"{name} -> {LIGHTNING_PRECISION[name]} (as configured)"


def resolve_channels_last(setting: object, accelerator: str, net: torch.nn.Module) -> tuple[bool, str]:
    """NHWC lets cuDNN use tensor-core convolution kernels without transposes (timm measured +47%
    for ResNet-50 with AMP on an RTX 3090). Models without convolutions gain nothing. On CPU it
    measured 1.05x-1.13x for a small CNN on 2 cores (benchmarks/practices.py), too little to
    change the default there, so it is an opt-in."""
    convolutional = any(isinstance(m, torch.nn.Conv2d) for m in net.modules())
    if setting == "auto":
        if not convolutional:
            return False, "auto -> false (no convolutions in the model)"
        if accelerator != "cuda":
            return False, f"auto -> false (on by default on CUDA only; precision.channels_last=true opts in on {accelerator})"
        return True, "auto -> true (convolutional model on CUDA)"
    return bool(setting), f"{str(bool(setting)).lower()} (as configured)"


def resolve_tf32(setting: object, accelerator: str, deterministic: bool) -> tuple[bool, str]:
    """TF32 matmuls/convolutions and cuDNN autotuning: fast, but not bit-reproducible."""
    if setting == "auto":
        if accelerator != "cuda":
            return False, f"auto -> off (CUDA only; accelerator {accelerator})"
        if deterministic:
            return False, "auto -> off (trainer.deterministic=true)"
        return True, "auto -> on (matmul precision high, cuDNN benchmark)"
    return bool(setting), f"{'on' if setting else 'off'} (as configured)"


def apply_tf32(enabled: bool, accelerator: str) -> None:
    if accelerator != "cuda":
        return
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled


@contextlib.contextmanager
def tf32_during(enabled: bool, accelerator: str) -> Iterator[None]:
    """TF32 as `apply_tf32` sets it, and as it was before afterwards (a measurement before the run's
    own is applied)."""
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    apply_tf32(enabled, accelerator)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]


def lightning_precision(precision: str, accelerator: str, cfg: PrecisionConfig) -> dict[str, Any]:
    """Trainer keyword arguments: a precision string, or for fp16 a plugin carrying our GradScaler."""
    if precision != "16-mixed" or accelerator != "cuda":
        return {"precision": precision}
    scaler = torch.amp.GradScaler(
        "cuda", init_scale=cfg.scaler_init_scale, growth_factor=cfg.scaler_growth_factor,
        backoff_factor=cfg.scaler_backoff_factor, growth_interval=cfg.scaler_growth_interval)
    return {"plugins": [MixedPrecision("16-mixed", "cuda", scaler=scaler)]}


GROUP = ConfigGroup("precision", __name__, "numeric format, TF32, channels_last, the fp16 GradScaler",
                    lambda values: check_keys("precision", values, PrecisionConfig), keys=PrecisionConfig)
