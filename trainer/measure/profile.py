"""``profile=true``: where the time of a training step goes, operator by operator.

torch.profiler records a few scheduled steps of the real training loop, then the fit stops; what is
written into ``RUN_DIR/profile/`` (the trace, ``ops.md``, ``profile.json``, ``roofline.png``) is in
docs/diagnosis.md ("The profile"). The categories come from operator names (`category_of`); an
operator under the optimizer's step or zero_grad but in neither of the forward and backward ranges
trainer/task.py names is the optimizer's, and one in the backward range (or run by the autograd
engine) is backward."""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import torch
from lightning.pytorch.callbacks import Callback

from trainer.infra.atomic import write_json_atomic, write_text_atomic
from trainer.infra.figures import new_figure, save_png
from trainer.measure.mfu import peak_bandwidth, peak_flops

CONV_MATMUL = "convolution/matmul"
NORMALIZATION = "normalization"
ELEMENTWISE = "elementwise/activation"
POOLING = "pooling"
REDUCTION = "reduction/softmax/loss"
DATA_MOVEMENT = "data movement"
OPTIMIZER = "optimizer"
COMMUNICATION = "communication"
OTHER = "other"
CATEGORIES = (CONV_MATMUL, NORMALIZATION, ELEMENTWISE, POOLING, REDUCTION, DATA_MOVEMENT, OPTIMIZER, COMMUNICATION,
              OTHER)
#: Categories whose operators do O(1) arithmetic per element they read or write: memory-bound on
#: every CPU and GPU whatever their shapes (a fusion, not a faster kernel, is what helps them).
MEMORY_BOUND_BY_NATURE = (NORMALIZATION, ELEMENTWISE, POOLING, REDUCTION, DATA_MOVEMENT, OPTIMIZER)

# Checked in this order: the first pattern an operator's name matches decides (aten:: stripped).
_PATTERNS: tuple[tuple[str, str], ...] = (
    (CONV_MATMUL, r"conv|^(addmm|mm|bmm|baddbmm|matmul|linear|einsum|_scaled_dot_product|scaled_dot_product)|"
                  r"cudnn_convolution|mkldnn_convolution|gemm|cutlass|sm\d+_xmma|ampere_|hopper_|wgmma"),
    (NORMALIZATION, r"batch_norm|layer_norm|group_norm|instance_norm|rms_norm|_norm_|bn_fw|bn_bw|welford"),
    (POOLING, r"pool"),
    (REDUCTION, r"softmax|nll_loss|cross_entropy|^(sum|mean|amax|amin|max|min|argmax|norm|linalg_vector_norm|"
                r"var|std|logsumexp|cumsum|topk|sort)$|reduce|loss"),
    (DATA_MOVEMENT, r"^(copy_|to|_to_copy|contiguous|clone|cat|stack|index_select|gather|scatter|pad|"
                    r"constant_pad_nd|flip|roll|permute_copy|pin_memory|_pin_memory|narrow_copy)$|memcpy|memset|"
                    r"copy_kernel|cat_"),
    (ELEMENTWISE, r"relu|gelu|silu|sigmoid|tanh|threshold|hardswish|elu|dropout|^(add|add_|sub|sub_|mul|mul_|div|"
                  r"div_|addcmul_|addcdiv_|sqrt|rsqrt|exp|log|pow|neg|abs|clamp|clamp_|where|fill_|zero_|lerp_|"
                  r"masked_fill_?|ne|eq|lt|gt|le|ge|ones_like|zeros_like|empty_like)$|elementwise|vectorized"),
)
_OPTIMIZER_OPS = re.compile(r"^_foreach_|^_fused_(adam|adamw|sgd)|^Optimizer\.|multi_tensor")
# Collectives between processes (DDP's gradient all-reduce, its start-up broadcast) and DDP's reducer
# around them, matched on the whole name before the namespace is stripped. Names as torch.profiler
# gives them: on gloo (seen, torch 2.14) c10d::allreduce_, gloo:all_reduce, c10d::broadcast_,
# torch.distributed.ddp.reducer::copy_bucket_to_grad, torch::distributed::reducer::mul_out; on NCCL
# nccl:all_reduce, record_param_comms and the ncclDevKernel_/ncclKernel_ kernels.
_COMMUNICATION_OPS = re.compile(r"^c10d::|^(gloo|nccl|mpi|ucc):|record_param_comms|^nccl|processgroup|"
                                r"ddp\.reducer::|distributed::reducer::", re.IGNORECASE)
