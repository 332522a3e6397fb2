"""benchmarks/hand_loop.py: the hand-written loop trains the framework's own network with the
framework's optimizer settings (its facts equal the plan's and the framework loop's), its loss falls,
and `time_windows` times a loop at the steps it says."""

from __future__ import annotations

import statistics
import sys

import pytest
import torch

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

from hand_loop import FrameworkLoop, HandLoop, compare_facts, prepare_run, steps_for, time_windows  # noqa: E402

pytestmark = pytest.mark.run

# The small CNN on 8 px device-made images with a strong class pattern, on the CPU (the loss band is
# a CPU claim), with batch scaling and the AdamW defaults as any run has them.
TINY = ["model=small_cnn", "data=synthetic", "data.shape=[3,8,8]", "data.num_classes=4", "data.signal=2.0",
        "data.batch_size=16", "data.train_samples=4096", "precision.channels_last=true", "trainer.accelerator=cpu",
        "clipping=off", "nonfinite=off", "checkpointing=off", "progress=off", "logger=csv", "trainer.max_epochs=1",
        "trainer.limit_val_batches=0", "trainer.num_sanity_val_steps=0"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return prepare_run(TINY, tmp_path_factory.mktemp("hand_loop") / "run")


def test_the_loop_runs_the_plans_network_optimizer_and_precision(run):
    """The facts before a step: the plan's lr and weight decay per group (norms and biases without
    decay), its kernel, precision, memory format and batch, on the network the framework built."""
    loop = HandLoop(run)
    plan, facts = run.plan, loop.facts()
    assert loop.net is run.task.net
    decaying, exempt = facts["param_groups"]
    assert decaying["lr"] == exempt["lr"] == pytest.approx(plan.lr)
    assert decaying["weight_decay"] == pytest.approx(plan.weight_decay) and exempt["weight_decay"] == 0.0
    assert decaying["elements"] + exempt["elements"] == facts["parameters"] == sum(p.numel() for p in run.parts.net.parameters())
    assert facts["kernel"] == plan.optimizer_implementation and facts["optimizer"] == "AdamW"
    assert (facts["precision"], facts["batch_size"], facts["compile_mode"]) == (plan.precision, 16, "off")
    assert facts["memory_format"] == "channels_last" and facts["device"] == "cpu"
    assert facts["scheduler"] == run.spec.scheduler.name and facts["units_per_step"] == 16


def test_its_loss_falls_and_the_framework_ran_the_same_work(run):
    """40 steps of the hand loop lower the loss (read at each step's start, never inside the loop);
    then the framework's own loop over the same run reports the same facts."""
    loop = HandLoop(run)
    losses: list[float] = []
    loop.run(41, on_step_start=lambda i: losses.append(float(loop.last_loss)) if loop.last_loss is not None else None)
    assert len(losses) == 40 and loop.steps_done == 41
    assert statistics.mean(losses[-5:]) < 0.7 * statistics.mean(losses[:5]), losses
    framework = FrameworkLoop(run)
    framework.run(3)
    assert framework.trainer.global_step == 3
    assert compare_facts(loop.facts(), framework.facts()) == []
    # Lightning's teardown leaves the shared network on the CPU: the loop moves it to its device again.
    moves = []
    to = loop.net.to
    loop.net.to = lambda *args, **kwargs: moves.append(args) or to(*args, **kwargs)
    loop.run(1)
    assert moves == [(loop.device,)]
    assert compare_facts({"lr": 1.0, "same": 2}, {"lr": 2.0, "same": 2}) == ["lr: hand 1.0 vs framework 2.0"]


class _Steps:
    """A loop whose step i takes (i + 1) ms of a fake clock: what `time_windows` must cut into windows.
    The clock is fake so that the windows' lengths are exact, not at the mercy of sleep on a loaded machine."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self.now = 0.0

    def run(self, steps, on_step_start=None):
        for index in range(steps):
            on_step_start(index)
            self.started.append(index)
            self.now += (index + 1) / 1000


def test_time_windows_cuts_full_windows_from_step_starts(monkeypatch):
    """warm-up 2, windows of 3 steps: steps 2-4 and 5-7 timed, from step starts; step 8 only ends the last."""
    import types

    import hand_loop

    loop = _Steps()
    monkeypatch.setattr(hand_loop, "time", types.SimpleNamespace(perf_counter=lambda: loop.now))
    seconds = time_windows(loop, steps_for(2, warmup=2, window=3), 2, 3, torch.device("cpu"))
    assert loop.started == list(range(9)) and len(seconds) == 2
    assert seconds == pytest.approx([0.003 + 0.004 + 0.005, 0.006 + 0.007 + 0.008])
    with pytest.raises(ValueError, match="no full window"):
        time_windows(loop, 5, 2, 3, torch.device("cpu"))
