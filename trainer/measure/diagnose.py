"""`diagnose=true`: where the time of one training step goes, on this machine, for this config.

Four timings of the composed run (the data pipeline alone; forward; forward + backward + optimizer
step; the full training step in Lightning's loop), each the median over timed repeats after
warm-up with the device synchronized before every clock read, then a verdict and the switch to try
next. docs/diagnosis.md ("The diagnosis") gives the timings, the sweeps and the verdicts."""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import time
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator, Iterable

import torch
from torch.profiler import record_function

from trainer.callbacks.throughput import synchronize
from trainer.data.base import DataModule
from trainer.data.loader import resolve_loader, usable_cpus
from trainer.groups.precision import compute_dtype
from trainer.infra.atomic import write_json_atomic
from trainer.infra.figures import new_figure, save_png
from trainer.measure.communication import (CommunicationTimer, CommunicationTiming, communication_lines, half_iqr,
                                           timed_ms)
from trainer.measure.profile import (BACKWARD_RANGE, ELEMENTWISE, FORWARD_RANGE, NORMALIZATION, OPTIMIZER, POOLING,
                                     Breakdown, breakdown, ops_of, unusual)

log = logging.getLogger("trainer")

# Verdict thresholds, as shares of the full step. A loader slower than 90% of the compute time
# cannot hide behind it; a remainder above 30% of the step is neither data nor model arithmetic.
INPUT_BOUND_RATIO = 0.9
OVERHEAD_SHARE = 0.3
OPTIMIZER_SHARE = 0.3
# Under DDP: an all-reduce the backward does not hide, above 30% of the step, is the bottleneck.
COMMUNICATION_SHARE = 0.3


@dataclass
class Timings:
    batch_size: int
    data_ms: float
    forward_ms: float
    forward_backward_ms: float
    step_ms: float  # forward + backward + optimizer step
    full_ms: float
    notes: list[str] = field(default_factory=list)
    #: Half the interquartile range of each timing's samples (data, forward, forward_backward, step,
    #: full), in ms: how far a median may move between two diagnoses of the same config.
    noise_ms: dict[str, float] = field(default_factory=dict)
    #: Under DDP: the gradient all-reduce the backward does not hide, per step (trainer/measure/communication.py);
    #: part of the full step, not of the model's step timed in one process.
    communication_ms: float = 0.0

    @property
    def backward_ms(self) -> float:
        return max(0.0, self.forward_backward_ms - self.forward_ms)

    @property
    def optimizer_ms(self) -> float:
        return max(0.0, self.step_ms - self.forward_backward_ms)

    @property
    def remainder_ms(self) -> float:
        """Full step minus the model's arithmetic (and, under DDP, the exposed all-reduce): waiting for
        data plus host and framework work."""
        return max(0.0, self.full_ms - self.step_ms - self.communication_ms)


@dataclass(frozen=True)
class ModelStep:
    """What one training step of the model is made of, for timing and profiling it on a resident
    batch: the task (the network and its loss), the optimizer, the precision's forward context and
    fp16 GradScaler (None without one), and the device."""

    task: Any
    optimizer: torch.optim.Optimizer
    forward_context: Callable[[], Any]
    scaler: Any
    device: torch.device


@dataclass
class Verdict:
    kind: str  # input-bound | communication-bound | compute-bound | optimizer-bound | host-overhead-bound
    reason: str
    try_next: list[str]
    #: Set when the deciding comparison is within the timings' noise of its threshold: the verdict
    #: could flip on a rerun, and this names the other candidate.
    borderline: str | None = None


