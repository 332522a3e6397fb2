"""The non-finite guard, decided on the device: a NaN step moves neither the weights nor the
optimizer state, through a fused kernel's `found_inf` or by putting a foreach optimizer back (also
on its very first step); the first bad parameter is named; with several processes all skip when
any saw a bad step; the counters are read at log steps, where enough bad steps in a row (even ones
between two reads) stop the run with a diagnostic checkpoint; under an fp16 GradScaler it only
counts until the scale is spent; off checks nothing."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import trainer.groups.nonfinite as nonfinite
from tests.helpers import fake_trainer_with_log_steps
from trainer.groups.nonfinite import NonFiniteGuard, NonFiniteTraining
from trainer.infra.step_gradients import steps_in_kernel


class Module(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        self.logged = []

    def forward(self, x):
        return self.body(x)

    def log(self, name, value, **kwargs):
        self.logged.append((name, value))


def fake_trainer(tmp_path, step=0, scaler=None, world_size=1, log_every_n_steps=1):
    saved = []

    def save_checkpoint(path, weights_only=None):
        Path(path).write_bytes(b"checkpoint")
        saved.append(path)

    return fake_trainer_with_log_steps(global_step=step, precision_plugin=SimpleNamespace(scaler=scaler),
                                       default_root_dir=str(tmp_path), save_checkpoint=save_checkpoint, saved=saved,
                                       world_size=world_size, log_every_n_steps=log_every_n_steps)


def step(module, optimizer, guard, trainer, poison=False):
    """One step in Lightning's order: backward, the hook, the optimizer's step, the batch's end."""
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(trainer.global_step))
    loss = module(x).square().mean() * (float("nan") if poison else 1.0)
    guard.on_before_backward(trainer, module, loss)
    loss.backward()
    guard.on_before_optimizer_step(trainer, module, optimizer)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    trainer.global_step += 1
    guard.on_train_batch_end(trainer, module, None, None, 0)


OPTIMIZERS = {
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1, foreach=True),
    "sgd_foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1, foreach=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.1, fused=True),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1, fused=True),
}


def same_state(before, after):
    for index, values in before["state"].items():
        for key, value in values.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(after["state"][index][key])), (index, key)


