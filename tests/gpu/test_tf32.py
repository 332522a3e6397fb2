"""TF32 and cuDNN autotuning (precision.tf32=auto) on CUDA: a run switches them on itself (they are
switched off before it starts): float32 matmul precision "high", cudnn.allow_tf32 and
cudnn.benchmark, both in the training steps and after the run; with trainer.deterministic=true a
run switches all three off (they are switched on before it starts) and turns on deterministic
algorithms."""

from __future__ import annotations

from tests.gpu.common import GPU, ProbeNet, TorchFlags, probe_run, set_tf32
from tests.helpers import run_in_process

pytestmark = [*GPU]

DETERMINISTIC_STEPS = 4


def _tf32(flags) -> tuple[str, bool, bool]:
    return flags.matmul_precision, flags.cudnn_allow_tf32, flags.cudnn_benchmark


def test_auto_switches_tf32_and_cudnn_autotuning_on(auto_run):
    assert auto_run.summary["derived"]["precision.tf32"]["value"] is True
    assert _tf32(auto_run.flags_after) == ("high", True, True)
    assert auto_run.net.records and all(_tf32(r) == ("high", True, True) for r in auto_run.net.records)


def test_deterministic_switches_tf32_and_autotuning_off(tmp_path):
    set_tf32(True)
    summary = run_in_process([*probe_run(DETERMINISTIC_STEPS, batch=32), "trainer.deterministic=true"], tmp_path)
    after = TorchFlags.now()
    assert summary is not None and summary["status"] == "completed", summary
    tf32 = summary["derived"]["precision.tf32"]
    assert tf32["value"] is False and "deterministic" in tf32["how"], tf32
    assert _tf32(after) == ("highest", False, False)
    assert after.deterministic_algorithms
    records = ProbeNet.last().records
    assert len(records) == DETERMINISTIC_STEPS
    assert all(_tf32(r) == ("highest", False, False) for r in records)
