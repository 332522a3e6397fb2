"""The expanded digits (data=digits_expanded): the same settings make the same images, another
distortion seed other ones; each original's copies are its own distortions, none of an original of
another split; the default set has 52,794 training images (25 steps an epoch at a global batch of
2,048) and is kept in a cache that a later run reads instead of making it again, one file per setting."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.datasets import load_digits

import trainer.data.digits_expanded as expanded_module
from trainer.data.digits import stratified_split
from trainer.data.digits_expanded import ExpandedDigitsDataModule, expand


def small(tmp_path, **settings) -> ExpandedDigitsDataModule:
    return ExpandedDigitsDataModule(copies=2, eval_copies=1, cache_dir=str(tmp_path), **settings)


def test_the_same_settings_make_the_same_images_and_another_seed_others():
    originals = load_digits().images[:20]
    first, again = expand(originals, 3, 16, seed=5), expand(originals, 3, 16, seed=5)
    assert first.shape == (60, 16, 16) and first.dtype == np.uint8
    assert np.array_equal(first, again)
    assert not np.array_equal(first, expand(originals, 3, 16, seed=6))
    # each original's copies differ from one another (distorted), and are drawn from that original
    assert not np.array_equal(first[0], first[1])
    centre = [float(np.corrcoef(first[i].ravel(), first[j].ravel())[0, 1]) for i, j in ((0, 1), (0, 3 * 7))]
    assert centre[0] > centre[1]  # two copies of original 0 look more alike than copies of 0 and 7


def test_the_splits_come_from_disjoint_originals_and_have_the_stated_sizes(tmp_path):
    data = small(tmp_path)
    splits = data.expanded()
    parts = stratified_split(load_digits().target, 0.15, 0.15, 0)
    assert {k: len(v) for k, v in parts.items()} == {"train": 1257, "val": 270, "test": 270}
    assert set(parts["train"]).isdisjoint(parts["val"]) and set(parts["train"]).isdisjoint(parts["test"])
    assert [len(splits[k][1]) for k in ("train", "val", "test")] == [2 * 1257, 270, 270]
    # the labels follow the originals of each split, copy by copy
    assert np.array_equal(splits["train"][1], np.repeat(load_digits().target[parts["train"]], 2))


def test_the_default_set_is_large_enough_for_the_batch_study(tmp_path):
    info = ExpandedDigitsDataModule(cache_dir=str(tmp_path)).inspect()
    assert info.sizes == {"train": 52794, "val": 2160, "test": 2160}
    assert info.sizes["train"] // 2048 >= 25 and info.record.image_size == (16, 16)


def test_a_later_run_reads_the_cache_and_other_settings_get_their_own_file(tmp_path, monkeypatch):
    made = small(tmp_path)
    made.setup()
    assert made.cache_file().is_file() and not list(tmp_path.glob(".*.tmp"))

    def refuse(*args, **kwargs):
        raise AssertionError("made again instead of read from the cache")

    monkeypatch.setattr(expanded_module, "expand", refuse)
    read = small(tmp_path)
    read.setup()
    assert np.array_equal(read.expanded()["train"][0], made.expanded()["train"][0])
    assert small(tmp_path, distortion_seed=1).cache_file() != made.cache_file()
    assert small(tmp_path, image_size=20).cache_file() != made.cache_file()
    # standardized with the training split's statistics
    x = read.train_set.tensors[0]
    assert x.shape[1:] == (1, 16, 16) and float(x.mean()) == pytest.approx(0.0, abs=1e-5)
