"""The `regularization` group (conf/regularization/, trainer/groups/regularization.py): mixup and cutmix
turn a batch's labels into class probabilities that sum to 1 and weigh each image's share of the
pixels; a batch left unmixed keeps its integer labels; label smoothing is the loss's, training
only; the task measures a mixed batch's training accuracy against its dominant class; and a wrong
value is one line naming the key."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import ON_CPU, compose
from trainer.configuration.spec import choice_config, validate
from trainer.groups.optimizer.build import OptimizerRecipe
from trainer.groups.regularization import BatchMixing, RegularizationConfig, describe
from trainer.tasks.classification import dominant_labels
from trainer.infra.errors import UserError
from trainer.task import ClassificationTask, classification_loss

CLASSES = 10


def config(**values: float) -> RegularizationConfig:
    base = dict(label_smoothing=0.0, mixup_alpha=0.0, cutmix_alpha=0.0, mix_prob=1.0, switch_prob=0.5)
    return RegularizationConfig(**{**base, **values})


def constant_images(n: int = 8, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Image i is the constant i+1 in every pixel, label i: a pixel says which image it came from."""
    values = torch.arange(1, n + 1, dtype=torch.float32).view(n, 1, 1, 1)
    return values.expand(n, 3, size, size).clone(), torch.arange(n) % CLASSES


@pytest.mark.parametrize("values", [dict(mixup_alpha=0.8), dict(cutmix_alpha=1.0),
                                    dict(mixup_alpha=0.8, cutmix_alpha=1.0)])
def test_mixed_targets_are_probabilities_that_sum_to_one(values):
    torch.manual_seed(0)
    mixing = BatchMixing(config(**values), CLASSES)
    for _ in range(20):
        images, labels = constant_images()
        mixed, targets = mixing(images, labels)
        assert mixed.shape == images.shape
        assert targets.shape == (8, CLASSES) and targets.dtype.is_floating_point
        assert torch.allclose(targets.sum(dim=1), torch.ones(8))
        assert (targets >= 0).all()
        # Only the image's own label and its neighbour's carry weight.
        assert set(targets[0].nonzero().flatten().tolist()) <= {0, 7}


def test_mixup_blends_each_image_with_its_neighbour_by_the_targets_weight():
    torch.manual_seed(1)
    images, labels = constant_images()
    mixed, targets = BatchMixing(config(mixup_alpha=0.8), CLASSES)(images, labels)
    lam = targets[1, 1].item()  # image 1's own share; its partner is image 0 (the batch rolled by one)
    assert 0 < lam < 1
    assert torch.allclose(mixed[1], lam * images[1] + (1 - lam) * images[0])


def test_cutmix_weighs_each_image_by_its_share_of_the_pixels():
    torch.manual_seed(2)
    for _ in range(10):
        images, labels = constant_images()
        mixed, targets = BatchMixing(config(cutmix_alpha=1.0), CLASSES)(images, labels)
        own = (mixed[1] == images[1]).float().mean().item()
        assert own == pytest.approx(targets[1, 1].item(), abs=1e-6)
        assert ((mixed[1] == images[1]) | (mixed[1] == images[0])).all()


def test_a_batch_left_unmixed_keeps_its_integer_labels():
    images, labels = constant_images()
    for mixing in (BatchMixing(config(mixup_alpha=0.8, mix_prob=0.0), CLASSES), BatchMixing(config(), CLASSES)):
        assert not mixing.active
        out, targets = mixing(images, labels)
        assert out is images and targets is labels


def test_mix_prob_mixes_about_that_share_of_batches():
    torch.manual_seed(3)
    mixing = BatchMixing(config(mixup_alpha=1.0, mix_prob=0.3), CLASSES)
    images, labels = constant_images()
    mixed = sum(mixing(images, labels)[1].ndim == 2 for _ in range(400))
    assert 80 < mixed < 160  # 120 expected; the binomial's sd is 9


