"""MFU on a GPU whose datasheet peak is known (A100, H100, H200; skipped with the reason on any
other): summary.json's throughput has the counted training FLOPs per sample (exactly those of
ProbeNet's convolutions and classifier, forward and backward), the peak for the precision the run
used, and an MFU in (0, 1) equal to samples/s x FLOPs per sample / peak."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.common import GPU, probe_flops_per_sample

pytestmark = [*GPU]

#: ProbeNet(width=32) on 3x32x32 images, per sample (the formula: `probe_flops_per_sample`).
FLOPS_PER_SAMPLE = probe_flops_per_sample(width=32, image=32)


def test_mfu_for_a_known_gpu(auto_run):
    from trainer.measure.mfu import peak_flops

    name = torch.cuda.get_device_name()
    summary = auto_run.summary
    peak, how = peak_flops(name, summary["hyperparameters"]["precision"], summary["derived"]["precision.tf32"]["value"])
    if peak is None:
        pytest.skip(f"no datasheet peak for this GPU: {how}")
    throughput = summary["throughput"]
    assert throughput["flops_per_sample"] == FLOPS_PER_SAMPLE
    assert throughput["peak_flops"] == peak
    assert throughput["windows"] >= 1 and throughput["samples_per_s"] > 0, throughput
    assert 0 < throughput["mfu"] < 1, throughput
    assert throughput["mfu"] == pytest.approx(throughput["samples_per_s"] * FLOPS_PER_SAMPLE / peak, rel=1e-9)