@pytest.mark.parametrize("make", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_a_nan_step_moves_neither_weights_nor_optimizer_state(tmp_path, make):
    module, guard, trainer = Module(), NonFiniteGuard(), fake_trainer(tmp_path)
    optimizer = make(module.parameters())
    assert steps_in_kernel(optimizer) == bool(optimizer.defaults.get("fused"))
    step(module, optimizer, guard, trainer)
    weights, state = copy.deepcopy(module.state_dict()), copy.deepcopy(optimizer.state_dict())
    step(module, optimizer, guard, trainer, poison=True)
    assert all(torch.equal(weights[k], v) for k, v in module.state_dict().items())
    same_state(state, optimizer.state_dict())
    assert not hasattr(optimizer, "found_inf")  # a later step must not see this one's flag
    assert guard.skipped_steps == 1 and guard.skipped_at == [1]
    assert guard.first_nonfinite == {"step": 1, "parameter": "body.0.weight"}
    step(module, optimizer, guard, trainer)  # a good step applies again and resets the run of bad ones
    assert not torch.equal(weights["body.0.weight"], module.state_dict()["body.0.weight"])
    assert guard.consecutive == 0


@pytest.mark.parametrize("make", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_a_nan_first_step_leaves_the_optimizer_as_fresh_as_it_was(tmp_path, make):
    """The first step creates the optimizer's state: skipped, it must be the fresh state, so the
    next good step does exactly what a first step does."""
    torch.manual_seed(0)
    module, guard, trainer = Module(), NonFiniteGuard(), fake_trainer(tmp_path)
    twin = copy.deepcopy(module)
    optimizer, twin_optimizer = make(module.parameters()), make(twin.parameters())
    step(module, optimizer, guard, trainer, poison=True)
    step(module, optimizer, guard, trainer)
    twin_trainer = fake_trainer(tmp_path, step=1)
    step(twin, twin_optimizer, NonFiniteGuard(mode="off"), twin_trainer)
    assert all(torch.equal(a, b) for a, b in zip(module.state_dict().values(), twin.state_dict().values()))


def test_with_several_processes_all_skip_when_any_saw_a_non_finite_step(tmp_path, monkeypatch):
    # This process's loss and gradients are finite, another process's loss was not: stepping
    # alone would leave the replicas apart, so this process skips too.
    others_bad = {"flag": True}
    seen = []

    def any_process(flag):
        # The flag is a found_inf (0-d float, 1.0: bad), or-ed over processes as the all-reduce does (MAX).
        seen.append(flag.clone())
        return torch.maximum(flag, torch.tensor(float(others_bad["flag"])))

    monkeypatch.setattr(nonfinite, "_any_process", any_process)
    module, guard = Module(), NonFiniteGuard()
    trainer = fake_trainer(tmp_path, world_size=2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    weights = copy.deepcopy(module.state_dict())
    step(module, optimizer, guard, trainer)
    assert [bool(s) for s in seen] == [False] and guard.skipped_steps == 1
    assert guard.first_nonfinite == {"step": 0, "parameter": "(another process's loss or gradient shard; this process's were finite)"}
    assert all(torch.equal(weights[k], v) for k, v in module.state_dict().items())
    others_bad["flag"] = False
    step(module, optimizer, guard, trainer)
    assert guard.skipped_steps == 1 and not torch.equal(weights["body.0.weight"], module.state_dict()["body.0.weight"])


def test_the_first_parameter_named_is_where_the_nan_starts(tmp_path):
    module, guard, trainer = Module(), NonFiniteGuard(), fake_trainer(tmp_path)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    module(torch.randn(2, 4)).sum().backward()
    module.body[2].weight.grad[0, 0] = float("inf")
    guard.on_before_optimizer_step(trainer, module, optimizer)
    assert guard.summary()["first_nonfinite"]["parameter"] == "body.2.weight"


def test_max_consecutive_bad_steps_stop_at_the_log_step_with_a_diagnostic_checkpoint(tmp_path):
    module, guard, trainer = Module(), NonFiniteGuard(max_consecutive=3), fake_trainer(tmp_path, step=5)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    step(module, optimizer, guard, trainer, poison=True)
    step(module, optimizer, guard, trainer, poison=True)
    with pytest.raises(NonFiniteTraining) as stopped:
        step(module, optimizer, guard, trainer, poison=True)
    line = stopped.value.line()
    assert line.startswith("training: 3 steps in a row had a non-finite loss or gradient")
    assert "body.0.weight at step 5" in line and "optimizer.lr" in line
    assert trainer.saved == [str(tmp_path / "checkpoints" / "nonfinite-step000008.ckpt")]
    assert guard.summary()["diagnostic_checkpoint"] == trainer.saved[0]


def test_a_run_of_bad_steps_between_two_reads_is_not_missed(tmp_path):
    """Read every 10 steps: three bad steps, then good ones, still stop the run at the next read."""
    module, guard = Module(), NonFiniteGuard(max_consecutive=3)
    trainer = fake_trainer(tmp_path, step=1, log_every_n_steps=10)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    for poison in (True, True, True, False, False, False, False, False):
        step(module, optimizer, guard, trainer, poison=poison)
    assert trainer.saved == [] and guard.skipped_steps == 0  # not read yet: global step 9
    with pytest.raises(NonFiniteTraining, match="3 steps in a row"):
        step(module, optimizer, guard, trainer)
    assert guard.skipped_steps == 3 and guard.skipped_at == [1, 2, 3] and guard.consecutive == 0


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
        assert not hasattr(optimizer, "found_inf")
        optimizer.zero_grad(set_to_none=True)
        trainer.global_step += 1
        guard.on_train_batch_end(trainer, module, None, None, 0)
    assert guard.skipped_steps == 4 and trainer.saved == []
    trainer.precision_plugin.scaler.scale = 0.5  # the scale is spent and steps still overflow
    module(torch.randn(2, 4)).sum().backward()
    module.body[0].weight.grad.fill_(float("nan"))
    guard.on_before_optimizer_step(trainer, module, optimizer)
    trainer.global_step += 1
    with pytest.raises(NonFiniteTraining):
        guard.on_train_batch_end(trainer, module, None, None, 0)


def test_off_checks_nothing(tmp_path):
    module, guard, trainer = Module(), NonFiniteGuard(mode="off"), fake_trainer(tmp_path)
    module(torch.randn(2, 4)).sum().backward()
    module.body[0].weight.grad.fill_(float("nan"))
    guard.on_before_optimizer_step(trainer, module, torch.optim.SGD(module.parameters(), lr=0.1))
    assert guard.skipped_steps == 0 and module.body[0].weight.grad is not None


def test_norms_and_a_loss_summing_past_float32_are_a_bad_step_skipped_and_named(tmp_path):
    # Each value finite, their sum past float32's range: the flag (a float32 sum) says bad, the fused
    # optimizer skips, and the count read later agrees with the flag and says why.
    module, guard, trainer = nn.Linear(1, 1, bias=False), NonFiniteGuard(), fake_trainer(tmp_path)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, fused=True)
    before = module.weight.detach().clone()
    guard.on_before_backward(trainer, module, torch.tensor(2e38))
    module.weight.grad = torch.tensor([[2e38]])
    guard.on_before_optimizer_step(trainer, module, optimizer)
    optimizer.step()
    assert torch.equal(module.weight.detach(), before)
    assert guard.summary()["skipped_steps"] == 1
    assert guard.first_nonfinite["parameter"].startswith("(the norms and the loss together")


def test_a_change_of_the_parameters_with_gradients_reads_the_rows_before_it(tmp_path):
    # A layer unfrozen (or frozen) mid-run changes the row's width: the rows written so far are read
    # first, so a bad step before the change is still counted.
    module, guard = Module(), NonFiniteGuard()
    trainer = fake_trainer(tmp_path, log_every_n_steps=100)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    step(module, optimizer, guard, trainer, poison=True)
    module.body[0].weight.requires_grad_(False)
    step(module, optimizer, guard, trainer)
    assert guard.skipped_steps == 1 and guard.skipped_at == [0]
    assert guard.summary()["skipped_steps"] == 1


def test_an_epoch_with_skipped_steps_says_so_in_one_line_and_the_record_keeps_the_first_and_the_latest(
        tmp_path, caplog):
    """A NaN in train/loss's epoch mean is explained on screen at the epoch's end (how many steps of
    the epoch, of the run, the first with its parameter and the latest); an epoch without skips says
    nothing; the latest skipped step survives a checkpoint."""
    import logging

    module, guard = Module(), NonFiniteGuard()
    trainer = fake_trainer(tmp_path, step=0)
    trainer.is_global_zero, trainer.current_epoch = True, 0
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="trainer"):
        for epoch, poisoned in enumerate(((1,), (), (6, 8))):
            trainer.current_epoch = epoch
            guard.on_train_epoch_start(trainer, module)
            for index in range(3):
                step(module, optimizer, guard, trainer, poison=3 * epoch + index in poisoned)
            guard.on_train_epoch_end(trainer, module)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("nonfinite: 1 step of epoch 1 skipped (a NaN/Inf loss or gradient;")
    assert lines[0].endswith("1 in the run, the first at step 1 in body.0.weight")
    assert lines[1].startswith("nonfinite: 2 steps of epoch 3 skipped")
    assert lines[1].endswith("3 in the run, the first at step 1 in body.0.weight, the latest at step 8")
    summary = guard.summary()
    assert summary["skipped_at"] == [1, 6, 8] and summary["last_skipped"] == 8
    assert summary["first_nonfinite"] == {"step": 1, "parameter": "body.0.weight"}
    resumed = NonFiniteGuard()
    resumed.load_state_dict(guard.state_dict())
    assert resumed.summary() == summary
    older = {k: v for k, v in guard.state_dict().items() if k != "last_skipped"}  # written before it was kept
    resumed.load_state_dict(older)
    assert resumed.last_skipped == 8