def test_switch_prob_chooses_cutmix_that_share_of_the_time():
    torch.manual_seed(4)
    mixing = BatchMixing(config(mixup_alpha=1.0, cutmix_alpha=1.0, switch_prob=1.0), CLASSES)
    for _ in range(20):
        images, labels = constant_images()
        mixed, _ = mixing(images, labels)
        # cutmix only: every pixel is one image's or the other's, never a blend
        assert ((mixed[1] == images[1]) | (mixed[1] == images[0])).all()


def test_dominant_labels_are_the_larger_share():
    targets = torch.tensor([[0.7, 0.3, 0.0], [0.2, 0.0, 0.8]])
    assert dominant_labels(targets).tolist() == [0, 2]
    assert dominant_labels(torch.tensor([2, 1])).tolist() == [2, 1]


def test_label_smoothing_spreads_that_share_over_all_classes():
    logits = torch.randn(4, CLASSES)
    labels = torch.tensor([0, 3, 5, 9])
    eps = 0.1
    smooth = torch.full((4, CLASSES), eps / CLASSES)
    smooth[torch.arange(4), labels] += 1 - eps
    expected = -(smooth * F.log_softmax(logits, dim=1)).sum(dim=1).mean()
    assert classification_loss(logits, labels, eps).item() == pytest.approx(expected.item(), rel=1e-5)
    # mixed (probability) targets are smoothed the same way
    probs = F.one_hot(labels, CLASSES).float()
    assert classification_loss(logits, probs, eps).item() == pytest.approx(expected.item(), rel=1e-5)


def test_the_task_smooths_the_training_loss_only_and_counts_the_dominant_class():
    net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, CLASSES))
    optimizer, scheduler = choice_config("optimizer", "adamw"), choice_config("scheduler", "constant")
    task = ClassificationTask(net, CLASSES, OptimizerRecipe.for_network(net, optimizer, 0.01, 0.0), scheduler,
                              regularization=config(label_smoothing=0.2, mixup_alpha=1.0))
    logits, labels = torch.randn(4, CLASSES), torch.tensor([1, 2, 3, 4])
    assert task.training_loss(logits, labels) > classification_loss(logits, labels) - 1  # smoothed
    assert task.training_loss(logits, labels).item() == pytest.approx(
        classification_loss(logits, labels, 0.2).item())
    assert task.evaluation_loss(logits, labels).item() == pytest.approx(classification_loss(logits, labels).item())
    assert task.definition.mixing is not None and task.definition.mixing.active


def test_the_choices_compose_and_describe_themselves():
    for choice, words in (("off", "off"), ("label_smoothing", "label smoothing 0.1"),
                          ("mixup_cutmix", "mixup alpha 0.8 or cutmix alpha 1 (cutmix 50% of the time)")):
        spec = validate(compose([*ON_CPU, f"regularization={choice}"]))
        assert words in describe(spec.regularization)
    assert validate(compose(ON_CPU)).regularization.label_smoothing == 0.0  # off by default


@pytest.mark.parametrize("override, key", [("regularization.label_smoothing=1.5", "regularization.label_smoothing"),
                                           ("regularization.mixup_alpha=-1", "regularization.mixup_alpha"),
                                           ("regularization.mix_prob=2", "regularization.mix_prob"),
                                           ("+regularization.mixup=0.2", "regularization.mixup")])
def test_a_wrong_value_is_one_line_naming_the_key(override, key):
    with pytest.raises(UserError) as caught:
        validate(compose([*ON_CPU, override]))
    assert caught.value.where == key and "\n" not in str(caught.value)


def test_the_beta_draws_are_those_of_the_seeded_global_generator():
    """A resumed run restores torch's generator (trainer/callbacks/rng.py) and so mixes alike."""
    mixing = BatchMixing(config(mixup_alpha=0.8, cutmix_alpha=1.0, mix_prob=0.5), CLASSES)
    draws = []
    for _ in range(2):
        torch.manual_seed(7)
        draws.append([mixing(*constant_images())[1] for _ in range(5)])
    assert all(torch.equal(a, b) for a, b in zip(*draws))
    assert math.isfinite(float(draws[0][0].sum()))
