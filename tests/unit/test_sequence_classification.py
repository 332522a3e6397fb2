"""task=sequence_classification on its own: the loss, the metrics and the checks for single- and
multi-label data, against torch's and torchmetrics' own definitions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torchmetrics.classification import BinaryAUROC, MulticlassF1Score

from trainer.data.base import DataInfo, SequenceRecord
from trainer.tasks.sequence_classification import SequenceClassification, multi_label_loss


def bound(classes: int, multi_label: bool = False) -> SequenceClassification:
    task = SequenceClassification()
    task.bind(DataInfo(SequenceRecord(vocab_size=50, sequence_length=16, pad_id=0, multi_label=multi_label),
                       {"train": 8, "val": 4, "test": 4}, num_classes=classes))
    return task


def test_single_label_loss_is_cross_entropy_with_smoothing_in_training_only():
    task = bound(3)
    task.use_regularization(0.1, None)
    logits, labels = torch.randn(5, 3), torch.tensor([0, 2, 1, 1, 0])
    assert torch.allclose(task.loss(logits, labels, training=True), F.cross_entropy(logits, labels, label_smoothing=0.1))
    assert torch.allclose(task.loss(logits, labels, training=False), F.cross_entropy(logits, labels))


def test_multi_label_loss_is_binary_cross_entropy_per_label_smoothed_towards_a_half():
    task = bound(4, multi_label=True)
    logits, targets = torch.randn(3, 4), torch.tensor([[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 0]]).float()
    assert torch.allclose(task.loss(logits, targets, training=False), F.binary_cross_entropy_with_logits(logits, targets))
    assert torch.allclose(multi_label_loss(logits, targets, 0.2),
                          F.binary_cross_entropy_with_logits(logits, targets * 0.8 + 0.1))


def test_binary_data_report_accuracy_macro_f1_and_auroc_of_the_positive_class():
    task = bound(2)
    metrics = task.metrics("val")
    assert set(metrics) == {"acc", "f1", "auroc"} and set(task.metrics("train")) == {"acc"}
    logits, labels = torch.randn(32, 2), torch.randint(0, 2, (32,))
    task.update_metrics(metrics, logits, labels)
    positive = logits.softmax(-1)[:, 1]
    assert metrics["auroc"].compute() == pytest.approx(float(BinaryAUROC()(positive, labels)))
    assert metrics["acc"].compute() == pytest.approx(float((logits.argmax(-1) == labels).float().mean()))
    assert metrics["f1"].compute() == pytest.approx(float(MulticlassF1Score(2, average="macro")(logits, labels)))
    # The training accuracy (the lean metric a step updates) gives the same value.
    train = task.metrics("train")
    task.update_metrics(train, logits, labels)
    assert train["acc"].compute() == pytest.approx(float(metrics["acc"].compute()))


def test_more_classes_have_no_auroc_and_multi_label_has_all_three():
    assert set(bound(5).metrics("test")) == {"acc", "f1"}
    task = bound(3, multi_label=True)
    metrics = task.metrics("val")
    assert set(metrics) == {"acc", "f1", "auroc"} and task.metrics("train") == {}
    targets = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 1]]).float()
    task.update_metrics(metrics, targets * 8 - 4, targets)  # confident and right
    assert all(float(metric.compute()) == pytest.approx(1.0) for metric in metrics.values())


def test_the_rate_is_counted_in_tokens_without_padding():
    task = bound(2)
    ids = torch.tensor([[2, 9, 9, 3, 0, 0, 0, 0], [2, 7, 3, 0, 0, 0, 0, 0]])
    assert task.unit == "samples" and task.rate_unit == "tokens"
    assert int(task.rate_units_in((ids, torch.tensor([0, 1])))) == 7 and task.units_in((ids, torch.tensor([0, 1]))) == 2


def test_a_head_of_the_wrong_width_or_shape_is_named():
    task = bound(3)
    assert task.check_outputs(torch.zeros(4, 3), torch.zeros(4)) is None
    assert "gives 2 outputs a sequence, the data have 3 classes" in task.check_outputs(torch.zeros(4, 2), torch.zeros(4))
    assert "logits of batch x classes" in task.check_outputs(torch.zeros(4, 8, 3), torch.zeros(4))


def test_example_batches_fill_the_maximum_length_with_real_tokens():
    ids, labels = bound(3).example_batch(4, torch.device("cpu"))
    assert ids.shape == (4, 16) and bool((ids >= 4).all()) and labels.shape == (4,)
    ids, targets = bound(3, multi_label=True).example_batch(2, torch.device("cpu"))
    assert targets.shape == (2, 3) and targets.dtype == torch.float32


def test_compile_without_dynamic_shapes_is_refused_and_mfu_needs_the_networks_count():
    task = bound(2)
    assert task.refusals({"compile": {"mode": "default", "dynamic": False}})[0][0] == "compile.dynamic"
    assert task.refusals({"compile": {"mode": "off", "dynamic": False}}) == []
    flops, how = task.flops_per_unit(torch.nn.Linear(2, 2))
    assert flops is None and "flops_per_token" in how

    class Counted(torch.nn.Linear):
        def flops_per_token(self, length: int) -> tuple[int, str]:
            return 1000 + length, "closed form"

    assert task.flops_per_unit(Counted(2, 2)) == (1016, "closed form")
