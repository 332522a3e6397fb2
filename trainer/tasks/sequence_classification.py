"""task=sequence_classification: a label per sequence of token ids (sentiment, routing, tagging
tickets), or several (multi-label). Batches are (ids, labels): ids N x L padded with the data's
pad id, labels N integers, or N x C multi-hot floats for multi-label data. The loss is
cross-entropy (binary cross-entropy per label for multi-label), label smoothing optional; the
metrics accuracy, macro-F1 and, for two classes or multi-label, AUROC. A batch counts as its
sequences (the unit the lr and weight-decay rules scale by); the throughput meter reports tokens/s
beside them (padding is not a token) and MFU per token."""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import Metric
from torchmetrics.classification import (BinaryAUROC, MulticlassAccuracy, MulticlassF1Score, MultilabelAccuracy,
                                         MultilabelAUROC, MultilabelF1Score)

from trainer.data.base import DataInfo, SequenceRecord
from trainer.tasks.classification import classification_loss
from trainer.tasks.metrics import Accuracy, StepUpdate
from trainer.tasks.protocol import TaskDefinition


def multi_label_loss(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Binary cross-entropy per label in fp32, each target pulled `label_smoothing` towards 1/2."""
    targets = targets.float()
    if label_smoothing:
        targets = targets * (1.0 - label_smoothing) + 0.5 * label_smoothing
    return F.binary_cross_entropy_with_logits(logits.float(), targets)


class SequenceClassification(TaskDefinition):
    """A label (or several) per sequence; the network maps token ids (N x L) to one logit a class."""

    unit: ClassVar[str] = "samples"
    rate_unit: ClassVar[str | None] = "tokens"
    data_kinds: ClassVar[tuple[str, ...]] = ("sequences",)
    model_inputs: ClassVar[tuple[str, ...]] = ("num_classes", "vocab_size")
    regularization: ClassVar[tuple[str, ...]] = ("label_smoothing",)
    objective: ClassVar[str] = "val/acc"

    def __init__(self) -> None:
        self.num_classes = 0
        self.multi_label = False
        self.pad_id = 0
        self.vocab_size = 0
        self.max_length = 0
        self.label_smoothing = 0.0

    def bind(self, info: DataInfo) -> None:
        super().bind(info)
        record = info.record
        assert isinstance(record, SequenceRecord)  # data_kinds: refused in one line before a bind otherwise
        self.num_classes, self.multi_label, self.pad_id = info.num_classes, record.multi_label, record.pad_id
        self.vocab_size, self.max_length = record.vocab_size, record.sequence_length

    def use_regularization(self, label_smoothing: float, mixing: Any) -> None:
        self.label_smoothing = label_smoothing

    def rate_units_in(self, batch: Any) -> int | torch.Tensor:
        # A device tensor: the meter sums it on the device and reads it once a window (no sync a step).
        return (self.inputs(batch) != self.pad_id).sum()

    def loss(self, outputs: Any, targets: Any, training: bool) -> torch.Tensor:
        smoothing = self.label_smoothing if training else 0.0
        if self.multi_label:
            return multi_label_loss(outputs, targets, smoothing)
        return classification_loss(outputs, targets, smoothing)

    def check_outputs(self, outputs: Any, targets: Any) -> str | None:
        if not isinstance(outputs, torch.Tensor) or outputs.ndim != 2:
            shape = " x ".join(map(str, outputs.shape)) if isinstance(outputs, torch.Tensor) else type(outputs).__name__
            return (f"it returns {shape} for a batch of sequences; allowed: logits of batch x classes "
                    f"({self.num_classes})")
        if outputs.shape[1] != self.num_classes:
            return (f"its head gives {outputs.shape[1]} outputs a sequence, the data have {self.num_classes} "
                    "classes; allowed: one output a class (the model's num_classes)")
        return None

    def metrics(self, split: str) -> Mapping[str, Metric]:
        classes = self.num_classes
        if self.multi_label:
            if split == "train":
                return {}
            return {"acc": MultilabelAccuracy(classes, average="micro"), "f1": MultilabelF1Score(classes, average="macro"),
                    "auroc": MultilabelAUROC(classes, average="macro")}
        if split == "train":  # updated every training step: the lean one (the same value)
            return {"acc": Accuracy()}
        metrics: dict[str, Metric] = {"acc": MulticlassAccuracy(classes, average="micro"),
                                      "f1": MulticlassF1Score(classes, average="macro")}
        if classes == 2:
            metrics["auroc"] = BinaryAUROC()
        return metrics

    def update_metrics(self, metrics: Mapping[str, Metric], outputs: Any, targets: Any) -> None:
        for name, metric in metrics.items():
            if isinstance(metric, StepUpdate):
                metric.add_step(outputs, targets)  # the training accuracy, every step: the lean path
            elif self.multi_label:
                metric.update(outputs.detach().float(), targets.long())
            elif name == "auroc":  # the positive class's probability
                metric.update(outputs.detach().float().softmax(dim=-1)[:, 1], targets)
            else:
                metric.update(outputs.detach(), targets)

    def example_batch(self, size: int, device: torch.device) -> tuple[Any, Any]:
        # Full-length sequences of ids above the special tokens: the largest batch the data can give.
        ids = torch.randint(4, max(self.vocab_size, 5), (size, self.max_length), device=device)
        if self.multi_label:
            return ids, torch.randint(0, 2, (size, self.num_classes), device=device).float()
        return ids, torch.randint(0, self.num_classes, (size,), device=device)

    def flops_per_unit(self, net: nn.Module) -> tuple[int | None, str]:
        """Per token, from the network's own count (trainer.models.encoder.Encoder: 6N plus attention at
        the maximum length); a network without one leaves MFU out (a batch's tokens vary)."""
        count = getattr(getattr(net, "_orig_mod", net), "flops_per_token", None)
        if callable(count):
            flops, how = count(self.max_length)
            return int(flops), how
        return None, "the network has no flops_per_token: MFU per token left out (a sequence's length varies)"

    def refusals(self, settings: Mapping[str, Any]) -> list[tuple[str, str, str]]:
        compiled = settings.get("compile", {})
        if compiled.get("mode", "off") != "off" and compiled.get("dynamic") is False:
            return [("compile.dynamic", "false with sequences padded per batch: every padded length would compile "
                     "a graph of its own", "true, or null (dynamic shapes for batches of varying length)")]
        return []

    def describe(self) -> str:
        kind = "multi-label" if self.multi_label else "single-label"
        loss = "binary cross-entropy per label" if self.multi_label else "cross-entropy"
        return (f"{kind} sequence classification of {self.num_classes} classes: {loss}, accuracy, macro-F1"
                f"{', AUROC' if self.multi_label or self.num_classes == 2 else ''}; batches in sequences "
                f"(at most {self.max_length} tokens), tokens/s beside")

    def hyperparameters(self) -> dict[str, Any]:
        return {**super().hyperparameters(), "num_classes": self.num_classes, "multi_label": self.multi_label,
                "vocab_size": self.vocab_size, "max_length": self.max_length}