# The all-reduce itself among them: c10d::allreduce_ (the call), gloo:all_reduce (gloo's worker thread,
# which does the work on CPU processes), nccl:all_reduce and NCCL's AllReduce kernels (their device time).
_ALL_REDUCE = re.compile(r"all_?reduce", re.IGNORECASE)


def category_of(name: str) -> str:
    """The category of an operator (``aten::relu``) or a kernel's name."""
    if _COMMUNICATION_OPS.search(name):
        return COMMUNICATION
    bare = name.split("::", 1)[1] if "::" in name else name
    if _OPTIMIZER_OPS.search(bare):
        return OPTIMIZER
    lowered = bare.lower()
    for category, pattern in _PATTERNS:
        if re.search(pattern, lowered):
            return category
    return OTHER


@dataclass(frozen=True)
class Op:
    """One recorded operator call, reduced to what the tables need."""

    name: str
    self_cpu_us: float
    self_device_us: float = 0.0
    flops: float = 0.0
    input_numel: int = 0  # elements of its input tensors (record_shapes)
    flops_us: float = 0.0  # where FLOPs are counted: the call's inclusive time (its children do the work)
    backward: bool = False
    optimizer: bool = False

    @property
    def category(self) -> str:
        return OPTIMIZER if self.optimizer else category_of(self.name)


@dataclass
class CategoryRow:
    category: str
    self_cpu_ms: float = 0.0
    self_device_ms: float = 0.0
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    flops_ms: float = 0.0  # the time of the calls whose FLOPs are counted
    calls: int = 0
    share: float = 0.0  # of the step, by the time that bounds it (device time on a GPU, else CPU)

    @property
    def flops_per_s(self) -> Optional[float]:
        """Achieved FLOP/s of the calls whose FLOPs the profiler counts (forward convolutions and
        matmuls: their backward has no count)."""
        return self.flops / (self.flops_ms / 1000) if self.flops and self.flops_ms > 0 else None

    @property
    def intensity(self) -> Optional[float]:
        """FLOPs per byte moved (estimated), where FLOPs are counted."""
        return self.flops / self.bytes if self.flops and self.bytes else None

    @property
    def backward_over_forward(self) -> Optional[float]:
        return self.backward_ms / self.forward_ms if self.forward_ms > 0 else None


@dataclass
class Breakdown:
    """The categories of a profiled window of `steps` training steps of `step_ms` each."""

    steps: int
    step_ms: float
    rows: list[CategoryRow]
    on_device: bool
    outside_ms: float = 0.0  # per step: time in no recorded operator (Python, the loop, waiting)
    notes: list[str] = field(default_factory=list)

    @property
    def outside_share(self) -> float:
        return self.outside_ms / self.step_ms if self.step_ms else 0.0

    def memory_bound_share(self, ridge: Optional[float] = None) -> float:
        """Share of the step in memory-bound operators: the categories that are by nature, plus
        convolution/matmul when their intensity is below the machine's ridge point."""
        share = sum(r.share for r in self.rows if r.category in MEMORY_BOUND_BY_NATURE)
        conv = next((r for r in self.rows if r.category == CONV_MATMUL), None)
        if conv is not None and ridge is not None and conv.intensity is not None and conv.intensity < ridge:
            share += conv.share
        return share


