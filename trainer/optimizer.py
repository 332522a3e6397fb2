"""The `optimizer` group: torch optimizers from `SGDConfig` / `AdamWConfig`."""

from __future__ import annotations

from typing import Iterable, Union

import torch
from torch import nn

from trainer.config import AdamWConfig, SGDConfig


def build_optimizer(params: Iterable[nn.Parameter] | Iterable[dict], cfg: Union[SGDConfig, AdamWConfig],
                    lr: float | None = None, weight_decay: float | None = None) -> torch.optim.Optimizer:
    """`lr` and `weight_decay`, when given, are the effective values the run resolved."""
    lr = cfg.lr if lr is None else lr
    weight_decay = cfg.weight_decay if weight_decay is None else weight_decay
    if isinstance(cfg, SGDConfig):
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov,
                               weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, betas=cfg.betas, eps=cfg.eps, weight_decay=weight_decay)
