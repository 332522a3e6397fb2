"""How fast can ResNet-50 and GPT-2 small train on this GPU? A short search over the batch, the
torch.compile mode and the memory format, with the project's hand-written loop (benchmarks/gpu_check.sh's
`ceiling` step, run with --steps).

    .venv/bin/python benchmarks/gpu_ceiling.py --out DIR/ceiling.md --json DIR/ceiling.json   # one CUDA GPU
    .venv/bin/python benchmarks/gpu_ceiling.py --quick --out /tmp/ceiling.md                  # tiny models, CPU

Each setting is one run made from the framework's overrides (benchmarks/hand_loop.py: the framework's
network, optimizer recipe, precision, TF32 and kernels) and trained by the hand loop, timed by
`time_windows` (5 warm-up steps, in which the compile happens, then 3 windows of 10 steps, device
synchronized at each window's ends). The hand loop, not the framework: it can compile in a mode the
`compile` group does not offer (max-autotune-no-cudagraphs), and what the framework reaches is this
ceiling times its framework/loop ratio (the `overhead` step). MFU is against the device's dense bf16
peak (trainer/measure/mfu.py). Compiles cost tens of seconds each (max-autotune's autotuning minutes),
so the search is coordinate-wise, cheapest first, and the outputs are rewritten after every setting:

1. eager, per model: ResNet-50 at batch 128 channels_last, 128 NCHW and 256 in the faster memory
   format; GPT-2 small at 16 and 32 sequences of 1,024 tokens (no convolutions: no memory format);
2. at each model's fastest eager batch and format, compile=default, then reduce-overhead (CUDA graphs),
   then max-autotune-no-cudagraphs; the two models alternate (GPT-2 small first), so a stop leaves
   both half-searched rather than one untouched. max-autotune's autotuning of ResNet-50's
   convolutions comes last: it may not finish within the step's budget.

The goals (one H200): ResNet-50 >= 5,500 img/s, GPT-2 small >= 45% MFU. `--quick`: the small CNN and a
one-block GPT on the CPU, batches 4 and 8, one compile setting run eager in its stead (Inductor takes
minutes on a CPU): the machinery, not the numbers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_overhead import bf16_peak, device_name, free_device_memory, model_overrides, mfu  # noqa: E402
from hand_loop import (add_output_arguments, add_window_arguments, prepare_hand_loop, steps_for, time_windows,  # noqa: E402
                       window_defaults, write_results)
from practices import merged  # noqa: E402

#: The goals on one H200: img/s for ResNet-50, MFU (dense bf16 peak) for GPT-2 small.
GOALS = {"resnet50": ("img/s", 5500.0), "gpt_small": ("MFU", 0.45)}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
#: Eager batches searched per model (GPU, quick).
BATCHES = {"resnet50": ((128, 256), (4, 8)), "gpt_small": ((16, 32), (4, 8))}


def setting_overrides(model: str, batch: int, channels_last: Optional[bool], quick: bool,
                      cache_dir: Optional[Path]) -> list[str]:
    extra = [f"data.batch_size={batch}", "compile=off"]
    if channels_last is not None:
        extra.append(f"precision.channels_last={str(channels_last).lower()}")
    return merged(model_overrides(model, quick, cache_dir), extra)


def measure(model: str, batch: int, channels_last: Optional[bool], mode: str, args: argparse.Namespace,
            runs_dir: Path) -> dict[str, Any]:
    """One setting trained by the hand loop; its units/s and MFU, or why it failed."""
    import torch

    stand_in = args.quick and mode != "off"
    label = f"{model} b{batch}" + ("" if channels_last is None else " cl" if channels_last else " nchw") + f" {mode}"
    row: dict[str, Any] = {"setting": label, "model": model, "batch": batch, "channels_last": channels_last,
                           "compile": mode, "stand_in": stand_in, "status": "failed"}
    began = time.perf_counter()
    torch._dynamo.reset()  # each setting compiles afresh (and Dynamo's recompile limit counts per function)
    try:
        loop = prepare_hand_loop(setting_overrides(model, batch, channels_last, args.quick, args.cache_dir),
                                 runs_dir / label.replace(" ", "_"), compile_mode=None if mode == "off" or stand_in else mode)
        steps = steps_for(args.windows, args.warmup, args.window)
        seconds = time_windows(loop, steps, args.warmup, args.window, loop.device)
        rates = [loop.units_per_step * args.window / s for s in seconds]
        peak, note = bf16_peak(loop.device)
        rate = statistics.median(rates)
        row.update(status="ok", unit=loop.plan.unit, rate=rate, window_rates=rates, device=device_name(loop.device),
                   flops_per_unit=loop.plan.flops_per_sample, mfu=mfu(rate, loop.plan.flops_per_sample, peak),
                   mfu_note=note, precision=loop.precision, kernel=loop.facts()["kernel"])
        del loop
    except Exception as ex:  # noqa: BLE001 - one failed setting is one row; the search goes on
        row["error"] = f"{type(ex).__name__}: {ex}"[:600]
    free_device_memory()
    row["seconds"] = round(time.perf_counter() - began, 1)
    return row


def best(rows: list[dict[str, Any]], model: str) -> Optional[dict[str, Any]]:
    done = [r for r in rows if r["model"] == model and r["status"] == "ok"]
    return max(done, key=lambda r: r["rate"]) if done else None


def verdict(row: Optional[dict[str, Any]], model: str, quick: bool = False) -> str:
    if row is None:
        return f"{model}: no setting completed"
    what, goal = GOALS[model]
    value = row["rate"] if what == "img/s" else row.get("mfu")
    reached = ("not judged (a tiny stand-in model)" if quick else f"{'met' if value >= goal else 'NOT met'}"
               if isinstance(value, float) else "unknown (no MFU)")
    shown = f"{goal:,.0f} img/s" if what == "img/s" else f"{goal:.0%} MFU"
    return (f"{model}: fastest {row['setting']}{' (eager stand-in)' if row['stand_in'] else ''} "
            f"{row['rate']:,.0f} {row['unit']}/s, MFU {_pct(row.get('mfu'))}; goal >= {shown}: {reached}")


def _pct(value: Any) -> str:
    return f"{value:.1%}" if isinstance(value, float) else "-"


def table(rows: list[dict[str, Any]], header: str, models: list[str], quick: bool = False) -> str:
    lines = [header, "", *(f"- {verdict(best(rows, model), model, quick)}" for model in models), "",
             "| setting | status | units/s | MFU (bf16 peak) | seconds |", "|---|---|---:|---:|---:|"]
    for row in rows:
        rate = f"{row['rate']:,.0f} {row['unit']}/s" if row["status"] == "ok" else "-"
        stand_in = " (eager stand-in)" if row["stand_in"] else ""
        lines.append(f"| {row['setting']}{stand_in} | {row['status']} | {rate} | {_pct(row.get('mfu'))} | "
                     f"{row['seconds']:.0f} |")
    notes = [f"- {row['setting']}: {row['error']}" for row in rows if row.get("error")]
    peaks = sorted({row["mfu_note"] for row in rows if row.get("mfu_note")})
    return "\n".join(lines + [""] + notes + ([f"- MFU peak: {'; '.join(peaks)}"] if peaks else []))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny models on the CPU, compile run eager (dry runs)")
    parser.add_argument("--models", default="resnet50,gpt_small", help="comma-separated: resnet50, gpt_small")
    parser.add_argument("--modes", default=",".join(COMPILE_MODES), help="compile modes searched, in this order")
    add_window_arguments(parser, "a setting")
    parser.add_argument("--cache-dir", type=Path, help="the text corpus's token cache (data.cache_dir)")
    add_output_arguments(parser, "every setting's figures")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    if not models or any(m not in GOALS for m in models):
        parser.error(f"--models: {args.models}; allowed: {', '.join(GOALS)}")
    modes = [m for m in args.modes.split(",") if m]
    if args.quick:
        modes = modes[:1]  # run eager in its stead: one stands for all
    window_defaults(args, args.quick)
    header = (f"The hand loop's ceiling (benchmarks/hand_loop.py: the framework's network, optimizer, precision "
              f"and kernels without the framework's per-step work): units/s of the median of {args.windows} windows "
              f"of {args.window} steps after {args.warmup} warm-up steps, device synchronized; a coordinate search, "
              f"eager batch and memory format first, then compile modes at the fastest.")
    rows: list[dict[str, Any]] = []

    def write() -> None:
        write_results(args.out, table(rows, header, models, args.quick), args.json,
                      {"quick": args.quick, "goals": GOALS, "rows": rows, "best": {m: best(rows, m) for m in models}})

    def add(row: dict[str, Any]) -> None:
        rows.append(row)
        print(f"{row['setting']}: " + (f"{row['rate']:,.0f} {row['unit']}/s, MFU {_pct(row.get('mfu'))}, "
                                       f"{row['seconds']:.0f} s" if row["status"] == "ok" else f"failed: {row['error']}"),
              flush=True)
        write()

    with tempfile.TemporaryDirectory(prefix="gpu_ceiling_") as tmp:
        runs_dir = args.runs_dir or Path(tmp)
        chosen: dict[str, tuple[int, Optional[bool]]] = {}
        for model in models:  # 1. eager: batch and memory format
            small, large = BATCHES[model][1 if args.quick else 0]
            convolutional = model == "resnet50"
            formats = [True, False] if convolutional else [None]
            for channels_last in formats:
                add(measure(model, small, channels_last, "off", args, runs_dir))
            fastest = best(rows, model)
            layout = fastest["channels_last"] if fastest else formats[0]
            add(measure(model, large, layout, "off", args, runs_dir))
            fastest = best(rows, model)
            chosen[model] = (fastest["batch"], fastest["channels_last"]) if fastest else (small, layout)
        # 2. compile modes at each model's fastest eager setting, the models alternating, GPT-2 small's
        # compile (fewer kernels to tune) before ResNet-50's, so that a stop in max-autotune's
        # autotuning of ResNet-50's convolutions leaves every other setting measured.
        for mode in modes:
            for model in sorted(models, key=lambda m: m != "gpt_small"):
                add(measure(model, *chosen[model], mode, args, runs_dir))
    print(table(rows, header, models, args.quick))
    return 0 if all(row["status"] == "ok" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
