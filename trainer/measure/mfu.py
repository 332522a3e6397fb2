"""Model FLOPs utilization (MFU), reported only where it can be honest.

MFU = achieved model FLOP/s / the device's dense peak FLOP/s for the math the precision runs;
docs/diagnosis.md ("Throughput and MFU, honestly") says how. The FLOPs are counted
(``torch.utils.flop_counter`` on a meta-device copy, the real backward graph: the first layer has no
input-gradient GEMM), not guessed as "3x forward" or "6 x params". An unknown device, a MIG slice or
a CPU has no trustworthy peak, so MFU is left out with the reason. Beside the precision's own peak,
every run's MFU is also taken against one peak, the dense bf16 tensor-core peak (`bf16_peak_flops`),
so that stages of different precisions compare on one scale. Every function returns its value with a
one-line ``how`` (as every value the plan derives: docs/config.md, "Derived values")."""

from __future__ import annotations

import copy
import math
import re

import torch
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from trainer.infra.errors import exception_line

TFLOP = 10**12

# Dense peaks in TFLOP/s per GPU: (16-bit tensor core, TF32 tensor core, FP32 non-tensor); bf16 and
# fp16 tensor-core peaks are equal on every part listed. Sources: NVIDIA datasheets.
#   A100: "NVIDIA A100 Tensor Core GPU" datasheet (SXM4 and PCIe, 40 GB and 80 GB): BF16/FP16
#         312 (624 sparse), TF32 156 (312 sparse), FP32 19.5.
#   H100 SXM / PCIe / NVL: "NVIDIA H100 Tensor Core GPU" datasheet. NVIDIA prints the tensor-core
#         figures *with* sparsity; the dense peak is half: SXM 1979/989 -> 989.4 bf16, 494.7 TF32
#         (the exact values from the Hopper architecture whitepaper), FP32 67 (66.9).
#         PCIe 1513/756 -> 756.5 bf16, 378 TF32, FP32 51 (51.2 in the whitepaper).
#         NVL: 1671/835 -> 835.5 bf16, 417.5 TF32, FP32 60. Unsure: the first (2023, dual-card)
#         H100 NVL listing quoted per-pair figures close to 2x SXM; the current datasheet's per-GPU
#         figures are used here. Re-check against the datasheet of the exact part before quoting.
#   H200 SXM / NVL: "NVIDIA H200 Tensor Core GPU" datasheet: SXM has the H100 SXM compute
#         (1979/989 sparse, FP32 67), NVL has the H100 NVL compute (1671/835 sparse, FP32 60).
#
# Not Lightning's `get_available_flops` (lightning/fabric/utilities/throughput.py), deliberately: in
# the Lightning we pin (2.6) its H200 entries are the *sparse* tensor-core figures (bf16 2.0e15,
# TF32 9.9e14: twice the dense peak, which would halve every MFU); "NVIDIA H200", the name torch
# reports, matches none of its H200 keys (they need "sxm1" or "nvl1"); its substring matching takes
# a MIG slice ("NVIDIA H100 80GB HBM3 MIG 1g.10gb") and an "A100X" for the whole chip; and it has no
# bandwidths, which the roofline needs. Its H100 and A100 dense figures agree with the ones below.
_PEAKS_TFLOPS: dict[str, tuple[float, float, float]] = {
    "A100 SXM": (312.0, 156.0, 19.5),
    "A100 PCIe": (312.0, 156.0, 19.5),
    "H100 SXM": (989.4, 494.7, 66.9),
    "H100 PCIe": (756.5, 378.0, 51.2),
    "H100 NVL": (835.5, 417.5, 60.0),
    "H200 SXM": (989.4, 494.7, 66.9),
    "H200 NVL": (835.5, 417.5, 60.0),
}

_TENSOR16, _TF32, _FP32 = 0, 1, 2

# Memory bandwidth in TB/s per GPU, from the same datasheets (the 80 GB A100; the 40 GB SXM4 part
# has 1.555). The roofline's slope (trainer/measure/profile.py).
_BANDWIDTH_TBS: dict[str, float] = {
    "A100 SXM": 2.039, "A100 PCIe": 1.935, "H100 SXM": 3.35, "H100 PCIe": 2.0, "H100 NVL": 3.9,
    "H200 SXM": 4.8, "H200 NVL": 4.8,
}


def _part_name(device_name: str) -> str | None:
    """Map a ``torch.cuda.get_device_name()`` string to a key of the peak table, or None.
    Word boundaries keep look-alikes out: "GH200" (Grace Hopper), "H20", "H800" and "A100X" are
    different parts with different peaks and must not borrow these."""
    name = device_name.lower()
    if re.search(r"\bmig\b", name):
        return None  # a MIG slice has a fraction of the chip; the whole-chip peak would flatter it
    for family in ("a100", "h100", "h200"):
        if re.search(rf"(?<![a-z0-9]){family}(?![a-z0-9])", name):
            if "nvl" in name:
                return f"{family.upper()} NVL" if family != "a100" else None
            if "pcie" in name:
                return f"{family.upper()} PCIe"
            # "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB": the SXM parts.
            return f"{family.upper()} SXM"
    return None


