"""Host time per training step: the framework against the loop a user would write, on any machine.

    .venv/bin/python benchmarks/host_overhead.py --out benchmarks/results/host_overhead_cpu.md   # 16 rounds of 200 steps
    .venv/bin/python benchmarks/host_overhead.py --set optimizer.implementation=foreach --out ...  # another kernel
    .venv/bin/python benchmarks/host_overhead.py --quick          # CI: 1 short round, fewer variants

A GPU hides the host's work only while the device is busier than the host; a fast GPU, a small model
or an eager Transformer exposes every microsecond the framework adds (docs/diagnosis.md, "Host time
per step"). This measures that host time where it is all there is: a network so small (one
4-channel stage of the SmallCNN on 4x4 images, batch 2, AdamW with the default kernel (fused on the
CPU; `--set optimizer.implementation=foreach` for the other), on the CPU) that a step is almost only
host work. Every variant trains the same network on the same batches with the same
optimizer and schedule, built once by the framework's own phases (benchmarks/hand_loop.py:
`prepare_run`):

- `loop`: the hand-written loop (hand_loop.HandLoop: forward, loss, zero_grad, backward, step, schedule);
- `lightning`: bare Lightning: a LightningModule with the same step, `Trainer(logger=False,
  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)`;
- `lightning_barebones`: the same with `Trainer(barebones=True)`, Lightning's leanest settings;
- `framework`: the framework's own loop with every default (train.py's Trainer, callbacks, logger);
- `framework OVERRIDES`: the same with one default or callback off (and all of them off).

Each round runs every variant once, in a new order, in this one process (what is timed is the
steady state of a step, not an interpreter's start), after an untimed round that warms every variant
up past the clipping's calibration. A run's host time per step is its thread's CPU time,
undisturbed: for each position in Lightning's 10-step log cycle the fastest step of the run, averaged
over the positions (the log steps' extra work counted at its share; another process on the machine
only ever adds time). The figure of record is each variant's best round, as timeit takes the
minimum; the median and range over rounds, and the paired differences (both sides in the same round),
stand beside it, with the median wall-clock step.

Then, from one more framework run with timers around the parts (`SourceTimers`: each part's own
time, its nested parts taken out), the framework's extra time per step by source; what is left of
the measured extra is Lightning's loop itself. And the number of operations (aten ops: on a GPU,
kernel launches and their host cost) and of Python calls a step makes beyond the loop's and bare
Lightning's, for the small network and a 12-block one (six stages): counts no other load changes, and
they must not grow with the number of parameter tensors.

`--variants loop,lightning,framework --timing-only` runs the rounds alone, also against an older
checkout with this file and hand_loop.py copied into it (how benchmarks/results/
host_overhead_cpu_before.md was measured: the code before issue 48, commit 3a087bd).

Every number lands in the results file (`--out`, and `--json` with every run's times, the command,
the start and end, the machine and its load)."""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import importlib
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import lightning as L
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hand_loop import REPO, FrameworkLoop, HandLoop, compare_facts, prepare_run  # noqa: E402

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

#: The network so small that a step is host work, and its data (made on the device by the loader's transfer).
BASE = ["model=small_cnn", "model.widths=[4]", "data=synthetic", "data.shape=[1,4,4]", "data.batch_size=2",
        "data.train_samples=100000", "data.val_samples=2", "data.test_samples=2", "trainer.accelerator=cpu",
        "trainer.max_epochs=1"]
#: The same with six stages (12 Conv-BN-ReLU blocks: 38 parameter tensors instead of 8).
DEEP = ["model.widths=[4,4,4,4,4,4]"]
#: The framework with one default (or callback) off, and all of them off (a run always has a logger:
#: csv by default, writing at log steps only).
OFF = {"clipping=off": ["clipping=off"], "nonfinite=off": ["nonfinite=off"], "checkpointing=off": ["checkpointing=off"],
       "progress=off": ["progress=off"]}
