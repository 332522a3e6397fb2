"""Configuration-driven PyTorch training that applies the GPU best practices by default and
measures what they buy.

The command line is `python train.py` (Hydra); this is the public Python surface, for notebooks,
scripts and a team's own code. Everything else in the package may change without notice.

Names are imported on first use (PEP 562): every `python train.py` imports this package before
Hydra composes, and an error or `--help` should not pay for importing torch and Lightning."""

from __future__ import annotations

import importlib
from typing import Any

#: Public name -> the module that defines it.
_PUBLIC = {
    # a run, and the config it is made from
    "run": "trainer.run",
    "validate": "trainer.configuration.spec",
    "choice_config": "trainer.configuration.spec",
    "RunSpec": "trainer.configuration.spec",
    "UserError": "trainer.infra.errors",
    # the phases' products
    "Plan": "trainer.phases.plan",
    "OptimizerRecipe": "trainer.groups.optimizer.build",
    "ClassificationTask": "trainer.task",
    "TrainingTask": "trainer.task",
    # tasks: the protocol a team's own task follows, and the shipped ones
    "TaskDefinition": "trainer.tasks.protocol",
    "Classification": "trainer.tasks.classification",
    "LanguageModel": "trainer.tasks.language_model",
    # data modules and models
    "DataModule": "trainer.data.base",
    "ImageData": "trainer.data.base",
    "ImageClassificationData": "trainer.data.base",  # DataModule's former name
    "DataInfo": "trainer.data.base",
    "ImageRecord": "trainer.data.base",
    "TokenRecord": "trainer.data.base",
    "FeatureRecord": "trainer.data.base",
    "KindRecord": "trainer.data.base",
    "DigitsDataModule": "trainer.data.digits",
    "SyntheticDataModule": "trainer.data.synthetic",
    "ImageFolderDataModule": "trainer.data.imagefolder",
    "CIFAR10DataModule": "trainer.data.cifar10",
    "SmallCNN": "trainer.models.small_cnn",
    "build_resnet": "trainer.models.resnet",
    "SelfAttention": "trainer.models.attention",
    "GPT": "trainer.models.gpt",
    "TextData": "trainer.data.text",
    "fuse_for_inference": "trainer.models.fuse",
    "apply_activation_checkpointing": "trainer.models.activation_checkpointing",
    # callbacks usable in any Lightning Trainer, and the clipping rules
    "GradientClipping": "trainer.groups.clipping",
    "ClippingRule": "trainer.groups.clipping",
    "Percentile": "trainer.groups.clipping",
    "NonFiniteGuard": "trainer.groups.nonfinite",
    "ThroughputMeter": "trainer.callbacks.throughput",
    # checkpoints, reports, measurement
    "load_checkpoint": "trainer.infra.checkpoint_files",
    "export_safetensors": "trainer.deploy.export",
    "write_comparison": "trainer.measure.comparison",
    "fingerprint": "trainer.infra.fingerprint",
    "training_flops_per_sample": "trainer.measure.mfu",
    "peak_flops": "trainer.measure.mfu",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'trainer' has no attribute '{name}'")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # the next lookup does not come back here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
