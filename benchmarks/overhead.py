"""What the framework costs: its training step against a plain PyTorch loop doing the same work.

    .venv/bin/python benchmarks/overhead.py                 # ResNet-18, 32x32, batch 32, 60 steps, 3 repeats
    .venv/bin/python benchmarks/overhead.py --repeats 5 --out benchmarks/results/overhead_cpu.md
    .venv/bin/python benchmarks/overhead.py --repeats 1 --steps 20 --batch 8 --size 16   # smoke check

The project promises that the framework's overhead stays within 5% for ResNet-18 on CPU. Each
repeat runs two fresh interpreters, one after the other (which one goes first alternates):

- framework: `train.py` with synthetic data, ResNet-18, fp32, AdamW, on the CPU; its
  `summary.json` gives `throughput.samples_per_s` (trainer/callbacks/throughput.py).
- plain: this script with `--plain`: the project's hand-written loop (benchmarks/hand_loop.py) over
  the run the same overrides make, built by the framework's own phases: the same network (seeded
  the same way), the same batches (the synthetic module makes them on the device), the same
  optimizer (the plan's `OptimizerRecipe`) and schedule, and a plain loop: forward, fp32
  cross-entropy, zero_grad, backward, step, schedule step.

Both sides are timed the same way: 5 warm-up steps skipped, then windows of 10 consecutive steps,
samples/s per window, median window (the ThroughputMeter's own settings are read, not copied; the
plain side by hand_loop's `time_windows`, the device synchronized at each window's ends).

Gradient clipping and the lr schedule are switched off on purpose (`clipping=off
scheduler=constant`, with batch scaling of lr and weight decay off too), so both sides do the same
arithmetic. What the ratio measures is the framework's own cost: Lightning's loop and hooks, the
callbacks, logging, torchmetrics accuracy and the throughput meter itself (and the constant
schedule's step, which keeps every lr and exists so that the lr curves have one name). It does not price the
clipping or the schedule, which are work the plain loop would have to do as well.

Before reporting, the script checks that the two sides really match (lr and weight decay of every
parameter group, kernel, betas, eps, parameter count, torch threads, precision, memory format,
compile off, steps run, timing settings) and stops with one line naming the mismatch if they do not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SEED = 42
NUM_CLASSES = 10
BUDGET_PERCENT = 5.0
WHAT_IS_MEASURED = ("clipping and lr schedule off on both sides (same arithmetic): the difference is the "
                    "framework's own cost (Lightning loop and hooks, callbacks, logging, torchmetrics "
                    "accuracy, throughput meter)")


# --- the plain side ------------------------------------------------------------------------------

def plain_run(steps: int, batch: int, size: int) -> dict[str, Any]:
    """The hand-written loop over the framework's run; returns its throughput and what it ran, for the
    parent to compare."""
    import statistics as stats

    sys.path.insert(0, str(REPO / "benchmarks"))
    from hand_loop import prepare_hand_loop, time_windows

    from trainer.callbacks.throughput import ThroughputMeter

    meter = ThroughputMeter()
    warmup_steps, window_steps = meter.warmup_steps, meter.window_steps
    with tempfile.TemporaryDirectory(prefix="overhead-plain-") as tmp:
        loop = prepare_hand_loop(framework_overrides(steps, batch, size), Path(tmp) / "plain")
        seconds = time_windows(loop, steps, warmup_steps, window_steps, loop.device)
    window_rates = [loop.units_per_step * window_steps / s for s in seconds]
    facts = loop.facts()
    defaults = loop.optimizer.defaults if loop.optimizer is not None else {}
    decaying = facts["param_groups"][0]
    return {
        "samples_per_s": stats.median(window_rates) if window_rates else None,
        "windows": len(window_rates),
        "window_rates": window_rates,
        "warmup_steps": warmup_steps,
        "window_steps": window_steps,
        "steps": loop.steps_done,
        "final_loss": float(loop.last_loss) if loop.last_loss is not None else None,
        "parameters": facts["parameters"],
        "torch_threads": facts["torch_threads"],
        "lr": decaying["lr"],
        "weight_decay": decaying["weight_decay"],
        "betas": list(defaults.get("betas", ())),
        "eps": defaults.get("eps"),
        "decay_norm_and_bias": loop.run_state.spec.optimizer.decay_norm_and_bias,
        "precision": facts["precision"],
        "memory_format": facts["memory_format"],
        "optimizer_param_groups": facts["param_groups"],
    }


# --- the driver ----------------------------------------------------------------------------------

def framework_overrides(steps: int, batch: int, size: int) -> list[str]:
    return [
        "data=synthetic", f"data.shape=[3,{size},{size}]", f"data.batch_size={batch}",
        f"data.num_classes={NUM_CLASSES}", f"data.train_samples={batch * steps}", f"data.val_samples={batch}",
        f"data.test_samples={batch}", "model=resnet18", "precision=fp32", "clipping=off", "scheduler=constant",
        "checkpointing=off", "progress=off", "logger=csv", "trainer.max_epochs=1", "trainer.limit_val_batches=0",
        "trainer.num_sanity_val_steps=0", "optimizer.lr_scaling=none", "optimizer.wd_scaling=none",
        # The plain loop runs on the CPU with this seed; the framework must not pick a GPU or another seed.
        "trainer.accelerator=cpu", f"seed={SEED}",
    ]


def plain_command(steps: int, batch: int, size: int) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--plain", "--steps", str(steps), "--batch", str(batch),
            "--size", str(size)]


def _run_checked(command: list[str], what: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip())[-2000:]
        raise SystemExit(f"{what} failed (exit code {proc.returncode}):\n{tail}")
    return proc


def run_framework(overrides: list[str], folder: Path) -> dict[str, Any]:
    _run_checked([sys.executable, str(REPO / "train.py"), *overrides, f"hydra.run.dir={folder}"],
                 f"train.py {' '.join(overrides)}")
    try:
        summary = json.loads((folder / "summary.json").read_text())
        environment = json.loads((folder / "env.json").read_text())
    except (OSError, json.JSONDecodeError) as ex:
        raise SystemExit(f"train.py left no readable record in {folder}: {ex}") from None
    from omegaconf import OmegaConf

    resolved = OmegaConf.to_container(OmegaConf.load(folder / "config_resolved.yaml"))
    return {"summary": summary, "env": environment, "resolved": resolved}


def run_plain(steps: int, batch: int, size: int) -> dict[str, Any]:
    proc = _run_checked(plain_command(steps, batch, size), "the plain loop (benchmarks/overhead.py --plain)")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"the plain loop printed no result line:\n{proc.stdout[-2000:]}")
    return json.loads(lines[-1])


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def check_same_work(framework: dict[str, Any], plain: dict[str, Any]) -> None:
    """Stop with one line if the two sides did not do the same work."""
    summary, env, resolved = framework["summary"], framework["env"], framework["resolved"]
    problems = []
    if not _close(summary["hyperparameters"]["lr"], plain["lr"]):
        problems.append(f"lr: framework {summary['hyperparameters']['lr']} vs plain {plain['lr']}")
    if not _close(summary["hyperparameters"]["weight_decay"], plain["weight_decay"]):
        problems.append(f"weight_decay: framework {summary['hyperparameters']['weight_decay']} "
                        f"vs plain {plain['weight_decay']}")
    groups_fw, groups_plain = summary.get("optimizer_param_groups", []), plain["optimizer_param_groups"]
    if len(groups_fw) != len(groups_plain):
        problems.append(f"parameter groups: framework {len(groups_fw)} vs plain {len(groups_plain)}")
    for i, (fw, pl) in enumerate(zip(groups_fw, groups_plain)):
        for key in ("lr", "weight_decay"):
            if not _close(fw[key], pl[key]):
                problems.append(f"param group {i} {key}: framework {fw[key]} vs plain {pl[key]}")
        for key in ("tensors", "elements", "fused", "foreach"):
            if fw[key] != pl[key]:
                problems.append(f"param group {i} {key}: framework {fw[key]} vs plain {pl[key]}")
    optimizer = resolved.get("optimizer", {})
    if optimizer.get("name") != "adamw":
        problems.append(f"optimizer: framework {optimizer.get('name')} vs plain adamw")
    if list(optimizer.get("betas", [])) != plain["betas"] or not _close(optimizer.get("eps", -1.0), plain["eps"]):
        problems.append(f"betas/eps: framework {optimizer.get('betas')}/{optimizer.get('eps')} "
                        f"vs plain {plain['betas']}/{plain['eps']}")
    if summary["model"]["parameters"] != plain["parameters"]:
        problems.append(f"parameters: framework {summary['model']['parameters']} vs plain {plain['parameters']}")
    if summary["hyperparameters"]["precision"] != plain["precision"]:
        problems.append(f"precision: framework {summary['hyperparameters']['precision']} vs plain {plain['precision']}")
    channels_last = summary["derived"].get("precision.channels_last", {}).get("value")
    if channels_last != (plain["memory_format"] == "channels_last"):
        problems.append(f"memory format: framework channels_last {channels_last} vs plain {plain['memory_format']}")
    compiled = summary["derived"].get("compile", {}).get("value", "off")
    if compiled != "off":
        problems.append(f"compile: framework {compiled} vs plain eager")
    if summary["device"]["accelerator"] != "cpu":
        problems.append(f"device: framework {summary['device']['accelerator']} vs plain cpu")
    if env.get("torch_threads") != plain["torch_threads"]:
        problems.append(f"torch threads: framework {env.get('torch_threads')} vs plain {plain['torch_threads']}")
    if summary.get("steps") != plain["steps"]:
        problems.append(f"steps: framework {summary.get('steps')} vs plain {plain['steps']}")
    throughput = summary["throughput"]
    if (throughput["warmup_steps"], throughput["window_steps"]) != (plain["warmup_steps"], plain["window_steps"]):
        problems.append(f"timing: framework warm-up/window {throughput['warmup_steps']}/{throughput['window_steps']} "
                        f"vs plain {plain['warmup_steps']}/{plain['window_steps']}")
    if not throughput.get("windows") or not plain["windows"]:
        problems.append(f"no full timing window (framework {throughput.get('windows')}, plain {plain['windows']}): "
                        "raise --steps")
    if problems:
        raise SystemExit("the two sides did not do the same work: " + "; ".join(problems))


def machine_line() -> str:
    import torch

    from trainer.infra.fingerprint import cpu_name

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{cpu_name()} ({platform.machine()}), {os.cpu_count()} cores ({usable} usable), "
            f"{torch.get_num_threads()} torch threads, torch {torch.__version__}, Python {platform.python_version()}")


def command_line() -> str:
    executable = Path(sys.executable)
    try:
        executable = executable.relative_to(Path.cwd())
    except ValueError:
        pass
    return shlex.join([str(executable), *sys.argv])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="framework/plain pairs, interleaved (median reported)")
    parser.add_argument("--steps", type=int, default=60, help="training steps per run (5 warm-up, then 10-step windows)")
    parser.add_argument("--batch", type=int, default=32, help="batch size")
    parser.add_argument("--size", type=int, default=32, help="image height and width (3 channels)")
    parser.add_argument("--out", type=Path, help="also write the table to this Markdown file")
    parser.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.plain:
        print(json.dumps(plain_run(args.steps, args.batch, args.size)), flush=True)
        return

    from trainer.callbacks.throughput import ThroughputMeter

    meter = ThroughputMeter()
    least = meter.warmup_steps + 1 + meter.window_steps
    if args.steps < least:
        raise SystemExit(f"--steps {args.steps} is too few: {meter.warmup_steps} warm-up steps, one to start the "
                         f"clock and a {meter.window_steps}-step window need at least {least}")
    if args.repeats < 1 or args.batch < 1 or args.size < 1:
        raise SystemExit("--repeats, --batch and --size must be at least 1")

    overrides = framework_overrides(args.steps, args.batch, args.size)
    print(f"ResNet-18, {args.steps} steps of batch {args.batch} at 3x{args.size}x{args.size}, fp32, AdamW (foreach), "
          f"CPU; {args.repeats} repeat(s), interleaved", flush=True)
    print(f"measured: {WHAT_IS_MEASURED}", flush=True)
    rows: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory(prefix="overhead-") as tmp:
        for r in range(args.repeats):
            order = ("framework", "plain") if r % 2 == 0 else ("plain", "framework")
            results: dict[str, Any] = {}
            for side in order:
                if side == "framework":
                    results[side] = run_framework(overrides, Path(tmp) / f"framework-{r}")
                else:
                    results[side] = run_plain(args.steps, args.batch, args.size)
            check_same_work(results["framework"], results["plain"])
            fw_rate = float(results["framework"]["summary"]["throughput"]["samples_per_s"])
            plain_rate = float(results["plain"]["samples_per_s"])
            rows.append((fw_rate, plain_rate))
            ratio = fw_rate / plain_rate
            print(f"repeat {r + 1} ({order[0]} first): framework {fw_rate:,.1f} samples/s "
                  f"({results['framework']['summary']['throughput']['windows']} windows), "
                  f"plain {plain_rate:,.1f} samples/s ({results['plain']['windows']} windows), "
                  f"ratio {ratio:.3f}, overhead {(1 - ratio) * 100:+.1f}%", flush=True)
        lr = results["plain"]["lr"]
        weight_decay = results["plain"]["weight_decay"]

    ratios = [fw / pl for fw, pl in rows]
    median_ratio = statistics.median(ratios)
    overhead = (1 - median_ratio) * 100
    within = overhead <= BUDGET_PERCENT
    verdict = (f"overhead {overhead:+.1f}% (median of the per-repeat ratios): "
               + (f"within the {BUDGET_PERCENT:g}% budget" if within else f"OVER the {BUDGET_PERCENT:g}% budget"))

    table = ["| repeat | framework samples/s | plain samples/s | framework/plain | overhead |",
             "|---|---|---|---|---|"]
    for r, ((fw, pl), ratio) in enumerate(zip(rows, ratios)):
        table.append(f"| {r + 1} ({'framework' if r % 2 == 0 else 'plain'} first) | {fw:,.1f} | {pl:,.1f} "
                     f"| {ratio:.3f} | {(1 - ratio) * 100:+.1f}% |")
    table.append(f"| median | {statistics.median(fw for fw, _ in rows):,.1f} | "
                 f"{statistics.median(pl for _, pl in rows):,.1f} | {median_ratio:.3f} | {overhead:+.1f}% |")
    print("\n" + "\n".join(table))
    print(f"\n{verdict}")

    if args.out:
        document = [
            "# Framework overhead: train.py against a plain PyTorch loop", "",
            f"Machine: {machine_line()}.", "",
            f"Command: `{command_line()}`", "",
            f"ResNet-18 (`build_resnet`, seed {SEED}), synthetic 3x{args.size}x{args.size} images, batch {args.batch}, "
            f"{args.steps} steps per run, fp32, AdamW foreach (lr {lr:g}, weight decay {weight_decay:g}, no "
            f"batch scaling), CPU. Samples/s: median of 10-step windows after 5 warm-up steps, the same "
            f"method on both sides. {args.repeats} repeat(s), framework and plain interleaved, each in a fresh "
            f"interpreter.", "",
            f"What is measured: {WHAT_IS_MEASURED}.", "",
            f"Framework overrides: `{' '.join(overrides)}`", "",
            *table, "",
            f"**{verdict}**", "",
        ]
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(document))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
