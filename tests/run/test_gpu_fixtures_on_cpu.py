"""The fixtures and patch points of tests/gpu/ on the CPU, so that a refactor which breaks them fails
here rather than on the next GPU run (the first GPU run found three such tests broken unseen).

The same `ProbeNet` runs as tests/gpu/conftest.py's, made by the same code (`probed_run`), pinned to
the CPU: with precision=bf16_mixed (bf16 autocast on the CPU, channels_last opted in) every training
forward runs under bf16 autocast with NHWC weights and batches, bf16 logits and an fp32 loss, the
BatchNorm statistics stay fp32, TF32 is left as it was; with precision=fp16_mixed the run steps aside
to fp32 and the precision plugin captured says so; with trainer.deterministic=true deterministic
algorithms are on and put back afterwards. The batch finder's search stops at a fake memory cap
(OutOfMemoryError above a batch size); the guard and clipping loop of the no-sync test decides the
same steps; the ViT's attention gets bf16 under CPU autocast. Every framework name tests/gpu/ patches
is listed in `PATCH_POINTS`, and one real run calls each of them.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import math
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

from tests.gpu.common import (BATCH_COPY, FIT_START, FP16_SCALER, PATCH_POINTS, PROBE_DECAY_TENSORS,
                              PROBE_NO_DECAY_TENSORS, PROBE_STATE_KEYS, TRAINING_LOSS, ProbedRun, TorchFlags,
                              attention_dtypes, checkpoint, counting_copies, digits_copy_run, fp16_probe_run,
                              guarded_steps, precision_plugin_keys, probe_flops_per_sample, probe_run, probed_run,
                              search_largest_batch, wrap)
from tests.helpers import run_in_process

pytestmark = pytest.mark.run

GPU_TESTS = Path(__file__).resolve().parents[1] / "gpu"
CPU = torch.device("cpu")
#: Small enough for a 2-core CPU (bf16 autocast there is about 10x slower than fp32).
PROBE = {"batch": 8, "image": 16, "width": 8, "device": "cpu"}
STEPS = 6
FP16_STEPS = 3


def _tf32(flags: Any) -> tuple[str, bool, bool]:
    return flags.matmul_precision, flags.cudnn_allow_tf32, flags.cudnn_benchmark


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory: pytest.TempPathFactory) -> ProbedRun:
    """The auto run's twin: bf16 autocast and channels_last asked for (auto picks neither on a
    CPU), TF32 and autotuning all off before it starts."""
    run = probed_run([*probe_run(STEPS, **PROBE), "precision=bf16_mixed", "precision.channels_last=true"],
                     tmp_path_factory.mktemp("bf16_cpu"), "cpu", tf32=False)
    assert run.summary["steps"] == STEPS
    return run


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory: pytest.TempPathFactory) -> ProbedRun:
    run = probed_run(fp16_probe_run(FP16_STEPS, **PROBE), tmp_path_factory.mktemp("fp16_cpu"), "cpu")
    assert run.summary["steps"] == FP16_STEPS
    return run


# -- mixed precision ----------------------------------------------------------------------------------


def test_bf16_on_the_cpu_runs_every_step_under_autocast_with_an_fp32_loss(bf16_run):
    assert bf16_run.summary["derived"]["precision"] == {"value": "bf16-mixed",
                                                        "how": "bf16_mixed -> bf16-mixed (as configured)"}
    records = bf16_run.net.records
    assert len(records) == STEPS
    assert all(r.autocast and r.autocast_dtype == torch.bfloat16 and r.logits_dtype == torch.bfloat16
               for r in records)
    assert bf16_run.losses == [(torch.float32, True)] * STEPS


def test_bf16_batchnorm_statistics_stay_fp32_and_count_every_step(bf16_run):
    norms = [m for m in bf16_run.net.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(norms) == 2
    for bn in norms:
        assert bn.running_mean.dtype == bn.running_var.dtype == torch.float32
        assert bool(torch.isfinite(bn.running_mean).all() and torch.isfinite(bn.running_var).all())
        assert bool(bn.running_mean.abs().sum() > 0)
        assert int(bn.num_batches_tracked) == STEPS
    state = checkpoint(bf16_run.run_dir / "checkpoints" / "last.ckpt")["state_dict"]
    stats = {k: v for k, v in state.items() if k.endswith(("running_mean", "running_var"))}
    assert len(stats) == 4 and all(v.dtype == torch.float32 for v in stats.values()), stats.keys()
    # The compile tests' check of plain keys, on the eager run's checkpoint.
    assert {k for k in state if k.startswith("net.")} == PROBE_STATE_KEYS


def test_channels_last_opted_in_reaches_every_step_and_stays(bf16_run):
    assert bf16_run.summary["derived"]["precision.channels_last"] == {"value": True, "how": "true (as configured)"}
    records = bf16_run.net.records
    assert all(r.conv_weights_channels_last and r.input_channels_last and not r.input_nchw_contiguous
               for r in records)
    convs = [m for m in bf16_run.net.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 2 and all(c.weight.is_contiguous(memory_format=torch.channels_last)
                                   and not c.weight.is_contiguous() for c in convs)


def test_the_cpu_run_leaves_tf32_and_autotuning_as_they_were(bf16_run):
    tf32 = bf16_run.summary["derived"]["precision.tf32"]
    assert tf32 == {"value": False, "how": "auto -> off (CUDA only; accelerator cpu)"}
    assert _tf32(bf16_run.flags_after) == ("highest", False, False)
    assert all(_tf32(r) == ("highest", False, False) for r in bf16_run.net.records)


def test_the_probe_runs_summary_has_the_flops_and_parameter_groups_the_gpu_tests_read(bf16_run):
    summary = bf16_run.summary
    assert summary["throughput"]["flops_per_sample"] == probe_flops_per_sample(width=8, image=16) == 664_512
    assert summary["throughput"]["peak_flops"] is None  # no known CPU peak: no MFU
    assert summary["derived"]["optimizer.implementation"]["value"] == "fused"  # torch's fused CPU kernels
    groups = summary["optimizer_param_groups"]
    assert [g["tensors"] for g in groups] == [PROBE_DECAY_TENSORS, PROBE_NO_DECAY_TENSORS] == [3, 5]
    assert all(g["fused"] is True and not g["foreach"] for g in groups), groups


def test_fp16_on_the_cpu_steps_aside_to_fp32_and_the_capture_says_so(fp16_run):
    assert fp16_run.plugin == {"mixed_precision": False, "precision": "32-true", "grad_scaler": False}
    assert fp16_run.summary["derived"]["precision"] == {
        "value": "32-true", "how": "fp16_mixed -> 32-true (fp16 with a GradScaler needs CUDA; accelerator cpu)"}
    records = fp16_run.net.records
    assert len(records) == FP16_STEPS
    assert not any(r.autocast for r in records) and all(r.logits_dtype == torch.float32 for r in records)
    assert fp16_run.losses == [(torch.float32, False)] * FP16_STEPS
    loss = fp16_run.summary["loss"]
    assert len(loss["first"]) == FP16_STEPS and all(math.isfinite(v) for v in loss["first"]), loss
    assert "MixedPrecision" not in checkpoint(fp16_run.run_dir / "checkpoints" / "last.ckpt")  # no scaler state


def test_the_capture_reads_the_fp16_plugin_the_framework_builds_for_cuda():
    """`precision_plugin_keys` on the plugin a CUDA run gets: MixedPrecision with a GradScaler; here
    without CUDA the scaler disables itself, and with CUDA its settings are the configured ones."""
    from trainer.groups.precision import PrecisionConfig, lightning_precision

    cfg = PrecisionConfig(name="fp16_mixed", channels_last="auto", tf32="auto",
                          **{f"scaler_{k}": v for k, v in FP16_SCALER.items()})
    cuda = torch.cuda.is_available()
    with contextlib.nullcontext() if cuda else pytest.warns(UserWarning, match="CUDA is not available"):
        (plugin,) = lightning_precision("16-mixed", "cuda", cfg)["plugins"]
    keys = precision_plugin_keys(plugin)
    assert {k: keys[k] for k in ("mixed_precision", "precision", "grad_scaler", "enabled")} == {
        "mixed_precision": True, "precision": "16-mixed", "grad_scaler": True, "enabled": cuda}
    assert {k: keys.get(k) for k in FP16_SCALER} == (FP16_SCALER if cuda else dict.fromkeys(FP16_SCALER))


def test_deterministic_on_the_cpu_turns_deterministic_algorithms_on_and_the_fixture_puts_them_back(tmp_path):
    before = TorchFlags.now()  # (whatever an earlier test on this worker left)
    torch.use_deterministic_algorithms(False)
    try:
        run = probed_run([*probe_run(2, evaluate=False, **PROBE), "trainer.deterministic=true"], tmp_path, "cpu",
                         tf32=True)
        assert run.summary["derived"]["precision.tf32"]["value"] is False
        assert run.flags_after.deterministic_algorithms
        assert len(run.net.records) == 2
        assert not TorchFlags.now().deterministic_algorithms  # flags_restored put the process back
    finally:
        before.apply()


# -- the batch finder's search ------------------------------------------------------------------------


def _capped_loss(cap: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """cross_entropy that runs out of memory, after the forward, for batches above `cap` samples."""
    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if logits.shape[0] > cap:
            raise torch.OutOfMemoryError(f"fake memory cap of {cap} samples")
        return nn.functional.cross_entropy(logits, labels)
    return loss


@pytest.fixture
def cuda_calls_on_the_cpu(monkeypatch):
    """The search's two CUDA calls (a synchronize after each step, the device's name in the
    derivation) made harmless, so its logic runs on the CPU."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "the CPU")


