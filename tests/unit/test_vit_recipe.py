"""The ViT recipes (recipes/vit_*.yaml) and the transformer practices of the optimizer: attention goes
through one fused QKV projection and F.scaled_dot_product_attention; AdamW decays no norm weight,
bias, position embedding or class token; layer-wise lr decay scales each layer's lr by its depth
below the head (and a model without layers to decay is one line); each recipe composes with the
practices it states."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import ON_CPU, compose, planned_run
from trainer.configuration.spec import choice_config, validate
from trainer.data.base import DataInfo, ImageRecord
from trainer.groups.optimizer.build import OptimizerRecipe
from trainer.groups.optimizer.parameters import layer_lr_scales, one_dimensional, parameter_groups
from trainer.infra.errors import UserError
from trainer.models.group import build_model
from trainer.models.timm import build_timm
from trainer.task import ClassificationTask


def tiny_vit(depth: int = 3, **options: object) -> nn.Module:
    return build_timm(10, "vit_tiny_patch16_224", in_channels=3, image_size=(16, 16),
                      options={"patch_size": 4, "depth": depth, "embed_dim": 64, "num_heads": 4, **options})


def test_attention_is_one_fused_qkv_projection_and_scaled_dot_product_attention(monkeypatch):
    vit = tiny_vit(depth=3).eval()
    calls: list[tuple[int, ...]] = []
    real = F.scaled_dot_product_attention

    def counting(q, k, v, *args, **kwargs):
        calls.append(tuple(q.shape))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    with torch.no_grad():
        vit(torch.randn(2, 3, 16, 16))
    # one call per block, on (batch, heads, tokens, head dim): 16 patches and the class token
    assert calls == [(2, 4, 17, 16)] * 3
    for block in vit.blocks:
        assert block.attn.fused_attn
        assert isinstance(block.attn.qkv, nn.Linear) and block.attn.qkv.out_features == 3 * 64


def test_the_digits_recipe_network_calls_scaled_dot_product_attention(monkeypatch):
    spec = validate(compose(["+recipe=vit_tiny_digits", *ON_CPU]))
    net = build_model(spec.model, DataInfo(ImageRecord(1, (8, 8)), {"train": 8, "val": 4, "test": 4}, 10).model_inputs())
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    net(torch.randn(2, 1, 8, 8)).sum().backward()  # the training path too
    assert len(calls) == 4


def test_adamw_decays_no_norm_bias_position_embedding_or_class_token():
    vit = tiny_vit()
    exempt = one_dimensional(vit)
    assert {"pos_embed", "cls_token", "norm.weight", "blocks.0.attn.qkv.bias"} <= exempt
    assert "blocks.0.attn.qkv.weight" not in exempt and "patch_embed.proj.weight" not in exempt
    groups = parameter_groups(vit, 0.05, decay_norm_and_bias=False, no_decay_names=exempt)
    by_param = {id(p): g["weight_decay"] for g in groups for p in g["params"]}
    named = dict(vit.named_parameters())
    assert by_param[id(named["pos_embed"])] == by_param[id(named["cls_token"])] == 0.0
    assert by_param[id(named["blocks.1.mlp.fc1.weight"])] == 0.05
    assert sum(len(g["params"]) for g in groups) == len(named)


def test_layer_decay_scales_each_layers_lr_by_its_depth_below_the_head():
    vit = tiny_vit(depth=3)
    scales = layer_lr_scales(vit, 0.5)
    # timm's layers for a ViT: the embeddings (0), each block (1-3, the final norm with the last), the head (4)
    assert scales["head.weight"] == 1.0
    assert scales["blocks.2.mlp.fc1.weight"] == scales["norm.weight"] == 0.5
    assert scales["blocks.1.mlp.fc1.weight"] == 0.25
    assert scales["blocks.0.attn.qkv.weight"] == 0.125
    assert scales["patch_embed.proj.weight"] == scales["pos_embed"] == scales["cls_token"] == 0.0625
    cfg = choice_config("optimizer", "adamw", layer_decay=0.5)
    optimizer = OptimizerRecipe(cfg, 0.01, 0.05, "foreach", one_dimensional(vit), scales).build(vit)
    lr_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    named = dict(vit.named_parameters())
    assert lr_of[id(named["head.weight"])] == pytest.approx(0.01)
    assert lr_of[id(named["blocks.0.attn.qkv.weight"])] == pytest.approx(0.00125)
    decay_of = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    assert decay_of[id(named["pos_embed"])] == 0.0 and decay_of[id(named["blocks.0.attn.qkv.weight"])] == 0.05


def test_the_schedule_keeps_each_layers_ratio():
    vit = tiny_vit(depth=2)
    optimizer = choice_config("optimizer", "adamw", layer_decay=0.5)
    task = ClassificationTask(vit, 10, OptimizerRecipe.for_network(vit, optimizer, 0.01, 0.05),
                              choice_config("scheduler", "warmup_cosine"))

    class Stub:
        estimated_stepping_batches = 10

    task._trainer = Stub()  # noqa: SLF001 - configure_optimizers reads the step count from it
    configured = task.configure_optimizers()
    opt, schedule = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
    for _ in range(3):
        opt.step()
        schedule.step()
    lrs = sorted({round(g["lr"] / g["lr_scale"], 12) for g in opt.param_groups})
    assert len(lrs) == 1  # every group at the same point of the schedule, times its own scale


def test_layer_decay_on_a_model_without_layers_is_one_line():
    with pytest.raises(UserError) as caught:
        layer_lr_scales(nn.Sequential(nn.Linear(2, 2)), 0.75)
    assert caught.value.where == "optimizer.layer_decay" and "model=timm" in caught.value.line()


@pytest.mark.parametrize("recipe, expected", [
    ("vit_small", {"model.name": "vit_small_patch16_224", "regularization.mixup_alpha": 0.8, "data.augment":
                   "randaugment", "clipping._target_": "trainer.groups.clipping.FixedNorm", "optimizer.weight_decay": 0.05,
                   "model.drop_path_rate": 0.1, "data.image_size": 224}),
    ("vit_tiny_digits", {"regularization.label_smoothing": 0.1, "data.translate": 0}),
    ("vit_tiny_cifar10", {"regularization.cutmix_alpha": 1.0, "model.drop_path_rate": 0.1}),
])
def test_each_recipe_composes_with_its_practices(recipe, expected):
    overrides = [f"+recipe={recipe}", *ON_CPU]
    if recipe != "vit_tiny_digits":
        overrides.append("data.root=/nowhere")
    spec = validate(compose(overrides))
    values = {"model": spec.model, "data": spec.data, "regularization": vars(spec.regularization),
              "clipping": spec.clipping, "optimizer": vars(spec.optimizer)}
    for key, value in expected.items():
        group, _, name = key.partition(".")
        assert values[group][name] == value, key
    assert spec.optimizer.name == "adamw" and not spec.optimizer.decay_norm_and_bias


def test_the_plan_says_what_the_model_exempts_and_how_the_layers_decay(tmp_path):
    plan = planned_run(compose(["+recipe=vit_tiny_digits", *ON_CPU, "model.options.class_token=true",
                                "model.options.global_pool=token", "optimizer.layer_decay=0.5"]), tmp_path).plan
    assert "nor on cls_token, pos_embed (the model's no_weight_decay())" in plan.derived["optimizer.decay_norm_and_bias"].how
    layer = plan.derived["optimizer.layer_decay"]
    # 4 blocks: the embeddings, 4 blocks, the head: 6 layers, the stem at 0.5^5 of the head's lr
    assert layer.value == 0.5 and layer.how.startswith("6 layers (the model's group_matcher)") and "(0.5^5)" in layer.how
