"""The `precision` group: which Lightning precision plugin runs, and why."""

from __future__ import annotations

import torch

from trainer.errors import UserError

LIGHTNING_PRECISION = {"fp32": "32-true", "bf16_mixed": "bf16-mixed", "fp16_mixed": "16-mixed"}


def resolve_precision(name: str, accelerator: str) -> tuple[str, str]:
    """Return the Lightning precision string and a one-line derivation.

    ``auto``: bf16-mixed on CUDA devices with bf16 support (no GradScaler needed), fp16-mixed with
    a GradScaler on older CUDA devices, fp32 elsewhere.
    """
    cuda = accelerator == "cuda"
    bf16_ok = cuda and torch.cuda.is_bf16_supported()
    if name == "auto":
        if bf16_ok:
            return "bf16-mixed", "auto -> bf16-mixed (the GPU supports bf16)"
        if cuda:
            return "16-mixed", "auto -> 16-mixed with a GradScaler (the GPU has no bf16)"
        return "32-true", f"auto -> 32-true (no CUDA device; accelerator {accelerator})"
    if name == "fp16_mixed" and not cuda:
        # fp16 autocast with a GradScaler is a CUDA practice; a recipe written for a GPU still
        # runs here, in fp32, and says so.
        return "32-true", f"fp16_mixed -> 32-true (fp16 with a GradScaler needs CUDA; accelerator {accelerator})"
    if name == "bf16_mixed" and cuda and not bf16_ok:
        raise UserError("precision", f"bf16_mixed is not supported on {torch.cuda.get_device_name()}",
                        "fp16_mixed, fp32, auto")
    return LIGHTNING_PRECISION[name], f"{name} -> {LIGHTNING_PRECISION[name]} (as configured)"