@pytest.mark.parametrize("cap, limit, batch, tried", [
    (100, 100_000, 96, "8 ok, 16 ok, 32 ok, 64 ok, 128 out of memory, 96 ok, 112 out of memory, 104 out of memory"),
    (10_000, 43, 40, "8 ok, 16 ok, 32 ok, 40 ok"),
])
def test_the_search_doubles_then_bisects_to_the_fake_memory_cap(cuda_calls_on_the_cpu, cap, limit, batch, tried):
    found, how = search_largest_batch(CPU, image=8, limit=limit, loss_fn=_capped_loss(cap))
    capped = " (capped by the training split)" if batch == limit // 8 * 8 else ""
    assert (found, how) == (batch, f"auto -> {batch}{capped}: the largest multiple of 8 whose training step ran on "
                                   f"the CPU (tried {tried})")


def test_the_search_refuses_when_the_first_batch_does_not_fit(cuda_calls_on_the_cpu):
    with pytest.raises(ValueError, match="a step of 8 samples runs out of memory"):
        search_largest_batch(CPU, image=8, limit=1000, loss_fn=_capped_loss(4))


# -- the guard and the clipping, attention under autocast ---------------------------------------------


@pytest.mark.parametrize("kernel", [{"fused": True}, {"foreach": True}], ids=["fused", "foreach"])
def test_the_no_sync_loop_skips_the_nan_steps_and_clips_on_the_cpu(tmp_path, kernel):
    """The loop of tests/gpu/test_no_sync_step.py, without the sync check (foreach without
    capturable: capturable step counts are CUDA's)."""
    steps = guarded_steps(CPU, kernel, tmp_path)
    assert steps.guard.summary()["skipped_at"] == [7, 13]
    assert steps.clipping.summary()["steps_clipped"] >= 1 and steps.clipping.nonfinite_steps == 2
    assert all(bool(torch.isfinite(p).all()) for p in steps.module.parameters())