def breakdown(ops: Iterable[Op], steps: int, step_ms: float, on_device: bool, bytes_per_element: int) -> Breakdown:
    """Per-category totals per step from the operators of `steps` steps."""
    rows = {category: CategoryRow(category) for category in CATEGORIES}
    for op in ops:
        row = rows[op.category]
        row.calls += 1
        row.self_cpu_ms += op.self_cpu_us / 1000
        row.self_device_ms += op.self_device_us / 1000
        spent = (op.self_device_us if on_device else op.self_cpu_us) / 1000
        if op.backward:
            row.backward_ms += spent
        elif op.category != OPTIMIZER:
            row.forward_ms += spent
        if op.flops and op.category != OPTIMIZER:  # the profiler counts a few of the optimizer's ops only
            row.flops += op.flops
            row.bytes += op.input_numel * bytes_per_element
            row.flops_ms += op.flops_us / 1000
    scale = 1 / max(steps, 1)
    for row in rows.values():
        for name in ("self_cpu_ms", "self_device_ms", "forward_ms", "backward_ms", "flops", "bytes", "flops_ms"):
            setattr(row, name, getattr(row, name) * scale)
        row.share = (row.self_device_ms if on_device else row.self_cpu_ms) / step_ms if step_ms else 0.0
    used = [row for row in rows.values() if row.calls]
    inside = sum(r.self_device_ms if on_device else r.self_cpu_ms for r in used)
    return Breakdown(steps, step_ms, sorted(used, key=lambda r: -r.share), on_device, max(0.0, step_ms - inside))


def unusual(result: Breakdown, backward_ratio: float = 2.5, min_share: float = 0.05) -> list[str]:
    """Ratios worth a look: a category whose backward takes far more than its forward (about 2x
    is usual: the gradients of the input and of the weights)."""
    flags = []
    for row in result.rows:
        ratio = row.backward_over_forward
        if ratio is not None and ratio > backward_ratio and row.share >= min_share:
            flags.append(f"{row.category}: backward {row.backward_ms:.2f} ms is {ratio:.1f}x its forward "
                         f"({row.forward_ms:.2f} ms); about 2x is usual")
    return flags


