"""The `compile` group: torch.compile of the network, in place."""

from __future__ import annotations

from torch import nn

from trainer.config import CompileConfig


def resolve_compile_mode(mode: str, accelerator: str) -> tuple[str, str]:
    """`auto` compiles on CUDA only: on CPU, Inductor's compile time (minutes for a ResNet) buys
    little for the models this framework trains, so compiling there is an explicit choice."""
    if mode != "auto":
        return mode, f"{mode} (as configured)"
    if accelerator == "cuda":
        return "default", "auto -> default (CUDA)"
    return "off", f"auto -> off (no CUDA; compile=default compiles on {accelerator} too)"


def apply_compile(net: nn.Module, cfg: CompileConfig, accelerator: str = "cpu") -> tuple[str, str]:
    """Compile `net` in place; return the mode used and how it was chosen.

    `nn.Module.compile` (not `torch.compile(net)`) keeps the module and its state-dict keys as they
    are, so checkpoints never carry `_orig_mod.` prefixes.
    """
    mode, how = resolve_compile_mode(cfg.mode, accelerator)
    if mode == "off":
        return mode, how + "; eager"
    net.compile(mode=mode, fullgraph=cfg.fullgraph, dynamic=cfg.dynamic)
    return mode, f"{how}; torch.compile fullgraph={cfg.fullgraph} dynamic={cfg.dynamic}"
