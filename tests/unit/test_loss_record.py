"""The loss record: first and last steps, spread, non-finite values counted, not averaged, and loss
spikes (a step above 3x the median of the steps before it) counted over the whole run, also across
a resume."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.callbacks.loss_record import LossRecord
from trainer.groups.compile import resolve_compile_mode


def feed(record, values):
    for v in values:
        record.on_train_batch_end(None, None, {"loss": torch.tensor(v)}, None, 0)


def test_first_and_last_steps_and_their_spread():
    record = LossRecord(first_steps=3, last_steps=4)
    feed(record, [5.0, 4.0, 3.0, 2.0, 1.0, 1.0, 3.0])
    s = record.summary()
    assert s["first"] == [5.0, 4.0, 3.0]
    assert s["last_steps"] == 4 and s["final"] == 3.0
    assert s["mean"] == pytest.approx(1.75) and s["spread"] == pytest.approx(math.sqrt(0.6875))
    assert (s["min"], s["max"], s["non_finite"]) == (1.0, 3.0, 0)


def test_non_finite_losses_are_counted_and_left_out_of_the_statistics():
    record = LossRecord(last_steps=3)
    feed(record, [1.0, float("nan"), 3.0])
    s = record.summary()
    assert s["non_finite"] == 1 and s["mean"] == pytest.approx(2.0)


def test_no_steps_means_no_numbers():
    assert LossRecord().summary()["final"] is None


def test_a_spike_is_a_loss_above_three_times_the_median_of_the_steps_before_it():
    record = LossRecord(spike_window=20)
    # a falling loss is never a spike; 2.9x the median is not one, 3.1x is; a NaN is not one either
    feed(record, [4.0 - 0.15 * i for i in range(20)] + [1.0] * 20 + [2.9, 1.0, 3.1, float("nan"), 1.0])
    s = record.summary()
    assert (s["spikes"], s["first_spike"], s["non_finite"]) == (1, 43, 1)


def test_the_first_steps_have_too_little_history_to_spike():
    record = LossRecord()
    feed(record, [1.0] * 9 + [100.0])  # step 10 has 9 steps before it: not judged
    assert record.summary()["spikes"] == 0
    feed(record, [100.0])  # step 11 has 10, median 1.0 (100 is one of ten)
    assert record.summary()["spikes"] == 1


def test_spikes_are_counted_across_a_resume_and_judged_against_the_history_saved():
    before = LossRecord(spike_window=10)
    feed(before, [1.0] * 15)
    after = LossRecord(spike_window=10)
    after.load_state_dict(before.state_dict())
    feed(after, [3.5])  # a spike only against the history of the first attempt
    s = after.summary()
    assert (s["spikes"], s["first_spike"]) == (1, 16)


def test_losses_are_read_back_once_a_window_not_every_step():
    record = LossRecord(spike_window=4)
    feed(record, [1.0, 1.0, 1.0])
    assert len(record._pending) == 3 and record.steps == 0  # still on the device: no synchronization
    feed(record, [1.0])
    assert not record._pending and record.steps == 4


@pytest.mark.parametrize("mode, accelerator, chosen", [
    ("auto", "cuda", "default"), ("auto", "cpu", "off"), ("off", "cuda", "off"), ("default", "cpu", "default"),
    ("max-autotune", "cuda", "max-autotune")])
def test_compile_auto_compiles_on_cuda_only(mode, accelerator, chosen):
    """`compile=auto` compiles on CUDA and stays eager on CPU; an explicit mode is kept as given."""
    assert resolve_compile_mode(mode, accelerator)[0] == chosen
