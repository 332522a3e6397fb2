"""Tiny real runs with the `callbacks` group: early stopping ends the run at the step its rule gives;
a team's own callback, named by `_target_`, sees every step, and its state comes back on resume;
EMA averages the weights (the checkpoint's state_dict is the average) while leaving the training
itself bit for bit as it was without it; device_stats's utilisation sampler says in summary.json why
a CPU run was not sampled (and a run without it, which choice samples).

The runs are pinned to the CPU: bit-identical weights between two runs are a CPU claim."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from tests.helpers import ON_CPU, TINY, run_in_process
from trainer.callbacks.utilisation import NOT_AMONG_CALLBACKS

pytestmark = pytest.mark.run

#: Two steps an epoch on tiny synthetic images (8 training samples, batch 4).
RUN = [*TINY, *ON_CPU, "trainer.deterministic=true"]
COUNTER = "+callbacks.counter._target_=tests.run.test_callbacks.StepCounter"


class StepCounter(Callback):
    """A team's own callback with state: counts the training steps; the count is in every checkpoint."""

    made: ClassVar[list[StepCounter]] = []

    def __init__(self) -> None:
        self.count = 0
        self.at_train_end: int | None = None
        StepCounter.made.append(self)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.count += 1

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        # Read here: testing the best checkpoint afterwards restores the states it was written with.
        self.at_train_end = self.count

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.count = state_dict["count"]


def test_early_stopping_ends_the_run_when_val_loss_stops_improving(tmp_path):
    # An improvement must beat the best val/loss by 100: the first validation sets the best, the
    # second cannot beat it, and patience 1 stops there: 2 epochs of 2 steps instead of 5 epochs.
    summary = run_in_process([*RUN, "trainer.max_steps=-1", "trainer.max_epochs=5", "callbacks=early_stopping",
                              "callbacks.early_stopping.patience=1", "callbacks.early_stopping.min_delta=100.0"],
                             tmp_path)
    assert summary["status"] == "completed"
    assert summary["steps"] == 4
    assert summary["device_utilisation"] == {"sampled": False, "why": NOT_AMONG_CALLBACKS}


def test_device_stats_adds_the_utilisation_sampler_which_says_why_a_cpu_run_is_not_sampled(tmp_path):
    summary = run_in_process([*RUN, "callbacks=device_stats"], tmp_path)
    assert summary["status"] == "completed"
    assert summary["device_utilisation"] == {"sampled": False, "why": "not sampled: the run is on cpu, not CUDA"}


def test_a_teams_own_callback_sees_every_step(tmp_path):
    summary = run_in_process([*RUN, "trainer.max_steps=3", "trainer.max_epochs=2", COUNTER], tmp_path)
    assert summary["steps"] == 3
    assert StepCounter.made[-1].count == summary["steps"]


def test_a_teams_callback_state_comes_back_on_resume(tmp_path):
    first = run_in_process([*RUN, "trainer.max_steps=-1", "trainer.max_epochs=1", "checkpointing=default", COUNTER],
                           tmp_path / "first")
    last = tmp_path / "first" / "checkpoints" / "last.ckpt"
    assert first["steps"] == 2
    assert torch.load(last, weights_only=True)["callbacks"]["StepCounter"] == {"count": 2}  # under its state_key
    resumed = run_in_process([*RUN, "trainer.max_steps=-1", "trainer.max_epochs=2", "checkpointing=default", COUNTER,
                              f"resume={last}"], tmp_path / "resumed")
    # Without its state the counter would start again at 0 and end training at 2.
    assert resumed["steps"] == 4 and StepCounter.made[-1].at_train_end == 4


