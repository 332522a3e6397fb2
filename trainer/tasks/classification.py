"""task=classification: integer labels, cross-entropy, accuracy (and top-5 from ten classes on)."""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Mapping, Optional

import torch
import torch.nn.functional as F
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy

from trainer.data.base import DataInfo
from trainer.tasks.metrics import Accuracy, StepUpdate
from trainer.tasks.protocol import TaskDefinition

#: Top-5 accuracy, as ImageNet recipes report it, from this many classes on (below, it says little).
TOP5_MIN_CLASSES = 10


def classification_loss(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Cross-entropy in fp32 whatever the autocast dtype: log-softmax of half logits loses precision.
    `targets`: integer labels, or class probabilities (N x classes) from mixup/cutmix; smoothing
    applies to both."""
    return F.cross_entropy(logits.float(), targets, label_smoothing=label_smoothing)


def dominant_labels(targets: torch.Tensor) -> torch.Tensor:
    """The class each target weighs most: the label itself, or a mixed target's larger share
    (what the training accuracy of a mixed batch is measured against)."""
    return targets.argmax(dim=1) if targets.ndim == 2 else targets


class Classification(TaskDefinition):
    """A label per sample; the network returns one logit per class."""

    unit: ClassVar[str] = "samples"
    data_kinds: ClassVar[tuple[str, ...]] = ("images", "features")
    model_inputs: ClassVar[tuple[str, ...]] = ("num_classes",)
    regularization: ClassVar[tuple[str, ...]] = ("label_smoothing", "mixing")
    objective: ClassVar[str] = "val/acc"

    def __init__(self) -> None:
        self.num_classes = 0
        # Label smoothing shapes the training loss only: validation and test losses stay the plain
        # cross-entropy, comparable between runs with and without it (as timm reports them).
        self.label_smoothing = 0.0
        self.mixing: Optional[Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = None

    def bind(self, info: DataInfo) -> None:
        super().bind(info)
        self.num_classes = info.num_classes

    def use_regularization(self, label_smoothing: float, mixing: Any) -> None:
        self.label_smoothing = label_smoothing
        self.mixing = mixing

    def training_batch(self, batch: Any) -> Any:
        images, labels = batch
        if self.mixing is not None:
            return self.mixing(images, labels)
        return images, labels

    def loss(self, outputs: Any, targets: Any, training: bool) -> torch.Tensor:
        return classification_loss(outputs, targets, self.label_smoothing if training else 0.0)

    def check_outputs(self, outputs: Any, targets: Any) -> str | None:
        if isinstance(outputs, torch.Tensor) and outputs.ndim == 2 and outputs.shape[1] != self.num_classes:
            return (f"its head gives {outputs.shape[1]} outputs a sample (outputs {' x '.join(map(str, outputs.shape))}), "
                    f"the data have {self.num_classes} classes; allowed: one output a class (the model's num_classes)")
        return None

    def metrics(self, split: str) -> Mapping[str, Metric]:
        if split == "train":  # updated every training step: the lean one (the same value)
            return {"acc": Accuracy()}
        metrics: dict[str, Metric] = {"acc": MulticlassAccuracy(self.num_classes, average="micro")}
        if self.num_classes >= TOP5_MIN_CLASSES:
            metrics["acc5"] = MulticlassAccuracy(self.num_classes, top_k=5, average="micro")
        return metrics

    def update_metrics(self, metrics: Mapping[str, Metric], outputs: Any, targets: Any) -> None:
        # A mixed batch's accuracy counts the class its target weighs most.
        labels = dominant_labels(targets)
        for metric in metrics.values():
            if isinstance(metric, StepUpdate):
                metric.add_step(outputs, labels)  # the training accuracy, every step: the lean path
            else:
                metric.update(outputs.detach(), labels)

    def example_batch(self, size: int, device: torch.device) -> tuple[Any, Any]:
        inputs = torch.randn(size, *self.info.input_shape(), device=device)
        return inputs, torch.randint(0, self.num_classes, (size,), device=device)

    def describe(self) -> str:
        return f"classification of {self.num_classes} classes: cross-entropy, accuracy; batches in samples"

    def hyperparameters(self) -> dict[str, Any]:
        return {**super().hyperparameters(), "num_classes": self.num_classes}
