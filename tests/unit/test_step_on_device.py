"""The step's decisions moved to the device are the decisions the host made before (issue 39): on a
run with loss spikes and NaN steps injected, the percentile clipping (calibrating, then frozen or
rolling) and the non-finite guard clip by the same factors, skip the same steps and end at the same
weights, bit for bit, as the host-side rules they replaced (kept below as the reference: numpy's
percentile of the recorded norms, `clip_grads_with_norm_`, and a skip that drops the gradients),
also once a log step has told the rule that calibration is over and its steps take the short path."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from tests.unit.test_nonfinite import fake_trainer
from trainer.groups.clipping import GradientClipping, Percentile
from trainer.groups.nonfinite import NonFiniteGuard

SPIKES = {7: 30.0, 23: 200.0, 24: 50.0, 41: 1e3}  # step -> loss multiplier
NANS = {3, 18, 30, 31}


class HostPercentile:
    """The rule as the host ran it before: Python floats, numpy's percentile."""

    def __init__(self, percentile, calibration_steps, rolling_window):
        self.percentile, self.calibration_steps, self.rolling_window = percentile, calibration_steps, rolling_window
        self.calibration, self.window, self.threshold = [], [], None

    def bound(self, norm):
        if self.rolling_window:
            self.window = (self.window + [norm])[-self.rolling_window:]
        if len(self.calibration) < self.calibration_steps:
            self.calibration.append(norm)
            self.threshold = float(np.percentile(self.calibration, self.percentile, method="linear"))
            return self.threshold
        if self.rolling_window:
            self.threshold = float(np.percentile(self.window, self.percentile, method="linear"))
        return self.threshold


def host_step(module, rule, loss):
    """Before: read the norm, decide on the host, clip with torch's own function, skip by dropping grads."""
    params = [p for p in module.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params])
    norm = total.item()
    finite = math.isfinite(norm) and math.isfinite(loss.item())
    factor = 1.0
    if math.isfinite(norm):
        bound = rule.bound(norm)
        if norm > bound:
            before = params[0].grad.clone()
            torch.nn.utils.clip_grads_with_norm_(params, bound, total)
            factor = (params[0].grad / before).flatten()[0].item()
    if not finite:
        for p in params:
            p.grad = None
    return factor, not finite


def device_step(module, clipping, guard, trainer, optimizer, loss):
    params = [p for p in module.parameters() if p.grad is not None]
    before = params[0].grad.clone()
    guard.on_before_backward(trainer, module, loss)
    guard.on_before_optimizer_step(trainer, module, optimizer)
    record = clipping.clip_on_device(params)
    clipped = bool(record.clipped)
    factor = (params[0].grad / before).flatten()[0].item() if clipped else 1.0
    return factor


def run(optimizer_kind, rolling_window, on_device, tmp_path):
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    fused = optimizer_kind == "fused"
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.01, weight_decay=0.1,
                                  **({"fused": True} if fused else {"foreach": True}))
    data = torch.Generator().manual_seed(1)
    factors, skipped = [], []
    if on_device:
        clipping = GradientClipping(Percentile(calibration_steps=12, rolling_window=rolling_window))
        guard, trainer = NonFiniteGuard(max_consecutive=50), fake_trainer(tmp_path, log_every_n_steps=1000)
        module.log = lambda *a, **k: None
    else:
        rule = HostPercentile(95.0, 12, rolling_window)
    for step in range(50):
        x, y = torch.randn(32, 6, generator=data), torch.randn(32, 3, generator=data)
        loss = (module(x) - y).square().mean() * SPIKES.get(step, 1.0)
        if step in NANS:
            loss = loss * float("nan")
        loss.backward()
        if on_device:
            # The guard goes first, as in the run: it sees the gradients before clipping scales them.
            factors.append(device_step(module, clipping, guard, trainer, optimizer, loss.detach()))
        else:
            factor, skip = host_step(module, rule, loss.detach())
            factors.append(factor)
            skipped.append(skip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if on_device:
            trainer.global_step += 1
            if trainer.global_step % 10 == 0:
                clipping.rule.settle(clipping.steps_seen)  # at a log step: from the first after calibration, the short path
    if on_device:
        skipped = [step in guard.summary()["skipped_at"] for step in range(50)]
        summary = clipping.summary()
        assert clipping.rule._calibration_over  # the steps after step 20 took the short path
    else:
        summary = {"threshold": rule.threshold, "calibration": rule.calibration}
    return factors, skipped, [p.detach().clone() for p in module.parameters()], summary


@pytest.mark.parametrize("rolling_window", [None, 8], ids=["calibrated", "rolling"])
@pytest.mark.parametrize("optimizer_kind", ["foreach", "fused"])
def test_device_decisions_match_the_host_rules_bit_for_bit(tmp_path, optimizer_kind, rolling_window):
    host_factors, host_skipped, host_weights, host = run(optimizer_kind, rolling_window, False, tmp_path)
    factors, skipped, weights, summary = run(optimizer_kind, rolling_window, True, tmp_path)
    assert sum(host_skipped) == len(NANS) and sum(f < 1 for f in host_factors) >= 3  # the run has both
    assert skipped == host_skipped
    assert factors == host_factors
    assert summary["threshold"] == host["threshold"]
    assert all(torch.equal(a, b) for a, b in zip(weights, host_weights))