ALL_OFF = [override for overrides in OFF.values() for override in overrides]
QUICK_OFF = ("clipping=off", "nonfinite=off")
#: Lightning's log interval in these runs (the framework's default): the cycle a step's work repeats in.
LOG_EVERY = 10
#: Steps of the untimed round that warms every variant up: past the clipping's calibration (100 steps).
WARM_UP_STEPS = 110
#: Steps before the operations are counted: past the clipping's calibration (100 steps by default),
#: whose percentile arithmetic a run does only at its start.
OPS_SKIP = 110
#: The goal the issue set: the framework with its defaults within this much of bare Lightning.
GOAL_US = 250


# --- the loops -----------------------------------------------------------------------------------

class LightningLoop:
    """Bare Lightning over the same built run: the hand loop's step in a LightningModule."""

    def __init__(self, run: Any, barebones: bool = False) -> None:
        self.run_state, self.barebones = run, barebones

    def run(self, steps: int, on_step_start: Optional[Callable[[int], None]] = None) -> None:
        from trainer.groups.precision import lightning_precision

        run = self.run_state
        precision = lightning_precision(run.plan.precision, run.plan.accelerator, run.spec.precision)
        off = {} if self.barebones else {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                                         "enable_model_summary": False}
        trainer = L.Trainer(accelerator=run.plan.accelerator, devices=1, max_steps=steps, max_epochs=-1,
                            limit_val_batches=0, num_sanity_val_steps=0, barebones=self.barebones,
                            precision=precision.get("precision"), **off)
        trainer.fit(BareModule(run, steps, on_step_start), datamodule=run.parts.datamodule)


class BareModule(L.LightningModule):
    """The hand loop's step as a LightningModule: the step, the optimizer and the schedule, nothing else."""

    def __init__(self, run: Any, steps: int, hook: Optional[Callable[[int], None]]) -> None:
        super().__init__()
        self.net, self.definition, self.plan = run.task.net, run.parts.definition, run.plan
        self.scheduler_cfg, self.steps, self.hook = run.spec.scheduler, steps, hook

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.hook is not None:
            self.hook(batch_idx)
        batch = self.definition.training_batch(batch)
        outputs = self.definition.forward(self.net, batch)
        return self.definition.loss(outputs, self.definition.targets(batch), training=True)

    def configure_optimizers(self) -> Any:
        from trainer.groups.scheduler import build_scheduler

        optimizer = self.plan.optimizer.build(self.net)
        return {"optimizer": optimizer, "lr_scheduler": build_scheduler(optimizer, self.scheduler_cfg, self.steps)}


class StepClock:
    """The wall-clock and thread CPU time at the start of each step."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def __call__(self, index: int) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.thread_time())

    def per_step_us(self, skip: int, period: int) -> tuple[float, float]:
        """Microseconds per step after `skip` steps: (the median wall-clock interval, the undisturbed
        CPU time). Undisturbed: for each position in a cycle of `period` steps (Lightning's log
        interval: a log step does more than the others), that position's fastest step, averaged over
        the positions. Another process on the machine only ever adds time, so the fastest of ~30
        cycles is the step's own work, the log steps' work included at its share."""
        wall = [(b - a) * 1e6 for a, b in zip(self.wall[skip:], self.wall[skip + 1:])]
        cpu = [(b - a) * 1e6 for a, b in zip(self.cpu[skip:], self.cpu[skip + 1:])]
        fastest = [min(cpu[position::period]) for position in range(period)]
        return statistics.median(wall), statistics.fmean(fastest)


def build_variants(names: Sequence[str], folder: Path, base: Sequence[str]) -> dict[str, Any]:
    """Each variant's loop, built once. The loop and both Lightning variants share one built run."""
    shared = prepare_run(base, folder / "shared")
    loops: dict[str, Any] = {"loop": HandLoop(shared), "lightning": LightningLoop(shared),
                             "lightning_barebones": LightningLoop(shared, barebones=True)}
    for name in names:
        if name in loops:
            continue
        extra = [] if name == "framework" else ALL_OFF if name == "framework, all off" else OFF[name.split(" ", 1)[1]]
        loops[name] = FrameworkLoop(prepare_run([*base, *extra], folder / name.replace(" ", "_").replace(",", "")))
    return {name: loops[name] for name in names}


