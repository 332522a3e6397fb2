"""The lr schedule: warmup given as a fraction (a float) or a step count (an integer), linear
warmup then cosine down to the floor, and the torch scheduler applying that factor per step."""

import pytest
import torch

from trainer.configuration.spec import choice_config
from trainer.groups.scheduler import build_scheduler, describe_one_cycle, warmup_cosine_factor, warmup_steps


def test_warmup_is_a_fraction_for_floats_and_a_count_for_integers():
    assert warmup_steps(choice_config("scheduler", "warmup_cosine", warmup=0.1).arguments["warmup"], 200) == 20
    assert warmup_steps(choice_config("scheduler", "warmup_cosine", warmup=7).arguments["warmup"], 200) == 7


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


# --- one_cycle ----------------------------------------------------------------------------------

def _one_cycle_run(optimizer, cfg, total, steps=None):
    """Each step's lr and momentum (or beta1) of each group, as the optimizer steps with them."""
    schedule = build_scheduler(optimizer, cfg, total)
    assert schedule["interval"] == "step"
    seen = []
    for _ in range(total if steps is None else steps):
        seen.append([(g["lr"], g["betas"][0] if "betas" in g else g["momentum"]) for g in optimizer.param_groups])
        optimizer.step()
        schedule["scheduler"].step()
    return schedule["scheduler"], seen


def test_one_cycle_rises_to_each_groups_derived_lr_then_anneals_far_below_it_with_momentum_inverse():
    # Two groups, as layer-wise lr decay makes them: each peaks at its own derived lr.
    weights, bias = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [weights], "lr": 0.4}, {"params": [bias], "lr": 0.1}], momentum=0.9, nesterov=True)
    cfg = choice_config("scheduler", "one_cycle")
    a = cfg.arguments
    assert (a["pct_start"], a["div_factor"], a["final_div_factor"]) == (0.25, 25.0, 10000.0)  # fastai's pct_start
    _, seen = _one_cycle_run(opt, cfg, 100)
    for group, peak in ((0, 0.4), (1, 0.1)):
        lrs, momenta = [s[group][0] for s in seen], [s[group][1] for s in seen]
        assert lrs[0] == pytest.approx(peak / 25) and momenta[0] == pytest.approx(0.95)
        # The peak is the 25th step (round(pct_start x 100); step 24 counting from 0), momentum lowest there.
        assert lrs.index(max(lrs)) == round(0.25 * 100) - 1 and max(lrs) == pytest.approx(peak)
        assert momenta[24] == pytest.approx(0.85) and min(momenta) == pytest.approx(0.85)
        assert all(a < b for a, b in zip(lrs[:24], lrs[1:25])) and all(a > b for a, b in zip(lrs[24:], lrs[25:]))
        assert lrs[-1] == pytest.approx(peak / 25 / 1e4) and momenta[-1] == pytest.approx(0.95)


@pytest.mark.parametrize("name", ["sgd", "adamw", "lamb", "lars"])
def test_one_cycle_cycles_momentum_or_beta1_of_every_optimizer_choice(name):
    pytest.importorskip("timm")
    from trainer.groups.optimizer.build import OptimizerRecipe

    net = torch.nn.Linear(3, 2)
    opt = OptimizerRecipe.for_network(net, choice_config("optimizer", name), 0.01, 0.0).build(net)
    _, seen = _one_cycle_run(opt, choice_config("scheduler", "one_cycle"), 8)
    assert [s[0][1] for s in seen][:3] == pytest.approx([0.95, 0.85, 0.8565], abs=1e-3)
    assert max(s[0][0] for s in seen) == pytest.approx(0.01, rel=0.05)
    kept = OptimizerRecipe.for_network(net, choice_config("optimizer", name), 0.01, 0.0).build(net)
    _, seen = _one_cycle_run(kept, choice_config("scheduler", "one_cycle", cycle_momentum=False), 8)
    assert {s[0][1] for s in seen} == {0.9}  # the optimizer's own momentum / beta1


def test_one_cycle_resumes_from_a_weights_only_checkpoint_and_keeps_this_runs_length(tmp_path):
    def fresh():
        return torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=0.02)

    cfg = choice_config("scheduler", "one_cycle")
    _, uninterrupted = _one_cycle_run(fresh(), cfg, 40)
    first = fresh()
    schedule, _ = _one_cycle_run(first, cfg, 40, steps=15)
    torch.save({"optimizer": first.state_dict(), "scheduler": schedule.state_dict()}, tmp_path / "state.pt")
    saved = torch.load(tmp_path / "state.pt", weights_only=True)

    def resumed(total):
        opt = fresh()
        config = build_scheduler(opt, cfg, total)
        opt.load_state_dict(saved["optimizer"])
        config["scheduler"].load_state_dict(saved["scheduler"])
        lrs = []
        for _ in range(40 - 15):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            config["scheduler"].step()
        return config["scheduler"], lrs

    assert resumed(40)[1] == pytest.approx([s[0][0] for s in uninterrupted[15:]])
    # Resumed with more steps than it started with: the cycle stretches to this run's end instead of
    # failing when it steps past the saved length.
    longer, lrs = resumed(80)
    assert longer.total_steps == 80 and lrs[-1] > uninterrupted[-1][0][0]


def test_one_cycle_values_are_checked_in_one_line():
    from trainer.infra.errors import UserError

    with pytest.raises(UserError, match=r"^scheduler.pct_start: 0.5 leaves no steps for the third phase"):
        choice_config("scheduler", "one_cycle", three_phase=True, pct_start=0.5)
    with pytest.raises(UserError, match=r"^scheduler.base_momentum: 0.96 is above max_momentum 0.95"):
        choice_config("scheduler", "one_cycle", base_momentum=0.96)
    with pytest.raises(UserError, match=r"^scheduler.pct_start: 1.2 must be < 1"):
        choice_config("scheduler", "one_cycle", pct_start=1.2)


def test_one_cycle_is_described_with_its_numbers():
    cfg = choice_config("scheduler", "one_cycle")
    assert describe_one_cycle(cfg, 0.05, 300, choice_config("optimizer", "sgd")) == (
        "lr 0.002 -> peak 0.05 at 25% of 300 steps -> 2e-07 (cos); momentum 0.95 -> 0.85 -> 0.95 (in place of 0.9)")
    three = choice_config("scheduler", "one_cycle", three_phase=True, anneal_strategy="linear", cycle_momentum=False)
    assert describe_one_cycle(three, 0.002, None, choice_config("optimizer", "adamw")) == (
        "lr 8e-05 -> peak 0.002 at 25% of the run's steps -> 8e-05 at 50% -> 8e-09 (linear); beta1 0.9 as configured")
