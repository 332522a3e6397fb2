"""Percentile gradient clipping: the threshold is numpy's percentile of the calibration norms,
each calibration step is clipped to the percentile of the norms so far (or left alone when told),
no update after calibration exceeds it and small ones are untouched, a rolling window follows the
last norms, non-finite norms are counted but never recorded, gradients under an fp16 GradScaler
are seen unscaled, and a real Lightning run clips in the right place. Also: the fixed-norm and
value rules are Lightning's own clipping (the callback only counts what it changes, in the order
Lightning's hooks run), off changes nothing, the state survives a checkpoint, and fused kernels
under fp16 or a second clipping through `trainer.gradient_clip_val` are refused."""

from __future__ import annotations

import copy
import io
import math

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests.helpers import Ops, RecordingLogger
from trainer.callbacks.step_log import StepLog
from trainer.infra.step_gradients import of_parameters
from trainer.groups.clipping import (FIXED_ROWS, FixedNorm, GradientClipping, Off, Percentile, Value,
                                     global_grad_norm, percentile_threshold)


def params_with_norms(norms: list[float], seed: int = 0, shape: tuple[int, ...] = (5,)) -> list[torch.Tensor]:
    """One float64 parameter per step whose gradient has exactly the prescribed norm (to rounding)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in norms:
        p = torch.zeros(shape, dtype=torch.float64, requires_grad=True)
        direction = torch.randn(shape, generator=gen, dtype=torch.float64)
        p.grad = direction / direction.norm() * n
        out.append(p)
    return out


def random_grads(gen: torch.Generator, scale: float) -> list[torch.Tensor]:
    params = [torch.zeros(s, requires_grad=True) for s in [(3, 4), (4,), (7,)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * scale
    return params


def test_percentile_threshold_is_numpys_linear_percentile():
    norms = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    for q in (50.0, 90.0, 95.0, 100.0):
        assert percentile_threshold(norms, q) == np.percentile(norms, q)
    with pytest.raises(ValueError):
        percentile_threshold([], 95.0)


def test_global_grad_norm_matches_clip_grad_norm_and_skips_missing_grads():
    gen = torch.Generator().manual_seed(1)
    params = random_grads(gen, 2.0) + [torch.zeros(3, requires_grad=True)]  # the last has no grad
    expected = torch.nn.utils.clip_grad_norm_(copy.deepcopy(params), float("inf"))
    assert global_grad_norm(params).item() == pytest.approx(expected.item(), rel=1e-6)
    assert global_grad_norm([torch.zeros(2, requires_grad=True)]).item() == 0.0


def calibration_norms_with_an_outlier() -> list[float]:
    norms = list(np.random.default_rng(0).lognormal(0.0, 1.0, size=20))
    norms[7] = 100.0
    return norms


def test_calibration_clips_each_step_to_the_percentile_so_far_and_records_the_pre_clip_norms():
    norms = calibration_norms_with_an_outlier()
    cb = GradientClipping(Percentile(calibration_steps=20))
    clipped_steps = []
    for i, p in enumerate(params_with_norms(norms)):
        before = p.grad.clone()
        norm, threshold, clipped = cb.observe_and_clip([p])
        assert norm == pytest.approx(norms[i], rel=1e-12)
        # AutoClip's order: the norm joins the history, then the percentile of all of it is the bound.
        assert threshold == pytest.approx(np.percentile(norms[:i + 1], 95), rel=1e-12)
        assert clipped == (norms[i] > threshold)
        if clipped:
            clipped_steps.append(i)
            assert global_grad_norm([p]).item() == pytest.approx(threshold, rel=1e-5)
            coef = p.grad[0] / before[0]
            assert torch.allclose(p.grad, before * coef)  # the same direction, shorter
        else:
            assert torch.equal(p.grad, before)
    assert 0 not in clipped_steps  # one norm is its own percentile
    assert 7 in clipped_steps  # the outlier is held to the percentile of the eight norms so far
    assert cb.rule.calibration_norms == pytest.approx(norms, rel=1e-12)  # pre-clip: clipping cannot drag it down
    assert cb.rule.calibrated_threshold == cb.threshold == pytest.approx(np.percentile(norms, 95), rel=1e-12)
    assert cb.steps_clipped == len(clipped_steps) and cb.summary()["clip_during_calibration"] is True


def test_a_bound_made_afresh_at_each_step_is_never_taken_for_an_earlier_one():
    # Calibration makes its bound afresh at every step (float64) and casts it to the gradients' float32.
    # A cast kept by the bound's id was once reused for a later bound that took the freed one's id and
    # version: the step was clipped to an earlier step's threshold (as the allocator happened to place it).
    cb = GradientClipping(Percentile())
    p = torch.zeros(3, requires_grad=True)
    for bound_value in (0.5, 1.0, 0.25, 1.5, 0.75):
        p.grad = torch.ones(3)  # norm sqrt(3), above every bound
        gradients = of_parameters([p])
        bound = torch.tensor(bound_value, dtype=torch.float64)
        cb._scale_grads(gradients, bound, gradients.total, torch.tensor(True))
        assert p.grad.norm().item() == pytest.approx(bound_value, rel=1e-5)
        del bound, gradients  # freed, as a calibration step's bound is: its id is free for the next


def test_calibration_left_unclipped_records_then_threshold_is_the_95th_percentile():
    norms = calibration_norms_with_an_outlier()  # the outlier must pass untouched here
    cb = GradientClipping(Percentile(calibration_steps=20, clip_during_calibration=False))
    for i, p in enumerate(params_with_norms(norms)):
        before = p.grad.clone()
        norm, threshold, clipped = cb.observe_and_clip([p])
        assert norm == pytest.approx(norms[i], rel=1e-12)
        assert not clipped and torch.equal(p.grad, before)
        assert threshold is None if i < 19 else threshold is not None
    assert cb.rule.calibration_norms == pytest.approx(norms, rel=1e-12)
    assert cb.threshold == np.percentile(cb.rule.calibration_norms, 95)
    assert cb.threshold == pytest.approx(np.percentile(norms, 95), rel=1e-12)
    assert cb.rule.calibrated_threshold == cb.threshold
    assert cb.steps_clipped == 0 and cb.summary()["steps_observed"] == 20


def test_after_calibration_no_update_exceeds_the_threshold_and_small_ones_are_untouched():
    gen = torch.Generator().manual_seed(2)
    cb = GradientClipping(Percentile(calibration_steps=30))
    for _ in range(30):
        cb.observe_and_clip(random_grads(gen, float(torch.rand(1, generator=gen)) * 3))
    threshold, clipped_in_calibration = cb.threshold, cb.steps_clipped
    clipped_steps = 0
    for _ in range(200):
        params = random_grads(gen, float(torch.rand(1, generator=gen)) * 6)
        before = [p.grad.clone() for p in params]
        norm, thr, clipped = cb.observe_and_clip(params)
        assert thr == threshold  # no rolling window: frozen after calibration
        after = global_grad_norm(params).item()
        assert after <= threshold * (1 + 1e-6)
        if norm <= threshold:
            assert not clipped and all(torch.equal(p.grad, b) for p, b in zip(params, before))
        else:
            clipped_steps += 1
            assert clipped and after == pytest.approx(threshold, rel=1e-5)
            coef = params[0].grad.flatten()[0] / before[0].flatten()[0]  # same direction, one factor
            assert all(torch.allclose(p.grad, b * coef) for p, b in zip(params, before))
    assert 0 < clipped_steps < 200 and cb.steps_clipped == clipped_in_calibration + clipped_steps


def test_the_short_path_of_a_fixed_bound_clips_and_counts_as_the_general_path():
    # Once a log step has told the rule that calibration is over, a step takes the short path (its norm
    # written into a buffer, the counting done when the counts are read). Over more steps than the
    # buffer holds, with infinite and NaN steps among them and a read in the middle, it leaves the same
    # gradients, bit for bit, and the same counts as the general path; and it does 7 operations a step.
    gen = torch.Generator().manual_seed(5)
    short, general = (GradientClipping(Percentile(calibration_steps=10)) for _ in range(2))
    for _ in range(10):
        params = random_grads(gen, float(torch.rand(1, generator=gen)) * 3)
        twin = copy.deepcopy(params)
        short.observe_and_clip(params)
        general.observe_and_clip(twin)
    short.rule.settle(short.steps_seen)
    assert short.rule.settled and not general.rule.settled
    for index in range(3 * FIXED_ROWS + 5):
        params = random_grads(gen, float(torch.rand(1, generator=gen)) * 6)
        if index % 37 == 5:
            params[1].grad[0] = float("inf")
        if index % 41 == 7:
            params[2].grad[0] = float("nan")
        twin = copy.deepcopy(params)
        record, expected = short.clip_on_device(params), general.clip_on_device(twin)
        for ours, theirs in zip(params, twin):
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=0, equal_nan=True)
        assert bool(record.clipped) == bool(expected.clipped)
        assert torch.equal(record.norm, expected.norm) or math.isnan(record.norm)
        if index == FIXED_ROWS + 3:
            assert (short.steps_clipped, short.nonfinite_steps) == (general.steps_clipped, general.nonfinite_steps)
    assert (short.steps_clipped, short.nonfinite_steps, short.steps_seen) == \
        (general.steps_clipped, general.nonfinite_steps, general.steps_seen)
    assert short.steps_clipped > 20 and short.nonfinite_steps == 11

    gradients = of_parameters(random_grads(gen, 6.0))
    assert gradients.norms.numel() == 3  # stacked when first read (or in the guard's row): not the clipping's operation
    with Ops() as ops:
        short._clip(gradients, sharded=False)
    assert len(ops.names) == 7


def test_rolling_window_follows_the_last_pre_clip_norms():
    rng = np.random.default_rng(3)
    norms = list(rng.lognormal(0.0, 0.7, size=40) * np.linspace(1, 5, 40))  # drifting upwards
    cb = GradientClipping(Percentile(calibration_steps=5, rolling_window=8))
    seen: list[float] = []
    for i, p in enumerate(params_with_norms(norms, seed=3)):
        norm, threshold, clipped = cb.observe_and_clip([p])
        seen.append(norm)
        if i <= 4:  # calibrating: the percentile of every norm so far (the window holds them all)
            assert threshold == np.percentile(seen, 95)
            assert cb.rule.calibrated_threshold == (threshold if i == 4 else None)
        else:
            # the window holds the current pre-clip norm too, and nothing older than 8 steps
            assert threshold == np.percentile(seen[-8:], 95)
            assert list(cb.rule.window) == seen[-8:]
            assert clipped == (norm > threshold)
    assert cb.threshold > cb.rule.calibrated_threshold  # it followed the drift
    assert cb.rule.calibration_norms == seen[:5]


def test_nonfinite_norms_are_counted_but_never_recorded_or_clipped():
    cb = GradientClipping(Percentile(calibration_steps=3, rolling_window=4))
    for p in params_with_norms([1.0, 2.0, 3.0, 4.0]):
        cb.observe_and_clip([p])
    window, threshold = list(cb.rule.window), cb.threshold
    for bad in (float("inf"), float("nan")):
        p = torch.zeros(3, requires_grad=True)
        p.grad = torch.tensor([1.0, bad, 1.0])
        before = p.grad.clone()
        norm, thr, clipped = cb.observe_and_clip([p])
        assert not math.isfinite(norm) and not clipped
        assert torch.equal(p.grad, before) or (bad != bad and torch.equal(p.grad.isnan(), before.isnan()))
    assert cb.nonfinite_steps == 2 and cb.steps_seen == 6
    assert list(cb.rule.window) == window and cb.threshold == threshold


def fp16_pair() -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(4)
    return nn.Linear(8, 3), torch.randn(16, 8), torch.randn(16, 3)


def test_gradscaler_gradients_are_observed_unscaled_after_unscale_():
    model, x, y = fp16_pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    nn.functional.mse_loss(model(x), y).backward()
    reference = global_grad_norm(model.parameters()).item()

    opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
    # Without unscaling the callback would record a norm off by the loss scale: the check can fail.
    assert global_grad_norm(model.parameters()).item() == pytest.approx(reference * 2 ** 10, rel=1e-5)
    scaler.unscale_(opt)
    norm, _, _ = GradientClipping(Percentile(calibration_steps=5)).observe_and_clip(model.parameters())
    assert norm == pytest.approx(reference, rel=1e-5)


class TinyModule(L.LightningModule):
    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        self.net = nn.Linear(8, 1)
        self.optimizer = optimizer
        self.last_batch: tuple[torch.Tensor, torch.Tensor] | None = None

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.last_batch = batch
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, fused=self.optimizer == "fused")

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(64, 8, generator=gen)
        # Inputs grow along the (unshuffled) epoch, so later steps have larger norms and get clipped.
        x = x * torch.linspace(1.0, 4.0, 64).unsqueeze(1)
        y = x.sum(dim=1, keepdim=True) + torch.randn(64, 1, generator=gen)
        return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)


class NormRecorder(Callback):
    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.norms.append(global_grad_norm(pl_module.parameters()).item())


def tiny_trainer(callbacks: list[Callback], **kwargs) -> L.Trainer:
    kwargs.setdefault("max_steps", 30)
    kwargs.setdefault("logger", False)
    return L.Trainer(accelerator="cpu", enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, callbacks=callbacks, **kwargs)


@pytest.mark.run
def test_lightning_run_calibrates_then_keeps_every_update_under_the_threshold():
    torch.manual_seed(6)
    before, clip, after = NormRecorder(), GradientClipping(Percentile(calibration_steps=10)), NormRecorder()
    logger = RecordingLogger()
    # Lightning keeps this order for the hook; the step log writes the clipping's values at log steps.
    trainer = tiny_trainer([before, clip, after, StepLog([clip])], logger=logger, log_every_n_steps=5)
    trainer.fit(TinyModule())

    summary = clip.summary()
    assert summary["steps_observed"] == 30 and len(before.norms) == 30
    assert clip.rule.calibration_norms == pytest.approx(before.norms[:10], rel=1e-6)
    assert clip.threshold == np.percentile(clip.rule.calibration_norms, 95) == summary["calibrated_threshold"]
    # Each calibration step is held to the percentile of the norms so far, every later one to the threshold.
    bounds = [np.percentile(before.norms[:i + 1], 95) for i in range(10)] + [clip.threshold] * 20
    for pre, post, bound in zip(before.norms, after.norms, bounds):
        assert post <= bound * (1 + 1e-6)
        assert post == pytest.approx(min(pre, bound), rel=1e-5)
    assert summary["steps_clipped"] == sum(n > b for n, b in zip(before.norms, bounds))
    assert sum(n > clip.threshold for n in before.norms[10:]) > 0
    # What the loggers got at each log step (every 5th): that step's pre-clip norm, the threshold in
    # force and whether it was clipped, read from the device at the log step only.
    clipped_at = [n > b for n, b in zip(before.norms, bounds)]
    written = [(step, m) for step, m in logger.logged if "clip/grad_norm" in m]
    assert [step for step, _ in written] == [4, 9, 14, 19, 24, 29]
    for step, metrics in written:
        assert metrics["clip/grad_norm"] == pytest.approx(before.norms[step], rel=1e-6)
        assert metrics["clip/threshold"] == pytest.approx(bounds[step], rel=1e-6)
        assert metrics["clip/clipped"] == float(clipped_at[step])


class AfterStep(Callback):
    """Each step's gradient norm once the optimizer has stepped, and whether a `grad_scale` was left on it."""

    def __init__(self) -> None:
        self.norms: list[float] = []
        self.left: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.norms.append(global_grad_norm(pl_module.parameters()).item())
        self.left.append(any(hasattr(o, "grad_scale") for o in trainer.optimizers))


