"""Selective activation checkpointing by stage name (non-reentrant): SmallCNN and ResNet-18 train
with the same loss, gradients and BatchNorm statistics as without it (dropout replayed in the
recompute, BatchNorm counted once where plain torch checkpointing counts it twice); state-dict
keys unchanged, so checkpoints load both ways; unknown or nested stages are one line naming the
key and the choices."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from trainer.infra.errors import UserError
from trainer.models import activation_checkpointing as ac
from trainer.models.activation_checkpointing import apply_activation_checkpointing, checkpointed_stages
from trainer.models.resnet import build_resnet
from trainer.models.small_cnn import SmallCNN


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    # features: 0 ConvBNAct(3,8), 1 ConvBNAct(8,8), 2 MaxPool, 3 ConvBNAct(8,16), 4 ConvBNAct(16,16)
    return SmallCNN(num_classes=10, widths=(8, 16), dropout=0.1)


def resnet18() -> nn.Module:
    torch.manual_seed(0)
    return build_resnet(10, arch="resnet18", image_size=(32, 32))


def train_steps(model: nn.Module, steps: int = 2, size: int = 8) -> tuple[list[torch.Tensor], dict]:
    """Forward, backward and an SGD step, `steps` times; returns the losses and the last grads."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    grads: dict[str, torch.Tensor] = {}
    for step in range(steps):
        data = torch.Generator().manual_seed(100 + step)
        x = torch.randn(4, 3, size, size, generator=data)
        y = torch.randint(0, 10, (4,), generator=data)
        optimizer.zero_grad()
        # Same seed before each forward: dropout masks must match between the two models.
        torch.manual_seed(1234 + step)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
        losses.append(loss.detach())
    return losses, grads


def assert_same_training(build, stages: list[str]) -> None:
    plain, checkpointed = build(), build()
    assert apply_activation_checkpointing(checkpointed, stages) == stages
    plain_losses, plain_grads = train_steps(plain)
    ckpt_losses, ckpt_grads = train_steps(checkpointed)

    for a, b in zip(plain_losses, ckpt_losses):
        assert torch.allclose(a, b, atol=1e-6)
    assert plain_grads.keys() == ckpt_grads.keys() and plain_grads
    for name in plain_grads:
        assert torch.allclose(plain_grads[name], ckpt_grads[name], atol=1e-6), name
    # BatchNorm running statistics and batch counters: a recompute must not count the batch twice.
    plain_state, ckpt_state = plain.state_dict(), checkpointed.state_dict()
    assert list(plain_state) == list(ckpt_state)
    for name, value in plain_state.items():
        if value.is_floating_point():
            assert torch.allclose(value, ckpt_state[name], atol=1e-6), name
        else:
            assert torch.equal(value, ckpt_state[name]), name
    counters = [v for k, v in ckpt_state.items() if k.endswith("num_batches_tracked")]
    assert counters and all(c.item() == 2 for c in counters)  # two steps, each counted once


def test_small_cnn_trains_identically_with_checkpointed_stages():
    # 'head' holds the dropout: its mask must be replayed exactly in the recompute.
    assert_same_training(small_cnn, ["features.1", "features.3", "head"])


def test_resnet18_trains_identically_with_checkpointed_layers():
    assert_same_training(resnet18, ["layer2", "layer3"])


def test_dropout_inside_a_stage_is_replayed_in_the_recompute():
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16, momentum=None), nn.ReLU(), nn.Dropout(0.5)),
            nn.Linear(16, 10),
        )

    plain, checkpointed = build(), build()
    apply_activation_checkpointing(checkpointed, ["0"])
    for model in (plain, checkpointed):
        model.train()
        torch.manual_seed(7)
        model(torch.ones(8, 6)).square().sum().backward()
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6), name
    # momentum=None (cumulative average) reads num_batches_tracked: still counted once.
    assert checkpointed[0][1].num_batches_tracked.item() == 1
    assert torch.allclose(plain[0][1].running_var, checkpointed[0][1].running_var)


