"""The ViT recipe and the accuracy practices train for real: the digits ViT recipe reaches a stated
validation accuracy within a short run (and records when, as time to target); an image folder run
with RandAugment, mixup/cutmix and label smoothing all on takes its steps on each host decode path."""

from __future__ import annotations

import pytest

from tests.helpers import ON_CPU, run_in_process, write_photo_jpegs

pytestmark = pytest.mark.run


def test_the_digits_vit_recipe_reaches_its_stated_accuracy(tmp_path):
    # 12 epochs of the recipe's 20 (the schedule shortens with them): 0.85 val acc measured on
    # 2 CPU cores in about 11 s; the bar leaves room for another machine's arithmetic.
    summary = run_in_process(["+recipe=vit_tiny_digits", *ON_CPU, "trainer.max_epochs=12", "progress=off",
                              "target.metric=val/acc", "target.value=0.75"], tmp_path)
    assert summary["status"] == "completed"
    assert summary["target"]["reached"] is True and summary["target"]["epoch"] <= 12
    assert summary["metrics"]["test"]["acc"] >= 0.7


@pytest.mark.parametrize("decode", ["pil", "fast"])
def test_an_image_folder_run_with_every_accuracy_practice_takes_its_steps(tmp_path, decode):
    root = tmp_path / "photos"
    write_photo_jpegs(root, {"train": 8, "val": 4}, size=(64, 48))
    summary = run_in_process([*ON_CPU, "data=imagefolder", f"data.root={root}", "data.image_size=32",
                              "data.batch_size=4", "data.num_workers=1", f"data.decode={decode}",
                              "data.augment=randaugment", "regularization=mixup_cutmix", "model=timm",
                              "model.name=vit_tiny_patch16_224", "model.options={patch_size:8,depth:2}",
                              "model.drop_path_rate=0.1", "trainer.max_steps=3", "progress=off"], tmp_path / "run")
    assert summary["status"] == "completed" and summary["steps"] == 3
    assert summary["derived"]["regularization"]["value"] == "mixup_cutmix"