def category_table(result: Breakdown) -> list[str]:
    device = "CUDA" if result.on_device else "CPU"
    lines = [f"| category | share of step | self {device} ms/step | forward ms | backward ms | backward/forward | "
             "GFLOP/s | FLOPs/byte | calls/step |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result.rows:
        spent = row.self_device_ms if result.on_device else row.self_cpu_ms
        ratio = row.backward_over_forward
        rate = row.flops_per_s
        lines.append(f"| {row.category} | {row.share:.1%} | {spent:.2f} | {row.forward_ms:.2f} | "
                     f"{row.backward_ms:.2f} | {f'{ratio:.1f}x' if ratio else '-'} | "
                     f"{f'{rate / 1e9:.3g}' if rate else '-'} | "
                     f"{f'{row.intensity:.3g}' if row.intensity else '-'} | {row.calls / max(result.steps, 1):.0f} |")
    lines.append(f"| outside operators (Python, the loop, waiting) | {result.outside_share:.1%} | "
                 f"{result.outside_ms:.2f} | | | | | | |")
    return lines


def all_reduce_ms(ops: Iterable[Op], steps: int, on_device: bool) -> float:
    """ms per step in the all-reduce's operators (DDP's gradient all-reduce): their self device time
    on a GPU (NCCL's kernels), else their self CPU time (on gloo, its worker thread's)."""
    spent = sum(op.self_device_us if on_device else op.self_cpu_us for op in ops
                if op.category == COMMUNICATION and _ALL_REDUCE.search(op.name))
    return spent / 1000 / max(steps, 1)


def all_reduce_line(ms: float, step_ms: float) -> str:
    return (f"all-reduce: {ms:.2f} ms/step, {ms / step_ms if step_ms else 0.0:.1%} of the step (overlapped with "
            "backward by DDP's buckets where the device allows)")


def top_ops(ops: Sequence[Op], steps: int, on_device: bool, count: int = 15) -> list[str]:
    """The operators with the most self time, per step."""
    totals: dict[str, list[float]] = {}
    for op in ops:
        entry = totals.setdefault(op.name, [0.0, 0.0, 0])
        entry[0] += op.self_cpu_us
        entry[1] += op.self_device_us
        entry[2] += 1
    key = 1 if on_device else 0
    ordered = sorted(totals.items(), key=lambda item: -item[1][key])[:count]
    lines = ["| operator | category | self CPU ms/step | self CUDA ms/step | calls/step |", "|---|---|---:|---:|---:|"]
    for name, (cpu, device, calls) in ordered:
        lines.append(f"| `{name}` | {category_of(name)} | {cpu / 1000 / steps:.3f} | "
                     f"{device / 1000 / steps:.3f} | {calls / steps:.0f} |")
    return lines


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """FLOPs per byte above which a kernel can be compute-bound."""
    return peak_flops / bandwidth if bandwidth > 0 else math.inf


#: The ranges trainer/task.py names around the training step's forward (with the loss) and its
#: backward; inside the optimizer's step, what is in neither is the optimizer's own work.
FORWARD_RANGE = "trainer: forward"
BACKWARD_RANGE = "trainer: backward"

# -- recording -----------------------------------------------------------------------------------------
#: Steps skipped before recording (the first steps allocate, compile and warm caches), then steps
#: recorded and dropped (the profiler's own start-up cost), before `profile_steps` kept steps.
WAIT_STEPS = 3
WARMUP_STEPS = 2


def ops_of(events: Iterable[Any], on_device: bool = False) -> tuple[list[Op], list[float]]:
    """The operator calls of a profiler's events, and the durations (ms) of its steps."""
    ops: list[Op] = []
    steps: list[float] = []
    for event in events:
        if getattr(event, "device_type", None) is not None and str(event.device_type) != "DeviceType.CPU":
            continue  # kernels: their time is in their launching operator's self device time
        if event.name.startswith("ProfilerStep"):
            steps.append(event.cpu_time_total / 1000)
            continue
        if event.name in (FORWARD_RANGE, BACKWARD_RANGE):
            continue  # the ranges themselves: their time is their operators'
        ancestors = _ancestors(event)
        in_model = FORWARD_RANGE in ancestors or BACKWARD_RANGE in ancestors
        shapes = getattr(event, "input_shapes", None) or []
        inclusive = getattr(event, "device_time_total", 0.0) if on_device else event.cpu_time_total
        ops.append(Op(event.name, float(event.self_cpu_time_total), float(getattr(event, "self_device_time_total", 0.0)),
                      float(getattr(event, "flops", 0) or 0), sum(_numel(shape) for shape in shapes), float(inclusive),
                      backward=BACKWARD_RANGE in ancestors or "Backward" in event.name
                      or any(a.startswith("autograd::engine::evaluate_function") for a in ancestors),
                      optimizer=not in_model and any(name.startswith(("Optimizer.step#", "Optimizer.zero_grad#"))
                                                     for name in (event.name, *ancestors))))
    return ops, steps


def _ancestors(event: Any) -> list[str]:
    names = []
    parent = getattr(event, "cpu_parent", None)
    while parent is not None:
        names.append(parent.name)
        parent = getattr(parent, "cpu_parent", None)
    return names


def _numel(shape: Any) -> int:
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) for d in shape):
        return 0
    return math.prod(shape) if shape else 0


# -- the machine's roof ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Roof:
    peak_flops: float
    bandwidth: float  # bytes/s
    how: str  # where the two figures come from ("measured: ..." or a datasheet)

    @property
    def ridge(self) -> float:
        return ridge_point(self.peak_flops, self.bandwidth)


