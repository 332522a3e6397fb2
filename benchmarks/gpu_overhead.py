"""The framework's training loop against the project's hand-written loop, on one device: the ratio
framework/loop for ResNet-50 and GPT-2 small, eager and compiled (benchmarks/gpu_check.sh's
`overhead` step).

    .venv/bin/python benchmarks/gpu_overhead.py --out DIR/overhead.md --json DIR/overhead.json   # one CUDA GPU
    .venv/bin/python benchmarks/gpu_overhead.py --quick --out /tmp/overhead.md                   # tiny models, CPU

Each row builds one run from its overrides through the framework's own phases (benchmarks/hand_loop.py:
`prepare_run`), then times two loops over that run's network, in this process: the hand-written loop
(`HandLoop`) and the framework's Trainer (`FrameworkLoop`: every callback and logger a run has). Both
share the network object, so the compiled rows compile once and both sides run the same kernels; both
are timed by the same code (`time_windows`: the device synchronized and the clock read at the start
of a step, 5 warm-up steps, then 3 windows of 10 steps). The two sides alternate over `--repeats`
(hand first in even repeats, the framework first in odd ones); each repeat's ratio is framework/loop
of the median windows, and the table gives the median ratio with the range over the repeats, against
the goal (the framework within 2% of the loop: >= 0.98x). Before the first repeat is kept, the two
sides' facts are compared (lr and weight decay per parameter group, optimizer kernel, precision,
memory format, compile, parameters, torch threads, batch, device); a row whose sides differ is marked
failed with the difference.

Both sides do the same arithmetic: `clipping=off nonfinite=off` (the hand loop has neither). The
ResNet-50 eager row adds a third side, the framework with its defaults (95th-percentile clipping and
the non-finite guard, decided on the device), built as its own run: defaults/loop is what a user's
default run costs against the loop, and defaults/bare the step cost of those two defaults (what the
`step_cost` step measures with whole train.py runs).

The rows: ResNet-50 on benchmarks/practices.py's GPU base (224 px device-made images, batch 128, bf16,
TF32, channels_last, fused SGD), and `+recipe=gpt_small` (12 x 768, 12 heads, vocabulary 8,192, 16 x
1,024 tokens, fused AdamW, bf16) on 6 MB of its standard-library corpus; each with compile=off and
compile=default. Eager rows run first (seconds each), then the compiled ones (a compile each, tens of
seconds); the outputs are rewritten after every row. MFU is against the device's dense bf16 peak
(trainer/measure/mfu.py). `--quick`: the small CNN on 8 px images and a one-block GPT on the CPU,
short windows, compile=off standing in for compile=default (Inductor takes minutes on a CPU): the
machinery, not the numbers.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hand_loop import (FrameworkLoop, HandLoop, add_output_arguments, add_window_arguments, compare_facts, prepare_run,  # noqa: E402
                       steps_for, time_windows, window_defaults, write_results)
from practices import GPU_BASE, merged  # noqa: E402 - the GPU base every ResNet-50 step uses

from trainer.groups.compile import compile_counts  # noqa: E402

#: The framework within 2% of the hand loop.
GOAL = 0.98
#: The two sides do the same arithmetic; the rows with a third side add the defaults back there.
SAME_WORK = ["clipping=off", "nonfinite=off"]
DEFAULTS = ["clipping=percentile", "nonfinite=skip"]
COMMON = ["checkpointing=off", "progress=off", "logger=csv", "trainer.max_epochs=1", "trainer.limit_val_batches=0",
          "trainer.limit_test_batches=0", "trainer.num_sanity_val_steps=0"]

# Enough device-made images that no run crosses an epoch (they cost nothing: made from an index).
RESNET50 = merged(GPU_BASE, ["data.train_samples=65536"])
# fp32: bf16 autocast on a CPU is several times slower, and its kernels' first calls slower still.
RESNET50_QUICK = merged(RESNET50, ["model=small_cnn", "data.shape=[3,8,8]", "data.num_classes=10", "data.batch_size=4",
                                   "precision=fp32", "trainer.accelerator=cpu"])
# 6 MB of the standard library: ~84 batches of 16 x 1,024 tokens an epoch, 42 of 32 (a run is 36 steps).
GPT_SMALL = ["+recipe=gpt_small", "data.max_corpus_mb=6", *COMMON]
GPT_QUICK = [*GPT_SMALL, "data.max_corpus_mb=0.5", "data.val_fraction=0.25", "data.test_fraction=0.25",
             "data.vocab_size=300", "data.sequence_length=32", "data.batch_size=4", "data.num_workers=0",
             "model.layers=1", "model.width=32", "model.heads=2", "trainer.accelerator=cpu"]

#: (row, model's overrides, compile override); eager rows first.
ROWS = [("resnet50 eager", "resnet50", "compile=off"), ("gpt_small eager", "gpt_small", "compile=off"),
        ("resnet50 compiled", "resnet50", "compile=default"), ("gpt_small compiled", "gpt_small", "compile=default")]
#: The rows that also time the framework with its defaults (a run of its own: one more build and three
#: more fits, ~12 s a row on an H200; the step cost is a ResNet-50 figure in the practices' tables).
WITH_DEFAULTS = ("resnet50 eager",)


def model_overrides(model: str, quick: bool, cache_dir: Optional[Path]) -> list[str]:
    """A model's overrides (the framework's, without the compile and clipping switches)."""
    if model == "resnet50":
        return list(RESNET50_QUICK if quick else RESNET50)
    base = list(GPT_QUICK if quick else GPT_SMALL)
    return base + ([f"data.cache_dir={cache_dir}"] if cache_dir else [])


def device_name(device: Any) -> str:
    import torch

    from trainer.infra.fingerprint import cpu_name

    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()


def bf16_peak(device: Any) -> tuple[Optional[float], str]:
    """The device's dense bf16 peak FLOP/s (None off CUDA or for a part the table lacks), and its source."""
    from trainer.measure.mfu import bf16_peak_flops

    if device.type != "cuda":
        return None, f"no known peak for the {device.type.upper()}: MFU left out"
    return bf16_peak_flops(device_name(device))


