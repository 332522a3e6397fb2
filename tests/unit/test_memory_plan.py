"""The memory plan (trainer/memory.py) on a small ResNet on the CPU: its parts are the tensors'
sizes, the activations grow linearly with the batch, the modelled peak is within 10% of the measured
one, and each practice changes the part it should."""

import contextlib

import pytest
import torch
import torchvision

from trainer.memory import autocast_for, plan_memory, saved_activations


def _batch(size):
    generator = torch.Generator().manual_seed(size)
    return torch.randn(size, 3, 32, 32, generator=generator), torch.randint(0, 10, (size,), generator=generator)


@pytest.fixture(scope="module")
def net():
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=10)


def _plan(net, batch, implementation="foreach"):
    kernel = {"foreach": {"foreach": True}, "fused": {"fused": True}}
    return plan_memory(net, lambda n: torch.optim.AdamW(n.parameters(), **kernel[implementation]), _batch,
                       torch.nn.functional.cross_entropy, contextlib.nullcontext, torch.device("cpu"), batch,
                       half_context=autocast_for("bf16-mixed", torch.device("cpu")),
                       make_fused=lambda n: torch.optim.AdamW(n.parameters(), fused=True))


@pytest.mark.parametrize("batch", [16, 128])
def test_the_parts_add_up_to_the_measured_peak_within_ten_percent(net, batch):
    plan = _plan(net, batch)
    parameters = sum(p.numel() * 4 for p in net.parameters())
    assert plan.gradients == parameters and plan.optimizer_state >= 2 * parameters  # AdamW: two moments
    assert plan.weights >= parameters
    assert plan.measured_peak is not None and plan.peak_how.endswith("(torch MemTracker)")
    assert abs(plan.modelled_peak() - plan.measured_peak) <= 0.10 * plan.measured_peak
    assert abs(plan.rest) <= 0.10 * plan.measured_peak


def test_activations_grow_linearly_with_the_batch(net):
    plan = _plan(net, 8)
    direct, _ = saved_activations(net, *_batch(24), torch.nn.functional.cross_entropy, contextlib.nullcontext)
    assert plan.activations.per_sample > 0
    assert plan.activations.at(24) == pytest.approx(direct, rel=0.02)


def test_each_practice_changes_the_part_it_should(net):
    plan = _plan(net, 256)  # activations dominate here
    by_name = {p["practice"]: p for p in plan.practices}
    assert by_name["bf16 activations"]["peak"] < plan.modelled_peak()
    assert by_name["half the batch, twice the accumulation"]["peak"] < plan.modelled_peak()
    checkpointed = [p for p in plan.practices if p["practice"].startswith("activation checkpointing of layer")]
    assert checkpointed and all(p["peak"] < plan.modelled_peak() for p in checkpointed)
    assert by_name["fused optimizer"]["how"].startswith("the step's scratch 0.0 MiB")  # foreach's scratch: gone
    assert plan.optimizer_scratch > 0.5 * plan.gradients  # foreach: an intermediate per parameter
    lines = plan.lines()
    assert lines[0].startswith("memory plan at batch 256 on cpu (MiB): weights 42.7") and len(lines) >= 5
    assert plan.to_dict()["bytes"]["activations"] == pytest.approx(plan.activations.at(256))