def measure_roof(device: torch.device, dtype: torch.dtype, seconds: float = 0.3) -> Roof:
    """A short microbenchmark: the best FLOP/s of a square matmul in `dtype`, and the bytes/s of a
    large copy (read + write), on `device`."""

    def best_rate(work: float, call: Any) -> float:
        call()
        synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        synchronize()
        best, deadline = 0.0, time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            call()
            synchronize()
            best = max(best, work / (time.perf_counter() - start))
        return best

    n = 2048 if device.type == "cuda" else 1024
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    flops = best_rate(2 * n**3, lambda: a @ b)
    elements = (256 if device.type == "cuda" else 32) * 1024 * 1024
    source = torch.empty(elements, dtype=torch.float32, device=device).fill_(1.0)
    target = torch.empty_like(source)
    bandwidth = best_rate(2 * source.numel() * 4, lambda: target.copy_(source))
    return Roof(flops, bandwidth, f"measured here: {str(dtype).removeprefix('torch.')} {n}x{n} matmul "
                                  f"{flops / 1e9:,.0f} GFLOP/s, a {elements * 4 >> 20} MiB copy "
                                  f"{bandwidth / 1e9:,.1f} GB/s (best of {seconds:g} s each)")


def machine_roof(device: torch.device, precision: str, tf32: bool, dtype: torch.dtype) -> Roof:
    """The datasheet's peak and bandwidth for a known GPU, else measured (`measure_roof`)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak, peak_how = peak_flops(name, precision, tf32)
        bandwidth, bandwidth_how = peak_bandwidth(name)
        if peak is not None and bandwidth is not None:
            return Roof(peak, bandwidth, f"{peak_how}; {bandwidth_how}")
    return measure_roof(device, dtype)


def plot_roofline(result: Breakdown, roof: Roof, path: "Path", title: str) -> None:
    points = [(row, intensity) for row in result.rows if (intensity := row.intensity) and row.flops_per_s]
    low = min([0.1, *(intensity / 3 for _, intensity in points)])
    high = max([roof.ridge * 10, *(intensity * 3 for _, intensity in points)])
    figure = new_figure(figsize=(7, 4.6))
    axis = figure.subplots()
    xs = [low * (high / low) ** (i / 200) for i in range(201)]
    axis.plot(xs, [min(roof.peak_flops, x * roof.bandwidth) for x in xs], color="black",
              label=f"roof: {roof.peak_flops / 1e9:,.0f} GFLOP/s, {roof.bandwidth / 1e9:,.0f} GB/s")
    axis.axvline(roof.ridge, color="grey", linestyle=":", label=f"ridge {roof.ridge:.1f} FLOPs/byte")
    for row, intensity in points:
        axis.scatter([intensity], [row.flops_per_s], s=40 + 400 * row.share, label=f"{row.category} "
                     f"({row.share:.0%} of the step)")
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlabel("arithmetic intensity, FLOPs per byte (bytes estimated from input sizes)")
    axis.set_ylabel("achieved FLOP/s")
    axis.set_title(title, fontsize=9)
    axis.legend(fontsize=7, loc="lower right")
    figure.text(0.01, 0.01, roof.how, fontsize=6)
    figure.tight_layout(rect=(0, 0.03, 1, 1))
    save_png(figure, path)


# -- the callback that records the real loop --------------------------------------------------------------
class StepProfiler(Callback):
    """Records `WAIT_STEPS` + `WARMUP_STEPS` + `active` training steps of the run's own loop with
    torch.profiler, writes the trace and the tables into `folder`, then stops the fit. Under DDP every
    process records the same steps (the profiler's cost alike on each, so none waits for another in
    the all-reduce for it); only where `write_trace` (rank 0) is the trace written."""

    def __init__(self, folder: Path, active: int, on_device: bool, write_trace: bool = True) -> None:
        self.folder, self.active, self.on_device, self.write_trace = folder, active, on_device, write_trace
        self.total = WAIT_STEPS + WARMUP_STEPS + active
        self._profiler: Any = None
        self._seen = 0
        self.events: Any = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._profiler is None and self.events is None:
            from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.on_device else [])
            trace = tensorboard_trace_handler(str(self.folder), worker_name="train")

            def ready(profiler: Any) -> None:
                if self.write_trace:
                    trace(profiler)  # *.pt.trace.json: Perfetto, chrome://tracing, TensorBoard's profiler plugin
                self.events = profiler.events()

            self._profiler = profile(activities=activities, record_shapes=True, with_flops=True,
                                     schedule=schedule(wait=WAIT_STEPS, warmup=WARMUP_STEPS, active=self.active,
                                                       repeat=1), on_trace_ready=ready)
            self._profiler.__enter__()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._profiler is None:
            return
        self._profiler.step()
        self._seen += 1
        if self._seen >= self.total:
            self._close()
            trainer.should_stop = True

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def _close(self) -> None:
        if self._profiler is not None:
            profiler, self._profiler = self._profiler, None
            profiler.__exit__(None, None, None)


# -- the report ---------------------------------------------------------------------------------------------
def write_report(events: Any, folder: Path, on_device: bool, bytes_per_element: int, roof: Roof,
                 title: str, nvtx: Optional[str] = None) -> dict[str, Any]:
    """ops.md, profile.json and roofline.png from the recorded events; returns profile.json's record.
    `nvtx`: whether the step's phases were marked for Nsight Systems (trainer/callbacks/nvtx.py)."""
    ops, step_ms = ops_of(events, on_device)
    if not step_ms:
        raise RuntimeError("the profiler recorded no training step")
    result = breakdown(ops, len(step_ms), sum(step_ms) / len(step_ms), on_device, bytes_per_element)
    memory_share = result.memory_bound_share(roof.ridge)
    reduce_ms = all_reduce_ms(ops, result.steps, on_device)
    flags = unusual(result)
    lines = [f"# Profile: {title}", "",
             f"{result.steps} training steps of the run's own loop recorded by torch.profiler (after {WAIT_STEPS} "
             f"skipped and {WARMUP_STEPS} warm-up steps): {result.step_ms:.2f} ms per step (the profiler's own "
             f"cost included). Roof: {roof.how}.", *([f"{nvtx}."] if nvtx else []), "",
             "## By category", "", *category_table(result), "",
             *([all_reduce_line(reduce_ms, result.step_ms), ""] if reduce_ms > 0 else []),
             f"Memory-bound operators: {memory_share:.0%} of the step ({', '.join(MEMORY_BOUND_BY_NATURE)} by "
             f"nature; convolution/matmul too when below the ridge of {roof.ridge:.1f} FLOPs/byte).",
             *(f"Unusual: {flag}" for flag in flags), "",
             "## Operators by self time", "", *top_ops(ops, result.steps, on_device), ""]
    write_text_atomic(folder / "ops.md", "\n".join(lines) + "\n")
    record = {
        "steps": result.steps, "step_ms": result.step_ms, "on_device": on_device,
        "categories": [{"category": r.category, "share": r.share, "self_cpu_ms": r.self_cpu_ms,
                        "self_device_ms": r.self_device_ms, "forward_ms": r.forward_ms, "backward_ms": r.backward_ms,
                        "flops_per_step": r.flops, "flops_per_s": r.flops_per_s, "intensity": r.intensity,
                        "calls_per_step": r.calls / result.steps} for r in result.rows],
        "outside_operators": {"ms": result.outside_ms, "share": result.outside_share},
        "memory_bound_share": memory_share, "unusual": flags,
        **({"all_reduce": {"ms_per_step": reduce_ms, "share": reduce_ms / result.step_ms if result.step_ms else 0.0}}
           if reduce_ms > 0 else {}),
        "roof": {"peak_flops": roof.peak_flops, "bandwidth": roof.bandwidth, "ridge": roof.ridge, "how": roof.how},
        "trace": sorted(p.name for p in folder.glob("*.pt.trace.json")),
        **({"nvtx": nvtx} if nvtx else {}),
    }
    write_json_atomic(folder / "profile.json", record)
    plot_roofline(result, roof, folder / "roofline.png", title)
    return record