def rate_of(loop: Any, seconds: list[float], window: int) -> dict[str, Any]:
    """Units/s of the median window (and of each), from a loop's units per step."""
    per_window = [loop.units_per_step * window / s for s in seconds]
    return {"rate": statistics.median(per_window), "window_rates": per_window}


def mfu(rate: Optional[float], flops_per_unit: Optional[int], peak: Optional[float]) -> Optional[float]:
    return rate * flops_per_unit / peak if rate and flops_per_unit and peak else None


def free_device_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure_row(name: str, model: str, compile_switch: str, args: argparse.Namespace, runs_dir: Path,
                quick: bool) -> dict[str, Any]:
    """One row: the hand loop and the framework (and on `WITH_DEFAULTS` the framework with its defaults),
    interleaved."""
    stand_in = quick and compile_switch != "compile=off"
    overrides = merged(model_overrides(model, quick, args.cache_dir), [compile_switch if not stand_in else "compile=off"])
    row: dict[str, Any] = {"row": name, "model": model, "compile": compile_switch.split("=", 1)[1],
                           "stand_in": stand_in, "overrides": merged(overrides, SAME_WORK), "status": "failed"}
    began = time.perf_counter()
    run = prepare_run(merged(overrides, SAME_WORK), runs_dir / name.replace(" ", "_"))
    loops: dict[str, Any] = {"hand": HandLoop(run), "framework": FrameworkLoop(run)}
    if name in WITH_DEFAULTS:
        loops["defaults"] = FrameworkLoop(prepare_run(merged(overrides, DEFAULTS),
                                                      runs_dir / (name.replace(" ", "_") + "_defaults")))
    device = loops["hand"].device
    steps = steps_for(args.windows, args.warmup, args.window)
    rates: dict[str, list[float]] = {side: [] for side in loops}
    windows: dict[str, list[list[float]]] = {side: [] for side in loops}
    # Dynamo's frames compiled by each side's runs: the shared network should compile on the first
    # side only (a count on the second means its guards differed: a compile more in this row's time).
    compiled = {side: 0 for side in loops}
    for repeat in range(args.repeats):
        order = list(loops) if repeat % 2 == 0 else list(reversed(loops))
        for side in order:
            before = compile_counts()["frames_compiled"]
            measured = rate_of(loops[side], time_windows(loops[side], steps, args.warmup, args.window, device),
                               args.window)
            compiled[side] += compile_counts()["frames_compiled"] - before
            rates[side].append(measured["rate"])
            windows[side].append(measured["window_rates"])
        row["frames_compiled"] = compiled
        if repeat == 0:
            facts = {side: loop.facts() for side, loop in loops.items()}
            row["facts"] = facts["hand"]
            problems = compare_facts(facts["hand"], facts["framework"])
            if "defaults" in facts:
                problems += compare_facts(facts["hand"], facts["defaults"], ("hand", "framework with its defaults"))
            if problems:
                row["error"] = "the sides did not run the same work: " + "; ".join(problems)
                return row
    hand, framework = loops["hand"], loops["framework"]
    peak, peak_note = bf16_peak(device)
    flops = row["facts"]["flops_per_unit"]
    ratios = [f / h for f, h in zip(rates["framework"], rates["hand"])]
    row.update(status="ok", device=device_name(device), unit=hand.plan.unit, units_per_step=hand.units_per_step,
               repeats=args.repeats, steps=steps, warmup=args.warmup, window=args.window, windows=args.windows,
               rates=rates, window_rates=windows, ratios=ratios, ratio=statistics.median(ratios),
               goal=GOAL, within_goal=statistics.median(ratios) >= GOAL,
               hand_rate=statistics.median(rates["hand"]), framework_rate=statistics.median(rates["framework"]),
               peak_flops=peak, mfu_note=peak_note, seconds=round(time.perf_counter() - began, 1))
    row["hand_mfu"], row["framework_mfu"] = mfu(row["hand_rate"], flops, peak), mfu(row["framework_rate"], flops, peak)
    meter = framework.meter.summary() if framework.meter is not None else {}
    row["meter_rate"] = meter.get(f"{meter.get('unit')}_per_s", meter.get("samples_per_s")) if meter else None
    if "defaults" in loops:
        defaults = [d / h for d, h in zip(rates["defaults"], rates["hand"])]
        cost = [d / f for d, f in zip(rates["defaults"], rates["framework"])]
        row.update(defaults_rate=statistics.median(rates["defaults"]), defaults_ratios=defaults,
                   defaults_ratio=statistics.median(defaults), step_cost_ratios=cost,
                   step_cost_ratio=statistics.median(cost))
    return row


