"""The optional parts of the package and what each needs (pyproject.toml's extras): a feature whose
extra is not installed stops in one line that names the pip command, before anything is built.

The core trains (torch, Lightning, Hydra, torchmetrics, the digits data, csv logs); `make install`
installs every extra, so the README's commands and CI use them all."""

from __future__ import annotations

import importlib.util

from trainer.infra.errors import UserError
from trainer.infra.versions import DISTRIBUTION

#: extra -> the modules it provides (checked without importing them).
EXTRAS: dict[str, tuple[str, ...]] = {
    "deploy": ("onnx", "onnxscript", "onnxruntime", "litserve", "aiohttp", "prometheus_client"),
    "sweeps": ("optuna", "hydra_plugins.hydra_optuna_sweeper"),
    "slurm": ("submitit", "hydra_plugins.hydra_submitit_launcher"),
    "timm": ("timm",),
    "shards": ("litdata", "boto3"),
    "wandb": ("wandb",),
    "tensorboard": ("tensorboard",),
    "text": ("tokenizers", "transformers"),
}


def missing_modules(extra: str) -> list[str]:
    missing = []
    for module in EXTRAS[extra]:
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # a parent package missing, or an import hook that refuses it
            found = False
        if not found:
            missing.append(module)
    return missing


def require(extra: str, feature: str) -> None:
    """Raise a one-line UserError naming `feature` and the pip command when `extra` is not installed."""
    missing = missing_modules(extra)
    if missing:
        raise UserError(feature, f"needs the '{extra}' extra ({', '.join(missing)} not installed)",
                        f"pip install '{DISTRIBUTION}[{extra}]'")