def check_same_work(loops: dict[str, Any]) -> None:
    """The loop and the framework must run the same network, optimizer, precision and batch."""
    problems = compare_facts(loops["loop"].facts(), loops["framework"].facts())
    if problems:
        raise SystemExit("error: the loop and the framework differ: " + "; ".join(problems))


# --- the rounds ----------------------------------------------------------------------------------

def time_rounds(loops: dict[str, Any], rounds: int, steps: int, skip: int, seed: int,
                warm_up: int = WARM_UP_STEPS) -> dict[str, list[dict[str, float]]]:
    """Every variant once per round, in a shuffled order; per run its wall and CPU us per step. A
    first, untimed round warms every variant up (the clipping's calibration ends there: the
    callbacks, like the network, carry over from one run of a variant to the next)."""
    times: dict[str, list[dict[str, float]]] = {name: [] for name in loops}
    order = list(loops)
    with _quiet():
        for name in order:
            loops[name].run(warm_up)
    shuffle = random.Random(seed)
    for round_index in range(rounds):
        shuffle.shuffle(order)
        for name in order:
            clock = StepClock()
            with _quiet():
                loops[name].run(steps, on_step_start=clock)
            wall, cpu = clock.per_step_us(skip, LOG_EVERY)
            times[name].append({"round": round_index + 1, "wall_us": wall, "cpu_us": cpu})
            print(f"round {round_index + 1} {name}: {wall:,.0f} us wall (median), {cpu:,.0f} us CPU (undisturbed) "
                  "per step", flush=True)
    return times


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Lightning's start-up chatter off the benchmark's output."""
    import logging

    from trainer.infra.library_logs import quiet_library_warnings

    lightning_logs = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric", "trainer")]
    levels = [log.level for log in lightning_logs]
    for log in lightning_logs:
        log.setLevel(logging.ERROR)
    try:
        with quiet_library_warnings(), open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
            yield
    finally:
        for log, level in zip(lightning_logs, levels):
            log.setLevel(level)


def summarize(times: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per variant: the median and range over rounds, wall and CPU."""
    out = {}
    for name, runs in times.items():
        wall, cpu = [r["wall_us"] for r in runs], [r["cpu_us"] for r in runs]
        out[name] = {"wall_median": statistics.median(wall), "wall_min": min(wall), "wall_max": max(wall),
                     "cpu_median": statistics.median(cpu), "cpu_min": min(cpu), "cpu_max": max(cpu)}
    return out


def paired_difference(times: dict[str, list[dict[str, float]]], a: str, b: str, key: str = "cpu_us") -> dict[str, float]:
    """a minus b, per round (both ran in the same round): median and range."""
    diffs = [x[key] - y[key] for x, y in zip(times[a], times[b])]
    return {"median": statistics.median(diffs), "min": min(diffs), "max": max(diffs)}


# --- attribution ---------------------------------------------------------------------------------

