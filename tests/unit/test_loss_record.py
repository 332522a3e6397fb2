"""The loss record: first and last steps, spread, and non-finite values counted, not averaged."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.callbacks.loss_record import LossRecord
from trainer.compile import resolve_compile_mode


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


@pytest.mark.parametrize("mode, accelerator, chosen", [
    ("auto", "cuda", "default"), ("auto", "cpu", "off"), ("off", "cuda", "off"), ("default", "cpu", "default"),
    ("max-autotune", "cuda", "max-autotune")])
def test_compile_auto_compiles_on_cuda_only(mode, accelerator, chosen):
    """`compile=auto` compiles on CUDA and stays eager on CPU; an explicit mode is kept as given."""
    assert resolve_compile_mode(mode, accelerator)[0] == chosen
