"""The non-finite guard: a NaN step moves neither the weights nor the AdamW/SGD state and the
first bad parameter is named; with several processes all skip when any saw a bad step; enough
bad steps in a row stop the run with a diagnostic checkpoint; under an fp16 GradScaler it only
counts until the scale is spent; off checks nothing."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from trainer.groups.nonfinite import NonFiniteGuard, NonFiniteTraining


class Module(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.logged = []

    def forward(self, x):
        return self.body(x)

    def log(self, name, value, **kwargs):
        self.logged.append((name, value))


def fake_trainer(tmp_path, step=0, scaler=None, others_finite=None):
    """`others_finite`: a second process that saw a finite (True) or non-finite (False) step."""
    saved = []
    decisions = []

    def reduce_boolean_decision(decision, all=True):
        decisions.append(decision)
        return decision and others_finite if all else decision or others_finite

    def save_checkpoint(path, weights_only=None):
        Path(path).write_bytes(b"checkpoint")
        saved.append(path)

    return SimpleNamespace(global_step=step, precision_plugin=SimpleNamespace(scaler=scaler),
                           default_root_dir=str(tmp_path), save_checkpoint=save_checkpoint, saved=saved,
                           world_size=1 if others_finite is None else 2, decisions=decisions,
                           strategy=SimpleNamespace(reduce_boolean_decision=reduce_boolean_decision))


def step(module, optimizer, guard, trainer, poison=False):
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(trainer.global_step))
    loss = module(x).square().mean() * (float("nan") if poison else 1.0)
    guard.on_before_backward(trainer, module, loss)
    loss.backward()
    guard.on_before_optimizer_step(trainer, module, optimizer)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    trainer.global_step += 1


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1, foreach=True),
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1, foreach=True)], ids=["adamw", "sgd"])
def test_a_nan_step_moves_neither_weights_nor_optimizer_state(tmp_path, make):
    module, guard, trainer = Module(), NonFiniteGuard(), fake_trainer(tmp_path)
    optimizer = make(module.parameters())
    step(module, optimizer, guard, trainer)
    weights, state = copy.deepcopy(module.state_dict()), copy.deepcopy(optimizer.state_dict())
    step(module, optimizer, guard, trainer, poison=True)
    assert all(torch.equal(weights[k], v) for k, v in module.state_dict().items())
    after = optimizer.state_dict()["state"]
    for index, values in state["state"].items():
        for key, value in values.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(after[index][key])), (index, key)
    assert guard.skipped_steps == 1 and guard.skipped_at == [1]
    assert guard.first_nonfinite == {"step": 1, "parameter": "body.0.weight"}
    step(module, optimizer, guard, trainer)  # a good step applies again and resets the run of bad ones
    assert not torch.equal(weights["body.0.weight"], module.state_dict()["body.0.weight"])
    assert guard.consecutive == 0


def test_with_several_processes_all_skip_when_any_saw_a_non_finite_step(tmp_path):
    # This process's loss and gradients are finite, another process's loss was not: stepping
    # alone would leave the replicas apart, so this process skips too.
    module, guard = Module(), NonFiniteGuard()
    trainer = fake_trainer(tmp_path, others_finite=False)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    weights = copy.deepcopy(module.state_dict())
    step(module, optimizer, guard, trainer)
    assert trainer.decisions == [True] and guard.skipped_steps == 1
    assert guard.first_nonfinite == {"step": 0, "parameter": "(another process's loss or gradient shard; this process's were finite)"}
    assert all(torch.equal(weights[k], v) for k, v in module.state_dict().items())
    agreeing = fake_trainer(tmp_path, others_finite=True)
    step(module, optimizer, guard, agreeing)
    assert guard.skipped_steps == 1 and not torch.equal(weights["body.0.weight"], module.state_dict()["body.0.weight"])


def test_the_first_parameter_named_is_where_the_nan_starts(tmp_path):
    module, guard, trainer = Module(), NonFiniteGuard(), fake_trainer(tmp_path)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    module(torch.randn(2, 4)).sum().backward()
    module.body[2].weight.grad[0, 0] = float("inf")
    guard.on_before_optimizer_step(trainer, module, optimizer)
    assert guard.first_nonfinite["parameter"] == "body.2.weight"


def test_max_consecutive_bad_steps_stop_with_a_diagnostic_checkpoint(tmp_path):
    module, guard, trainer = Module(), NonFiniteGuard(max_consecutive=3), fake_trainer(tmp_path, step=5)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    step(module, optimizer, guard, trainer, poison=True)
    step(module, optimizer, guard, trainer, poison=True)
    with pytest.raises(NonFiniteTraining) as stopped:
        step(module, optimizer, guard, trainer, poison=True)
    line = stopped.value.line()
    assert line.startswith("training: 3 steps in a row had a non-finite loss or gradient")
    assert "body.0.weight at step 5" in line and "optimizer.lr" in line
    assert trainer.saved == [str(tmp_path / "checkpoints" / "nonfinite-step000007.ckpt")]
    assert guard.summary()["diagnostic_checkpoint"] == trainer.saved[0]


class FakeScaler:
    def __init__(self, scale):
        self.scale = scale

    def is_enabled(self):
        return True

    def get_scale(self):
        return self.scale


def test_under_a_grad_scaler_the_guard_counts_and_leaves_the_skip_to_the_scaler(tmp_path):
    module, guard = Module(), NonFiniteGuard(max_consecutive=2)
    trainer = fake_trainer(tmp_path, scaler=FakeScaler(1024.0))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    for _ in range(4):
        module(torch.randn(2, 4)).sum().backward()
        module.body[0].weight.grad.fill_(float("inf"))
        guard.on_before_optimizer_step(trainer, module, optimizer)
        assert module.body[0].weight.grad is not None  # the scaler's own step() skips it
        optimizer.zero_grad(set_to_none=True)
    assert guard.skipped_steps == 4 and trainer.saved == []
    trainer.precision_plugin.scaler.scale = 0.5  # the scale is spent and steps still overflow
    module(torch.randn(2, 4)).sum().backward()
    module.body[0].weight.grad.fill_(float("nan"))
    with pytest.raises(NonFiniteTraining):
        guard.on_before_optimizer_step(trainer, module, optimizer)


def test_off_checks_nothing(tmp_path):
    module, guard, trainer = Module(), NonFiniteGuard(mode="off"), fake_trainer(tmp_path)
    module(torch.randn(2, 4)).sum().backward()
    module.body[0].weight.grad.fill_(float("nan"))
    guard.on_before_optimizer_step(trainer, module, torch.optim.SGD(module.parameters(), lr=0.1))
    assert guard.skipped_steps == 0 and module.body[0].weight.grad is not None