@pytest.mark.run
def test_a_fused_kernel_applies_the_factor_as_it_steps_as_the_multiply_would(monkeypatch):
    # With a fused optimizer the factor's inverse goes to the kernel as a GradScaler's grad_scale: it
    # divides the gradients as it steps (and writes them back clipped), one pass over them fewer. Over
    # the calibration (the general path) and the steps after it (the short path): the same clipped
    # gradients after each step, the same weights and counts as multiplying them here, and no
    # grad_scale left on the optimizer after a step.
    def run(kernel: bool):
        if not kernel:
            monkeypatch.setattr(GradientClipping, "_kernel_scales", lambda self, optimizer, gradients: None)
        torch.manual_seed(6)
        before, clip, after = NormRecorder(), GradientClipping(Percentile(calibration_steps=10)), AfterStep()
        module = TinyModule("fused")
        tiny_trainer([before, clip, after, StepLog([clip])], log_every_n_steps=5).fit(module)
        monkeypatch.undo()
        return module, clip, before, after

    kernel, multiply = run(kernel=True), run(kernel=False)
    assert kernel[1].rule.settled and kernel[1].summary()["steps_clipped"] > 5
    ours, theirs = kernel[1].summary(), multiply[1].summary()  # (division and multiplication round apart)
    assert ours.keys() == theirs.keys() and ours["steps_clipped"] == theirs["steps_clipped"]
    for key, value in ours.items():
        assert value == (pytest.approx(theirs[key], rel=2e-5) if isinstance(value, float) else theirs[key]), key
    # (fp32 rounding, division against multiplication, drifts the two runs apart by about 1e-6 over 30 steps)
    assert kernel[2].norms == pytest.approx(multiply[2].norms, rel=2e-5)  # not clipped yet at the hook
    assert kernel[3].norms == pytest.approx(multiply[3].norms, rel=2e-5)
    bounds = [np.percentile(kernel[2].norms[:i + 1], 95) for i in range(10)] + [kernel[1].threshold] * 20
    assert kernel[3].norms == pytest.approx([min(n, b) for n, b in zip(kernel[2].norms, bounds)], rel=1e-5)
    assert not any(kernel[3].left) and list(kernel[1]._kernel_hooked.values()) == [True]  # the kernel's route taken
    for ours, theirs in zip(kernel[0].parameters(), multiply[0].parameters()):
        torch.testing.assert_close(ours, theirs, rtol=2e-5, atol=1e-6)


