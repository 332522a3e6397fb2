"""Measure what each best practice buys on this machine: samples/s with and without, same session.

    .venv/bin/python benchmarks/practices.py                 # CPU-sized defaults, prints a Markdown table
    .venv/bin/python benchmarks/practices.py --repeats 3 --out benchmarks/results/practices_cpu.md
    .venv/bin/python benchmarks/practices.py --preset gpu --json practices.json   # ResNet-50 / 224 px on one GPU

Each row runs `train.py` twice (practice on, practice off) on the same base config, interleaved
when repeated, and reports the median of the runs' `throughput.samples_per_s` (itself the median
of timed windows after warm-up, device synchronized), MFU where the device's peak is known, and
peak memory from summary.json. A row's switch replaces the base's value of the same key; a
configuration two rows share (the base itself, usually) runs once per repeat. A run that fails or
outlives `--run-timeout` leaves its row marked failed, the other rows still run, and the exit
status is 1. The Markdown and JSON outputs are rewritten after every row, so a run cut short keeps
the rows it finished.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence, Union

REPO = Path(__file__).resolve().parent.parent

# The compute-bound base: a small CNN on device-generated images, so the input pipeline does not
# hide what the switches change. No checkpoints, no validation cost worth measuring.
BASE = ["data=synthetic", "data.shape=[3,32,32]", "data.train_samples=4096", "data.batch_size=64",
        "trainer.max_epochs=1", "trainer.limit_val_batches=1", "trainer.num_sanity_val_steps=0",
        "checkpointing=off", "progress=off", "logger=csv"]

PRACTICES = [
    ("mixed precision (bf16 autocast)", "precision=bf16_mixed", "precision=fp32"),
    ("fused optimizer kernel", "optimizer.implementation=fused", "optimizer.implementation=foreach"),
    ("foreach vs per-tensor loop", "optimizer.implementation=foreach", "optimizer.implementation=for_loop"),
    ("channels_last memory format", "precision.channels_last=true", "precision.channels_last=false"),
    ("95th-percentile clipping (cost)", "clipping=percentile", "clipping=off"),
    ("activation checkpointing (cost)", "model.activation_checkpointing=[features.4,features.5]",
     "model.activation_checkpointing=[]"),
    ("non-finite guard (cost)", "nonfinite=skip", "nonfinite=off"),
    # The two defaults that decide from each step's numbers, together: on a GPU each read of those on
    # the host would stall the queue, so they decide on the device; this prices what that costs.
    ("clipping + non-finite guard, decided on the device (cost)", ["clipping=percentile", "nonfinite=skip"],
     ["clipping=off", "nonfinite=off"]),
]

# The GPU base: ResNet-50 at 224 px on device-made images (compute only, no input pipeline), every
# practice on but compile, no validation or test pass (a compiled model would compile again for
# eval). 16 steps: the meter's 5 warm-up steps (cuDNN autotuning, compilation), then one timed
# window of 10. Each row switches one thing away from this base.
GPU_BASE = ["model=resnet50", "data=synthetic", "data.shape=[3,224,224]", "data.num_classes=1000",
            "data.batch_size=128", "data.train_samples=2048", "data.val_samples=128", "data.test_samples=128",
            "optimizer=sgd", "trainer.max_epochs=1", "trainer.limit_val_batches=0", "trainer.limit_test_batches=0",
            "trainer.num_sanity_val_steps=0", "checkpointing=off", "progress=off", "logger=csv",
            "precision=bf16_mixed", "precision.tf32=true", "precision.channels_last=true",
            "optimizer.implementation=fused", "compile=off"]

Switch = Union[str, Sequence[str]]

#: The least on/off ratio a row must reach (what the practice may cost), where the row has one.
BUDGETS = {"clipping + non-finite guard, decided on the device (cost; budget 2%)": 0.98}

GPU_PRACTICES: list[tuple[str, Switch, Switch]] = [
    # First: the defaults' per-step cost, which the framework promises stays within 2% of the step.
    ("clipping + non-finite guard, decided on the device (cost; budget 2%)", ["clipping=percentile", "nonfinite=skip"],
     ["clipping=off", "nonfinite=off"]),
    ("mixed precision (bf16 autocast vs fp32 with TF32)", "precision=bf16_mixed", "precision=fp32"),
    ("TF32 tensor cores (fp32)", ["precision=fp32", "precision.tf32=true"], ["precision=fp32", "precision.tf32=false"]),
    ("channels_last memory format", "precision.channels_last=true", "precision.channels_last=false"),
    ("fused optimizer kernel vs foreach", "optimizer.implementation=fused", "optimizer.implementation=foreach"),
    # Last: the slowest run (compilation happens inside the warm-up steps).
    ("torch.compile (compile=auto: default mode on CUDA)", "compile=auto", "compile=off"),
]

PRESETS = {"cpu": (BASE, PRACTICES), "gpu": (GPU_BASE, GPU_PRACTICES)}


def merged(*override_lists: Sequence[str]) -> list[str]:
    """The overrides with one value per key, the last given winning: a row's switch replaces the
    base's value of the same key instead of relying on Hydra's handling of a repeated key."""
    by_key: dict[str, str] = {}
    for overrides in override_lists:
        for override in overrides:
            key = override.split("=", 1)[0].lstrip("+~")
            by_key.pop(key, None)
            by_key[key] = override
    return list(by_key.values())


def _as_list(switch: Switch) -> list[str]:
    return [switch] if isinstance(switch, str) else list(switch)


def run(overrides: list[str], folder: Path, timeout: float | None = None, in_process: bool = False) -> dict | None:
    """summary.json of one `train.py` run, or None (said on stderr) when it failed or timed out."""
    if in_process:
        return _run_in_process(overrides, folder)
    try:
        proc = subprocess.run([sys.executable, str(REPO / "train.py"), *overrides, f"hydra.run.dir={folder}"],
                              cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"train.py {' '.join(overrides)}: no result within {timeout:g} s", file=sys.stderr, flush=True)
        return None
    if proc.returncode != 0:
        print(f"train.py {' '.join(overrides)} failed:\n{proc.stderr[-2000:]}", file=sys.stderr, flush=True)
        return None
    return json.loads((folder / "summary.json").read_text())


def _run_in_process(overrides: list[str], folder: Path) -> dict | None:
    """The run composed as `train.py` composes it, in this interpreter: no interpreter start and
    import per run, for smoke tests (benchmarks/gpu_check.sh --dry-run). Process-wide settings (cuDNN
    autotuning, TF32) carry over from one run to the next, so these numbers are not comparable."""
    from hydra import compose, initialize_config_dir

    from trainer.configuration.hydra_setup import install as install_hydra_setup
    from trainer.run import run as train_run

    install_hydra_setup()
    try:
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose(config_name="train", overrides=list(overrides), return_hydra_config=True)
            choices = {k: str(v) for k, v in cfg.hydra.runtime.choices.items()
                       if not k.startswith("hydra") and v is not None}
            train_run(cfg, run_dir=folder, group_choices=choices, overrides=list(overrides))
    except (Exception, SystemExit) as ex:  # noqa: BLE001 - one failed run is one failed row
        print(f"train.py {' '.join(overrides)} failed: {type(ex).__name__}: {ex}", file=sys.stderr, flush=True)
        return None
    summary = folder / "summary.json"
    return json.loads(summary.read_text()) if summary.exists() else None


def _median(values: list[Any]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _fmt(value: float | None, pattern: str) -> str:
    return pattern.format(value) if value is not None else "-"


def _side(summaries: list[dict | None], switch: list[str], folders: list[str]) -> dict[str, Any]:
    ok = [s for s in summaries if s is not None and s.get("status") == "completed"]
    return {"switch": switch, "runs": folders, "completed": len(ok), "failed": len(summaries) - len(ok),
            "samples_per_s": _median([s["throughput"].get("samples_per_s") for s in ok]),
            "mfu": _median([s["throughput"].get("mfu") for s in ok]),
            "peak_mib": _median([s["peak_memory"]["bytes"] / 2**20 for s in ok]),
            "precision": ok[0]["hyperparameters"]["precision"] if ok else None,
            "compile": (ok[0]["derived"].get("compile") or {}).get("value") if ok else None}


def _paired_ratios(on: list[tuple[dict | None, str]], off: list[tuple[dict | None, str]]) -> list[float]:
    """on/off of each repeat (the two runs made next to each other): their spread is the noise."""
    ratios = []
    for (a, _), (b, _) in zip(on, off):
        rates = [s["throughput"].get("samples_per_s") if s and s.get("status") == "completed" else None for s in (a, b)]
        if rates[0] and rates[1]:
            ratios.append(rates[0] / rates[1])
    return ratios


def _ratio_cell(row: dict[str, Any]) -> str:
    if row["status"] != "ok":
        return "failed"
    text = _fmt(row["ratio"], "{:.2f}x")
    spread = row.get("repeat_ratios") or []
    if len(spread) > 1:
        text += f" ({min(spread):.2f}-{max(spread):.2f})"
    if row.get("budget") is not None:
        text += f", {'within' if row['within_budget'] else 'OVER'} the budget >= {row['budget']:.2f}x"
    return text


def _table(base: list[str], repeats: int, device: str, rows: list[dict[str, Any]]) -> str:
    lines = [f"Machine: {device or 'unknown'} ({platform.machine()}), torch run via train.py; base: "
             f"`{' '.join(base)}`; median of {repeats} run(s) per setting; on/off: the ratio of the medians, in brackets the "
             "range of the per-repeat ratios (on and off run next to each other).", "",
             "| practice | switch (on vs off) | on samples/s | off samples/s | on/off | MFU on / off | peak MiB on / off |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        on, off = row["on"], row["off"]
        lines.append(
            f"| {row['practice']} | `{' '.join(on['switch'])}` vs `{' '.join(off['switch'])}` "
            f"| {_fmt(on['samples_per_s'], '{:,.0f}')} | {_fmt(off['samples_per_s'], '{:,.0f}')} "
            f"| {_ratio_cell(row)} "
            f"| {_fmt(on['mfu'], '{:.1%}')} / {_fmt(off['mfu'], '{:.1%}')} "
            f"| {_fmt(on['peak_mib'], '{:,.0f}')} / {_fmt(off['peak_mib'], '{:,.0f}')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                        help="base config and rows: cpu (small CNN, 32 px) or gpu (ResNet-50, 224 px)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per setting (median reported)")
    parser.add_argument("--base", nargs="*", default=[], help="overrides added to (or replacing keys of) the base")
    parser.add_argument("--out", type=Path, help="also write the table to this Markdown file")
    parser.add_argument("--json", type=Path, help="also write every row's figures to this JSON file")
    parser.add_argument("--only", nargs="*", default=[], help="rows whose name contains one of these words")
    parser.add_argument("--skip", nargs="*", default=[],
                        help="leave out the rows whose name contains one of these words (after --only)")
    parser.add_argument("--runs-dir", type=Path, help="keep the run folders here (default: a temporary folder)")
    parser.add_argument("--run-timeout", type=float, help="seconds one run may take before its row counts as failed")
    parser.add_argument("--in-process", action="store_true",
                        help="run every config in this interpreter (smoke tests only: numbers not comparable)")
    args = parser.parse_args()
    preset_base, practices = PRESETS[args.preset]
    base = merged(preset_base, args.base)
    chosen = [p for p in practices if (not args.only or any(word in p[0] for word in args.only))
              and not any(word in p[0] for word in args.skip)]
    rows: list[dict[str, Any]] = []
    device = ""
    done: dict[tuple[tuple[str, ...], int], tuple[dict | None, str]] = {}

    def measure(overrides: list[str], repeat: int, runs: Path) -> tuple[dict | None, str]:
        nonlocal device
        key = (tuple(sorted(overrides)), repeat)  # one value per key: the order carries no meaning
        if key not in done:
            folder = runs / f"run{len(done):02d}"
            summary = run(overrides, folder, args.run_timeout, args.in_process)
            done[key] = (summary, str(folder))
            if summary is not None and not device:
                device = summary["device"]["name"]
        return done[key]

    def write(table: str) -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(table + "\n")
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"preset": args.preset, "device": device, "machine": platform.machine(),
                                             "base": base, "repeats": args.repeats, "rows": rows}, indent=2) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        runs = args.runs_dir or Path(tmp)
        for name, on_switch, off_switch in chosen:
            sides = {"on": _as_list(on_switch), "off": _as_list(off_switch)}
            results: dict[str, list[tuple[dict | None, str]]] = {"on": [], "off": []}
            for r in range(args.repeats):
                for label in ("on", "off") if r % 2 == 0 else ("off", "on"):
                    results[label].append(measure(merged(base, sides[label]), r, runs))
            on, off = (_side([s for s, _ in results[label]], sides[label], [f for _, f in results[label]])
                       for label in ("on", "off"))
            ok = bool(not on["failed"] and not off["failed"] and on["samples_per_s"] and off["samples_per_s"])
            ratio = on["samples_per_s"] / off["samples_per_s"] if ok else None
            budget = BUDGETS.get(name)
            rows.append({"practice": name, "status": "ok" if ok else "failed", "on": on, "off": off,
                         "ratio": ratio, "repeat_ratios": _paired_ratios(results["on"], results["off"]),
                         "budget": budget, "within_budget": None if budget is None or ratio is None else ratio >= budget})
            table = _table(base, args.repeats, device, rows)
            print(table.splitlines()[-1], flush=True)
            write(table)
    table = _table(base, args.repeats, device, rows)
    print("\n" + table)
    write(table)
    if any(row["status"] != "ok" for row in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
