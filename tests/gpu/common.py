"""What the CUDA-only tests share: the skip marker, a network that records what reaches it, the
process-wide torch flags a run changes, the overrides of a short run on device-made images, the
framework names the tests patch (`PATCH_POINTS`), and the fixture-making code of tests/gpu/.

Everything here but the CUDA assertions also runs on the CPU in the ordinary suite
(tests/run/test_gpu_fixtures_on_cpu.py): a refactor that breaks a fixture, or makes a patch miss
the code it was meant to observe, fails there instead of on the next GPU run."""

from __future__ import annotations

import contextlib
import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, ContextManager, Iterator, Sequence

import pytest
import torch
from torch import nn

#: Every module of tests/gpu/ starts with ``pytestmark = [*GPU]``: selected by ``-m gpu``, skipped
#: with this reason where there is no CUDA device.
GPU = [pytest.mark.gpu,
       pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA GPU (torch.cuda.is_available() is False here); "
                                 "run on a GPU machine: pytest -m gpu, or benchmarks/gpu_check.sh")]


#: The shared auto run (tests/gpu/conftest.py): long enough for the throughput meter, 5 warm-up
#: steps and then a timed window of 10 steps.
AUTO_RUN_STEPS = 24
#: The GradScaler settings the fp16 run configures (none of them the default, so each is seen to arrive).
FP16_SCALER = {"init_scale": 4096.0, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 1000}
FP16_RUN_STEPS = 8


def require_native_bf16() -> None:
    """Skip on GPUs without bf16 tensor cores (precision=auto then picks fp16 with a GradScaler)."""
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        pytest.skip(f"{torch.cuda.get_device_name()} has no native bf16: precision=auto picks 16-mixed there")


@dataclass(frozen=True)
class ForwardRecord:
    """What one training forward call saw, read inside the call (under the run's autocast)."""

    input_channels_last: bool
    input_nchw_contiguous: bool
    conv_weights_channels_last: bool
    autocast: bool
    autocast_dtype: torch.dtype
    logits_dtype: torch.dtype
    matmul_precision: str
    cudnn_allow_tf32: bool
    cudnn_benchmark: bool


