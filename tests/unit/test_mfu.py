"""FLOP counting and MFU: the training FLOPs of a small MLP counted exactly (independent of the
batch, frozen layers counted right), ResNet-18 within 2.5-3.1x its known forward count, the
caller's model untouched (weights, BatchNorm statistics, device, mode, no gradients); a model
that cannot run on the meta device gives no count, with a reason; the peak table from NVIDIA's
datasheets (A100, H100, H200 per precision, with and without TF32), unknown devices and MIG
slices leave MFU out; the one bf16 peak every precision's MFU is also taken against (the ResNet-50
ladder on the H200 read on one scale); the MFU arithmetic, None unless every input is known and
positive."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.measure.mfu import bf16_peak_flops, model_flops_utilization, peak_flops, training_flops_per_sample

T = 10**12


def test_mlp_flops_match_first_principles():
    # Per sample, a GEMM of (1 x k) @ (k x n) costs 2*k*n FLOPs.
    fwd = 2 * 8 * 16 + 2 * 16 * 4  # 256 + 128 = 384
    weight_grads = 2 * 8 * 16 + 2 * 16 * 4  # dW for both layers: 384
    input_grads = 2 * 16 * 4  # dX only for the second layer; the network input needs no grad: 128
    assert fwd + weight_grads + input_grads == 896
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    flops, how = training_flops_per_sample(net, (8,), batch=2)
    assert flops == 896
    assert how == "counted by torch.utils.flop_counter: forward + backward, batch 2 on the meta device"


def test_per_sample_count_does_not_depend_on_batch():
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    assert training_flops_per_sample(net, (8,), batch=7)[0] == 896
    assert "batch 7" in training_flops_per_sample(net, (8,), batch=7)[1]


def test_frozen_first_layer_has_no_weight_gradient_flops():
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    net[0].requires_grad_(False)
    # Forward 384 and dW of the second layer 128. No dX anywhere: with the first layer frozen,
    # nothing upstream of the second layer needs a gradient, so its input gradient is skipped too.
    assert training_flops_per_sample(net, (8,))[0] == 384 + 128


def test_callers_model_is_untouched():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))
    net(torch.randn(4, 3, 8, 8))  # give BatchNorm non-trivial running statistics
    net.eval()
    before = {k: v.clone() for k, v in net.state_dict().items()}

    flops, how = training_flops_per_sample(net, (3, 8, 8))

    assert flops is not None and flops > 0, how
    after = net.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
        assert after[key].device.type == "cpu", key
    assert torch.equal(net[1].running_mean, before["1.running_mean"])
    assert int(net[1].num_batches_tracked) == int(before["1.num_batches_tracked"])
    assert all(p.grad is None for p in net.parameters())
    assert all(p.device.type == "cpu" for p in net.parameters())
    assert not net.training and not any(m.training for m in net.modules())


def test_resnet18_training_flops_are_about_three_times_forward():
    torchvision = pytest.importorskip("torchvision")
    net = torchvision.models.resnet18(num_classes=1000)
    flops, how = training_flops_per_sample(net, (3, 224, 224))
    assert flops is not None, how
    forward = 3.64e9  # 1.82 GMACs, the well-known figure
    # Backward is ~2x forward, less the first conv's input gradient (its input needs none).
    assert 2.5 * forward <= flops <= 3.1 * forward


class _CallsItem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().max().item()  # data-dependent Python value: impossible on meta
        return self.fc(x) * scale


class _CallsNumpy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.numpy()
        return self.fc(x)


@pytest.mark.parametrize("net", [_CallsItem(), _CallsNumpy()], ids=["item", "numpy"])
def test_model_that_cannot_run_on_meta_gives_none_with_a_reason(net: nn.Module):
    flops, how = training_flops_per_sample(net, (4,))
    assert flops is None
    assert how.startswith("could not count FLOPs: ")
    assert len(how) > len("could not count FLOPs: ") and "\n" not in how


def test_output_without_grad_gives_none_with_a_reason():
    net = nn.Linear(4, 2).requires_grad_(False)
    flops, how = training_flops_per_sample(net, (4,))
    assert flops is None and "requires grad" in how


# (device name, part, 16-bit, TF32, FP32) in TFLOP/s, dense.
DEVICES = [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4, 494.7, 66.9),
    ("H100 80GB HBM3", "H100 SXM", 989.4, 494.7, 66.9),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.5, 378.0, 51.2),
    ("NVIDIA H100 NVL", "H100 NVL", 835.5, 417.5, 60.0),
    ("NVIDIA H200", "H200 SXM", 989.4, 494.7, 66.9),
    ("NVIDIA H200 NVL", "H200 NVL", 835.5, 417.5, 60.0),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM", 312.0, 156.0, 19.5),
    ("NVIDIA A100-SXM4-40GB", "A100 SXM", 312.0, 156.0, 19.5),
    ("NVIDIA A100-PCIE-40GB", "A100 PCIe", 312.0, 156.0, 19.5),
    ("NVIDIA A100 80GB PCIe", "A100 PCIe", 312.0, 156.0, 19.5),
    ("nvidia h100 pcie", "H100 PCIe", 756.5, 378.0, 51.2),
]


@pytest.mark.parametrize("name,part,tensor16,tf32,fp32", DEVICES, ids=[d[0] for d in DEVICES])
def test_peak_table(name: str, part: str, tensor16: float, tf32: float, fp32: float):
    for precision, label in [("bf16-mixed", "bf16"), ("bf16-true", "bf16"),
                             ("16-mixed", "fp16"), ("16-true", "fp16")]:
        for tf32_on in (True, False):  # TF32 does not change 16-bit math
            peak, how = peak_flops(name, precision, tf32_on)
            assert peak == pytest.approx(tensor16 * T, rel=1e-12)
            assert how == f"{part} dense {label} peak {tensor16:g} TFLOP/s (NVIDIA datasheet)"
    peak, how = peak_flops(name, "32-true", True)
    assert peak == pytest.approx(tf32 * T, rel=1e-12)
    assert how == f"{part} dense tf32 peak {tf32:g} TFLOP/s (NVIDIA datasheet)"
    peak, how = peak_flops(name, "32-true", False)
    assert peak == pytest.approx(fp32 * T, rel=1e-12)
    assert how.startswith(f"{part} fp32") and f"{fp32:g} TFLOP/s" in how


def test_h100_sxm_peak_strings_read_well():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16-mixed", True) == (
        989.4e12, "H100 SXM dense bf16 peak 989.4 TFLOP/s (NVIDIA datasheet)")


@pytest.mark.parametrize("name", [
    "NVIDIA GeForce RTX 4090", "NVIDIA GH200 480GB", "NVIDIA H800", "NVIDIA H20", "NVIDIA A100X",
    "NVIDIA H100 80GB HBM3 MIG 1g.10gb", "cpu", "Intel(R) Xeon(R) Platinum 8480+", "",
])
def test_unknown_devices_leave_mfu_out(name: str):
    for precision in ("bf16-mixed", "32-true"):
        peak, how = peak_flops(name, precision, True)
        assert peak is None
        assert how == f"no known peak for '{name}' at {precision}: MFU left out"


@pytest.mark.parametrize("name,part,tensor16,tf32,fp32", DEVICES, ids=[d[0] for d in DEVICES])
def test_the_bf16_peak_is_the_same_whatever_the_precision(name: str, part: str, tensor16: float, tf32: float,
                                                          fp32: float):
    peak, how = bf16_peak_flops(name)
    assert peak == pytest.approx(tensor16 * T, rel=1e-12)
    assert how == f"{part} dense bf16 peak {tensor16:g} TFLOP/s (NVIDIA datasheet)"
    assert (peak, how) == peak_flops(name, "bf16-mixed", False)


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 4090", "NVIDIA GH200 480GB", "NVIDIA H100 80GB HBM3 MIG 1g.10gb",
                                  "cpu", ""])
def test_no_bf16_peak_for_unknown_devices_with_the_reason(name: str):
    assert bf16_peak_flops(name) == (None, f"no known dense bf16 peak for '{name}': MFU against it left out")


def test_the_h200_ladder_on_one_peak_rises_with_its_throughput():
    # The first GPU check (benchmarks/results/gpu/2026-12-04/ladder_mfu.md): resnet50_baseline (fp32,
    # no TF32) at 30.8% of the fp32 peak and resnet50_optimized (bf16) at 11.8% of the bf16 peak,
    # at 847 and 4,790 img/s. Against the one bf16 peak the same runs are 2.1% and 11.8%: MFU rises
    # 5.65x with the throughput, as it must.
    bf16, _ = bf16_peak_flops("NVIDIA H200")
    fp32, _ = peak_flops("NVIDIA H200", "32-true", False)
    flops = 24.3e9  # ResNet-50 at 224 px, forward + backward, as the plan counted it
    baseline, optimized = 847.0, 4790.0
    assert model_flops_utilization(baseline, flops, fp32) == pytest.approx(0.308, abs=0.001)
    assert model_flops_utilization(optimized, flops, bf16) == pytest.approx(0.118, abs=0.001)
    on_one_peak = [model_flops_utilization(rate, flops, bf16) for rate in (baseline, optimized)]
    assert on_one_peak[0] == pytest.approx(0.0208, abs=0.0001)
    assert on_one_peak[1] / on_one_peak[0] == pytest.approx(optimized / baseline)


def test_unknown_precision_leaves_mfu_out():
    peak, how = peak_flops("NVIDIA H100 80GB HBM3", "64-true", False)
    assert peak is None and "MFU left out" in how and "64-true" in how


def test_mfu_arithmetic():
    # 1000 samples/s x 10.65 GFLOP = 10.65 TFLOP/s achieved on a 989.4 TFLOP/s part.
    assert model_flops_utilization(1000.0, 10_650_000_000, 989.4e12) == pytest.approx(10.65 / 989.4)
    assert model_flops_utilization(2.0, 3, 12.0) == pytest.approx(0.5)


@pytest.mark.parametrize("args", [
    (None, 896, 1e12), (10.0, None, 1e12), (10.0, 896, None),
    (0.0, 896, 1e12), (-1.0, 896, 1e12), (10.0, 0, 1e12), (10.0, 896, 0.0), (10.0, 896, -1e12),
    (float("nan"), 896, 1e12), (float("inf"), 896, 1e12),
])
def test_mfu_is_none_unless_every_input_is_known_and_positive(args):
    assert model_flops_utilization(*args) is None
