"""Run identity, finding the checkpoint to resume from, the resumable data order and RNG states:
the default run name (the recipe or data-model plus the overrides that change the result);
resume=auto takes the newest readable checkpoint of that name, passing over torn files and
hidden temporaries and leaving out the current folder; if_any; a path or a run folder; a
checkpoint of another model is one line; each epoch's order follows from seed and epoch, restores
mid-epoch, is dealt out to processes and resumes on another process count; host-side random
transforms are equal with and without a worker and after a restore; RNG states survive a
weights-only checkpoint."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from trainer.callbacks.rng import capture, restore
from trainer.data.resumable import EpochSampler, SeededSamples, own_generator
from trainer.infra.errors import UserError
from trainer.phases.resume import check_fits, default_name, find_latest, read_resumable, resolve_resume, write_identity


def test_default_name_is_the_recipe_or_data_model_plus_the_overrides_that_change_the_result():
    assert default_name({"data": "digits", "model": "small_cnn"}, []) == "digits-small_cnn"
    overrides = ["optimizer.lr=0.1", "+recipe=cifar10_resnet18", "resume=auto", "progress=plain",
                 "data.num_workers=4", "run.root=/x", "hydra.run.dir=/y", "+model.hidden=8", "hparams_search=digits_optuna"]
    assert default_name({"recipe": "cifar10_resnet18", "data": "cifar10", "model": "resnet18"}, overrides) == \
        "cifar10_resnet18,model.hidden=8,optimizer.lr=0.1"
    # A requeue (resume=auto added) keeps the name; the order of overrides does not matter.
    assert default_name({"data": "d", "model": "m"}, ["b=2", "a=1"]) == default_name(
        {"data": "d", "model": "m"}, ["a=1", "resume=auto", "b=2"])


def fake_checkpoint(path: Path, step: int, shapes: dict[str, tuple[int, ...]] | None = None,
                    mid_epoch: bool = False) -> Path:
    shapes = shapes or {"net.weight": (3, 2)}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {k: torch.zeros(s) for k, s in shapes.items()}, "optimizer_states": [],
                "global_step": step, "epoch": 0,
                "loops": {"fit_loop": {"epoch_loop.batch_progress": {
                    "current": {"processed": 2}, "is_last_batch": not mid_epoch}}}}, path)
    return path


def make_run(root: Path, folder: str, name: str) -> Path:
    run_dir = root / folder
    run_dir.mkdir(parents=True)
    write_identity(run_dir, name, None)
    return run_dir


def touch_later(path: Path, seconds: float) -> None:
    stamp = time.time() + seconds
    os.utime(path, (stamp, stamp))


def test_auto_takes_the_newest_readable_checkpoint_of_runs_with_that_name(tmp_path, caplog):
    first = make_run(tmp_path, "runs/a", "mine")
    second = make_run(tmp_path, "runs/b", "mine")
    other = make_run(tmp_path, "runs/c", "someone else")
    fake_checkpoint(first / "checkpoints" / "last.ckpt", 10)
    newest = fake_checkpoint(second / "checkpoints" / "last.ckpt", 20, mid_epoch=True)
    touch_later(newest, 10)
    touch_later(fake_checkpoint(other / "checkpoints" / "last.ckpt", 99), 60)
    # A torn file under a checkpoint name (written without the atomic writer) is passed over;
    # a hidden temporary of a write in progress is not even looked at.
    torn = second / "checkpoints" / "epoch001-step000030.ckpt"
    torn.write_bytes(newest.read_bytes()[:100])
    touch_later(torn, 20)
    hidden = second / "checkpoints" / ".last.ckpt.x1y2.tmp"
    hidden.write_bytes(b"partial")
    found = find_latest("mine", tmp_path)
    assert found is not None and found.path == newest and found.global_step == 20 and found.mid_epoch
    assert "passing over" in caplog.text and "epoch001-step000030.ckpt" in caplog.text


def test_a_requeued_job_carries_on_from_its_own_folder_and_nothing_found_is_one_line(tmp_path):
    # submitit requeues a job into the folder of its first attempt, which need not lie under run.root.
    own = make_run(tmp_path, "sweep/0", "mine")
    root = tmp_path / "root"
    with pytest.raises(UserError) as caught:
        resolve_resume("auto", "mine", root, own)
    line = caught.value.line()
    assert line.startswith("resume: auto found no readable checkpoint of run 'mine'") and str(root) in line
    assert resolve_resume("if_any", "mine", root, own) is None
    fake_checkpoint(own / "checkpoints" / "last.ckpt", 5)
    assert resolve_resume("if_any", "mine", root, own).global_step == 5
    assert resolve_resume("auto", "mine", root, own).global_step == 5
    # A folder that holds another run's name is not this run's to carry on from.
    other = make_run(tmp_path, "sweep/1", "someone else")
    fake_checkpoint(other / "checkpoints" / "last.ckpt", 9)
    assert resolve_resume("if_any", "mine", root, other) is None


def test_if_any_carries_on_when_there_is_a_checkpoint_and_starts_fresh_when_not(tmp_path):
    assert resolve_resume("if_any", "requeued", tmp_path, tmp_path / "first") is None
    earlier = make_run(tmp_path, "runs/first", "requeued")
    fake_checkpoint(earlier / "checkpoints" / "last.ckpt", 7)
    assert resolve_resume("if_any", "requeued", tmp_path, tmp_path / "second").global_step == 7


def test_resume_from_a_path_or_a_run_folder_and_the_errors(tmp_path):
    run_dir = make_run(tmp_path, "old", "x")
    ckpt = fake_checkpoint(run_dir / "checkpoints" / "epoch000-step000004.ckpt", 4)
    assert resolve_resume(str(ckpt), "x", tmp_path, tmp_path / "new").global_step == 4
    assert resolve_resume(str(run_dir), "x", tmp_path, tmp_path / "new").path == ckpt
    assert resolve_resume(None, "x", tmp_path, tmp_path / "new") is None
    with pytest.raises(UserError, match="does not exist"):
        resolve_resume(str(tmp_path / "nope.ckpt"), "x", tmp_path, tmp_path / "new")
    weights_only = tmp_path / "weights.ckpt"
    torch.save({"state_dict": {}}, weights_only)
    with pytest.raises(UserError, match="not a training checkpoint"):
        resolve_resume(str(weights_only), "x", tmp_path, tmp_path / "new")


def test_a_checkpoint_of_another_model_is_one_line(tmp_path):
    ckpt = read_resumable(fake_checkpoint(tmp_path / "a.ckpt", 1, {"net.weight": (3, 2), "net.extra": (1,)}))
    check_fits(ckpt, {"net.weight": torch.zeros(3, 2), "net.extra": torch.zeros(1)})
    check_fits(ckpt, {"net._orig_mod.weight": torch.zeros(3, 2), "net._orig_mod.extra": torch.zeros(1)})
    with pytest.raises(UserError) as caught:
        check_fits(ckpt, {"net.weight": torch.zeros(4, 2), "net.bias": torch.zeros(4)})
    line = caught.value.line()
    assert "written by another model" in line and "net.weight: (3, 2) in the checkpoint, (4, 2) here" in line
    assert "1 weights missing (e.g. net.bias)" in line and "1 unknown weights (e.g. net.extra)" in line


def test_epoch_sampler_orders_from_seed_and_epoch_and_resumes_mid_epoch():
    sampler = EpochSampler(10, seed=3)
    first = list(sampler)
    assert sorted(first) == list(range(10)) and list(EpochSampler(10, seed=3)) == first
    sampler.set_epoch(1)
    second = list(sampler)
    assert second != first and sorted(second) == list(range(10))
    # Three batches of 2 taken in epoch 1: the next sampler starts at item 6 of the same order.
    sampler.taken = 3
    position = sampler.position(batches_per_epoch=5, items_per_batch=2)
    assert position == {"epoch": 1, "batches": 3, "items": 6, "items_per_batch": 2, "replicas": 1, "size": 10}
    resumed = EpochSampler(10, seed=3)
    resumed.restore(position)
    assert list(resumed) == second[6:] and resumed.taken == 3
    assert list(resumed) == second  # the skip applies once; the next pass is the whole epoch
    # All batches of the epoch taken: the position is the start of the next epoch.
    sampler.taken = 5
    assert sampler.position(5, 2) == {"epoch": 2, "batches": 0, "items": 0, "items_per_batch": 2, "replicas": 1,
                                      "size": 10}
    with pytest.raises(UserError, match="the data changed"):
        EpochSampler(11, seed=3).restore(position)
    # A checkpoint written before positions counted items (one process) still resumes.
    old = EpochSampler(10, seed=3)
    old.restore({"epoch": 1, "batches": 3, "items_per_batch": 2, "size": 10})
    assert list(old) == second[6:]


def test_epoch_sampler_deals_one_order_out_to_processes_and_resumes_on_another_count():
    whole = EpochSampler(13, seed=5)
    whole.set_epoch(2)
    order = list(whole)
    shards = [EpochSampler(13, seed=5, replicas=2, rank=r) for r in range(2)]
    for shard in shards:
        shard.set_epoch(2)
    first, second = (list(s) for s in shards)
    # Every process the same count (the odd item waits for the next epoch), together the epoch's order.
    assert len(first) == len(second) == len(shards[0]) == 6
    assert [i for pair in zip(first, second) for i in pair] == order[:12]
    # Two of the three batches of 2 per process taken on 2 processes: 8 items of the order consumed.
    for shard in shards:
        shard.taken = 2
    position = shards[0].position(batches_per_epoch=3, items_per_batch=2)
    assert position["items"] == 8 and position["replicas"] == 2 and position["epoch"] == 2
    # Resumed on one process, then on three: each carries on after those 8 items.
    alone = EpochSampler(13, seed=5)
    alone.restore(position)
    assert list(alone) == order[8:] and alone.taken == 4
    # Three processes share the 5 items left: one each; the other 2 wait for the next epoch.
    three = [EpochSampler(13, seed=5, replicas=3, rank=r) for r in range(3)]
    for shard in three:
        shard.restore(position)
    assert [list(s) for s in three] == [[order[8]], [order[9]], [order[10]]]
    # Lightning uses a DistributedSampler as it is (no DistributedSamplerWrapper re-shuffling it).
    from torch.utils.data import DistributedSampler

    assert isinstance(shards[1], DistributedSampler) and shards[1].num_replicas == 2


class RandomCrops(Dataset):
    """A host-side random transform, as an image folder's random crops are."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(3) + index