class ProbeNet(nn.Module):
    """Conv-BN-ReLU twice (the second with stride 2), a global mean and a linear classifier, which
    records every eager training forward call on the device type `record_on` ("cuda" unless a test
    asks for another: `probe_run(..., device="cpu")`), autocast read for that device type.

    Plugged in as ``model=custom model._target_=tests.gpu.common.ProbeNet``; the run builds it, so
    the last built instance is kept in `ProbeNet.built` for the test to inspect. No pooling layers:
    under ``trainer.deterministic=true`` CUDA has deterministic kernels for everything here. A
    compiled forward records nothing (`torch.compiler.is_compiling()` is true while Dynamo traces
    it), so empty records after a compiled run mean every training step ran the compiled graph.
    """

    built: ClassVar[list["ProbeNet"]] = []

    def __init__(self, num_classes: int, in_channels: int = 3, width: int = 32, record_on: str = "cuda") -> None:
        super().__init__()
        self.record_on = record_on
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(2 * width),
            nn.ReLU(inplace=True))
        self.classifier = nn.Linear(2 * width, num_classes)
        self.records: list[ForwardRecord] = []
        ProbeNet.built.append(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.classifier(self.features(x).mean((2, 3)))
        if self.training and x.device.type == self.record_on and not torch.compiler.is_compiling():
            self.records.append(ForwardRecord(
                input_channels_last=x.is_contiguous(memory_format=torch.channels_last),
                input_nchw_contiguous=x.is_contiguous(),
                conv_weights_channels_last=all(m.weight.is_contiguous(memory_format=torch.channels_last)
                                               for m in self.modules() if isinstance(m, nn.Conv2d)),
                autocast=torch.is_autocast_enabled(self.record_on),
                autocast_dtype=torch.get_autocast_dtype(self.record_on),
                logits_dtype=logits.dtype,
                matmul_precision=torch.get_float32_matmul_precision(),
                cudnn_allow_tf32=torch.backends.cudnn.allow_tf32,
                cudnn_benchmark=torch.backends.cudnn.benchmark))
        return logits

    @classmethod
    def last(cls) -> "ProbeNet":
        assert cls.built, "the run built no ProbeNet"
        return cls.built[-1]


def probe_run(steps: int, batch: int = 256, image: int = 32, width: int = 32, evaluate: bool = True,
              device: str = "cuda") -> list[str]:
    """Overrides of a short run of `ProbeNet` on device-made images: `steps` training steps in one
    epoch, then one validation and one test batch (none without `evaluate`); checkpoints written
    (last.ckpt, and the best by val/loss when evaluating). On "cuda" the accelerator stays auto (the
    GPU); any other device pins the accelerator to it and has `ProbeNet` record there."""
    eval_batches = 1 if evaluate else 0
    pinned = [] if device == "cuda" else [f"trainer.accelerator={device}", f"+model.record_on={device}"]
    return [*pinned, "model=custom", "model._target_=tests.gpu.common.ProbeNet", f"+model.width={width}",
            "data=synthetic", f"data.shape=[3,{image},{image}]", f"data.batch_size={batch}",
            f"data.train_samples={steps * batch}", f"data.val_samples={batch}", f"data.test_samples={batch}",
            "trainer.max_epochs=1", "trainer.num_sanity_val_steps=0", f"trainer.limit_val_batches={eval_batches}",
            f"trainer.limit_test_batches={eval_batches}", "progress=off"]


def fp16_probe_run(steps: int, batch: int = 64, **probe: Any) -> list[str]:
    """`probe_run` (`probe`: its other arguments) with precision=fp16_mixed and the GradScaler
    settings of `FP16_SCALER`."""
    return [*probe_run(steps, batch=batch, **probe), "precision=fp16_mixed",
            *(f"precision.scaler_{key}={value}" for key, value in FP16_SCALER.items())]


def probe_flops_per_sample(width: int = 32, image: int = 32, in_channels: int = 3, classes: int = 10) -> int:
    """The training FLOPs of one sample through `ProbeNet`: the first convolution forward and weight
    gradient (its input needs no gradient); the second (stride 2) and the classifier forward, weight
    gradient and input gradient."""
    first = 2 * in_channels * 9 * width * image * image
    second = 2 * width * 9 * (2 * width) * (image // 2) * (image // 2)
    classifier = 2 * (2 * width) * classes
    return 2 * first + 3 * second + 3 * classifier


#: `ProbeNet`'s parameter groups: two conv weights and the classifier weight decay; four BatchNorm
#: tensors and the classifier bias do not.
PROBE_DECAY_TENSORS, PROBE_NO_DECAY_TENSORS = 3, 5
#: `ProbeNet`'s own state-dict keys, as the task holds it (`net`) in a checkpoint.
PROBE_STATE_KEYS = frozenset(f"net.{k}" for k in (
    "features.0.weight", "features.1.weight", "features.1.bias", "features.1.running_mean",
    "features.1.running_var", "features.1.num_batches_tracked", "features.3.weight", "features.4.weight",
    "features.4.bias", "features.4.running_mean", "features.4.running_var", "features.4.num_batches_tracked",
    "classifier.weight", "classifier.bias"))


@dataclass(frozen=True)
class TorchFlags:
    """The process-wide settings a CUDA run changes (TF32, cuDNN autotuning, determinism)."""

    matmul_precision: str
    cudnn_allow_tf32: bool
    cudnn_benchmark: bool
    cudnn_deterministic: bool
    deterministic_algorithms: bool
    deterministic_warn_only: bool
    cublas_workspace_config: str | None

    @classmethod
    def now(cls) -> "TorchFlags":
        return cls(torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32,
                   torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
                   torch.are_deterministic_algorithms_enabled(),
                   torch.is_deterministic_algorithms_warn_only_enabled(), os.environ.get("CUBLAS_WORKSPACE_CONFIG"))

    def apply(self) -> None:
        torch.set_float32_matmul_precision(self.matmul_precision)
        torch.backends.cudnn.allow_tf32 = self.cudnn_allow_tf32
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        torch.backends.cudnn.deterministic = self.cudnn_deterministic
        torch.use_deterministic_algorithms(self.deterministic_algorithms, warn_only=self.deterministic_warn_only)
        if self.cublas_workspace_config is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = self.cublas_workspace_config


def set_tf32(enabled: bool) -> None:
    """Put TF32 and cuDNN autotuning all on or all off, so that a run is seen to change them."""
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    torch.backends.cudnn.allow_tf32 = enabled
    torch.backends.cudnn.benchmark = enabled


@contextlib.contextmanager
def flags_restored() -> Iterator[None]:
    """An in-process run leaves its TF32, autotuning and determinism settings in the process; give
    the tests after it the process as it was."""
    before = TorchFlags.now()
    try:
        yield
    finally:
        before.apply()


def checkpoint(path: Any) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


# -- the framework names the GPU tests patch ---------------------------------------------------------------


@dataclass(frozen=True)
class PatchPoint:
    """A framework attribute a GPU test replaces with a wrapper of itself, to observe the run from
    inside: `module` and the attribute's qualified name in it."""

    module: str
    attribute: str
    #: What the GPU tests read through it.
    why: str

    @property
    def name(self) -> str:
        return f"{self.module}:{self.attribute}"

    def owner(self) -> tuple[Any, str]:
        """The object holding the attribute, and the attribute's own name."""
        owner: Any = importlib.import_module(self.module)
        *path, attribute = self.attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        return owner, attribute


TRAINING_LOSS = PatchPoint("trainer.task", "TrainingTask.training_loss",
                           "the loss of every training step, its dtype and whether autocast was on")
FIT_START = PatchPoint("trainer.task", "TrainingTask.on_fit_start",
                       "the Trainer's precision plugin and its GradScaler as fit starts")
BATCH_COPY = PatchPoint("trainer.data.transfer", "SideStreamCopy.__call__",
                        "every batch moved to the device, on the side stream or as Lightning does")

#: Every framework name tests/gpu/ patches, all through `wrap`. The ordinary suite runs one CPU run
#: with a counter on each and fails if one is not called (a refactor made the patch dead), and
#: checks that tests/gpu/ patches no `trainer.` name missing here (tests/run/test_gpu_fixtures_on_cpu.py).
PATCH_POINTS = (TRAINING_LOSS, FIT_START, BATCH_COPY)

Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]


def wrap(patch: pytest.MonkeyPatch, point: PatchPoint, wrapper: Wrapper) -> None:
    """Replace `point` by ``wrapper(original)`` for as long as `patch` lasts; only a listed point."""
    if point not in PATCH_POINTS:
        raise AssertionError(f"{point.name} is not in tests/gpu/common.py's PATCH_POINTS: list it there, "
                             "so the ordinary suite sees a refactor make the patch dead")
    owner, attribute = point.owner()
    patch.setattr(owner, attribute, wrapper(getattr(owner, attribute)))


def recording_losses(losses: list[tuple[torch.dtype, bool]], device_type: str) -> Wrapper:
    """For `TRAINING_LOSS`: appends (dtype of the loss, autocast on for `device_type`) per call."""
    def wrapper(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def training_loss(self: Any, outputs: Any, targets: Any) -> torch.Tensor:
            loss = original(self, outputs, targets)
            losses.append((loss.dtype, torch.is_autocast_enabled(device_type)))
            return loss
        return training_loss
    return wrapper


def precision_plugin_keys(precision: Any) -> dict[str, Any]:
    """What the tests read of a Trainer's precision plugin: Lightning's MixedPrecision or not, its
    precision string, its GradScaler and, where the scaler is enabled, its settings (a scaler made for
    CUDA without CUDA disables itself and keeps none of them)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaler = getattr(precision, "scaler", None)
    keys: dict[str, Any] = {"mixed_precision": isinstance(precision, MixedPrecision),
                            "precision": getattr(precision, "precision", None),
                            "grad_scaler": isinstance(scaler, torch.amp.GradScaler)}
    if scaler is not None:
        keys["enabled"] = scaler.is_enabled()
        if scaler.is_enabled():
            keys.update(init_scale=scaler.get_scale(), growth_factor=scaler.get_growth_factor(),
                        backoff_factor=scaler.get_backoff_factor(), growth_interval=scaler.get_growth_interval())
    return keys


def capturing_plugin(plugin: dict[str, Any]) -> Wrapper:
    """For `FIT_START`: `precision_plugin_keys` of the Trainer's plugin into `plugin`, then the hook."""
    def wrapper(original: Callable[..., None]) -> Callable[..., None]:
        def on_fit_start(self: Any) -> None:
            plugin.update(precision_plugin_keys(self.trainer.precision_plugin))
            original(self)
        return on_fit_start
    return wrapper


def counting_copies(calls: list[str]) -> Wrapper:
    """For `BATCH_COPY`: "overlapped" or "plain" per batch moved."""
    def wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(self: Any, batch: Any, device: torch.device) -> Any:
            before = self.overlapped
            moved = original(self, batch, device)
            calls.append("overlapped" if self.overlapped > before else "plain")
            return moved
        return counted
    return wrapper


# -- the fixtures' runs and probes, on any device ---------------------------------------------------------


@dataclass(frozen=True)
class ProbedRun:
    """A `ProbeNet` run as the tests read it: what it wrote and what it saw."""

    summary: dict[str, Any]
    run_dir: Path
    net: ProbeNet
    #: The process's TF32, autotuning and determinism settings as the run left them.
    flags_after: TorchFlags
    #: (dtype of the loss, autocast on) for every training step, read as the task computed it.
    losses: list[tuple[torch.dtype, bool]]
    #: `precision_plugin_keys` of the Trainer's precision plugin as the run's fit started.
    plugin: dict[str, Any]


def probed_run(overrides: Sequence[str], run_dir: Path, device_type: str, tf32: bool | None = None) -> ProbedRun:
    """Run in process with the training loss and the precision plugin observed (`TRAINING_LOSS`,
    `FIT_START`); with `tf32`, TF32 and cuDNN autotuning all set so first (`set_tf32`), so that the
    run is seen to change them or not. The process's flags are put back afterwards."""
    from tests.helpers import run_in_process

    losses: list[tuple[torch.dtype, bool]] = []
    plugin: dict[str, Any] = {}
    with flags_restored(), pytest.MonkeyPatch.context() as patch:
        if tf32 is not None:
            set_tf32(tf32)
        wrap(patch, TRAINING_LOSS, recording_losses(losses, device_type))
        wrap(patch, FIT_START, capturing_plugin(plugin))
        summary = run_in_process(overrides, run_dir)
        flags_after = TorchFlags.now()
    assert summary is not None and summary["status"] == "completed", summary
    return ProbedRun(summary, run_dir, ProbeNet.last(), flags_after, losses, plugin)


def digits_copy_run(steps: int, overlap: bool) -> list[str]:
    """Overrides of a short run on the digits with pinned batches, copied on a side stream or not."""
    return ["data=digits", "model=small_cnn", "data.batch_size=32", "data.pin_memory=true",
            f"data.copy_overlap={str(overlap).lower()}", f"trainer.max_steps={steps}", "trainer.max_epochs=1",
            "trainer.num_sanity_val_steps=0", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
            "trainer.deterministic=true", "progress=off"]


def finder_net() -> nn.Module:
    """The network whose largest batch the batch finder's tests search for."""
    return nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def search_largest_batch(device: torch.device, image: int, limit: int,
                         loss_fn: Callable[..., torch.Tensor] = nn.functional.cross_entropy) -> tuple[int, str]:
    """`largest_batch_that_runs` on `finder_net` with SGD and batches of `image`-pixel images made on
    `device`, in multiples of 8."""
    from trainer.measure.memory import largest_batch_that_runs

    def make_batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(size, 3, image, image, device=device), torch.randint(0, 10, (size,), device=device)

    return largest_batch_that_runs(finder_net(), lambda n: torch.optim.SGD(n.parameters(), lr=0.1), make_batch,
                                   loss_fn, contextlib.nullcontext, device, 8, limit=limit)


#: The guarded steps (`guarded_steps`): the steps after the first two whose loss is NaN, and those
#: whose loss is scaled by 100 (a spike for the percentile clipping).
GUARD_NAN_STEPS, GUARD_SPIKE_STEPS, GUARD_FIRST_STEPS = (5, 11), (3, 14), 2


@dataclass(frozen=True)
class GuardedSteps:
    guard: Any
    clipping: Any
    module: nn.Module


def guarded_steps(device: torch.device, kernel: dict[str, bool], tmp_path: Path,
                  watch: Callable[[], ContextManager[Any]] = contextlib.nullcontext) -> GuardedSteps:
    """A small network trained with AdamW (`kernel`: its fused/foreach/capturable switches) under the
    percentile clipping and the non-finite guard, called as Lightning calls them: 2 steps that make the
    optimizer's state and the callbacks' buffers, then 20 under `watch` (on CUDA, the sync debug
    mode that raises at any synchronizing call), with NaN and spiking losses injected."""
    from tests.unit.test_nonfinite import fake_trainer
    from trainer.groups.clipping import GradientClipping, Percentile
    from trainer.groups.nonfinite import NonFiniteGuard

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
    module.log = lambda *a, **k: None  # type: ignore[assignment]  # the hooks log; a LightningModule would
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, **kernel)
    clipping = GradientClipping(Percentile(calibration_steps=8, rolling_window=16))
    guard, trainer = NonFiniteGuard(max_consecutive=100), fake_trainer(tmp_path, log_every_n_steps=10 ** 6)
    x, y = torch.randn(64, 32, device=device), torch.randn(64, 10, device=device)
    nan, spike = torch.tensor(float("nan"), device=device), torch.tensor(100.0, device=device)
    for _ in range(GUARD_FIRST_STEPS):  # allowed to copy
        loss = (module(x) - y).square().mean()
        loss.backward()
        guard.on_before_backward(trainer, module, loss)
        guard.on_before_optimizer_step(trainer, module, optimizer)
        clipping.clip_on_device([p for p in module.parameters()])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        trainer.global_step += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with watch():
        for step in range(20):
            loss = (module(x) - y).square().mean()
            if step in GUARD_NAN_STEPS:
                loss = loss * nan
            if step in GUARD_SPIKE_STEPS:
                loss = loss * spike
            guard.on_before_backward(trainer, module, loss)
            loss.backward()
            guard.on_before_optimizer_step(trainer, module, optimizer)
            clipping.clip_on_device([p for p in module.parameters()])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            trainer.global_step += 1
            guard.on_train_batch_end(trainer, module, None, None, 0)  # not a log step: no read
    return GuardedSteps(guard, clipping, module)


def attention_dtypes(device: torch.device, patch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """The dtype of the queries each scaled_dot_product_attention call of a 2-block ViT (the ViT
    recipe's timm model) gets in a forward and backward under bf16 autocast on `device`."""
    import torch.nn.functional as F

    from trainer.models.timm import build_timm

    vit = build_timm(10, "vit_tiny_patch16_224", in_channels=3, image_size=(32, 32),
                     options={"patch_size": 4, "depth": 2}).to(device)
    seen: list[torch.dtype] = []
    real = F.scaled_dot_product_attention

    def recording(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(q.dtype)
        return real(q, k, v, *args, **kwargs)

    patch.setattr(F, "scaled_dot_product_attention", recording)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        vit(torch.randn(4, 3, 32, 32, device=device)).float().sum().backward()
    return seen
