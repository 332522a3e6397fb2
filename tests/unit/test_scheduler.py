"""The lr schedule: warmup given as a fraction (a float) or a step count (an integer), linear
warmup then cosine down to the floor, and the torch scheduler applying that factor per step."""

import pytest
import torch

from trainer.configuration.spec import choice_config
from trainer.groups.scheduler import build_scheduler, warmup_cosine_factor, warmup_steps


def test_warmup_is_a_fraction_for_floats_and_a_count_for_integers():
    assert warmup_steps(choice_config("scheduler", "warmup_cosine", warmup=0.1), 200) == 20
    assert warmup_steps(choice_config("scheduler", "warmup_cosine", warmup=7), 200) == 7


def test_linear_warmup_then_cosine_to_the_floor():
    factors = [warmup_cosine_factor(s, 4, 20, 0.1) for s in range(20)]
    assert factors[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert factors[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[4:], factors[5:]))
    assert warmup_cosine_factor(20, 4, 20, 0.1) == pytest.approx(0.1)


def test_the_torch_scheduler_applies_the_factor():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    sched = build_scheduler(opt, choice_config("scheduler", "warmup_cosine", warmup=2, min_lr_ratio=0.0), 10)["scheduler"]
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(0.25) and lrs[1] == pytest.approx(0.5) and lrs[2] == pytest.approx(0.5)
    assert lrs[-1] < 0.05


def test_the_constant_schedule_keeps_each_lr_and_saves_as_plain_data(tmp_path):
    # A real scheduler for a constant lr, so that the loggers name the lr curves alike for every
    # scheduler (train/lr/pg1); its state must load from a weights-only checkpoint.
    weights, bias = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [weights], "lr": 0.3}, {"params": [bias], "lr": 0.1}])
    config = build_scheduler(opt, choice_config("scheduler", "constant"), 100)
    for _ in range(5):
        opt.step()
        config["scheduler"].step()
    assert [group["lr"] for group in opt.param_groups] == [0.3, 0.1] and config["interval"] == "step"
    torch.save(config["scheduler"].state_dict(), tmp_path / "state.pt")
    assert torch.load(tmp_path / "state.pt", weights_only=True)["last_epoch"] == 5