def test_host_randomness_is_the_same_in_workers_in_process_and_after_a_resume():
    def batches(num_workers: int, skip_batches: int = 0) -> list[torch.Tensor]:
        sampler = EpochSampler(12, seed=7, seeded=True)
        sampler.set_epoch(2)
        if skip_batches:
            sampler.restore({"epoch": 2, "batches": skip_batches, "items_per_batch": 3, "size": 12})
        loader = DataLoader(SeededSamples(RandomCrops()), sampler=sampler, batch_size=3, num_workers=num_workers,
                            generator=own_generator(7))
        return list(loader)

    torch.manual_seed(0)
    before = torch.get_rng_state()
    in_process = batches(0)
    assert torch.equal(torch.get_rng_state(), before)  # the training process's RNG is left alone
    with_worker = batches(1)
    assert all(torch.equal(a, b) for a, b in zip(in_process, with_worker))
    resumed = batches(0, skip_batches=2)
    assert len(resumed) == 2 and all(torch.equal(a, b) for a, b in zip(in_process[2:], resumed))


def test_rng_states_round_trip_through_a_weights_only_checkpoint(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.random(), np.random.normal(), torch.randn(2)  # noqa: B018 - move every generator (numpy's gauss cache too)
    path = tmp_path / "rng.pt"
    torch.save(capture(), path)
    expected = (random.random(), np.random.normal(), torch.randn(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore(torch.load(path, weights_only=True))
    again = (random.random(), np.random.normal(), torch.randn(3))
    assert expected[0] == again[0] and expected[1] == again[1] and torch.equal(expected[2], again[2])


def test_run_identity_file(tmp_path):
    write_identity(tmp_path, "name,with=chars", "/x/last.ckpt")
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["name"] == "name,with=chars" and record["resumed_from"] == "/x/last.ckpt"


def test_a_requeued_slurm_job_without_resume_carries_on_rather_than_starting_over(tmp_path, monkeypatch):
    own = make_run(tmp_path, "sweep/0", "mine")
    fake_checkpoint(own / "checkpoints" / "last.ckpt", 12)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert resolve_resume(None, "mine", tmp_path / "root", own) is None  # a first start: fresh
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert resolve_resume(None, "mine", tmp_path / "root", own).global_step == 12
