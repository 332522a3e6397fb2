"""A few named `train.py` runs on one base, side by side: each run's figures from its summary.json,
its profile and its memory plan, or the one line that says why it did not run.

    python benchmarks/check_runs.py --base model=resnet50 data=synthetic ... \\
        --run default compile=default --run reduce_overhead compile=reduce_overhead \\
        --out DIR/runs.md --json DIR/runs.json --runs-dir DIR/runs

The prepared GPU check's steps that compare a few runs use it (benchmarks/gpu_check.sh:
reduce_overhead, fsdp, profile_memory, gpt; benchmarks/data_stage.py). The runs go one after the
other in the order given, each in its own interpreter (`--in-process`: in this one, for the CPU dry
run: no interpreter start per run, but process-wide settings carry over). The first run is the
reference of the `vs first` column (samples/s, or the task's unit, tokens/s, when it has one).

A run's status: completed (summary.json says so), measured (a profile=true run: it writes its
profile instead of a summary), refused (the framework stopped it with its one-line error, exit 2),
failed or timed out. `--may-refuse NAME`: that run's refusal is its result (the step still passes);
any other run that is not completed or measured makes the exit status 1. The outputs are rewritten
after every run, so a step stopped half-way keeps the runs it finished.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from practices import merged  # noqa: E402 - one value per key, the last given winning

REPO = Path(__file__).resolve().parent.parent
MIB = 2**20

#: The plan's settings shown by default (summary.json's `derived`): what makes the runs differ.
DEFAULT_SHOW = ("precision", "compile")


def run_train(overrides: list[str], folder: Path, timeout: Optional[float], in_process: bool) -> tuple[str, str]:
    """Run train.py; (how it ended: ok, refused, failed or timed out; the error line or stderr's tail)."""
    folder.mkdir(parents=True, exist_ok=True)
    if in_process:
        return _in_process(overrides, folder)
    try:
        proc = subprocess.run([sys.executable, str(REPO / "train.py"), *overrides, f"hydra.run.dir={folder}"],
                              cwd=REPO, capture_output=True, text=True, timeout=timeout,
                              env={k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"})
    except subprocess.TimeoutExpired:
        return "timed out", f"no result within {timeout:g} s"
    (folder / "stderr.log").write_text(proc.stderr)
    return _ending(proc.returncode, proc.stderr)


def _ending(code: int, stderr: str) -> tuple[str, str]:
    lines = [line for line in stderr.splitlines() if line.strip()]
    refusal = next((line for line in reversed(lines) if line.startswith("error: ")), None)
    if code == 0:
        return "ok", ""
    if code == 2 and refusal:
        return "refused", refusal[len("error: "):]
    return "failed", (refusal or " / ".join(lines[-3:]))[-600:]


def _in_process(overrides: list[str], folder: Path) -> tuple[str, str]:
    """The run composed as train.py composes it, in this interpreter; stderr captured for its error line."""
    from hydra import compose, initialize_config_dir

    from trainer.configuration.hydra_setup import install as install_hydra_setup
    from trainer.run import run as train_run

    install_hydra_setup()
    captured = io.StringIO()
    code = 0
    try:
        with contextlib.redirect_stderr(captured), \
                initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose(config_name="train", overrides=list(overrides), return_hydra_config=True)
            choices = {k: str(v) for k, v in cfg.hydra.runtime.choices.items()
                       if not k.startswith("hydra") and v is not None}
            train_run(cfg, run_dir=folder, group_choices=choices, overrides=list(overrides))
    except SystemExit as ex:
        code = ex.code if isinstance(ex.code, int) else 1
    except Exception as ex:  # noqa: BLE001 - one failed run is one failed row
        code = 1
        captured.write(f"\n{type(ex).__name__}: {ex}\n")
    (folder / "stderr.log").write_text(captured.getvalue())
    return _ending(code, captured.getvalue())


def _value(derived: dict[str, Any], key: str) -> Any:
    entry = derived.get(key)
    return entry.get("value") if isinstance(entry, dict) else None


def figures(name: str, overrides: list[str], folder: Path, ending: str, error: str, seconds: float,
            show: Sequence[str]) -> dict[str, Any]:
    """One run's row: what its summary.json, profile/profile.json and memory plan say."""
    row: dict[str, Any] = {"name": name, "overrides": overrides, "folder": str(folder), "seconds": round(seconds, 1),
                           "status": ending, "error": error or None}
    summary_file = folder / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else None
    if summary is not None:
        throughput = summary.get("throughput") or {}
        unit = throughput.get("unit") or "samples"
        derived = summary.get("derived") or {}
        peak = (summary.get("peak_memory") or {}).get("bytes")
        row.update(
            status=summary.get("status", ending) if ending == "ok" else ending,
            device=(summary.get("device") or {}).get("name"), steps=summary.get("steps"),
            samples_per_s=throughput.get("samples_per_s"), unit=unit,
            units_per_s=throughput.get(f"{unit}_per_s", throughput.get("samples_per_s")),
            windows=throughput.get("windows"), mfu=throughput.get("mfu"), mfu_note=throughput.get("mfu_note"),
            peak_mib=peak / MIB if isinstance(peak, (int, float)) else None,
            settings={key: _value(derived, key) for key in show},
            device_utilisation=summary.get("device_utilisation"),
            memory_plan=summary.get("memory_plan"))
        if summary.get("error") and not row["error"]:
            row["error"] = str(summary["error"])[:600]
    profile = folder / "profile" / "profile.json"
    if profile.is_file():
        record = json.loads(profile.read_text())
        row["profile"] = {"step_ms": record.get("step_ms"), "steps": record.get("steps"),
                          "on_device": record.get("on_device"), "nvtx": record.get("nvtx"),
                          "memory_bound_share": record.get("memory_bound_share"),
                          "categories": [{"category": c["category"], "share": c["share"]}
                                         for c in record.get("categories", [])[:6]],
                          "unusual": record.get("unusual", [])}
        if ending == "ok" and summary is None:
            row["status"] = "measured"
    elif ending == "ok" and summary is None:
        row["status"] = "failed"
        row["error"] = "exited 0 without summary.json or a profile"
    return row


def _fmt(value: Any, pattern: str) -> str:
    return pattern.format(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def utilisation_cell(row: dict[str, Any]) -> str:
    util = row.get("device_utilisation") or {}
    if util.get("sampled"):
        return f"{util['gpu_util_mean']:.0f}%"
    return "-"


def table(rows: list[dict[str, Any]], show: Sequence[str], header: str) -> str:
    unit = next((r["unit"] for r in rows if r.get("unit")), "samples")
    first = rows[0].get("units_per_s") if rows else None
    lines = [header, "", f"| run | status | {unit}/s | vs first | MFU | peak MiB | GPU util | "
             + "".join(f"{key} | " for key in show) + "seconds |",
             "|---|---|---:|---:|---:|---:|---:|" + "---|" * len(show) + "---:|"]
    for row in rows:
        rate = row.get("units_per_s")
        ratio = _fmt(rate / first, "{:.2f}x") if rate and first else "-"
        settings = row.get("settings") or {}
        lines.append(f"| {row['name']} | {row['status']} | {_fmt(rate, '{:,.0f}')} | {ratio} | "
                     f"{_fmt(row.get('mfu'), '{:.1%}')} | {_fmt(row.get('peak_mib'), '{:,.0f}')} | "
                     f"{utilisation_cell(row)} | " + "".join(f"{settings.get(key, '-')} | " for key in show)
                     + f"{row['seconds']:.0f} |")
    notes = [f"- {row['name']}: {row['status']}: {row['error']}" for row in rows if row.get("error")]
    for row in rows:
        util = row.get("device_utilisation") or {}
        if util and not util.get("sampled") and util.get("why"):
            notes.append(f"- {row['name']}: GPU utilisation {util['why']}")
            break
    return "\n".join(lines + ([""] + notes if notes else []))


def compare(runs: list[tuple[str, list[str]]], base: list[str], runs_dir: Path, out: Optional[Path],
            json_out: Optional[Path], timeout: Optional[float] = None, in_process: bool = False,
            show: Sequence[str] = DEFAULT_SHOW, header: str = "", extra: Optional[dict[str, Any]] = None,
            ) -> list[dict[str, Any]]:
    """Run each (name, overrides) on `base`; rewrite the outputs after each; return the rows."""
    rows: list[dict[str, Any]] = []
    header = header or f"Runs of `train.py` on the base `{' '.join(base)}`, one after the other."

    def write() -> None:
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(table(rows, show, header) + "\n")
        if json_out is not None:
            json_out.parent.mkdir(parents=True, exist_ok=True)
            json_out.write_text(json.dumps({"base": base, "in_process": in_process, **(extra or {}), "rows": rows},
                                           indent=2, default=str) + "\n")

    for name, overrides in runs:
        folder = runs_dir / name
        full = merged(base, overrides)
        began = time.perf_counter()
        ending, error = run_train(full, folder, timeout, in_process)
        rows.append(figures(name, full, folder, ending, error, time.perf_counter() - began, show))
        print(f"{name}: {rows[-1]['status']} in {rows[-1]['seconds']:.0f} s"
              + (f", {rows[-1]['units_per_s']:,.0f} {rows[-1]['unit']}/s" if rows[-1].get("units_per_s") else "")
              + (f": {error}" if error else ""), flush=True)
        write()
    if rows:
        print(table(rows, show, header))
    return rows


def all_ok(rows: list[dict[str, Any]], may_refuse: Sequence[str] = ()) -> bool:
    return all(r["status"] in ("completed", "measured") or (r["status"] == "refused" and r["name"] in may_refuse)
               for r in rows)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", nargs="*", default=[], help="overrides every run starts from")
    parser.add_argument("--base-preset", choices=("gpu",),
                        help="start from benchmarks/practices.py's GPU base (ResNet-50, 224 px, device-made images, "
                             "bf16, TF32, channels_last, fused SGD, no compile, 16 steps); --base adds to it")
    parser.add_argument("--run", nargs=2, action="append", default=[], metavar=("NAME", "OVERRIDES"),
                        help="a run: its name and its overrides in one shell-quoted string (repeat)")
    parser.add_argument("--runs-dir", type=Path, required=True, help="the run folders: RUNS_DIR/NAME")
    parser.add_argument("--out", type=Path, help="the Markdown table")
    parser.add_argument("--json", type=Path, help="every run's figures")
    parser.add_argument("--show", default=",".join(DEFAULT_SHOW),
                        help="the plan's settings (summary.json's derived keys) shown as columns, comma-separated")
    parser.add_argument("--may-refuse", action="append", default=[], metavar="NAME",
                        help="a run whose refusal by the framework is its result, not a failure")
    parser.add_argument("--run-timeout", type=float, help="seconds one run may take")
    parser.add_argument("--in-process", action="store_true", help="every run in this interpreter (dry runs)")
    parser.add_argument("--title", default="", help="the table's first line")
    args = parser.parse_args(argv)
    if not args.run:
        parser.error("give at least one --run NAME OVERRIDES")
    show = [key for key in args.show.split(",") if key]
    runs = [(name, shlex.split(overrides)) for name, overrides in args.run]
    base = list(args.base)
    if args.base_preset == "gpu":
        sys.path.insert(0, str(REPO / "benchmarks"))
        from practices import GPU_BASE

        base = merged(GPU_BASE, base)
    rows = compare(runs, base, args.runs_dir, args.out, args.json, args.run_timeout, args.in_process,
                   show, args.title)
    return 0 if all_ok(rows, args.may_refuse) else 1


if __name__ == "__main__":
    sys.exit(main())
