"""profile=true's tables (trainer/measure/profile.py): known operators fall into their categories, the
categories and the time outside operators add up to the step, backward and optimizer work is told
apart by where it was called from, and the roof's ridge point follows from peak and bandwidth."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from trainer.measure.profile import (BACKWARD_RANGE, CATEGORIES, CONV_MATMUL, DATA_MOVEMENT, ELEMENTWISE, FORWARD_RANGE,
                             NORMALIZATION, OPTIMIZER, OTHER, POOLING, REDUCTION, Op, breakdown, category_of,
                             measure_roof, ops_of, ridge_point, unusual)


@pytest.mark.parametrize("name,category", [
    ("aten::conv2d", CONV_MATMUL), ("aten::mkldnn_convolution", CONV_MATMUL), ("aten::convolution_backward", CONV_MATMUL),
    ("aten::addmm", CONV_MATMUL), ("aten::mm", CONV_MATMUL), ("aten::linear", CONV_MATMUL),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", CONV_MATMUL), ("aten::_scaled_dot_product_flash_attention", CONV_MATMUL),
    ("aten::native_batch_norm", NORMALIZATION), ("aten::native_batch_norm_backward", NORMALIZATION),
    ("aten::native_layer_norm", NORMALIZATION),
    ("aten::relu", ELEMENTWISE), ("aten::threshold_backward", ELEMENTWISE), ("aten::add_", ELEMENTWISE),
    ("aten::gelu", ELEMENTWISE), ("aten::mul", ELEMENTWISE),
    ("aten::max_pool2d_with_indices", POOLING), ("aten::adaptive_avg_pool2d", POOLING),
    ("aten::_log_softmax", REDUCTION), ("aten::nll_loss_forward", REDUCTION), ("aten::sum", REDUCTION),
    ("aten::mean", REDUCTION),
    ("aten::copy_", DATA_MOVEMENT), ("aten::_to_copy", DATA_MOVEMENT), ("Memcpy HtoD (Pinned -> Device)", DATA_MOVEMENT),
    ("aten::cat", DATA_MOVEMENT),
    ("aten::_foreach_mul_", OPTIMIZER), ("aten::_fused_adamw_", OPTIMIZER), ("Optimizer.step#AdamW.step", OPTIMIZER),
    ("aten::empty", OTHER), ("aten::view", OTHER),
])
def test_known_operators_fall_into_their_categories(name, category):
    assert category_of(name) == category


def test_shares_and_the_time_outside_operators_sum_to_the_step():
    ops = [Op("aten::mkldnn_convolution", 4000), Op("aten::convolution_backward", 7000, backward=True),
           Op("aten::relu", 500), Op("aten::_foreach_add_", 1500, optimizer=True), Op("aten::mul", 800, optimizer=True)]
    result = breakdown(ops, steps=2, step_ms=8.0, on_device=False, bytes_per_element=4)
    assert {r.category for r in result.rows} == {CONV_MATMUL, ELEMENTWISE, OPTIMIZER}
    assert sum(r.share for r in result.rows) + result.outside_share == pytest.approx(1.0)
    conv = next(r for r in result.rows if r.category == CONV_MATMUL)
    assert (conv.forward_ms, conv.backward_ms, conv.self_cpu_ms) == (2.0, 3.5, 5.5)  # per step
    optimizer = next(r for r in result.rows if r.category == OPTIMIZER)
    assert optimizer.self_cpu_ms == pytest.approx(1.15) and optimizer.forward_ms == 0  # the mul is the optimizer's
    assert result.outside_ms == pytest.approx(8.0 - 5.5 - 0.25 - 1.15)


def test_a_backward_far_above_its_forward_is_flagged():
    ops = [Op("aten::native_batch_norm", 1000), Op("aten::native_batch_norm_backward", 4000, backward=True)]
    flags = unusual(breakdown(ops, 1, 6.0, False, 4))
    assert len(flags) == 1 and "normalization: backward 4.00 ms is 4.0x its forward" in flags[0]


def test_a_real_profile_tells_forward_backward_and_optimizer_apart():
    """A training step under the profiler, with the ranges trainer/task.py names: the backward's
    convolution is backward, the optimizer's elementwise ops are the optimizer's, the forward's
    FLOPs are counted, and each step is seen."""
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                              torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    images, labels = torch.randn(8, 3, 16, 16), torch.randint(0, 4, (8,))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True,
                 schedule=schedule(wait=1, warmup=1, active=3)) as profiler:
        for _ in range(5):
            def closure():
                with record_function(FORWARD_RANGE):
                    loss = torch.nn.functional.cross_entropy(net(images), labels)
                with record_function(BACKWARD_RANGE):
                    loss.backward()
                return loss
            optimizer.step(closure)  # as Lightning does: the step and its backward inside the optimizer's step
            optimizer.zero_grad(set_to_none=True)
            profiler.step()
    ops, steps = ops_of(profiler.events())
    assert len(steps) == 3 and all(ms > 0 for ms in steps)
    by_name = {}
    for op in ops:
        by_name.setdefault(op.name, []).append(op)
    assert all(op.backward and not op.optimizer for op in by_name["aten::convolution_backward"])
    assert all(not op.backward and not op.optimizer for op in by_name["aten::conv2d"])
    assert sum(op.flops for op in by_name["aten::conv2d"]) > 0
    momentum = [op for op in ops if op.optimizer and category_of(op.name) != OPTIMIZER]
    assert momentum  # SGD's elementwise updates, called by the optimizer's step
    result = breakdown(ops, len(steps), sum(steps) / len(steps), False, 4)
    assert set(r.category for r in result.rows) <= set(CATEGORIES)
    assert 0.9 <= sum(r.share for r in result.rows) + result.outside_share <= 1.1


def test_the_roof_measured_on_this_cpu_has_a_ridge():
    roof = measure_roof(torch.device("cpu"), torch.float32, seconds=0.05)
    assert roof.peak_flops > 1e8 and roof.bandwidth > 1e8 and roof.how.startswith("measured here")
    assert roof.ridge == pytest.approx(ridge_point(roof.peak_flops, roof.bandwidth))
