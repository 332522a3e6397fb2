"""The ViT recipe and the accuracy practices on CUDA: the digits ViT recipe runs in bf16-mixed on a
GPU that has it (precision=auto) with attention through scaled_dot_product_attention, its SDPA call
under autocast gets bf16 tensors; mixup/cutmix mix batches that live on the GPU and the targets
stay there and sum to 1."""

from __future__ import annotations

import torch

from tests.gpu.common import GPU, attention_dtypes
from tests.helpers import run_in_process
from trainer.groups.regularization import BatchMixing, RegularizationConfig

pytestmark = [*GPU]


def test_the_digits_vit_recipe_trains_in_bf16_on_the_gpu(tmp_path):
    summary = run_in_process(["+recipe=vit_tiny_digits", "trainer.max_steps=10", "progress=plain",
                              "regularization=mixup_cutmix"], tmp_path)
    assert summary["status"] == "completed" and summary["steps"] == 10
    assert summary["derived"]["trainer.accelerator"]["value"] == "cuda"
    if torch.cuda.is_bf16_supported():
        assert summary["derived"]["precision"]["value"] == "bf16-mixed"


def test_attention_under_autocast_gets_bf16_on_the_gpu(monkeypatch):
    assert attention_dtypes(torch.device("cuda"), monkeypatch) == [torch.bfloat16] * 2


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