def test_plain_torch_checkpoint_would_count_batchnorm_twice():
    # Why the guard exists: without it the recompute is a second training-mode forward.
    bn = nn.BatchNorm1d(4)
    torch_checkpoint(bn, torch.randn(8, 4, requires_grad=True), use_reentrant=False).sum().backward()
    assert bn.num_batches_tracked.item() == 2


def test_state_dict_keys_do_not_change_and_checkpoints_load_both_ways():
    plain, checkpointed = resnet18(), resnet18()
    apply_activation_checkpointing(checkpointed, ["layer2", "layer3"])
    assert list(plain.state_dict()) == list(checkpointed.state_dict())
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in checkpointed.named_parameters()]
    checkpointed.load_state_dict(plain.state_dict(), strict=True)
    plain.load_state_dict(checkpointed.state_dict(), strict=True)


def test_unknown_stage_is_a_user_error_naming_the_key_and_the_choices():
    with pytest.raises(UserError) as raised:
        apply_activation_checkpointing(resnet18(), ["layer3", "layer9"])
    line = raised.value.line()
    assert line.startswith("model.activation_checkpointing: no submodule named 'layer9'")
    assert "layer3" in line and "layer3.1" in line and "fc" in line
    assert "layer3.1.conv1" not in line  # only two levels: a short list

    with pytest.raises(UserError) as raised:
        apply_activation_checkpointing(small_cnn(), ["features.9"], key="model.ac")
    assert raised.value.line().startswith("model.ac: no submodule named 'features.9'")


def test_nested_stages_are_refused():
    model = resnet18()
    with pytest.raises(UserError, match="'layer3.0' is inside 'layer3'"):
        apply_activation_checkpointing(model, ["layer3", "layer3.0"])
    apply_activation_checkpointing(model, ["layer3"])
    with pytest.raises(UserError, match="inside 'layer3'"):
        apply_activation_checkpointing(model, ["layer3.1"])


def test_empty_list_is_a_no_op_and_repeats_are_harmless():
    model = small_cnn()
    assert apply_activation_checkpointing(model, []) == []
    assert checkpointed_stages(model) == []
    assert apply_activation_checkpointing(model, ["head", "features.0", "head"]) == ["head", "features.0"]
    assert apply_activation_checkpointing(model, ["head"]) == ["head"]
    assert checkpointed_stages(model) == ["features.0", "head"]  # module order
    # A bare string from a config is one name, not a list of letters.
    assert apply_activation_checkpointing(model, "features.1") == ["features.1"]  # type: ignore[arg-type]


class CountingCheckpoint:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return torch_checkpoint(*args, **kwargs)


def test_eval_and_no_grad_run_the_plain_forward(monkeypatch):
    counter = CountingCheckpoint()
    monkeypatch.setattr(ac, "checkpoint", counter)
    plain, checkpointed = resnet18().eval(), resnet18().eval()
    apply_activation_checkpointing(checkpointed, ["layer2", "layer3"])
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(plain(x), checkpointed(x))
    assert counter.calls == 0

    checkpointed.train()
    with torch.no_grad():
        checkpointed(x)
    assert counter.calls == 0


def test_training_forward_checkpoints_each_stage_once(monkeypatch):
    counter = CountingCheckpoint()
    monkeypatch.setattr(ac, "checkpoint", counter)
    model = small_cnn().train()
    apply_activation_checkpointing(model, ["features.1", "features.3", "head"])
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    assert counter.calls == 3
    model(torch.randn(2, 3, 16, 16))
    assert counter.calls == 6


def test_copies_checkpoint_their_own_modules(monkeypatch):
    # EMA and similar keep a deepcopy; its stages must run the copy's weights, not the original's.
    model = small_cnn()
    apply_activation_checkpointing(model, ["head"])
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert checkpointed_stages(clone) == ["head"]
        assert clone.head.forward.module is clone.head
        with torch.no_grad():
            for p in clone.parameters():
                p.zero_()
        clone.eval()
        assert not clone(torch.randn(2, 3, 8, 8)).any()