class ReferenceNorm(Callback):
    """Next to the hook's gradient norm, the fp32 gradient norm of the same batch without any scaler."""

    def __init__(self) -> None:
        self.pairs: list[tuple[float, float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        seen = global_grad_norm(pl_module.parameters()).item()
        x, y = pl_module.last_batch
        grads = torch.autograd.grad(nn.functional.mse_loss(pl_module.net(x), y), list(pl_module.parameters()))
        reference = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()
        self.pairs.append((seen, reference))


@pytest.mark.run
def test_lightning_fp16_amp_unscales_before_the_hook():
    torch.manual_seed(6)
    reference, clip = ReferenceNorm(), GradientClipping(Percentile(calibration_steps=10))
    trainer = tiny_trainer([reference, clip], plugins=[MixedPrecision("16-mixed", "cpu")])
    trainer.fit(TinyModule())
    assert trainer.precision_plugin.scaler is not None and trainer.precision_plugin.scaler.get_scale() > 1
    finite = [(s, r) for s, r in reference.pairs if math.isfinite(s)]
    assert len(finite) >= 20
    # The first steps overflow while the scaler backs off from 65536: counted, never recorded.
    assert clip.nonfinite_steps == len(reference.pairs) - len(finite) > 0
    # fp16 autocast differs from fp32 a little; a missing unscale would be off by the loss scale (>= 512).
    for seen, ref in finite:
        assert seen == pytest.approx(ref, rel=0.05)
    assert clip.rule.calibration_norms == [s for s, _ in finite][:10]


@pytest.mark.run
def test_fused_optimizer_under_fp16_is_refused_at_fit_start():
    trainer = tiny_trainer([GradientClipping()], plugins=[MixedPrecision("16-mixed", "cpu")])
    with pytest.raises(RuntimeError, match="fused"):
        trainer.fit(TinyModule(optimizer="fused"))
    # mode off does not care
    tiny_trainer([GradientClipping(Off())], plugins=[MixedPrecision("16-mixed", "cpu")],
                 max_steps=2).fit(TinyModule(optimizer="fused"))


@pytest.mark.run
def test_trainer_gradient_clip_val_together_with_a_rule_clipping_here_is_refused():
    trainer = tiny_trainer([GradientClipping(Percentile(calibration_steps=5))], gradient_clip_val=1.0)
    with pytest.raises(RuntimeError, match="gradient_clip_val"):
        trainer.fit(TinyModule())


@pytest.mark.parametrize("rule, kwargs", [
    (Percentile, {"percentile": 0}),
    (Percentile, {"percentile": 101}),
    (Percentile, {"percentile": True}),
    (Percentile, {"calibration_steps": 0}),
    (Percentile, {"calibration_steps": 2.5}),
    (Percentile, {"rolling_window": 0}),
    (Percentile, {"clip_during_calibration": "yes"}),
    (FixedNorm, {"max_norm": -1.0}),
    (FixedNorm, {"max_norm": float("inf")}),
    (Value, {"clip_value": 0.0}),
])
def test_invalid_arguments_raise_value_error(rule, kwargs):
    with pytest.raises(ValueError):
        rule(**kwargs)


@pytest.mark.run
@pytest.mark.parametrize("rule", [FixedNorm(max_norm=1.5), Value(clip_value=0.4)], ids=["fixed_norm", "value"])
def test_fixed_norm_and_value_are_lightnings_own_clipping_after_the_hook_that_counts_them(rule):
    """The run hands these rules to the Trainer (gradient_clip_val, gradient_clip_algorithm), and
    Lightning clips after `on_before_optimizer_step`, where the callback saw the gradients as they
    were: every update is clipped as torch's clip_grad_norm_ / clip_grad_value_ would, and the
    callback's count of clipped steps is the steps those change."""
    torch.manual_seed(6)
    before, clip = Largest(), GradientClipping(rule)
    trainer = tiny_trainer([before, clip], **rule.trainer_arguments())
    module = TinyModule()
    stepped: list[tuple[float, float]] = []  # (norm, largest element) the optimizer stepped with

    def step_hook(optimizer, args, kwargs) -> None:
        stepped.append((global_grad_norm(module.parameters()).item(),
                        max(p.grad.abs().max().item() for p in module.parameters())))

    module.configure_optimizers = lambda: _hooked(torch.optim.SGD(module.parameters(), lr=0.01), step_hook)
    trainer.fit(module)
    assert len(stepped) == len(before.seen) == 30
    if isinstance(rule, FixedNorm):
        for (norm, _), (pre, _) in zip(stepped, before.seen):
            assert norm == pytest.approx(min(pre, 1.5), rel=1e-5)
        assert clip.steps_clipped == sum(pre > 1.5 for pre, _ in before.seen) > 0
    else:
        for (_, largest), (_, pre) in zip(stepped, before.seen):
            assert largest == pytest.approx(min(pre, 0.4), rel=1e-6)
        assert clip.steps_clipped == sum(pre > 0.4 for _, pre in before.seen) > 0
    assert clip.summary()["threshold"] == rule.threshold and clip.summary()["mode"] == rule.mode


class Largest(Callback):
    """The global norm and the largest gradient element each step, as the callbacks see them."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.seen.append((global_grad_norm(pl_module.parameters()).item(),
                          max(p.grad.abs().max().item() for p in pl_module.parameters())))


def _hooked(optimizer: torch.optim.Optimizer, hook) -> torch.optim.Optimizer:
    optimizer.register_step_post_hook(hook)  # the step ran its closure: the gradients it stepped with
    return optimizer


def test_mode_off_never_changes_gradients():
    gen = torch.Generator().manual_seed(8)
    cb = GradientClipping(Off())
    for scale in (1e-3, 1.0, 1e6):
        params = random_grads(gen, scale)
        before = [p.grad.clone() for p in params]
        _, threshold, clipped = cb.observe_and_clip(params)
        assert threshold is None and not clipped
        assert all(torch.equal(p.grad, b) for p, b in zip(params, before))


def test_state_dict_round_trip_continues_identically():
    rng = np.random.default_rng(9)
    norms = list(rng.lognormal(0.0, 1.0, size=40))
    original = GradientClipping(Percentile(calibration_steps=10, rolling_window=12))
    first, rest = params_with_norms(norms[:15], seed=9), params_with_norms(norms[15:], seed=10)
    for p in first:
        original.observe_and_clip([p])

    # Through torch.save/load with weights_only, as a Lightning checkpoint would carry it.
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    buffer.seek(0)
    resumed = GradientClipping(Percentile(calibration_steps=10, rolling_window=12))
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.summary() == original.summary()

    for p in rest:
        twin = p.detach().clone().requires_grad_(True)
        twin.grad = p.grad.clone()
        assert original.observe_and_clip([p]) == resumed.observe_and_clip([twin])
        assert torch.equal(p.grad, twin.grad)
    assert resumed.summary() == original.summary()
    assert list(resumed.rule.window) == list(original.rule.window)

    with pytest.raises(ValueError, match="settings"):
        GradientClipping(Percentile(calibration_steps=10, rolling_window=6)).load_state_dict(original.state_dict())


def test_a_checkpoint_from_before_clip_during_calibration_resumes_only_as_it_was_recorded():
    old = GradientClipping(Percentile(calibration_steps=10, clip_during_calibration=False))
    for p in params_with_norms([1.0, 3.0, 2.0]):
        old.observe_and_clip([p])
    state = old.state_dict()
    del state["settings"]["clip_during_calibration"]  # as written before the setting existed: unclipped
    resumed = GradientClipping(Percentile(calibration_steps=10, clip_during_calibration=False))
    resumed.load_state_dict(state)
    assert resumed.rule.calibration_norms == old.rule.calibration_norms
    with pytest.raises(ValueError, match="clip_during_calibration"):
        GradientClipping(Percentile(calibration_steps=10)).load_state_dict(state)


def test_a_checkpoint_from_before_the_rules_were_classes_resumes():
    """Written when one callback held every mode: its settings carried every mode's keys."""
    rule = Percentile(calibration_steps=10)
    saved = {"settings": {"mode": "percentile", "percentile": 95.0, "calibration_steps": 10,
                          "clip_during_calibration": True, "rolling_window": None, "max_norm": None, "clip_value": None},
             "calibration_norms": [1.0, 2.0], "window": [], "calibrated_threshold": None, "threshold": 2.0,
             "steps_seen": 2, "steps_clipped": 1, "nonfinite_steps": 0}
    resumed = GradientClipping(rule)
    resumed.load_state_dict(saved)
    assert rule.calibration_norms == [1.0, 2.0] and resumed.threshold == 2.0 and resumed.steps_clipped == 1
    fixed = {**saved, "settings": {**saved["settings"], "mode": "fixed_norm", "max_norm": 1.0}}
    GradientClipping(FixedNorm(max_norm=1.0)).load_state_dict(fixed)
