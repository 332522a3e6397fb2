"""The per-step work the guard and the clipping share, and the guard's undo: one multi-tensor call for
the norms, taken once per optimizer step; a step put back bit for bit where a device flag is set, in
a fixed number of operations whatever the number of tensors, with no read of the flag."""

from __future__ import annotations

import torch
from torch import nn

from tests.helpers import Ops
from trainer.infra.step_gradients import of_parameters, step_gradients
from trainer.infra.step_undo import StepUndo


def with_grads(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    params = [nn.Parameter(torch.randn(*shape, dtype=dtype)) for shape in shapes]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def test_the_norms_are_clip_grad_norms_and_taken_once_per_step():
    torch.manual_seed(0)
    params = with_grads((4, 3), (3,), (2, 2, 3, 3))
    optimizer = torch.optim.SGD(params, lr=0.1)
    first = step_gradients(optimizer, step=7)
    assert first is not None and step_gradients(optimizer, step=7) is first  # the second caller shares it
    expected = [float(p.grad.norm()) for p in params]
    assert first.norms.tolist() == expected
    assert float(first.total) == float(torch.nn.utils.get_total_norm([p.grad for p in params]))
    with Ops() as ops:
        taken = step_gradients(optimizer, step=8)
        assert taken is not None and ops.names == ["aten._foreach_norm"]  # a new step: taken again, in one operation
        assert taken.norms.numel() == len(params)
    assert ops.names == ["aten._foreach_norm", "aten.stack"]  # and stacked when first read


def test_the_norms_go_into_a_callers_row_with_its_value_after_them_in_one_operation():
    torch.manual_seed(0)
    params = with_grads((4, 3), (3,))
    gradients = step_gradients(torch.optim.SGD(params, lr=0.1), step=0)
    assert gradients is not None
    row, loss = torch.full((3,), -1.0), torch.tensor(5.0)
    norms_view = row[:-1]
    with Ops() as ops:
        assert gradients.stack_into(row, norms_view, loss)
    assert ops.names == ["aten.stack"]
    assert row.tolist() == [float(params[0].grad.norm()), float(params[1].grad.norm()), 5.0]
    assert gradients.norms.data_ptr() == row.data_ptr() and gradients.norms.tolist() == row[:-1].tolist()
    assert not gradients.stack_into(torch.empty(3), torch.empty(2), torch.tensor(1.0))  # stacked already: the caller's own way


def test_a_step_number_seen_again_with_other_gradients_is_taken_again():
    # The same optimizer at the same step number (a second fit) or after another backward: the
    # gradients decide, not the number alone.
    torch.manual_seed(0)
    params = with_grads((4, 3), (3,))
    optimizer = torch.optim.SGD(params, lr=0.1)
    first = step_gradients(optimizer, step=0)
    for p in params:
        p.grad = torch.randn_like(p) * 10  # new gradient tensors (zero_grad's set_to_none, then a backward)
    second = step_gradients(optimizer, step=0)
    assert second is not first and second.norms.tolist() == [float(p.grad.norm()) for p in params]
    params[0].grad.mul_(2)  # added into in place (set_to_none=False, or accumulation)
    third = step_gradients(optimizer, step=0)
    assert third is not second and third.norms[0].item() == float(params[0].grad.norm())
    assert step_gradients(optimizer, step=0) is third  # unchanged: shared


def test_gradients_of_several_dtypes_are_normed_by_group_and_come_back_in_the_norms_order():
    params = with_grads((3,), (2,)) + with_grads((4,), dtype=torch.float64)
    gradients = of_parameters([params[2], params[0], params[1]])
    assert gradients.norms.dtype == torch.float64
    assert gradients.norms.tolist() == [float(p.grad.norm()) for p in gradients.params]
    assert step_gradients(torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1), step=0) is None  # no gradient


def stepped(optimizer: torch.optim.Optimizer, params: list[nn.Parameter], undo: StepUndo, bad: bool) -> None:
    for p in params:
        p.grad = torch.randn_like(p) * (float("nan") if bad else 1.0)
    undo.take(optimizer, params)
    optimizer.step()
    undo.undo_where(torch.tensor(bad))


def test_a_bad_step_is_put_back_bit_for_bit_and_a_good_one_stays():
    torch.manual_seed(1)
    weight = nn.Parameter(torch.randn(4, 3, 3, 3).to(memory_format=torch.channels_last))
    params = [weight, nn.Parameter(torch.randn(5))]
    optimizer = torch.optim.AdamW(params, lr=0.1, foreach=True)
    undo = StepUndo()
    stepped(optimizer, params, undo, bad=False)  # the state exists now (moments, step counts)
    before = ([p.detach().clone() for p in params],
              {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(optimizer.state.values())})
    stepped(optimizer, params, undo, bad=True)
    assert all(torch.equal(p, q) for p, q in zip(params, before[0]))
    after = {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(optimizer.state.values())}
    assert after.keys() == before[1].keys() and all(
        torch.equal(after[i][k], before[1][i][k]) for i in after for k in after[i])
    assert weight.is_contiguous(memory_format=torch.channels_last)  # put back in its own layout
    stepped(optimizer, params, undo, bad=False)
    assert not torch.equal(params[1], before[0][1])


def test_the_undo_is_a_fixed_number_of_operations_whatever_the_number_of_tensors():
    def count(tensors: int) -> tuple[list[str], list[str]]:
        params = [nn.Parameter(torch.randn(3)) for _ in range(tensors)]
        optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=True)
        undo = StepUndo()
        stepped(optimizer, params, undo, bad=False)
        stepped(optimizer, params, undo, bad=False)  # the buffers are made: steady state from here
        with Ops() as taking:
            undo.take(optimizer, params)
        optimizer.step()
        flag = torch.tensor(True)
        with Ops() as undoing:
            undo.undo_where(flag)
        return taking.names, undoing.names

    assert count(3) == count(40) == (["aten._foreach_copy_"], ["aten.cat", "aten.where", "aten._foreach_copy_"])