#: The framework's parts, by the functions that do their per-step work ("module:Class.method").
SOURCES: dict[str, tuple[str, ...]] = {
    "the throughput meter": ("trainer.callbacks.throughput:ThroughputMeter.on_train_batch_end",),
    "training metrics (the accuracy)": ("trainer.tasks.classification:Classification.update_metrics",),
    "logging (the loss into its mean, self.log once an epoch, the step log, the lr monitor)": (
        "trainer.task:TrainingTask._log_training", "trainer.callbacks.step_log:StepLog.on_train_batch_end",
        "lightning.pytorch.callbacks.lr_monitor:LearningRateMonitor.on_train_batch_start"),
    "progress": ("trainer.callbacks.progress:PlainProgress.on_train_batch_end",),
    "the loss record and curves": ("trainer.callbacks.loss_record:LossRecord.on_train_batch_end",),
    "clipping": ("trainer.groups.clipping:GradientClipping.on_before_optimizer_step",
                 "trainer.groups.clipping:GradientClipping.on_train_batch_end"),
    "the non-finite guard": ("trainer.groups.nonfinite:NonFiniteGuard.on_before_backward",
                             "trainer.groups.nonfinite:NonFiniteGuard.on_before_optimizer_step",
                             "trainer.groups.nonfinite:NonFiniteGuard._after_step",
                             "trainer.groups.nonfinite:NonFiniteGuard.on_train_batch_end"),
    "checkpointing and the graceful stop": (
        "trainer.groups.checkpointing:PeriodicCheckpoint.on_train_batch_end",
        "trainer.groups.checkpointing:LatestAndBest.on_train_batch_end",
        "trainer.callbacks.graceful:GracefulStop.on_train_batch_end",
        "trainer.callbacks.steps:StepBoundary.on_train_batch_start"),
    "the task protocol (the step less forward and loss)": ("trainer.task:TrainingTask.training_step",),
    "forward and loss (the loop's work too)": ("trainer.tasks.protocol:TaskDefinition.forward",
                                                "trainer.task:TrainingTask.training_loss"),
    "callback dispatch": ("trainer.infra.lean_lightning:lean_dispatch",),
}
NOT_EXTRA = "forward and loss (the loop's work too)"


class SourceTimers:
    """Timers around the functions of `SOURCES`: each call's own time (nested timed calls taken
    out), summed by source. About a microsecond per timed call."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self._stack: list[list[float]] = []  # per open call: [start, time of nested timed calls]
        self._patched: list[tuple[Any, str, Any]] = []

    def install(self) -> None:
        for source, names in SOURCES.items():
            for name in names:
                module_name, qualified = name.split(":")
                owner: Any = importlib.import_module(module_name)
                *path, attribute = qualified.split(".")
                for part in path:
                    owner = getattr(owner, part)
                original = owner.__dict__[attribute] if attribute in owner.__dict__ else getattr(owner, attribute)
                self._patched.append((owner, attribute, original))
                setattr(owner, attribute, self._timed(source, original))
        self._patch_dispatch_reference()

    def _patch_dispatch_reference(self) -> None:
        # Lightning calls the dispatch through its `call` module: point it at the timed one too.
        from lightning.pytorch.trainer import call

        import trainer.infra.lean_lightning as lean

        self._patched.append((call, "_call_callback_hooks", call._call_callback_hooks))
        call._call_callback_hooks = lean.lean_dispatch

    def uninstall(self) -> None:
        for owner, attribute, original in reversed(self._patched):
            setattr(owner, attribute, original)
        self._patched = []

    def _timed(self, source: str, function: Any) -> Any:
        stack, seconds = self._stack, self.seconds

        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            frame = [time.perf_counter(), 0.0]
            stack.append(frame)
            try:
                return function(*args, **kwargs)
            finally:
                stack.pop()
                spent = time.perf_counter() - frame[0]
                seconds[source] += spent - frame[1]
                if stack:
                    stack[-1][1] += spent
        return timed


def attribute(loop: Any, steps: int, skip: int) -> dict[str, float]:
    """Microseconds per step of each source over the steps after `skip` of one framework run, each
    undisturbed as `StepClock` takes a step's time (per position in the log cycle, the fastest)."""
    timers = SourceTimers()
    snapshots: list[dict[str, float]] = []
    timers.install()
    try:
        with _quiet():
            loop.run(steps, on_step_start=lambda index: snapshots.append(dict(timers.seconds)))
    finally:
        timers.uninstall()
    out = {}
    for source in SOURCES:
        per_step = [(b.get(source, 0.0) - a.get(source, 0.0)) * 1e6
                    for a, b in zip(snapshots[skip:], snapshots[skip + 1:])]
        out[source] = statistics.fmean(min(per_step[position::LOG_EVERY]) for position in range(LOG_EVERY))
    return out


