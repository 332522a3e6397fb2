"""On CUDA the framework's per-step work waits for nothing: the percentile clipping and the
non-finite guard run N steps of a small network (fused AdamW, the CUDA default, and foreach AdamW
with capturable step counts) under `torch.cuda.set_sync_debug_mode("error")`, which raises at any
synchronizing call (`.item()`, a blocking copy to or from the host), with NaN steps and spikes
injected; the decisions are then read once and checked. Also the whole default run's host reads
per step on CUDA, counted (`callbacks=host_reads`)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from tests.gpu.common import GPU
from tests.helpers import run_in_process
from tests.unit.test_nonfinite import fake_trainer
from trainer.groups.clipping import GradientClipping, Percentile
from trainer.groups.nonfinite import NonFiniteGuard

pytestmark = [*GPU]


@pytest.mark.parametrize("kernel", [{"fused": True}, {"foreach": True, "capturable": True}], ids=["fused", "foreach"])
def test_clipping_and_guard_steps_do_not_synchronize(tmp_path, kernel):
    torch.manual_seed(0)
    device = torch.device("cuda")
    module = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
    module.log = lambda *a, **k: None
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, **kernel)
    clipping = GradientClipping(Percentile(calibration_steps=8, rolling_window=16))
    guard, trainer = NonFiniteGuard(max_consecutive=100), fake_trainer(tmp_path, log_every_n_steps=10 ** 6)
    x, y = torch.randn(64, 32, device=device), torch.randn(64, 10, device=device)
    nan, spike = torch.tensor(float("nan"), device=device), torch.tensor(100.0, device=device)
    # The optimizer's state and the callbacks' device buffers are made on the first step (allowed to copy).
    for _ in range(2):
        loss = (module(x) - y).square().mean()
        loss.backward()
        guard.on_before_backward(trainer, module, loss)
        guard.on_before_optimizer_step(trainer, module, optimizer)
        clipping.clip_on_device([p for p in module.parameters()])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        trainer.global_step += 1
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(20):
            loss = (module(x) - y).square().mean()
            if step in (5, 11):
                loss = loss * nan
            if step in (3, 14):
                loss = loss * spike
            guard.on_before_backward(trainer, module, loss)
            loss.backward()
            guard.on_before_optimizer_step(trainer, module, optimizer)
            clipping.clip_on_device([p for p in module.parameters()])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            trainer.global_step += 1
            guard.on_train_batch_end(trainer, module, None, None, 0)  # not a log step: no read
    finally:
        torch.cuda.set_sync_debug_mode("default")
    summary = guard.summary()
    assert summary["skipped_at"] == [7, 13]
    assert clipping.summary()["steps_clipped"] >= 1 and clipping.nonfinite_steps == 2
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_the_default_run_reads_nothing_per_step_on_cuda(tmp_path):
    summary = run_in_process(["callbacks=host_reads", "trainer.max_epochs=2", "trainer.log_every_n_steps=10",
                              "trainer.limit_val_batches=0", "checkpointing=off", "progress=off"], tmp_path)
    report = json.loads((tmp_path / "host_reads.json").read_text())
    log_steps = {b for b in range(summary["steps"]) if (b + 1) % 10 == 0}
    per_step = [r for r in report["framework_reads"] if r["step"] is not None and r["step"] not in log_steps
                and not r["where"].startswith("trainer/callbacks/throughput.py")]
    assert per_step == [], per_step
