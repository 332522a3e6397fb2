"""A team's own code for a table, as a team writes it from docs/tasks.md: the digits as rows of 64
numbers (data of kind "features"), an MLP, and a one-logit task (is the digit 5 or more? BCE,
validation AUROC). Each part takes a switch that makes one of the mistakes teams make
(tests/run/test_first_batch.py)."""

from __future__ import annotations

from typing import Any, ClassVar, Mapping

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

from trainer.data.base import DataInfo, DataModule, FeatureRecord
from trainer.tasks.protocol import TaskDefinition


class DigitRows(DataModule):
    """`dtype`: the features' dtype (float64: the mistake); `targets`: "flat" (N) or "column" (N x 1,
    the mistake); `said_features`: what inspect() says a row holds (None: the truth, 64); `train_rows`:
    the rows setup() trains on (0: the mistake, an empty training split)."""

    in_memory = True

    def __init__(self, dtype: str = "float32", targets: str = "flat", said_features: int | None = None,
                 train_rows: int = 1400, **loader: Any) -> None:
        super().__init__(**loader)
        self.dtype, self.target_shape, self.said_features = dtype, targets, said_features
        self.train_rows = train_rows

    def _rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = load_digits(return_X_y=True)
        features = torch.tensor(x / 16.0, dtype=getattr(torch, self.dtype))
        labels = torch.tensor(y >= 5, dtype=torch.float32)
        return features, labels.unsqueeze(1) if self.target_shape == "column" else labels

    def inspect(self) -> DataInfo:
        features = self.said_features or 64
        return DataInfo(FeatureRecord(in_features=features), sizes={"train": 1400, "val": 397, "test": 397},
                        sample_bytes=4 * features)

    def inference_preprocessing(self) -> dict[str, Any]:
        # What a served row must go through first (the model card records it): counts 0-16 to 0-1.
        return {"features": {"scale": 1 / 16}}

    def setup(self, stage: str | None = None) -> None:
        x, y = self._rows()
        self.train_set = TensorDataset(x[:self.train_rows], y[:self.train_rows])
        self.val_set = self.test_set = TensorDataset(x[1400:], y[1400:])


class RowNet(nn.Sequential):
    """`outputs`: 1 (a logit) or 2 (the mistake for a one-logit loss)."""

    def __init__(self, in_features: int, outputs: int = 1, hidden: int = 32) -> None:
        super().__init__(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, outputs))


class IsLarge(TaskDefinition):
    data_kinds: ClassVar[tuple[str, ...]] = ("features",)
    model_inputs: ClassVar[tuple[str, ...]] = ("in_features",)
    objective: ClassVar[str] = "val/auroc"

    def loss(self, outputs: Any, targets: Any, training: bool) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(outputs.squeeze(-1).float(), targets)

    def metrics(self, split: str) -> Mapping[str, Any]:
        from torchmetrics.classification import BinaryAUROC

        return {} if split == "train" else {"auroc": BinaryAUROC()}

    def update_metrics(self, metrics: Mapping[str, Any], outputs: Any, targets: Any) -> None:
        for metric in metrics.values():
            metric.update(outputs.squeeze(-1).float(), targets.long())


class NoLoss(IsLarge):
    """The mistake: a task that never says its loss."""

    loss = TaskDefinition.loss  # type: ignore[assignment]


class FixedHead(nn.Sequential):
    """An image network whose head was written for a two-class data set: it takes num_classes and
    keeps its own `head` (the mistake on ten-class digits)."""

    def __init__(self, num_classes: int, in_channels: int, image_size: list[int], head: int = 2) -> None:
        super().__init__(nn.Flatten(1), nn.Linear(in_channels * image_size[0] * image_size[1], head))
