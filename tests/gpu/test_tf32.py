"""TF32 and cuDNN autotuning (precision.tf32=auto) on CUDA: a run switches them on itself (they are
switched off before it starts): float32 matmul precision "high", cudnn.allow_tf32 and
cudnn.benchmark, both in the training steps and after the run; with trainer.deterministic=true a
run switches all three off (they are switched on before it starts) and turns on deterministic
algorithms."""

from __future__ import annotations

from tests.gpu.common import GPU, probe_run, probed_run

pytestmark = [*GPU]

DETERMINISTIC_STEPS = 4


def _tf32(flags) -> tuple[str, bool, bool]:
    return flags.matmul_precision, flags.cudnn_allow_tf32, flags.cudnn_benchmark


def test_auto_switches_tf32_and_cudnn_autotuning_on(auto_run):
    assert auto_run.summary["derived"]["precision.tf32"]["value"] is True
    assert _tf32(auto_run.flags_after) == ("high", True, True)
    assert auto_run.net.records and all(_tf32(r) == ("high", True, True) for r in auto_run.net.records)


def test_deterministic_switches_tf32_and_autotuning_off(tmp_path):
    run = probed_run([*probe_run(DETERMINISTIC_STEPS, batch=32), "trainer.deterministic=true"], tmp_path, "cuda",
                     tf32=True)
    tf32 = run.summary["derived"]["precision.tf32"]
    assert tf32["value"] is False and "deterministic" in tf32["how"], tf32
    assert _tf32(run.flags_after) == ("highest", False, False)
    assert run.flags_after.deterministic_algorithms
    assert len(run.net.records) == DETERMINISTIC_STEPS
    assert all(_tf32(r) == ("highest", False, False) for r in run.net.records)
