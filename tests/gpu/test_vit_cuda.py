"""The ViT recipe and the accuracy practices on CUDA: the digits ViT recipe runs in bf16-mixed on a
GPU that has it (precision=auto) with attention through scaled_dot_product_attention, its SDPA call
under autocast gets bf16 tensors; mixup/cutmix mix batches that live on the GPU and the targets
stay there and sum to 1."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.gpu.common import GPU
from tests.helpers import run_in_process
from trainer.groups.regularization import BatchMixing, RegularizationConfig
from trainer.models.timm import build_timm

pytestmark = [*GPU]


def test_the_digits_vit_recipe_trains_in_bf16_on_the_gpu(tmp_path):
    summary = run_in_process(["+recipe=vit_tiny_digits", "trainer.max_steps=10", "progress=plain",
                              "regularization=mixup_cutmix"], tmp_path)
    assert summary["status"] == "completed" and summary["steps"] == 10
    assert summary["derived"]["trainer.accelerator"]["value"] == "cuda"
    if torch.cuda.is_bf16_supported():
        assert summary["derived"]["precision"]["value"] == "bf16-mixed"


def test_attention_under_autocast_gets_bf16_on_the_gpu(monkeypatch):
    vit = build_timm(10, "vit_tiny_patch16_224", in_channels=3, image_size=(32, 32),
                     options={"patch_size": 4, "depth": 2}).cuda()
    seen: list[torch.dtype] = []
    real = F.scaled_dot_product_attention

    def recording(q, k, v, *args, **kwargs):
        seen.append(q.dtype)
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        vit(torch.randn(4, 3, 32, 32, device="cuda")).float().sum().backward()
    assert seen == [torch.bfloat16] * 2


def test_mixed_batches_and_targets_stay_on_the_gpu():
    torch.manual_seed(0)
    mixing = BatchMixing(RegularizationConfig(label_smoothing=0.1, mixup_alpha=0.8, cutmix_alpha=1.0, mix_prob=1.0,
                                              switch_prob=0.5), 10)
    images = torch.randn(16, 3, 32, 32, device="cuda")
    labels = torch.randint(0, 10, (16,), device="cuda")
    for _ in range(10):
        mixed, targets = mixing(images, labels)
        assert mixed.is_cuda and targets.is_cuda and targets.shape == (16, 10)
        assert torch.allclose(targets.sum(dim=1), torch.ones(16, device="cuda"))
