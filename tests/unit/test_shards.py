"""Shards written from an image folder and read back (trainer/data/prepare_shards.py, shards.py).

A folder of photo JPEGs (one truncated) becomes LitData shards: the readable images, each once, with
the folder source's labels and order numbers, the bad one listed. Read back in every decode mode, an
image's training crop in an epoch is, bit for bit, the crop the image-folder source gives it for the
same run seed (the device path: the same crop box). A loader stopped after some batches and placed
where it stopped gives exactly the batches the uninterrupted loader gave after them. A killed write
carries on. A source with no complete shards is one line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.helpers import write_photo_jpegs
from trainer.data.decode import EncodedImage
from trainer.data.imagefolder import ImageFolderDataModule
from trainer.data.prepare_shards import prepare_shards
from trainer.data.resumable import SeededSamples, mix
from trainer.data.shards import ShardsDataModule, ShardStream
from trainer.infra.errors import UserError

litdata = pytest.importorskip("litdata")

SEED = 7
IMAGES = {"image_size": 32, "batch_size": 4, "num_workers": 0}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("photos")
    write_photo_jpegs(root, {"train": 12, "val": 4}, classes=3, size=(96, 72))
    cut = root / "train" / "class1" / "0015.jpg"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])  # truncated: training cannot read it
    return root


@pytest.fixture(scope="module")
def shards(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dst = tmp_path_factory.mktemp("shards") / "photos"
    report = prepare_shards(folder, str(dst), workers=1, chunk_mb=1, progress=False)
    assert report.sizes == {"train": 35, "val": 12} and len(report.bad) == 1
    return dst


def _raw_items(dataset: ShardStream) -> list[dict]:
    return [litdata.StreamingDataset.__getitem__(dataset, i) for i in range(len(dataset))]


def test_every_readable_image_is_written_once_with_its_label_and_place_and_the_bad_one_is_listed(folder, shards):
    described = json.loads((shards / "dataset.json").read_text())
    assert described["classes"] == ["class0", "class1", "class2"] and described["sizes"] == {"train": 35, "val": 12}
    assert described["jpeg_share"] == 1.0 and "0015.jpg" in (shards / "bad_files.tsv").read_text()
    module = ImageFolderDataModule(root=str(folder), scan="full", max_bad_share=0.1, decode="fast", **IMAGES)
    module.setup()
    reference = module.train_set.samples  # (path, label) in the folder source's order, bad file left out
    data = ShardsDataModule(source=str(shards), decode="fast", **IMAGES)
    data.setup()
    items = _raw_items(data.train_set)
    assert sorted(int(item["index"]) for item in items) == list(range(len(reference)))
    for item in items:
        path, label = reference[int(item["index"])]
        assert int(item["label"]) == label and bytes(item["image"]) == Path(path).read_bytes()
        assert path.endswith(item["name"])
    # written in a shuffled order: the first chunk's samples are not the folder's first class only
    assert len({int(item["label"]) for item in items[:12]}) > 1


@pytest.mark.parametrize("mode", ["pil", "fast", "device"])
def test_an_images_training_crop_in_an_epoch_is_the_image_folders_for_the_same_seed(folder, shards, mode):
    module = ImageFolderDataModule(root=str(folder), scan="full", max_bad_share=0.1, decode=mode, **IMAGES)
    module.attach_run(None, SEED)
    module.setup()
    data = ShardsDataModule(source=str(shards), decode=mode, **IMAGES)
    data.attach_run(None, SEED)
    data.setup()
    stream = data.train_set
    for epoch in (0, 3):
        stream.set_epoch(epoch + 1)  # LitData counts epochs from 1
        for item in _raw_items(stream)[:10]:
            index = int(item["index"])
            ours = stream.decoded(item)
            theirs = SeededSamples(module.train_set)[(index, mix(SEED, epoch, index, 1))][0]
            if mode == "device":
                assert isinstance(ours, EncodedImage) and ours.box == theirs.box
                assert torch.equal(ours.data, theirs.data)
            else:
                assert torch.equal(ours, theirs), (mode, epoch, index)


def _batches(loader, count=None) -> list[torch.Tensor]:
    out = []
    for batch in loader:
        out.append(batch[0].clone())
        if count is not None and len(out) == count:
            break
    return out


def test_a_loader_placed_where_another_stopped_gives_the_batches_that_followed(shards):
    def module() -> ShardsDataModule:
        data = ShardsDataModule(source=str(shards), decode="fast", image_size=32, batch_size=4, num_workers=2)
        data.attach_run(None, SEED)
        data.setup()
        return data

    uninterrupted = module().train_dataloader()
    first, second = _batches(uninterrupted), _batches(uninterrupted)
    assert len(first) == 8 and not all(torch.equal(a, b) for a, b in zip(first, second))  # reshuffled

    stopped = module()
    loader = stopped.train_dataloader()
    _batches(loader, count=4)  # 4 fetched: the last one as Lightning's prefetch, not trained on
    position = loader.position(3)
    resumed = module()
    resumed.load_state_dict({"stream_position": position})
    rest = _batches(resumed.train_dataloader())
    assert len(rest) == 5 and all(torch.equal(a, b) for a, b in zip(rest, first[3:]))
    after = _batches(resumed._loader)
    assert all(torch.equal(a, b) for a, b in zip(after, second))  # and the next epoch as before

    ended = module()
    ended.load_state_dict({"stream_position": {"epoch_done": 1}})
    assert all(torch.equal(a, b) for a, b in zip(_batches(ended.train_dataloader()), second))


def test_a_killed_write_carries_on_and_a_source_without_complete_shards_is_one_line(folder, shards, tmp_path):
    dst = tmp_path / "again"
    prepare_shards(folder, str(dst), workers=1, chunk_mb=1, progress=False)
    (dst / "dataset.json").unlink()  # as a run killed before its last write leaves it
    with pytest.raises(UserError) as raised:
        ShardsDataModule(source=str(dst), **IMAGES).inspect()
    assert raised.value.line().startswith(f"data.source: no complete shards at '{dst}'")
    report = prepare_shards(folder, str(dst), workers=1, chunk_mb=1, progress=False)
    assert report.skipped_splits == ["train", "val"] and (dst / "dataset.json").is_file()
    with pytest.raises(UserError, match="was written with"):
        prepare_shards(folder, str(dst), max_side=50, workers=1, chunk_mb=1, progress=False)


KILLED_WRITE = """
import os, signal, sys
from pathlib import Path
import trainer.data.prepare_shards as shards
real, done = shards.image_bytes, {"n": 0}

