"""model=timm trains through the whole framework: a timm ResNet and a small timm ViT on the digits
take two real optimizer steps each (the plan, the clipping, the checkpoint and the test included)."""

import pytest

from tests.helpers import run_in_process

pytestmark = pytest.mark.run


@pytest.mark.parametrize("model", [
    ["model.name=resnet18"],
    ["model.name=vit_tiny_patch16_224", "model.options={patch_size:2,depth:2,embed_dim:64,num_heads:2}",
     "model.drop_path_rate=0.1"],
])
def test_a_timm_model_takes_two_steps(tmp_path, model):
    summary = run_in_process(["model=timm", *model, "trainer.max_steps=2", "trainer.accelerator=cpu",
                              "progress=off"], tmp_path)
    assert summary["status"] == "completed" and summary["steps"] == 2
    assert summary["model"]["target"] == "trainer.models.timm.build_timm"
    assert summary["data"]["in_channels"] == 1 and 0 <= summary["metrics"]["test"]["acc"] <= 1
