"""The `compile` group: torch.compile of the network, in place."""

from __future__ import annotations

from torch import nn

from trainer.config import CompileConfig


def apply_compile(net: nn.Module, cfg: CompileConfig) -> str:
    """Compile `net` in place and say what was done.

    `nn.Module.compile` (not `torch.compile(net)`) keeps the module and its state-dict keys as they
    are, so checkpoints never carry `_orig_mod.` prefixes.
    """
    if cfg.mode == "off":
        return "off (eager)"
    net.compile(mode=cfg.mode, fullgraph=cfg.fullgraph, dynamic=cfg.dynamic)
    return f"torch.compile mode={cfg.mode} fullgraph={cfg.fullgraph} dynamic={cfg.dynamic}"
