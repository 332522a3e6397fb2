"""The memory plan (trainer/measure/memory.py) on a small ResNet on the CPU: its parts are the tensors'
sizes, the activations grow linearly with the batch, the modelled peak is within 10% of the measured
one, and each practice changes the part it should."""

import contextlib

import pytest
import torch
import torchvision

from trainer.measure.memory import MIB, autocast_for, plan_memory, saved_activations


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


def test_the_cpu_batch_finder_takes_the_largest_multiple_of_8_within_the_budget():
    from trainer.measure.memory import Activations, MemoryPlan, largest_batch_within

    plan = MemoryPlan(64, "cpu", weights=100 * MIB, gradients=100 * MIB, optimizer_state=200 * MIB,
                      activations=Activations(fixed=4 * MIB, per_sample=2 * MIB), optimizer_scratch=100 * MIB,
                      measured_peak=None, peak_how="")
    # 1 GiB - 400 MiB resident - 4 MiB fixed = 620 MiB of activations: 310 samples -> 304
    batch, how = largest_batch_within(plan, 2**30, 8, limit=10_000)
    assert batch == 304 and how.startswith("auto -> 304: the largest multiple of 8 within 1 GiB")
    assert plan.modelled_peak(batch=304) <= 2**30 < plan.modelled_peak(batch=312)
    assert largest_batch_within(plan, 2**30, 8, limit=100)[0] == 96  # capped by the training split
    with pytest.raises(ValueError, match="alone exceed it"):
        largest_batch_within(plan, 450 * MIB, 8, limit=10_000)
    plan.optimizer_scratch = 0
    with pytest.raises(ValueError, match="8 samples need"):  # 15 MiB of room: 5 samples
        largest_batch_within(plan, 415 * MIB, 8, limit=10_000)


def test_other_ranks_take_rank_zeros_batch(tmp_path):
    from trainer.modes.batch_finder import AUTO_BATCH_FILE, batch_of_rank_zero

    (tmp_path / AUTO_BATCH_FILE).write_text('{"batch_size": 136, "how": "auto -> 136: measured"}')
    found = batch_of_rank_zero(tmp_path / AUTO_BATCH_FILE, timeout_s=1)
    assert found.value == 136 and found.how.endswith("(rank 0's)")