def test_ema_averages_the_weights_and_leaves_the_training_alone(tmp_path):
    run = [*RUN, "trainer.max_steps=4", "trainer.max_epochs=2", "checkpointing=default"]
    plain = run_in_process(run, tmp_path / "plain")
    averaged = run_in_process([*run, "callbacks=ema", "callbacks.ema.decay=0.5"], tmp_path / "ema")
    assert plain["steps"] == averaged["steps"] == 4
    off = torch.load(tmp_path / "plain" / "checkpoints" / "last.ckpt", weights_only=True)
    ema = torch.load(tmp_path / "ema" / "checkpoints" / "last.ckpt", weights_only=True)
    # The weights trained are the same with and without EMA, bit for bit ...
    assert ema["current_model_state"].keys() == off["state_dict"].keys()
    assert all(torch.equal(ema["current_model_state"][k], v) for k, v in off["state_dict"].items())
    # ... and the weights the checkpoint (and the test) uses are their average, which differs.
    weights = [k for k, v in off["state_dict"].items() if v.is_floating_point()]
    assert ema["state_dict"].keys() == off["state_dict"].keys()
    assert any(not torch.equal(ema["state_dict"][k], off["state_dict"][k]) for k in weights)
    assert averaged["metrics"]["test"]["loss"] != plain["metrics"]["test"]["loss"]


def test_the_ema_weights_are_the_ones_validated_and_checkpointed(tmp_path):
    """With EMA on, the validation measures the averaged weights: the last validation's loss is that
    of the checkpoint's state_dict (the average), not of the raw weights it also keeps."""
    from trainer.deploy.export import load_network
    from trainer.task import classification_loss

    run_dir = tmp_path / "ema"
    out = run_in_process([*RUN, "trainer.max_steps=4", "trainer.max_epochs=2", "checkpointing=default",
                          "callbacks=ema", "callbacks.ema.decay=0.5"], run_dir)
    last = run_dir / "checkpoints" / "last.ckpt"
    net, _, datamodule, _ = load_network(run_dir, last, tmp_path / "scratch")
    raw = {k.removeprefix("net."): v for k, v in torch.load(last, weights_only=True)["current_model_state"].items()}

    def val_loss(weights: dict[str, torch.Tensor] | None = None) -> float:
        if weights is not None:
            net.load_state_dict(weights)
        net.eval()
        datamodule.apply_loader(datamodule.loader_settings(cuda=False))
        datamodule.setup("fit")
        total, count = 0.0, 0
        with torch.no_grad():
            for batch in datamodule.val_dataloader():
                on_cpu = datamodule.transfer_batch_to_device(batch, torch.device("cpu"), 0)
                images, labels = datamodule.finish_batch(on_cpu, training=False)
                total += classification_loss(net(images), labels).item() * len(labels)
                count += len(labels)
        return total / count

    averaged = val_loss()
    logged = out["metrics"]["val"]["loss"]
    assert logged == pytest.approx(averaged, rel=1e-6, abs=1e-6)
    assert abs(val_loss(raw) - logged) > 1e-5  # the raw weights measure otherwise


# (no validation: no monitored value, so no top-k checkpoint is ever written; a mode that takes the wrong
# end of the loss, the way this was once tested, is refused at start now)
@pytest.mark.parametrize("checkpointing", [["checkpointing.save_top_k=0"],
                                           ["checkpointing.monitor=val/loss", "trainer.limit_val_batches=0"]])
def test_last_ckpt_is_the_latest_epoch_even_when_no_best_one_is_written(tmp_path, checkpointing):
    """Lightning 2.6 writes last.ckpt only beside a new top-k checkpoint; the run's LatestAndBest
    writes it at every epoch end, so resume carries on from the latest epoch, not the best one."""
    out = run_in_process([*RUN, "trainer.max_steps=-1", "trainer.max_epochs=3", "checkpointing=default",
                          *checkpointing], tmp_path)
    last = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert not list((tmp_path / "checkpoints").glob("epoch*.ckpt"))  # no best one was written
    assert out["steps"] == last["global_step"] == 6
    assert any(key.startswith("ModelCheckpoint{") for key in last["callbacks"])  # Lightning's key, as before