# --- operations ----------------------------------------------------------------------------------

class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched while active (forward, backward and optimizer alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def ops_per_step(loop: Any, steps: int, skip: int) -> float:
    """aten operations per step over the steps after `skip` (the last step's end not counted)."""
    counter = OpCounter()
    counted = steps - skip - 1

    def on_step(index: int) -> None:
        if index == skip:
            counter.__enter__()
        elif index == skip + counted:
            counter.__exit__(None, None, None)

    with _quiet():
        loop.run(steps, on_step_start=on_step)
    return counter.count / counted


def calls_per_step(loop: Any, steps: int, skip: int) -> float:
    """Python function calls (and calls of built-in functions) per step after `skip`, counted with
    `sys.setprofile`: like the operations, a count of host work that no other load on the machine
    changes."""
    counted = steps - skip - 1
    calls = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            calls[0] += 1

    def on_step(index: int) -> None:
        if index == skip:
            sys.setprofile(profile)
        elif index == skip + counted:
            sys.setprofile(None)

    with _quiet():
        loop.run(steps, on_step_start=on_step)
    sys.setprofile(None)
    return calls[0] / counted


def count_ops(folder: Path, steps: int, skip: int, base: Sequence[str]) -> dict[str, dict[str, float]]:
    """Operations per step of the loop and the framework, for the small and the 12-block network."""
    out = {}
    for label, extra in (("small (8 parameter tensors)", []), ("12 blocks (38 parameter tensors)", DEEP)):
        run = prepare_run([*base, *extra], folder / f"ops_{len(extra)}")
        loop, lightning = ops_per_step(HandLoop(run), steps, skip), ops_per_step(LightningLoop(run), steps, skip)
        framework = ops_per_step(FrameworkLoop(run), steps, skip)
        tensors = sum(1 for _ in run.task.net.parameters())
        calls = {name: calls_per_step(made, steps, skip)
                 for name, made in (("loop", HandLoop(run)), ("lightning", LightningLoop(run)),
                                    ("framework", FrameworkLoop(run)))}
        out[label] = {"parameter_tensors": tensors, "loop": loop, "lightning": lightning, "framework": framework,
                      "added": framework - loop, "added_beyond_lightning": framework - lightning,
                      "calls": calls}
    return out


# --- the record ----------------------------------------------------------------------------------

def machine() -> dict[str, Any]:
    import lightning

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    return {"cpu": cpu, "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "lightning": lightning.__version__,
            "python": platform.python_version(), "host": platform.node()}


def table(summary: dict[str, dict[str, float]], times: dict[str, list[dict[str, float]]]) -> list[str]:
    lines = ["| variant | host time, best round | median over rounds (range) | beyond the loop: best rounds | "
             "beyond the loop: paired by round, median (range) | wall-clock step, median (range) |",
             "|---|---:|---:|---:|---:|---:|"]
    loop = summary["loop"]["cpu_min"]
    for name, s in summary.items():
        best, paired = "", ""
        if name != "loop":
            d = paired_difference(times, name, "loop")
            best, paired = f"{s['cpu_min'] - loop:+,.0f}", f"{d['median']:+,.0f} ({d['min']:+,.0f} to {d['max']:+,.0f})"
        lines.append(f"| {name} | {s['cpu_min']:,.0f} | {s['cpu_median']:,.0f} ({s['cpu_min']:,.0f}-{s['cpu_max']:,.0f}) | "
                     f"{best} | {paired} | {s['wall_median']:,.0f} ({s['wall_min']:,.0f}-{s['wall_max']:,.0f}) |")
    return lines


def beyond(summary: dict[str, dict[str, float]], times: dict[str, list[dict[str, float]]], a: str, b: str) -> str:
    d = paired_difference(times, a, b)
    return (f"**{summary[a]['cpu_min'] - summary[b]['cpu_min']:+,.0f} us per step** between the best rounds "
            f"({summary[a]['cpu_min']:,.0f} against {summary[b]['cpu_min']:,.0f}); paired by round "
            f"{d['median']:+,.0f} (range {d['min']:+,.0f} to {d['max']:+,.0f})")


def verdict(summary: dict[str, dict[str, float]], times: dict[str, list[dict[str, float]]]) -> list[str]:
    extra = summary["framework"]["cpu_min"] - summary["lightning"]["cpu_min"]
    lines = [f"- the framework with its defaults, beyond bare Lightning: {beyond(summary, times, 'framework', 'lightning')}; "
             f"the goal, within {GOAL_US} us: **{'met' if extra <= GOAL_US else 'not met'}**",
             f"- bare Lightning beyond the hand-written loop: {beyond(summary, times, 'lightning', 'loop')}"]
    if "lightning_barebones" in times:
        lines.append(f"- Lightning's `barebones=True` against bare Lightning: "
                     f"{beyond(summary, times, 'lightning_barebones', 'lightning')}")
    return lines


def attribution_lines(sources: dict[str, float], extra_us: float) -> list[str]:
    attributed = sum(v for k, v in sources.items() if k != NOT_EXTRA)
    lines = ["| source | us per step |", "|---|---:|"]
    for source, us in sorted(sources.items(), key=lambda kv: -kv[1]):
        if source != NOT_EXTRA:
            lines.append(f"| {source} | {us:,.1f} |")
    lines.append(f"| **the framework's parts, in all** | **{attributed:,.1f}** |")
    lines.append(f"| Lightning's loop and what no timer covers (the measured {extra_us:,.0f} us beyond the loop, less "
                 f"the parts) | {extra_us - attributed:,.1f} |")
    lines.append(f"| (not extra: forward and loss, which the loop does too) | {sources[NOT_EXTRA]:,.1f} |")
    return lines


def ops_lines(ops: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["| network | parameter tensors | loop | bare Lightning | framework | framework beyond the loop "
             "| beyond bare Lightning |", "|---|---:|---:|---:|---:|---:|---:|"]
    for label, o in ops.items():
        lines.append(f"| {label} | {o['parameter_tensors']} | {o['loop']:.1f} | {o['lightning']:.1f} | "
                     f"{o['framework']:.1f} | {o['added']:.1f} | {o['added_beyond_lightning']:.1f} |")
    added = [o["added"] for o in ops.values()]
    flat = max(added) - min(added) < 0.5
    lines += ["", f"Operations added per step: {' and '.join(f'{a:.1f}' for a in added)}: "
              f"**{'flat in the number of parameter tensors' if flat else 'they grow with the parameter tensors'}**.",
              "", "Python calls per step (functions and built-ins, counted with `sys.setprofile`: host work that "
              "no other load changes):", "",
              "| network | loop | bare Lightning | framework | framework beyond bare Lightning |", "|---|---:|---:|---:|---:|"]
    for label, o in ops.items():
        c = o["calls"]
        lines.append(f"| {label} | {c['loop']:,.0f} | {c['lightning']:,.0f} | {c['framework']:,.0f} | "
                     f"{c['framework'] - c['lightning']:+,.0f} |")
    return lines


def write(out: Path, record: dict[str, Any]) -> None:
    m, summary, times = record["machine"], record["summary"], record["times"]
    lines = ["# Host time per training step: the framework against the loop a user would write", "",
             f"Machine: {m['cpu']}, {m['usable_cores']} of {m['cores']} cores, {m['torch_threads']} torch thread(s), "
             f"torch {m['torch']}, Lightning {m['lightning']}, Python {m['python']}; 1-minute load "
             f"{record['load_at_start']:.2f} at the start, {record['load_at_end']:.2f} at the end.", "",
             f"Command: `{record['command']}` ({record['started']}, {record['duration_s']:.0f} s)", "",
             f"Network: SmallCNN with one 4-channel stage on 1x4x4 device-made images (data=synthetic), batch 2, "
             f"AdamW ({record['kernel']}), the default warmup-cosine schedule, on the CPU; {record['steps']} steps a run, the "
             f"first {record['skip']} not counted; {record['rounds']} interleaved rounds. Base overrides: "
             f"`{' '.join(record['base'])}`.", "",
             "Host time: a step's thread CPU time, undisturbed (per position in the 10-step log cycle the "
             "fastest step of the run, averaged: the log steps' work counted at its share); the best round is "
             "the figure of record (noise on a shared machine only ever adds, as timeit's minimum assumes), the "
             "median and range over rounds beside it.", "",
             *verdict(summary, times), "", "## Microseconds per step", "", *table(summary, times), ""]
    if record["sources"]:
        lines += ["## The framework's extra time per step, by source", "",
                  f"One more framework run of {record['steps']} steps with timers around each part (its own time, "
                  "the parts it calls taken out; about a microsecond per timed call).", "",
                  *attribution_lines(record["sources"], paired_difference(times, "framework", "loop")["median"]), ""]
    if record["ops"]:
        lines += ["## Operations per step (aten ops; on a GPU, kernel launches)", "", *ops_lines(record["ops"]), ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--skip", type=int, default=10, help="steps of each run not counted (its start)")
    parser.add_argument("--quick", action="store_true", help="1 round of 40 steps, fewer variants (CI)")
    parser.add_argument("--variants", default=None, help="only these, comma-separated, or semicolon-separated when one "
                        "has a comma ('framework, all off'); loop, lightning and framework at least; e.g. against an "
                        "older checkout of the framework")
    parser.add_argument("--timing-only", action="store_true", help="the rounds alone: no attribution, no counts")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="an override for every variant, the loop's included (e.g. optimizer.implementation=foreach)")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "host_overhead.md")
    parser.add_argument("--json", type=Path, default=None, help="every run's times and the record (default: beside --out)")
    args = parser.parse_args(argv)
    warm_up, attribution_steps = WARM_UP_STEPS, max(args.steps, 400)
    if args.quick:
        args.rounds, args.steps, args.skip, warm_up, attribution_steps = 1, 40, 10, 10, 40
    torch.set_num_threads(1)  # one core's host work, as a GPU run's main thread has
    off = QUICK_OFF if args.quick else tuple(OFF)
    names = ["loop", "lightning", *([] if args.quick else ["lightning_barebones"]), "framework",
             *(f"framework {name}" for name in off), *([] if args.quick else ["framework, all off"])]
    if args.variants:
        names = [name.strip() for name in args.variants.split(";" if ";" in args.variants else ",")]
    base = [*BASE, *args.set]
    started, load_at_start, start = time.strftime("%Y-%m-%dT%H:%M:%S%z"), os.getloadavg()[0], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="host_overhead_") as tmp:
        with _quiet():
            loops = build_variants(names, Path(tmp), base)
        check_same_work(loops)
        times = time_rounds(loops, args.rounds, args.steps, args.skip, seed=0, warm_up=warm_up)
        sources = {} if args.timing_only else attribute(loops["framework"], attribution_steps, args.skip)
        ops = {} if args.timing_only else count_ops(Path(tmp), steps=OPS_SKIP + 21, skip=OPS_SKIP, base=base)
        kernel = loops["loop"].facts()["kernel"]
    record = {"command": " ".join(["python", "benchmarks/host_overhead.py", *(argv if argv is not None else sys.argv[1:])]),
              "started": started, "duration_s": time.monotonic() - start, "machine": machine(),
              "load_at_start": load_at_start, "load_at_end": os.getloadavg()[0], "rounds": args.rounds,
              "steps": args.steps, "skip": args.skip, "base": base, "kernel": kernel, "summary": summarize(times),
              "times": times, "sources": sources, "ops": ops}
    write(args.out, record)
    (args.json or args.out.with_suffix(".json")).write_text(json.dumps(record, indent=1))
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