def median_ms(run_once: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds of `run_once`, device synchronized around each call."""
    return median_and_noise(run_once, device, warmup, repeats)[0]


def median_and_noise(run_once: Callable[[], Any], device: torch.device, warmup: int,
                     repeats: int) -> tuple[float, float]:
    """(median, half the interquartile range) in ms of `run_once`, device synchronized around each call."""
    for _ in range(warmup):
        run_once()
    samples = [timed_ms(run_once, device) for _ in range(repeats)]
    return statistics.median(samples), half_iqr(samples)


def _batches(datamodule: DataModule, device: torch.device) -> Generator[Any, None, None]:
    """Training batches as the step receives them: from the loader, on the device, finished."""
    while True:
        for batch in datamodule.train_dataloader():
            batch = datamodule.transfer_batch_to_device(batch, device, 0)
            yield datamodule.finish_batch(batch, training=True)


def time_data(datamodule: DataModule, device: torch.device, steps: int) -> tuple[float, float]:
    """Milliseconds per batch from the training loader to a finished batch on the device, with its
    noise (`median_and_noise`). The warm-up covers the loader's workers' start and their first
    prefetched batches."""
    workers = datamodule.loader.num_workers if datamodule.loader else 0
    with closing(_batches(datamodule, device)) as batches:  # closing shuts the loader's workers down
        return median_and_noise(lambda: next(batches), device, 2 + 2 * workers, steps)


def _sweep(datamodule: DataModule, device: torch.device, steps: int, key: str, values: Iterable[Any],
           use: Callable[[Any], None]) -> list[dict[str, Any]]:
    """Samples/s of the data pipeline with each of `values` put in place by `use`, recorded under `key`."""
    results = []
    for value in values:
        use(value)
        ms = time_data(datamodule, device, steps)[0]
        results.append({key: value, "ms_per_batch": ms, "samples_per_s": datamodule.batch_size / (ms / 1000)})
    return results


def sweep_workers(datamodule: DataModule, device: torch.device, steps: int,
                  cpus: int | None = None) -> list[dict[str, Any]]:
    """Samples/s of the data pipeline for 0, 1, 2, 4, ... workers up to the usable CPUs."""
    cpus = cpus or usable_cpus()
    counts = sorted({0, cpus, *itertools.takewhile(lambda n: n <= cpus, (2**i for i in range(10)))})
    configured = datamodule.loader

    def use(workers: int) -> None:
        datamodule.loader = resolve_loader(workers, configured.pin_memory if configured else "auto", False, "auto",
                                           in_memory=datamodule.in_memory, cuda=device.type == "cuda")

    try:
        return _sweep(datamodule, device, steps, "num_workers", counts, use)
    finally:
        datamodule.loader = configured


def sweep_decoders(datamodule: DataModule, device: torch.device, steps: int) -> list[dict[str, Any]]:
    """Samples/s of the data pipeline in each ``data.decode`` mode the data module can use, with its
    configured workers (none for data held decoded)."""
    modes = datamodule.decode_choices()
    if len(modes) < 2:
        return []
    configured = getattr(datamodule, "decode_in_use", None)
    try:
        return _sweep(datamodule, device, steps, "decode", modes, datamodule.use_decode)
    finally:
        if configured is not None:
            datamodule.use_decode(configured)


def step_functions(model_step: ModelStep, batch: Any) -> tuple[Callable[[], Any], Callable[[], None],
                                                              Callable[[], None]]:
    """(forward, forward + backward, full step) on one resident batch, the forward and the backward
    inside the ranges the profile tells apart (trainer/measure/profile.py). The batch is split as the
    task's definition says (inputs, targets)."""
    task, optimizer, scaler = model_step.task, model_step.optimizer, model_step.scaler
    forward_context = model_step.forward_context
    definition = getattr(task, "definition", None)
    inputs, targets = (definition.inputs(batch), definition.targets(batch)) if definition is not None else batch

    def forward() -> torch.Tensor:
        with record_function(FORWARD_RANGE), forward_context():
            return task.evaluation_loss(task(inputs), targets)

    def forward_backward() -> None:
        loss = forward()
        with record_function(BACKWARD_RANGE):
            (scaler.scale(loss) if scaler is not None else loss).backward()

    def full_step() -> None:
        forward_backward()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return forward, forward_backward, full_step


def time_model(model_step: ModelStep, batch: Any, steps: int, warmup: int) -> dict[str, tuple[float, float]]:
    """(median, noise) in ms of forward, forward + backward and forward + backward + optimizer step
    on one resident batch."""
    optimizer, device = model_step.optimizer, model_step.device
    model_step.task.train()
    forward, forward_backward, full_step = step_functions(model_step, batch)
    try:
        # Warm the whole path once first: a compiled model compiles here, not inside a timing.
        median_ms(full_step, device, warmup, 1)
        timed = {"forward": median_and_noise(forward, device, 1, steps),
                 "forward_backward": median_and_noise(forward_backward, device, 1, steps)}
        optimizer.zero_grad(set_to_none=True)
        timed["step"] = median_and_noise(full_step, device, 1, steps)
    finally:
        optimizer.zero_grad(set_to_none=True)
    return timed


def profile_step(model_step: ModelStep, batch: Any, precision: str, steps: int = 3) -> Breakdown:
    """The model's step (forward, backward, optimizer) by operator category, from a short torch.profiler
    record of `steps` steps on the resident batch (shares of the profiled step, whose operators the
    profiler slows alike)."""
    from torch.profiler import ProfilerActivity, profile

    optimizer, device = model_step.optimizer, model_step.device
    model_step.task.train()
    full_step = step_functions(model_step, batch)[2]
    on_device = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    try:
        with profile(activities=activities, record_shapes=True, with_flops=True) as profiler:
            start = time.perf_counter()
            for _ in range(steps):
                full_step()
            synchronize(device)
            step_ms = (time.perf_counter() - start) * 1000 / steps
    finally:
        optimizer.zero_grad(set_to_none=True)
    ops, _ = ops_of(profiler.events(), on_device)
    return breakdown(ops, steps, step_ms, on_device, compute_dtype(precision).itemsize)


def verdict(t: Timings, context: dict[str, Any]) -> Verdict:
    """Name the bottleneck and the switches worth trying, from the timings and the run's settings;
    say when it is borderline (`borderline`)."""
    found = _verdict(t, context)
    found.borderline = borderline(t, found.kind)
    return found


def _verdict(t: Timings, context: dict[str, Any]) -> Verdict:
    cuda = context.get("accelerator") == "cuda"
    full = t.full_ms or 1e-9
    if t.data_ms >= INPUT_BOUND_RATIO * t.step_ms and t.remainder_ms > 0.15 * full:
        tries = []
        best = context.get("best_workers")
        if best is not None and best != context.get("num_workers"):
            tries.append(f"data.num_workers={best} (fastest in the sweep)")
        decoders = {d["decode"]: d["samples_per_s"] for d in context.get("decode_sweep", [])}
        fastest = max(decoders, key=decoders.__getitem__) if decoders else None
        if fastest is not None and fastest != context.get("decode"):
            tries.append(f"data.decode={fastest} (fastest decode mode: {decoders[fastest]:,.0f} samples/s against "
                         f"{decoders.get(context.get('decode'), 0):,.0f} with {context.get('decode')})")
        if not context.get("device_normalize", True):
            tries.append("data.device_normalize=true (ship uint8, finish on the device)")
        if cuda and not context.get("pin_memory"):
            tries.append("data.pin_memory=true")
        tries.append("cheaper decoding: smaller stored images, or pre-decoded data")
        return Verdict("input-bound", f"the loader needs {t.data_ms:.1f} ms per batch, the model's step "
                       f"{t.step_ms:.1f} ms: the device waits for data", tries)
    if t.communication_ms > COMMUNICATION_SHARE * full:
        tries = []
        if context.get("gradient_compression", "none") == "none":
            tries.append("trainer.gradient_compression=fp16 (half the bytes; bf16 on gloo or NCCL >= 2.10)")
        tries += ["a larger data.batch_size (one all-reduce per more samples)",
                  "trainer.accumulate_grad_batches=2 (one all-reduce per 2 batches: Lightning skips the sync between)"]
        return Verdict("communication-bound", f"the gradient all-reduce the backward does not hide takes "
                       f"{t.communication_ms:.1f} ms of the {t.full_ms:.1f} ms step ({t.communication_ms / full:.0%})",
                       tries)
    if t.remainder_ms > OVERHEAD_SHARE * full:
        tries = []
        if cuda and context.get("compile") != "reduce-overhead":
            tries.append("compile=reduce_overhead (CUDA graphs: one launch for the whole step)")
        tries += ["a larger data.batch_size (the per-step cost is paid per batch)",
                  "trainer.log_every_n_steps=50 (fewer host syncs for logging)"]
        return Verdict("host-overhead-bound", f"{t.remainder_ms:.1f} ms of the {t.full_ms:.1f} ms step "
                       f"({t.remainder_ms / full:.0%}) is neither data loading nor model arithmetic: Python, "
                       "the training loop, callbacks and logging", tries)
    if t.optimizer_ms > OPTIMIZER_SHARE * t.step_ms:
        tries = []
        implementation = context.get("optimizer_implementation")
        if implementation != "fused":  # (torch has fused kernels for CUDA and the CPU)
            tries.append("optimizer.implementation=fused")
        if implementation == "for_loop":
            tries.append("optimizer.implementation=foreach")
        tries.append("a larger data.batch_size (one update per more samples)")
        return Verdict("optimizer-bound", f"the optimizer step takes {t.optimizer_ms:.1f} ms of the model's "
                       f"{t.step_ms:.1f} ms ({t.optimizer_ms / max(t.step_ms, 1e-9):.0%})", tries)
    tries = []
    if cuda:
        if context.get("precision") == "32-true":
            tries.append("precision=bf16_mixed (or fp16_mixed on GPUs without bf16)")
        if not context.get("channels_last") and context.get("convolutional"):
            tries.append("precision.channels_last=true")
        if context.get("compile") == "off":
            tries.append("compile=default")
        if context.get("precision") == "32-true" and not context.get("tf32"):
            tries.append("precision.tf32=true")
    else:
        tries.append("a GPU: on this CPU the arithmetic itself is the limit (bf16 autocast measured slower here)")
    if context.get("activation_checkpointing"):
        tries.append("model.activation_checkpointing=[] if memory allows (recomputation costs compute)")
    tries.append("a smaller model or image size, if the task allows")
    return Verdict("compute-bound", f"forward + backward + optimizer take {t.step_ms:.1f} ms of the "
                   f"{t.full_ms:.1f} ms step ({t.step_ms / full:.0%})", tries)


def _rules(t: Timings) -> list[tuple[str, float, float]]:
    """(verdict, margin, noise) of each rule in `verdict`'s order: the rule fires when its margin
    (ms) is positive; noise (ms) is how far the margin may move between two diagnoses."""
    n = {key: t.noise_ms.get(key, 0.0) for key in ("data", "forward_backward", "step", "full", "communication")}
    rules = [
        ("input-bound", t.data_ms - INPUT_BOUND_RATIO * t.step_ms, math.hypot(n["data"], INPUT_BOUND_RATIO * n["step"])),
    ]
    if t.communication_ms > 0:  # a DDP run's: one process has none to weigh
        rules.append(("communication-bound", t.communication_ms - COMMUNICATION_SHARE * t.full_ms,
                      math.hypot(n["communication"], COMMUNICATION_SHARE * n["full"])))
    return rules + [
        ("host-overhead-bound", t.remainder_ms - OVERHEAD_SHARE * t.full_ms,
         math.hypot((1 - OVERHEAD_SHARE) * n["full"], n["step"], n["communication"])),
        ("optimizer-bound", t.optimizer_ms - OPTIMIZER_SHARE * t.step_ms,
         math.hypot((1 - OPTIMIZER_SHARE) * n["step"], n["forward_backward"])),
    ]


def borderline(t: Timings, kind: str) -> str | None:
    """Why the verdict `kind` could flip on a rerun, or None: the rule that decided it, or one that
    did not fire before it, is within its noise of its threshold."""
    for name, margin, noise in _rules(t):
        if name == kind:
            if margin < noise:
                return (f"{kind} by {margin:.2f} ms, within the timings' noise ({noise:.2f} ms): a rerun may say "
                        "the next candidate")
            return None
        if name == "input-bound" and t.remainder_ms <= 0.15 * (t.full_ms or 1e-9):
            continue  # the input rule also needs a visible wait; it was not the one that decided
        if -margin < noise:
            return (f"{name} missed by {-margin:.2f} ms, within the timings' noise ({noise:.2f} ms): a rerun may say "
                    f"{name}")
    return None


def shares(t: Timings) -> dict[str, float]:
    full = t.full_ms or 1e-9
    parts = {"forward": t.forward_ms / full, "backward": t.backward_ms / full, "optimizer": t.optimizer_ms / full}
    if t.communication_ms > 0:
        parts["all-reduce (exposed)"] = t.communication_ms / full
    return {**parts, "data wait + host overhead": t.remainder_ms / full}


def input_side_of(workers: list[dict[str, Any]], step_samples_per_s: float,
                  context: dict[str, Any]) -> dict[str, Any] | None:
    """What the loader delivers per host core against what the step consumes, in the task's unit
    (tokens for a language model): the cores the input side needs to keep the step fed. One
    worker's rate stands for one core (the loader's own process, no workers, also runs the step's
    host side, so it is not a core's worth); without workers measured, nothing."""
    unit, per_sample = str(context.get("unit", "samples")), int(context.get("units_per_sample", 1))
    one_worker = next((w for w in workers if w["num_workers"] == 1), None)
    if one_worker is None:
        return None
    per_core = one_worker["samples_per_s"] * per_sample
    consumes = step_samples_per_s * per_sample
    best = max(workers, key=lambda w: w["samples_per_s"])
    return {"unit": unit, "loader_per_core_per_s": per_core, "loader_best_per_s": best["samples_per_s"] * per_sample,
            "loader_best_workers": best["num_workers"], "step_consumes_per_s": consumes,
            "cores_needed": consumes / per_core if per_core > 0 else None,
            "method": "one loader worker's rate as one host core's; the step's rate is the training meter's "
                      "median window"}


def input_side_lines(side: dict[str, Any] | None) -> list[str]:
    if not side:
        return []
    unit = side["unit"]
    line = (f"input side: the loader delivers {side['loader_per_core_per_s']:,.0f} {unit}/s per host core "
            f"({side['loader_best_per_s']:,.0f} {unit}/s with {side['loader_best_workers']} workers); the step "
            f"consumes {side['step_consumes_per_s']:,.0f} {unit}/s")
    if side["cores_needed"] is not None:
        line += f": {side['cores_needed']:.2f} cores keep it fed"
    return [line]


def report_lines(t: Timings, v: Verdict, workers: list[dict[str, Any]],
                 decoders: list[dict[str, Any]] | None = None,
                 communication: CommunicationTiming | None = None) -> list[str]:
    rows = [("data pipeline alone", t.data_ms), ("forward alone", t.forward_ms),
            ("forward + backward", t.forward_backward_ms), ("forward + backward + optimizer", t.step_ms),
            ("full training step", t.full_ms)]
    each = f", each of {communication.processes} processes" if communication is not None else ""
    lines = [f"diagnosis at batch {t.batch_size}{each} (ms per step, median after warm-up, device synchronized):"]
    lines += [f"  {name:<32} {ms:9.2f} ms  {t.batch_size / (ms / 1000) if ms else 0:10,.0f} samples/s"
              for name, ms in rows]
    if communication is not None:
        lines += communication_lines(communication, t.full_ms)
    lines.append("shares of the full step: " + ", ".join(f"{k} {v:.0%}" for k, v in shares(t).items()))
    if workers:
        lines.append("loader workers: " + ", ".join(f"{w['num_workers']} -> {w['samples_per_s']:,.0f}/s" for w in workers))
    if decoders:
        lines.append("decode modes: " + ", ".join(f"{d['decode']} -> {d['samples_per_s']:,.0f}/s" for d in decoders))
    lines += [f"verdict: {v.kind}: {v.reason}", "try next: " + "; ".join(v.try_next)]
    if v.borderline:
        lines.append(f"borderline: {v.borderline}")
    lines += [f"note: {n}" for n in t.notes]
    return lines


def memory_bound_help(operators: Breakdown, context: dict[str, Any]) -> list[str]:
    """What shrinks the memory-bound operators' time, for the categories that take it."""
    cuda = context.get("accelerator") == "cuda"
    share = {r.category: r.share for r in operators.rows}
    helps = []
    fusable = share.get(ELEMENTWISE, 0) + share.get(NORMALIZATION, 0) + share.get(POOLING, 0)
    if fusable >= 0.05 and context.get("compile") in ("off", None):
        helps.append(f"compile=default: fuses elementwise and normalization operators ({fusable:.0%} of the step)"
                     + ("" if cuda else "; on this CPU compile measured no faster (compile=auto stays eager)"))
    if share.get(OPTIMIZER, 0) >= 0.05 and context.get("optimizer_implementation") != "fused":
        helps.append(f"optimizer.implementation=fused: one kernel for the update ({share[OPTIMIZER]:.0%} of the step)")
    if context.get("convolutional") and not context.get("channels_last") and share.get(NORMALIZATION, 0) >= 0.05:
        helps.append("precision.channels_last=true: convolutions and batch norms without layout copies"
                     + ("" if cuda else " (CUDA; on this CPU measured 1.05x)"))
    return helps


def operator_lines(operators: Breakdown, context: dict[str, Any]) -> list[str]:
    top = ", ".join(f"{r.category} {r.share:.0%}" for r in operators.rows[:5])
    lines = [f"operators of the model's step (profiled, {operators.step_ms:.1f} ms): {top}; outside operators "
             f"{operators.outside_share:.0%}",
             f"memory-bound operators take {operators.memory_bound_share():.0%} of the model's step"]
    helps = memory_bound_help(operators, context)
    if helps:
        lines.append("would help them: " + "; ".join(helps))
    lines += [f"unusual: {flag}" for flag in unusual(operators)]
    return lines


def plot(t: Timings, v: Verdict, workers: list[dict[str, Any]], path: Path) -> None:
    # matplotlib only when drawing: run.py imports this module for every run (about 0.5 s).
    from matplotlib.ticker import MaxNLocator

    figure = new_figure(figsize=(11, 4.4))
    axes = figure.subplots(1, 2)
    left = axes[0]
    parts = [("forward", t.forward_ms), ("backward", t.backward_ms), ("optimizer", t.optimizer_ms),
             ("all-reduce (exposed)", t.communication_ms), ("data wait + host", t.remainder_ms)]
    start = 0.0
    for (name, ms), colour in zip(parts, ("#4c72b0", "#55a868", "#c44e52", "#937860", "#8172b2")):
        if name.startswith("all-reduce") and not ms:
            continue
        left.barh(["full step"], [ms], left=start, color=colour, label=f"{name} {ms:.1f} ms")
        start += ms
    left.barh(["data alone"], [t.data_ms], color="#dd8452", label=f"data pipeline alone {t.data_ms:.1f} ms")
    left.set_xlabel("ms per step")
    left.set_title(f"{v.kind} (batch {t.batch_size})")
    left.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
    right = axes[1]
    if workers:
        right.plot([w["num_workers"] for w in workers], [w["samples_per_s"] for w in workers], marker="o")
        right.xaxis.set_major_locator(MaxNLocator(integer=True))
        right.set_xlabel("loader workers")
        right.set_ylabel("data pipeline samples/s")
        right.set_title("worker sweep")
    else:
        right.text(0.5, 0.5, "worker sweep not applicable", ha="center", va="center")
        right.set_axis_off()
    figure.tight_layout()
    save_png(figure, path)


def diagnose(datamodule: DataModule, model_step: ModelStep,
             full_step_samples_per_s: Callable[[], tuple[float | None, list[float]]], context: dict[str, Any],
             run_dir: Path, steps: int = 20, sweep: bool = True, communication: CommunicationTimer | None = None,
             write: bool = True) -> dict[str, Any]:
    """Run the four timings, a short profile of the model's step and the worker sweep; write
    diagnosis.json and diagnosis.png. `full_step_samples_per_s`: the real loop's samples/s (of one
    process) and the rates of its timed windows.

    Under DDP (`communication`: the timer among the full step's callbacks) every process runs all
    of it, the full step first: every process then exists (Lightning's launcher starts the others
    inside fit) and has the threads training gives it, so the one-process timings after it are
    measured as each process trains. Only where `write` (rank 0) are the files written."""
    measured = time_parts(datamodule, model_step, full_step_samples_per_s, steps, communication)
    operators = profile_step(model_step, measured.resident, str(context.get("precision", "32-true")))
    workers, decoders = sweep_input(datamodule, model_step.device, steps, sweep, measured.timings.notes, context)
    input_side = input_side_of(workers, measured.rate, context)
    findings = Findings(measured.timings, verdict(measured.timings, context), operators, workers, decoders,
                        input_side, measured.communication)
    for line in findings.lines(context):
        log.info(line)
    record = findings.record(context, steps)
    if not write:
        return record
    write_json_atomic(run_dir / "diagnosis.json", record)
    plot(findings.timings, findings.verdict, workers, run_dir / "diagnosis.png")
    log.info("diagnosis written: %s, %s", run_dir / "diagnosis.json", run_dir / "diagnosis.png")
    return record


@dataclass(frozen=True)
class Measured:
    """The four timings, the batch they were timed on (resident on the device) and the full step's
    samples/s of one process; under DDP, the all-reduce the full step timed."""

    timings: Timings
    resident: Any
    rate: float
    communication: CommunicationTiming | None


def time_parts(datamodule: DataModule, model_step: ModelStep,
               full_step_samples_per_s: Callable[[], tuple[float | None, list[float]]], steps: int,
               communication: CommunicationTimer | None) -> Measured:
    """The data pipeline alone, the model's step in its three parts on a resident batch, and the full
    step (under DDP run first, `diagnose` says why), each with its noise."""
    notes: list[str] = []
    task, device = model_step.task, model_step.device
    datamodule.setup("fit")
    batch_size = datamodule.batch_size
    early = full_step_samples_per_s() if communication is not None else None
    task.to(device)  # after a fit, Lightning's teardown has moved the model to the CPU
    data_ms, data_noise = time_data(datamodule, device, steps)
    with closing(_batches(datamodule, device)) as batches:
        resident = next(batches)
    model = time_model(model_step, resident, steps, warmup=3)
    (forward_ms, _), (fb_ms, _), (step_ms, step_noise) = model["forward"], model["forward_backward"], model["step"]
    rate, window_rates = early if early is not None else full_step_samples_per_s()
    task.to(device)  # the same, after the fit just run (profile_step times the model on the device)
    if not rate:
        raise RuntimeError("the full-step run produced no timed window")
    full_ms = batch_size / rate * 1000
    reduced = communication.result if communication is not None else None
    if communication is not None and reduced is None:
        raise RuntimeError("the full-step run under DDP did not time the all-reduce")
    if full_ms < step_ms:
        notes.append("the full step measured faster than the model alone: timing noise on a busy machine; "
                     "rerun with a larger diagnose_steps")
    windows_ms = [batch_size / r * 1000 for r in window_rates if r]
    # Under 4 windows there is no quartile: the full step is taken to be as noisy as the model's.
    full_noise = half_iqr(windows_ms) if len(windows_ms) >= 4 else full_ms * step_noise / max(step_ms, 1e-9)
    noise = {"data": data_noise, **{part: part_noise for part, (_, part_noise) in model.items()}, "full": full_noise}
    if reduced is not None:
        noise["communication"] = reduced.exposed_noise_ms
    timings = Timings(batch_size, data_ms, forward_ms, fb_ms, step_ms, full_ms, notes, noise,
                      communication_ms=reduced.exposed_or_zero_ms if reduced is not None else 0.0)
    return Measured(timings, resident, rate, reduced)


def sweep_input(datamodule: DataModule, device: torch.device, steps: int, sweep: bool,
                notes: list[str], context: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(worker sweep, decode sweep) of the loader; neither for data made on the device (`sweep` false,
    said in `notes`). The best worker count and the decode sweep go into `context`, which the verdict
    reads."""
    workers: list[dict[str, Any]] = []
    if not sweep:
        notes.append("worker sweep skipped: the data is made on the device, there is no loader to tune")
    else:
        workers = sweep_workers(datamodule, device, steps)
        context["best_workers"] = max(workers, key=lambda w: w["samples_per_s"])["num_workers"]
    decoders = sweep_decoders(datamodule, device, steps) if sweep else []
    context["decode_sweep"] = decoders
    return workers, decoders


@dataclass(frozen=True)
class Findings:
    """What the diagnosis measured and its verdict, to be printed and recorded."""

    timings: Timings
    verdict: Verdict
    operators: Breakdown
    workers: list[dict[str, Any]]
    decoders: list[dict[str, Any]]
    input_side: dict[str, Any] | None
    communication: CommunicationTiming | None

    def lines(self, context: dict[str, Any]) -> list[str]:
        return (report_lines(self.timings, self.verdict, self.workers, self.decoders, self.communication)
                + input_side_lines(self.input_side) + operator_lines(self.operators, context))

    def record(self, context: dict[str, Any], steps: int) -> dict[str, Any]:
        """diagnosis.json's content."""
        t, judged, operators = self.timings, self.verdict, self.operators
        record: dict[str, Any] = {
            "batch_size": t.batch_size,
            "steps_timed": steps,
            "method": "median of timed repeats after warm-up, device synchronized before each clock read; "
                      "the full step is the training meter's median window",
            "ms_per_step": {"data_pipeline": t.data_ms, "forward": t.forward_ms,
                            "forward_backward": t.forward_backward_ms, "forward_backward_optimizer": t.step_ms,
                            "full_step": t.full_ms},
            "derived_ms": {"backward": t.backward_ms, "optimizer": t.optimizer_ms,
                           "data_wait_and_host_overhead": t.remainder_ms},
            "shares_of_full_step": shares(t),
            "noise_ms": t.noise_ms,
            "verdict": judged.kind,
            "borderline": judged.borderline,
            "reason": judged.reason,
            "operators": {"step_ms_profiled": operators.step_ms,
                          "shares": {r.category: r.share for r in operators.rows},
                          "outside_operators": operators.outside_share,
                          "memory_bound_share": operators.memory_bound_share(),
                          "backward_over_forward": {r.category: r.backward_over_forward for r in operators.rows
                                                    if r.backward_over_forward is not None},
                          "unusual": unusual(operators), "would_help": memory_bound_help(operators, context)},
            "try_next": judged.try_next,
            "worker_sweep": self.workers,
            "decode_sweep": self.decoders,
            "input_side": self.input_side,
            "context": context,
            "notes": t.notes,
        }
        if self.communication is not None:
            record["communication"] = self.communication.record(t.full_ms)
            record["derived_ms"]["all_reduce_exposed"] = t.communication_ms
        return record