def test_attention_under_cpu_autocast_gets_bf16(monkeypatch):
    assert attention_dtypes(CPU, monkeypatch) == [torch.bfloat16] * 2


# -- the patch points ---------------------------------------------------------------------------------


def _counting(name: str, calls: Counter) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return original(*args, **kwargs)
        return counted
    return wrapper


def test_one_cpu_run_calls_every_patch_point(tmp_path, monkeypatch):
    """A counter on each of `PATCH_POINTS` (through `wrap`, as the GPU tests patch them) over the
    copy-overlap test's digits run on the CPU: each is called, as often as the run's steps say. The
    side-stream route, CUDA's only, is forced on (its copy then moves the batch as Lightning does)."""
    calls: Counter = Counter()
    for point in PATCH_POINTS:
        wrap(monkeypatch, point, _counting(point.name, calls))
    copies: list[str] = []
    wrap(monkeypatch, BATCH_COPY, counting_copies(copies))
    monkeypatch.setattr(importlib.import_module("trainer.data.loader"), "_copy_overlap",
                        lambda requested, cuda, pinned: (bool(requested), "forced on for the CPU check"))
    steps = 4
    summary = run_in_process([*digits_copy_run(steps, overlap=True), "trainer.accelerator=cpu"], tmp_path)
    assert summary is not None and summary["status"] == "completed" and summary["steps"] == steps
    # Every training batch and the test batch went through the copy (max_steps ends the fit inside
    # its first epoch, before any validation).
    assert dict(calls) == {TRAINING_LOSS.name: steps, FIT_START.name: 1, BATCH_COPY.name: steps + 1}
    assert copies == ["plain"] * (steps + 1)


