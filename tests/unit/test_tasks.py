"""The task protocol's shipped definitions, on their own: what a batch holds in the task's unit, the
losses and metrics the LightningModule logs from them, and the weighted means behind evaluation."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.data.base import DataInfo, ImageRecord, TokenRecord
from trainer.tasks.classification import Classification
from trainer.tasks.language_model import IGNORE_INDEX, LanguageModel, TokenAccuracy, language_model_loss
from trainer.tasks.metrics import Accuracy, Perplexity, WeightedMean


def text_info(vocab: int = 11, length: int = 6) -> DataInfo:
    return DataInfo(TokenRecord(vocab_size=vocab, sequence_length=length), sizes={"train": 10})


def test_a_language_model_counts_tokens_without_the_padding():
    task = LanguageModel()
    task.bind(text_info())
    targets = torch.tensor([[1, 2, 3, IGNORE_INDEX], [4, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]])
    assert int(task.units_in((torch.zeros_like(targets), targets))) == 4
    assert task.units_per_sample() == 6 and task.unit == "tokens"


def test_the_language_model_loss_is_the_mean_over_real_tokens():
    logits = torch.randn(2, 3, 5)
    targets = torch.tensor([[1, 2, IGNORE_INDEX], [0, IGNORE_INDEX, IGNORE_INDEX]])
    real = [(0, 0), (0, 1), (1, 0)]
    expected = sum(-torch.log_softmax(logits[i, j], -1)[targets[i, j]] for i, j in real) / 3
    assert language_model_loss(logits, targets).item() == pytest.approx(expected.item(), rel=1e-5)


def test_perplexity_is_exp_of_the_token_weighted_mean_loss_not_a_mean_of_perplexities():
    perplexity, mean = Perplexity(), WeightedMean()
    for loss, tokens in ((2.0, 1000), (4.0, 10)):
        perplexity.update(torch.tensor(loss), torch.tensor(tokens))
        mean.update(torch.tensor(loss), tokens)
    weighted = (2.0 * 1000 + 4.0 * 10) / 1010
    assert mean.compute().item() == pytest.approx(weighted, rel=1e-6)
    assert perplexity.compute().item() == pytest.approx(math.exp(weighted), rel=1e-5)
    assert perplexity.compute().item() < (math.exp(2.0) + math.exp(4.0)) / 2


def test_a_count_kept_on_the_host_is_in_every_read_of_the_states_and_gone_after_a_reset():
    """The training step's metrics keep the samples they count in a Python number (no operation a
    step): a compute, a forward between steps, the states a checkpoint saves and a merge each see
    them, as torchmetrics' own accuracy and a plain mean would."""
    from torchmetrics.classification import MulticlassAccuracy

    gen = torch.Generator().manual_seed(0)
    ours, reference = Accuracy(), MulticlassAccuracy(4, average="micro")
    for step in range(6):
        outputs, labels = torch.randn(3, 4, generator=gen), torch.randint(0, 4, (3,), generator=gen)
        if step == 3:
            ours(outputs, labels)  # a forward: torchmetrics sets the states aside and resets meanwhile
        else:
            ours.add_step(outputs, labels)
        reference.update(outputs, labels)
        if step == 4:
            assert int(ours.metric_state["total"]) == 15
    assert float(ours.compute()) == float(reference.compute())
    ours.add_step(torch.randn(2, 4, generator=gen), torch.zeros(2, dtype=torch.long))
    ours.reset()
    assert {key: int(value) for key, value in ours.metric_state.items()} == {"correct": 0, "total": 0}

    first, second = WeightedMean(), WeightedMean()
    first.add_step(torch.tensor(2.0))
    first.add_step(torch.tensor(4.0))
    second.add_step(torch.tensor(9.0))
    first.merge_state(second)
    assert first.compute().item() == pytest.approx(5.0)


def test_token_accuracy_leaves_the_padding_out():
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 1] = logits[0, 1, 3] = logits[0, 2, 0] = 5.0
    accuracy = TokenAccuracy()
    accuracy.update(logits, torch.tensor([[1, 2, IGNORE_INDEX]]))
    assert accuracy.compute().item() == pytest.approx(0.5)


def test_example_batches_have_the_datas_shape_and_the_tasks_targets():
    language = LanguageModel()
    language.bind(text_info(vocab=11, length=6))
    inputs, targets = language.example_batch(3, torch.device("cpu"))
    assert inputs.shape == targets.shape == (3, 6) and inputs.dtype == torch.long and int(inputs.max()) < 11
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # the targets are the next tokens
    classes = Classification()
    classes.bind(DataInfo(ImageRecord(1, (8, 8)), {"train": 10}, num_classes=4))
    images, labels = classes.example_batch(2, torch.device("cpu"))
    assert images.shape == (2, 1, 8, 8) and int(labels.max()) < 4


def test_classification_smooths_only_the_training_loss_and_mixes_only_when_asked():
    task = Classification()
    task.bind(DataInfo(ImageRecord(1, (2, 2)), {"train": 4}, num_classes=3))
    logits, labels = torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
    plain = task.loss(logits, labels, training=True)
    task.use_regularization(0.3, None)
    assert task.loss(logits, labels, training=True).item() != pytest.approx(plain.item())
    assert task.loss(logits, labels, training=False).item() == pytest.approx(plain.item())
    batch = (torch.zeros(4, 1, 2, 2), labels)
    assert task.training_batch(batch)[1] is labels
