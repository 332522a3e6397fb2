"""The `compile` group: torch.compile of the network, in place."""

from __future__ import annotations

from torch import nn

from trainer.configuration.spec import CompileConfig


def resolve_compile_mode(mode: str, accelerator: str) -> tuple[str, str]:
    """`auto` compiles on CUDA only: on CPU, Inductor's compile time (minutes for a ResNet) buys
    little for the models this framework trains, so compiling there is an explicit choice."""
    if mode != "auto":
        return mode, f"{mode} (as configured)"
    if accelerator == "cuda":
        return "default", "auto -> default (CUDA)"
    return "off", f"auto -> off (no CUDA; compile=default compiles on {accelerator} too)"


def apply_compile(net: nn.Module, mode: str, cfg: CompileConfig) -> None:
    """Compile `net` in place in the resolved `mode` (see `resolve_compile_mode`); ``off`` leaves it eager.

    `nn.Module.compile` (not `torch.compile(net)`) keeps the module and its state-dict keys as they
    are, so checkpoints never carry `_orig_mod.` prefixes.
    """
    if mode != "off":
        net.compile(mode=mode, fullgraph=cfg.fullgraph, dynamic=cfg.dynamic)