def trainer_setattr_targets(source: str) -> list[str]:
    """The `trainer.` names a test module's source patches with ``setattr`` (pytest's monkeypatch,
    MonkeyPatch.context(), or the builtin), as "module:Qualified.attribute": an object named through
    the module's imports (at any depth), or a dotted string."""
    tree = ast.parse(source)
    imported: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.update({alias.asname or alias.name: f"{node.module}.{alias.name}" for alias in node.names})
        elif isinstance(node, ast.Import):
            for alias in node.names:  # "import a.b" binds a; "import a.b as c" binds c to a.b
                bound = alias.name if alias.asname else alias.name.split(".")[0]
                imported[alias.asname or bound] = bound

    def dotted(node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return imported.get(node.id)
        if isinstance(node, ast.Attribute):
            base = dotted(node.value)
            return None if base is None else f"{base}.{node.attr}"
        return None

    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "setattr")
                or (isinstance(node.func, ast.Name) and node.func.id == "setattr"))):
            continue
        target, rest = node.args[0], node.args[1:]
        if isinstance(target, ast.Constant) and isinstance(target.value, str):
            found.append(target.value)
        elif (owner := dotted(target)) is not None and rest and isinstance(rest[0], ast.Constant):
            found.append(f"{owner}.{rest[0].value}")
    return [_split_module(path) for path in found if path.startswith("trainer.")]


def _split_module(path: str) -> str:
    """"trainer.task.TrainingTask.x" as "trainer.task:TrainingTask.x": the longest importable prefix."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        return f"{'.'.join(parts[:cut])}:{'.'.join(parts[cut:])}"
    return path


def test_every_trainer_name_tests_gpu_patches_is_a_listed_patch_point():
    listed = {point.name for point in PATCH_POINTS}
    modules = sorted(GPU_TESTS.glob("*.py"))
    assert len(modules) >= 10
    unlisted = {f"{m.name}: {name}" for m in modules for name in trainer_setattr_targets(m.read_text())
                if name not in listed}
    assert unlisted == set(), f"patched in tests/gpu/ but not in PATCH_POINTS (use common.wrap): {unlisted}"


def test_the_check_finds_a_direct_patch_of_a_trainer_name():
    """What the conftest did before the registry (the patch that went dead) is found, in each form."""
    source = '''
import trainer.data.transfer as transfer
from trainer.task import TrainingTask as Task

def fixture(patch, monkeypatch):
    from trainer.task import ClassificationTask
    patch.setattr(ClassificationTask, "evaluation_loss", None)
    monkeypatch.setattr(transfer.SideStreamCopy, "__call__", None)
    monkeypatch.setattr("trainer.task.TrainingTask.training_loss", None)
    setattr(Task, "on_fit_start", None)
    monkeypatch.setattr(torch.cuda, "synchronize", None)
'''
    assert trainer_setattr_targets(source) == [
        "trainer.task:ClassificationTask.evaluation_loss", "trainer.data.transfer:SideStreamCopy.__call__",
        "trainer.task:TrainingTask.training_loss", "trainer.task:TrainingTask.on_fit_start"]


def test_wrap_refuses_a_name_missing_from_the_registry(monkeypatch):
    from tests.gpu.common import PatchPoint

    with pytest.raises(AssertionError, match="not in tests/gpu/common.py's PATCH_POINTS"):
        wrap(monkeypatch, PatchPoint("trainer.task", "TrainingTask.evaluation_loss", "unlisted"), lambda f: f)