def _fmt(value: Any, pattern: str) -> str:
    return pattern.format(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def _range(values: list[float]) -> str:
    return f" ({min(values):.3f}-{max(values):.3f})" if len(values) > 1 else ""


def table(rows: list[dict[str, Any]], header: str) -> str:
    lines = [header, "",
             "| row | framework/loop | goal >= 0.98x | loop units/s | framework units/s | MFU loop / framework "
             "| defaults/loop | defaults/bare | meter units/s |",
             "|---|---:|---|---:|---:|---|---:|---:|---:|"]
    for row in rows:
        if row["status"] != "ok":
            lines.append(f"| {row['row']} | failed | - | - | - | - | - | - | - |")
            continue
        unit = row["unit"]
        stand_in = " (eager stand-in)" if row["stand_in"] else ""
        lines.append(
            f"| {row['row']}{stand_in} | {row['ratio']:.3f}x{_range(row['ratios'])} | "
            f"{'met' if row['within_goal'] else 'NOT met'} | {row['hand_rate']:,.0f} {unit}/s | "
            f"{row['framework_rate']:,.0f} {unit}/s | {_fmt(row['hand_mfu'], '{:.1%}')} / "
            f"{_fmt(row['framework_mfu'], '{:.1%}')} | "
            f"{_fmt(row.get('defaults_ratio'), '{:.3f}x')}{_range(row.get('defaults_ratios') or [])} | "
            f"{_fmt(row.get('step_cost_ratio'), '{:.3f}x')}{_range(row.get('step_cost_ratios') or [])} | "
            f"{_fmt(row.get('meter_rate'), '{:,.0f}')} |")
    notes = [f"- {row['row']}: {row.get('error')}" for row in rows if row.get("error")]
    peaks = sorted({row["mfu_note"] for row in rows if row.get("mfu_note")})
    if peaks:
        notes.append("- MFU peak: " + "; ".join(peaks))
    return "\n".join(lines + ([""] + notes if notes else []))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny models on the CPU, short windows (dry runs)")
    parser.add_argument("--rows", default=",".join(r[0].replace(" ", "_") for r in ROWS),
                        help="the rows to run, comma-separated (resnet50_eager, gpt_small_eager, resnet50_compiled, "
                             "gpt_small_compiled)")
    parser.add_argument("--repeats", type=int, help="interleaved repeats per row (default 3; --quick 2)")
    add_window_arguments(parser, "a run")
    parser.add_argument("--cache-dir", type=Path, help="the text corpus's token cache (data.cache_dir)")
    add_output_arguments(parser, "every row's figures")
    args = parser.parse_args(argv)
    quick = args.quick
    args.repeats = args.repeats or (2 if quick else 3)
    window_defaults(args, quick)
    wanted = [r for r in ROWS if r[0].replace(" ", "_") in args.rows.split(",")]
    if not wanted:
        parser.error(f"--rows: none of {args.rows}; the rows: {', '.join(r[0].replace(' ', '_') for r in ROWS)}")
    header = (f"The framework (its Trainer, every callback and logger) against the hand-written loop "
              f"(benchmarks/hand_loop.py) on the same run's network, batch, optimizer, precision and kernels, "
              f"in one process on {platform.node() or 'this machine'}; clipping and the non-finite guard off on "
              f"both sides. Units/s: the median of {args.windows} windows of {args.window} steps after "
              f"{args.warmup} warm-up steps, device synchronized at each window's ends, the same code timing "
              f"both; framework/loop: median over {args.repeats} interleaved repeats (range in brackets). "
              f"defaults/loop: the framework with its default clipping and non-finite guard "
              f"({', '.join(WITH_DEFAULTS)}).")
    rows: list[dict[str, Any]] = []

    def write() -> None:
        write_results(args.out, table(rows, header), args.json, {"quick": quick, "goal": GOAL, "rows": rows})

    with tempfile.TemporaryDirectory(prefix="gpu_overhead_") as tmp:
        runs_dir = args.runs_dir or Path(tmp)
        for name, model, switch in wanted:
            try:
                row = measure_row(name, model, switch, args, runs_dir, quick)
            except Exception as ex:  # noqa: BLE001 - one failed row is one failed row; the next runs
                row = {"row": name, "model": model, "compile": switch.split("=", 1)[1], "status": "failed",
                       "stand_in": False, "error": f"{type(ex).__name__}: {ex}"[:600]}
            rows.append(row)
            free_device_memory()
            print(f"{name}: " + (f"framework/loop {row['ratio']:.3f}x{_range(row['ratios'])}, loop "
                                 f"{row['hand_rate']:,.0f} {row['unit']}/s, {row['seconds']:.0f} s"
                                 if row["status"] == "ok" else f"failed: {row.get('error')}"), flush=True)
            write()
    print(table(rows, header))
    return 0 if all(row["status"] == "ok" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
