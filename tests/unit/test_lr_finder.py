"""optimizer.lr=find without training: the found lr moved from the batch it was found at to the
global batch by the lr rule and compared with what the rule gives from the optimizer's shipped lr;
the keys' checks; where a resumed run finds the range test's answer, and how the other ranks wait
for rank 0's; the lines that stop a run whose test has nothing to suggest."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from tests.helpers import compose
from trainer.configuration.spec import validate
from trainer.groups.optimizer.scaling import FoundLr, scale_found
from trainer.infra.errors import UserError
from trainer.modes.lr_finder import (LR_FIND_FILE, RECORD_KEYS, _check_suggestion, earlier_record, find_lr, found_lr,
                                     shipped_lr)

HOW = "found by Lightning's lr range test (...)"


def test_the_found_lr_is_used_as_found_at_the_batch_it_was_found_at():
    found = FoundLr(0.0316, batch=64, how=HOW, shipped=0.1, shipped_from="optimizer=sgd")
    scaled = scale_found(found, "sqrt", global_batch=64, ref_batch=256)
    assert scaled.value == 0.0316
    # sqrt rule from sgd's 0.1 at 256 to 64: 0.05; the found lr is 0.63 of it.
    assert scaled.how == (f"{HOW} at batch 64; the sqrt rule from optimizer=sgd's 0.1 at batch 256 would give 0.05 "
                          "(0.63x)")


@pytest.mark.parametrize("rule, factor", [("sqrt", 2.0), ("linear", 4.0), ("none", 1.0)])
def test_the_found_lr_moves_to_the_global_batch_by_the_lr_rule(rule, factor):
    # Found on rank 0 at its per-device batch of 64; the run's global batch is 256 (4 devices).
    found = FoundLr(0.01, batch=64, how=HOW, shipped=0.004, shipped_from="optimizer=adamw")
    scaled = scale_found(found, rule, global_batch=256, ref_batch=256)
    assert scaled.value == pytest.approx(0.01 * factor)
    if rule == "none":
        assert "at batch 64, used as found at batch 256 (no batch scaling; rule none)" in scaled.how
        assert scaled.how.endswith("; optimizer=adamw's 0.004 (rule none) would give 0.004 (2.50x)")
    else:
        assert f"at batch 64 -> {0.01 * factor:g} at batch 256 ({rule} rule, x{factor:g})" in scaled.how
        # The rule would have given the shipped lr itself at its reference batch.
        assert scaled.how.endswith(f"would give 0.004 ({2.5 * factor:.2f}x)")
    assert "would give" not in scale_found(FoundLr(0.01, 64, HOW), rule, 256, 256).how  # nothing to compare with


def test_lr_is_a_positive_number_or_find_and_the_range_test_keys_are_checked():
    assert validate(compose(["optimizer.lr=find"])).optimizer.lr == "find"
    cases = {
        "optimizer.lr=fast": "optimizer.lr: 'fast' is not a number > 0 or one of 'find'",
        "optimizer.find_steps=10": "optimizer.find_steps: 10 must be >= 20",
        "optimizer.find_max_lr=1e-7": "optimizer.find_max_lr: 1e-07 is not above find_min_lr 1e-06",
    }
    for override, line in cases.items():
        with pytest.raises(UserError) as raised:
            validate(compose([override]))
        assert raised.value.line().startswith(line) and "\n" not in raised.value.line()


def test_the_comparison_starts_from_the_lr_the_optimizer_choice_ships():
    spec = validate(compose(["optimizer=sgd", "optimizer.lr=find"]), {"optimizer": "sgd"})
    assert shipped_lr(spec) == (0.1, "optimizer=sgd")
    # A choice the framework does not ship (a team's own): the optimizer of that name's.
    team = validate(compose(["optimizer=lamb", "optimizer.lr=find"]), {"optimizer": "team_lamb"})
    assert shipped_lr(team) == (0.02, "optimizer=lamb")


def _record(folder, lr=0.01, **extra):
    values = {"lr": lr, "batch_size": 64, "min_lr": 1e-6, "max_lr": 1.0, "steps": 100, "steps_run": 100,
              "suggestion_index": 40, "loss_at_suggestion": 1.5, **extra}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LR_FIND_FILE).write_text(json.dumps(values))
    return folder / LR_FIND_FILE


def test_a_resumed_run_finds_the_answer_its_run_already_has_and_a_fresh_run_tests_again(tmp_path):
    first, again = tmp_path / "first", tmp_path / "again"
    _record(first)
    checkpoint = first / "checkpoints" / "last.ckpt"
    assert earlier_record(again, resumed_from=checkpoint) == first / LR_FIND_FILE  # the same command run again
    _record(again, lr=0.02)
    assert earlier_record(again, resumed_from=checkpoint) == again / LR_FIND_FILE  # a requeued job's own folder
    assert earlier_record(again, resumed_from=None) is None  # a fresh run in a used folder tests again
    (again / LR_FIND_FILE).write_text('{"lr": 0.02}')  # not a whole record: passed over
    assert earlier_record(again, resumed_from=checkpoint) == first / LR_FIND_FILE


def test_the_other_ranks_take_rank_zeros_lr(tmp_path):
    spec = validate(compose(["optimizer.lr=find"]), {"optimizer": "adamw"})
    _record(tmp_path, lr=0.0123)
    run = SimpleNamespace(spec=spec, job=SimpleNamespace(run_dir=tmp_path), rank_zero=False,
                          identity=SimpleNamespace(resume_from=None))
    found = find_lr(run, probe=None)  # type: ignore[arg-type]  # another rank: no test, no probe needed
    assert (found.value, found.batch, found.shipped) == (0.0123, 64, 0.004)
    assert found.how == ("found by Lightning's lr range test (steepest descent of the smoothed loss at 0.0123, 100 "
                         "steps 1e-06..1; lr_find.png; rank 0's)")
    assert set(RECORD_KEYS) <= set(json.loads((tmp_path / LR_FIND_FILE).read_text()))


def test_waiting_for_rank_zeros_record_ends_in_one_line(tmp_path):
    from trainer.infra.distributed import rank_zero_record

    with pytest.raises(UserError, match=r"^optimizer.lr: find: rank 0 wrote no .*lr_find.json within 0 s; "
                                        r"allowed: a fixed optimizer.lr"):
        rank_zero_record(tmp_path / LR_FIND_FILE, RECORD_KEYS, "optimizer.lr", "find",
                         "a fixed optimizer.lr, or check rank 0's log", timeout_s=0.3)


def test_a_test_with_nothing_to_suggest_stops_the_run_in_one_line():
    lrs = [1e-6 * 10 ** (i / 5) for i in range(20)]
    with pytest.raises(UserError, match=r"^optimizer.lr: find: the lr range test has no suggestion \(2 of 20 steps"):
        _check_suggestion(None, lrs[:2], [1.2, 7e4], 20)
    # Flat (an lr too low to move anything): Lightning's smoothing still rises at the start, and
    # its steepest descent would be noise.
    flat = [2.0 + 0.01 * i for i in range(20)]
    with pytest.raises(UserError, match=r"^optimizer.lr: find: the smoothed loss never fell below 2.1, .*allowed: "
                                        r"a fixed optimizer.lr, or a wider range"):
        _check_suggestion(lrs[15], lrs, flat, 20)
    falling = [2.0 + 0.01 * i for i in range(12)] + [2.0 - 0.1 * i for i in range(8)]
    _check_suggestion(lrs[15], lrs, falling, 20)
    _check_suggestion(lrs[15], lrs, [math.nan] + falling[1:], 20)


def test_the_plan_says_how_the_lr_was_found():
    record = {"lr": 0.0312, "batch_size": 64, "min_lr": 1e-6, "max_lr": 1.0, "steps": 100}
    found = found_lr(record, (0.1, "optimizer=sgd"))
    assert scale_found(found, "sqrt", 64, 256).how == (
        "found by Lightning's lr range test (steepest descent of the smoothed loss at 0.0312, 100 steps 1e-06..1; "
        "lr_find.png) at batch 64; the sqrt rule from optimizer=sgd's 0.1 at batch 256 would give 0.05 (0.62x)")


def test_lightnings_isolate_rng_puts_every_global_generator_back():
    """What the range test relies on (trainer/modes/lr_finder.py): Lightning's `isolate_rng` restores
    Python's, NumPy's and torch's global generators after the test drew from them. (It restores
    nothing when the test raises; the run then ends with that error, so nothing trains after it.)"""
    import random

    import numpy as np
    import torch
    from lightning.pytorch.utilities.seed import isolate_rng

    def draws():
        return random.random(), float(np.random.rand()), float(torch.rand(1))

    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    expected = draws()
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    with isolate_rng(include_cuda=False):
        draws()
    assert draws() == expected


def test_the_suggestion_is_the_steepest_descent_per_log_lr_not_a_wobble_of_the_plateau():
    from types import SimpleNamespace

    from trainer.modes.lr_finder import steepest_descent

    lrs = [1e-4 * 10 ** (5 * i / 99) for i in range(100)]  # 1e-4 .. 10, exponential, as the test sweeps
    # A plateau at 2.25 with a dip of 0.01 at 0.0016, then the real fall from about 0.03 to 10.
    losses = [2.25 - (0.01 if i == 25 else 0.0) - (0.8 * max(0.0, min(1.0, (i - 50) / 40))) for i in range(100)]
    finder = SimpleNamespace(results={"lr": lrs, "loss": losses}, _optimal_idx=None)
    lr = steepest_descent(finder, skip_begin=10)
    assert 0.02 <= lr <= 2 and finder._optimal_idx == lrs.index(lr)
    # Lightning's own suggestion (the gradient against the lr itself) takes the dip instead.
    import torch
    linear = torch.gradient(torch.tensor(losses[10:-1]), spacing=[torch.tensor(lrs[10:-1])])[0]
    assert lrs[10 + int(torch.argmin(linear))] < 0.005
    assert steepest_descent(SimpleNamespace(results={"lr": lrs[:12], "loss": losses[:12]}, _optimal_idx=None), 10) is None