def _math_for(precision: str, tf32: bool) -> tuple[int, str] | None:
    """Which units the precision's matmuls run on: (column of the table, label)."""
    p = str(precision).lower()
    if p in ("bf16-mixed", "bf16-true", "bf16"):
        return _TENSOR16, "bf16"
    if p in ("16-mixed", "16-true", "16"):
        return _TENSOR16, "fp16"
    if p in ("32-true", "32"):
        return (_TF32, "tf32") if tf32 else (_FP32, "fp32 (non-tensor)")
    return None


def peak_flops(device_name: str, precision: str, tf32: bool) -> tuple[float | None, str]:
    """Dense peak FLOP/s of `device_name` for the math `precision` uses, and where it comes from.
    `precision` is Lightning's string ("32-true", "bf16-mixed", "16-mixed", "bf16-true",
    "16-true"); `tf32` says whether fp32 matmuls run on TF32 tensor cores. Unknown devices, MIG
    slices, CPUs and precisions without a table column give ``(None, reason)``."""
    part = _part_name(device_name)
    math_kind = _math_for(precision, tf32)
    if part is None or math_kind is None:
        return None, f"no known peak for '{device_name}' at {precision}: MFU left out"
    column, label = math_kind
    tflops = _PEAKS_TFLOPS[part][column]
    dense = "dense " if column != _FP32 else ""
    peak = float(round(tflops * 10) * (TFLOP // 10))  # integer arithmetic: 66.9 -> 6.69e13 exactly
    return peak, f"{part} {dense}{label} peak {tflops:g} TFLOP/s (NVIDIA datasheet)"


def bf16_peak_flops(device_name: str) -> tuple[float | None, str]:
    """The device's dense 16-bit tensor-core peak FLOP/s (bf16; fp16's is the same on every part
    listed), and where it comes from: the one peak every run's MFU is also reported against, whatever
    its precision (the module docstring says why). ``(None, reason)`` where the part is unknown, a MIG
    slice or not a GPU."""
    part = _part_name(device_name)
    if part is None:
        return None, f"no known dense bf16 peak for '{device_name}': MFU against it left out"
    return peak_flops(device_name, "bf16-mixed", tf32=False)


def peak_bandwidth(device_name: str) -> tuple[float | None, str]:
    """Datasheet memory bandwidth of `device_name` in bytes/s, and where it comes from; None for
    parts not in the table (the roofline then measures one)."""
    part = _part_name(device_name)
    if part is None:
        return None, f"no known bandwidth for '{device_name}'"
    return _BANDWIDTH_TBS[part] * 1e12, f"{part} {_BANDWIDTH_TBS[part]:g} TB/s (NVIDIA datasheet)"


def _meta_copy(net: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of `net` whose parameters and buffers live on the meta device.
    Parameters and buffers are swapped in through the deepcopy memo, so their storage (possibly
    gigabytes on a GPU) is never copied, tied weights stay tied, and `.grad` is not carried over."""
    memo: dict[int, object] = {}
    for p in net.parameters():
        memo[id(p)] = torch.nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
    for b in net.buffers():
        memo[id(b)] = b.detach().to("meta")
    return copy.deepcopy(net, memo)


def _input_dtype(net: torch.nn.Module) -> torch.dtype:
    return next((p.dtype for p in net.parameters() if p.is_floating_point()), torch.get_default_dtype())


def training_flops_per_sample(
    net: torch.nn.Module, input_shape: tuple[int, ...], batch: int = 2, dtype: torch.dtype | None = None
) -> tuple[int | None, str]:
    """FLOPs of one training step (forward + backward) per sample, and how they were counted.

    Backpropagates ``output.sum()`` of a train-mode meta-device copy under ``FlopCounterMode``: nothing
    is allocated or computed, and the caller's model is untouched. The optimizer step is not counted
    (elementwise, not model FLOPs). Never raises: ``(None, "could not count FLOPs: ...")`` instead."""
    try:
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        net = getattr(net, "_orig_mod", net)  # torch.compile wrapper: count the eager model
        model = _meta_copy(net).train()
        # Token ids (dtype=torch.long) for an embedding; floats of the network's dtype otherwise.
        x = torch.zeros((batch, *input_shape), device="meta", dtype=dtype or _input_dtype(net))
        counter = FlopCounterMode(display=False)
        with torch.inference_mode(False), torch.enable_grad(), counter:
            out = model(x)
            leaves = [t for t in tree_flatten(out)[0]
                      if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
            if not leaves:
                raise RuntimeError("the forward output has no tensor that requires grad")
            sum((t.sum() for t in leaves[1:]), leaves[0].sum()).backward()
        total = int(counter.get_total_flops())
    except Exception as error:  # noqa: BLE001 - any failure means "no count", never a crash
        return None, f"could not count FLOPs: {exception_line(error)}"
    if total <= 0:
        return None, "could not count FLOPs: the counter saw no matmul or convolution"
    per_sample = (total + batch // 2) // batch
    return per_sample, (f"counted by torch.utils.flop_counter: forward + backward, batch {batch} "
                        "on the meta device")


def model_flops_utilization(
    samples_per_s: float | None, flops_per_sample: int | None, peak: float | None
) -> float | None:
    """Achieved model FLOP/s over the peak, as a fraction; None unless every input is known and positive."""
    if samples_per_s is None or flops_per_sample is None or peak is None:
        return None
    if any(not math.isfinite(v) or v <= 0 for v in (samples_per_s, flops_per_sample, peak)):
        return None
    return float(samples_per_s) * float(flops_per_sample) / float(peak)
