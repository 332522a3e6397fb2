"""A team adds an optimizer and a schedule from its own folder, with no change to the framework: a
YAML in its conf/optimizer/ and conf/scheduler/ naming its own classes (`_target_`), found through
TRAINER_TEAM_DIRS. The run builds them with every practice of the group (the batch rule, no decay
on 1-D parameters, the kernel read from the class's signature, the schedule over Lightning's count
of steps), their keys are checked against the classes' own signatures, and what the constructor
refuses is one line before anything trains."""

from __future__ import annotations

import csv
import textwrap
from pathlib import Path

import pytest

from tests.helpers import ON_CPU, TINY, train_forked

pytestmark = pytest.mark.run

OPTIMIZER = '''
import torch


class SignDescent(torch.optim.Optimizer):
    """Steps every weight by lr x the sign of its (momentum-averaged) gradient, with decoupled decay."""

    def __init__(self, params, lr=0.01, weight_decay=0.0, momentum=0.0):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                average = self.state[p].setdefault("average", torch.zeros_like(p))
                average.mul_(group["momentum"]).add_(p.grad, alpha=1 - group["momentum"])
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(average.sign(), alpha=-group["lr"])
        return loss


def halving(optimizer, total_steps, every):
    """The lr halves every `every` optimizer steps."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** (step // every))
'''


def team_folder(root: Path) -> Path:
    team = root / "team"
    (team / "team_optim").mkdir(parents=True)
    (team / "team_optim" / "__init__.py").write_text(textwrap.dedent(OPTIMIZER))
    (team / "conf" / "optimizer").mkdir(parents=True)
    (team / "conf" / "optimizer" / "sign_descent.yaml").write_text(textwrap.dedent("""\
        name: sign_descent
        _target_: team_optim.SignDescent
        lr: 0.004
        weight_decay: 0.1
        ref_batch_size: 16
        lr_scaling: sqrt
        wd_scaling: none
        decay_norm_and_bias: false
        implementation: auto
        layer_decay: null
        find_min_lr: 1.0e-06
        find_max_lr: 1.0
        find_steps: 100
        momentum: 0.5
        """))
    (team / "conf" / "scheduler").mkdir(parents=True)
    (team / "conf" / "scheduler" / "halving.yaml").write_text(
        "name: halving\n_target_: team_optim.halving\ninterval: step\nevery: 2\n")
    return team


def test_a_teams_optimizer_and_schedule_train_with_the_groups_practices(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINER_TEAM_DIRS", str(team_folder(tmp_path)))
    result = train_forked([*TINY, *ON_CPU, "optimizer=sign_descent", "scheduler=halving", "trainer.max_steps=6",
                           "data.train_samples=24",
                           "trainer.log_every_n_steps=1"], tmp_path / "run")
    assert result.returncode == 0, result
    summary = result.summary
    derived = summary["derived"]
    # Batch 4 against the team's ref_batch_size 16: the sqrt rule halves the lr; weight decay as given.
    assert derived["optimizer.lr"]["how"] == "lr 0.004 at batch 16 -> 0.002 at batch 4 (sqrt rule, x0.5)"
    assert derived["optimizer.implementation"] == {"value": "for_loop",
                                                    "how": "auto -> for_loop (sign_descent has no fused kernel)"}
    groups = summary["optimizer_param_groups"]
    assert [group["weight_decay"] for group in groups] == [0.1, 0.0]  # no decay on norm weights and biases
    assert summary["scheduler"] == {"name": "halving", "optimizer_steps": 6,
                                    "how": "halving(every=2), per step over 6 optimizer steps"}
    rows = sorted(csv.DictReader((tmp_path / "run" / "csv" / "metrics.csv").open()), key=lambda r: int(r["step"]))
    lrs = [float(r["train/lr/pg1"]) for r in rows if r.get("train/lr/pg1")]
    assert lrs == pytest.approx([0.002, 0.002, 0.001, 0.001, 0.0005, 0.0005])
    assert summary["status"] == "completed" and summary["steps"] == 6


def test_a_teams_optimizer_keys_are_checked_against_its_own_class(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINER_TEAM_DIRS", str(team_folder(tmp_path)))
    typo = train_forked([*TINY, "optimizer=sign_descent", "+optimizer.momentm=0.9"], tmp_path / "typo")
    assert typo.returncode == 2 and typo.stderr.strip().startswith(
        "error: optimizer.momentm: unknown key for team_optim.SignDescent; allowed: "), typo
    assert "momentum" in typo.stderr
    refused = train_forked([*TINY, "optimizer=sign_descent", "optimizer.momentum=1.5"], tmp_path / "refused")
    assert refused.returncode == 2 and refused.stderr.strip() == (
        "error: optimizer: team_optim.SignDescent refused its arguments: momentum must be in [0, 1), got 1.5; "
        "allowed: values its constructor accepts (see its documentation)"), refused
    assert not (tmp_path / "refused" / "checkpoints").exists()