def dying(*args):
    done["n"] += 1
    if done["n"] == int(sys.argv[3]):  # this worker has written its first chunks: the whole job dies
        os.killpg(os.getpgrp(), signal.SIGKILL)
    return real(*args)

shards.image_bytes = dying
shards.prepare_shards(Path(sys.argv[1]), sys.argv[2], workers=1, chunk_mb=1, progress=False)
"""


def test_a_write_killed_mid_split_carries_on_from_its_checkpoint(tmp_path):
    import subprocess
    import sys

    from tests.helpers import REPO, benchmark

    root = benchmark("input_pipeline").make_folder(tmp_path / "photos", 60)  # 500x375 JPEGs: 3 chunks of 1 MB
    dst, script = tmp_path / "shards", tmp_path / "killed.py"
    script.write_text(KILLED_WRITE)
    killed = subprocess.run([sys.executable, str(script), str(root), str(dst), "45"], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True, timeout=300)
    assert killed.returncode == -9
    before = {p.name: p.stat().st_mtime_ns for p in (dst / "train").glob("chunk-*.bin")}
    assert before and (dst / "train" / ".checkpoints").is_dir() and not (dst / "dataset.json").exists()
    report = prepare_shards(root, str(dst), workers=1, chunk_mb=1, progress=False)
    after = {p.name: p.stat().st_mtime_ns for p in (dst / "train").glob("chunk-*.bin")}
    assert all(after[name] == stamp for name, stamp in before.items())  # carried on: kept what was written
    data = ShardsDataModule(source=str(dst), decode="fast", **IMAGES)
    data.setup()
    assert sorted(int(item["index"]) for item in _raw_items(data.train_set)) == list(range(report.sizes["train"]))


def test_a_remote_write_stages_its_chunks_in_a_folder_of_its_own(monkeypatch):
    # LitData stages a remote output's chunks in one folder per machine (/tmp/chunks) and empties it
    # when done: two writes at once deleted each other's chunks. Each destination gets its own folder
    # (the same when a killed write resumes), for the write only; a local write and a folder the
    # person set are left to LitData.
    from trainer.data.prepare_shards import STAGING_VARIABLES, _staging_folders

    for name in STAGING_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    seen = {}
    for output in ("s3://bucket/a/train", "s3://bucket/b/train", "s3://bucket/a/train"):
        with _staging_folders(output):
            seen.setdefault(output, []).append(tuple(os.environ[name] for name in STAGING_VARIABLES))
        assert not any(name in os.environ for name in STAGING_VARIABLES)
    a, b = seen["s3://bucket/a/train"], seen["s3://bucket/b/train"]
    assert a[0] == a[1] and a[0] != b[0] and all(Path(folder).name in ("chunks", "data") for folder in a[0])
    with _staging_folders("/local/shards/train"):
        assert not any(name in os.environ for name in STAGING_VARIABLES)
    monkeypatch.setenv(STAGING_VARIABLES[0], "/mine")
    with _staging_folders("s3://bucket/a/train"):
        assert os.environ[STAGING_VARIABLES[0]] == "/mine" and STAGING_VARIABLES[1] not in os.environ
