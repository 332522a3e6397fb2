"""The optimizer kernel on CUDA (optimizer.implementation=auto): fused (one kernel for the whole
update) in a bf16 run, recorded in summary.json's optimizer_param_groups for every group; foreach
under fp16_mixed, whose GradScaler must unscale before clipping sees the gradients."""

from __future__ import annotations

from tests.gpu.common import GPU, PROBE_DECAY_TENSORS, PROBE_NO_DECAY_TENSORS, require_native_bf16

pytestmark = [*GPU]


def test_fused_kernels_on_cuda(auto_run):
    require_native_bf16()
    implementation = auto_run.summary["derived"]["optimizer.implementation"]
    assert implementation["value"] == "fused", implementation
    groups = auto_run.summary["optimizer_param_groups"]
    assert [g["tensors"] for g in groups] == [PROBE_DECAY_TENSORS, PROBE_NO_DECAY_TENSORS]
    assert all(g["fused"] is True and g["foreach"] is False for g in groups), groups


def test_foreach_under_fp16_with_a_grad_scaler(fp16_run):
    implementation = fp16_run.summary["derived"]["optimizer.implementation"]
    assert implementation["value"] == "foreach" and "GradScaler" in implementation["how"], implementation
    groups = fp16_run.summary["optimizer_param_groups"]
    assert [g["tensors"] for g in groups] == [PROBE_DECAY_TENSORS, PROBE_NO_DECAY_TENSORS]
    assert all(g["foreach"] is True and g["fused"] is False for g in groups), groups
