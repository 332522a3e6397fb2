"""Training, the diagnosis and the memory plan build their optimizer from the plan's one recipe: with a
ViT, layer-wise lr decay and the parameters the model exempts from decay by name, each of them gets the
same parameter groups (each group's lr, weight decay and parameters)."""

from __future__ import annotations

import pytest

from tests.helpers import run_in_process
from trainer.groups.optimizer.build import OptimizerRecipe
from trainer.groups.optimizer.parameters import plain_name

pytestmark = pytest.mark.run

VIT = ["data=synthetic", "data.shape=[3,16,16]", "data.batch_size=8", "data.train_samples=64", "model=timm", "model.name=vit_tiny_patch16_224",
       "model.options={patch_size:4,depth:2,embed_dim:32,num_heads:2}", "optimizer.layer_decay=0.5",
       "checkpointing=off", "progress=off", "trainer.accelerator=cpu"]


def test_training_the_diagnosis_and_the_memory_plan_get_identical_parameter_groups(tmp_path, monkeypatch):
    built: list[list[tuple[float, float, tuple[str, ...]]]] = []
    real_build = OptimizerRecipe.build

    def recording(self, module, implementation=None):
        optimizer = real_build(self, module, implementation)
        names = {id(p): plain_name(n) for n, p in module.named_parameters()}
        built.append([(group["lr"], group["weight_decay"], tuple(sorted(names[id(p)] for p in group["params"])))
                      for group in optimizer.param_groups])
        return optimizer

    monkeypatch.setattr(OptimizerRecipe, "build", recording)
    run_in_process([*VIT, "trainer.max_steps=2", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1"],
                   tmp_path / "train")
    trained = built[-1]
    built.clear()
    run_in_process([*VIT, "diagnose=true", "diagnose_steps=3", "memory_plan=true"], tmp_path / "diagnose")
    assert len(built) >= 2  # the memory plan's and the diagnosis's
    assert all(groups == trained for groups in built)
    # the groups are worth comparing: several lrs (one per layer) and the model's own exemptions
    assert len({lr for lr, _, _ in trained}) >= 3
    assert any(decay == 0.0 and "pos_embed" in names for _, decay, names in trained)
