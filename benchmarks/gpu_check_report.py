"""The parts of benchmarks/gpu_check.sh that read and write records: the environment record, each
step's key figures (one Markdown line each), the ladder's img/s and MFU per stage, and summary.md.

    python benchmarks/gpu_check_report.py environment OUT.json [--require-cuda]
    python benchmarks/gpu_check_report.py figures STEP STEP_DIR        # key figures of one step
    python benchmarks/gpu_check_report.py ladder SWEEP_DIR OUT_DIR [--check]
    python benchmarks/gpu_check_report.py summary RESULTS_DIR

Only `environment` imports torch; the others read files, so they cost no more than an interpreter
start and work on whatever a step left behind, also when it failed or was stopped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import math
import platform
import sys
import xml.etree.ElementTree as ElementTree
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from trainer.measure.comparison import comparison_rows, load_jobs  # noqa: E402 - after the repo is on the path


# -- environment ---------------------------------------------------------------------------------

def environment(out: Path, require_cuda: bool) -> int:
    """Versions and devices, as torch sees them; the framework's own fingerprint beside them."""
    import torch

    record: dict[str, Any] = {
        "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "machine": platform.machine(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "devices": [],
    }
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            record["devices"].append({
                "name": props.name, "capability": f"{props.major}.{props.minor}",
                "memory_gib": round(props.total_memory / 2**30, 1), "multiprocessors": props.multi_processor_count,
                "bf16": torch.cuda.is_bf16_supported(including_emulation=False)})
    try:
        from trainer.infra.fingerprint import fingerprint

        record["fingerprint"] = fingerprint()
    except Exception as ex:  # noqa: BLE001 - the versions above are the record's core
        record["fingerprint_error"] = f"{type(ex).__name__}: {ex}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(_environment_line(record))
    if require_cuda and not record["cuda_available"]:
        print("no CUDA device visible to torch: the GPU check needs one (benchmarks/gpu_check.sh --dry-run runs "
              "on the CPU)", file=sys.stderr)
        return 1
    return 0


def _environment_line(record: dict[str, Any]) -> str:
    devices = record.get("devices") or []
    if devices:
        d = devices[0]
        device = (f"{len(devices)} x {d['name']}" if len(devices) > 1 else d["name"]) + \
            f" (sm {d['capability']}, {d['memory_gib']} GiB, {d['multiprocessors']} SMs, native bf16 {d['bf16']})"
    else:
        device = "no CUDA device (CPU only)"
    return (f"{device}; torch {record.get('torch')}, CUDA {record.get('torch_cuda')}, cuDNN {record.get('cudnn')}, "
            f"Python {record.get('python')}")


# -- key figures of each step -------------------------------------------------------------------

def figures_environment(folder: Path) -> list[str]:
    return [_environment_line(json.loads((folder / "environment.json").read_text()))]


def figures_gpu_tests(folder: Path) -> list[str]:
    root = ElementTree.parse(folder / "junit.xml").getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    seconds = sum(float(s.get("time", 0)) for s in suites)
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    lines = [f"{passed} passed, {counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped "
             f"of {counts['tests']} ({seconds:.1f} s)"]
    reasons: set[str] = set()
    for case in root.iter("testcase"):
        for outcome in ("failure", "error"):
            element = case.find(outcome)
            if element is not None:
                message = (element.get("message") or "").strip().splitlines()
                lines.append(f"{outcome}: {case.get('classname')}.{case.get('name')}: {message[0][:160] if message else ''}")
        skipped = case.find("skipped")
        if skipped is not None:
            reasons.add((skipped.get("message") or "").strip()[:200])
    lines += [f"skipped because: {reason}" for reason in sorted(reasons)]
    return lines


def figures_practices(folder: Path) -> list[str]:
    record = json.loads((folder / "practices.json").read_text())
    rows = record["rows"]
    ratios = ", ".join(f"{row['practice'].split(' (')[0]} {_fmt(row['ratio'], '{:.2f}x')}" for row in rows)
    lines = [f"{sum(r['status'] == 'ok' for r in rows)}/{len(rows)} rows ok on {record.get('device') or '?'} "
             f"(on/off): {ratios}"]
    for row in rows:
        on, off = row["on"], row["off"]
        if row["status"] != "ok":
            lines.append(f"{row['practice']}: failed")
            continue
        mfu = f"; MFU {_pct(on['mfu'])} vs {_pct(off['mfu'])}" if on.get("mfu") or off.get("mfu") else ""
        lines.append(f"{row['practice']}: {row['ratio']:.2f}x ({_num(on['samples_per_s'])} vs "
                     f"{_num(off['samples_per_s'])} samples/s{mfu})")
    return lines


def figures_step_cost(folder: Path) -> list[str]:
    """The defaults' per-step cost (clipping + the non-finite guard, decided on the device): the
    on/off ratio against its budget first, then each repeat's ratio and the rates."""
    record = json.loads((folder / "practices.json").read_text())
    rows = record["rows"]
    if not rows:
        raise ValueError("practices.json has no row")
    row = rows[0]
    on, off = row["on"], row["off"]
    if row["status"] != "ok":
        return [f"{row['practice']}: failed ({on['failed']} of the on runs, {off['failed']} of the off runs)"]
    spread = row.get("repeat_ratios") or []
    verdict = ("no budget" if row.get("budget") is None else
               f"{'within' if row['within_budget'] else 'OVER'} the budget (on/off >= {row['budget']:.2f})")
    return [f"the defaults' step cost (clipping + non-finite guard on the device): on/off {row['ratio']:.3f}x, "
            f"{verdict}; {_num(on['samples_per_s'])} vs {_num(off['samples_per_s'])} samples/s on "
            f"{record.get('device') or '?'}",
            f"per repeat (on and off next to each other): {', '.join(f'{r:.3f}x' for r in spread) or '-'} "
            f"({record.get('repeats')} repeats)",
            f"MFU on {_pct(on.get('mfu'))}, off {_pct(off.get('mfu'))}; peak MiB on {_num(on.get('peak_mib'))}, "
            f"off {_num(off.get('peak_mib'))}"]


def figures_ladder(folder: Path) -> list[str]:
    record = json.loads((folder / "ladder.json").read_text())
    stages = record["stages"]
    first, last = (stages[0], stages[-1]) if stages else ({}, {})
    lines = [f"{record['completed']}/{len(stages)} stages completed on {record.get('device') or '?'}: "
             f"{first.get('stage', '-')} {_num(first.get('samples_per_s'))} -> {last.get('stage', '-')} "
             f"{_num(last.get('samples_per_s'))} img/s ({_fmt(last.get('speedup'), '{:.2f}x')}), "
             f"MFU {_pct(first.get('mfu'))} -> {_pct(last.get('mfu'))}"]
    for stage in record["stages"]:
        if stage["status"] != "completed":
            lines.append(f"{stage['stage']}: {stage['status']}")
            continue
        speedup = f", {stage['speedup']:.2f}x" if stage.get("speedup") else ""
        lines.append(f"{stage['stage']}: {_num(stage['samples_per_s'])} img/s{speedup}, MFU {_pct(stage['mfu'])}")
    return lines


def _bullets(report: Path) -> list[str]:
    """A benchmark report's key lines: its Markdown list items, without the marker."""
    return [line[2:] for line in report.read_text().splitlines() if line.startswith("- ")]


def figures_input_pipeline(folder: Path) -> list[str]:
    """The benchmark's verdict lines and its device-side line (benchmarks/input_pipeline.py)."""
    return _bullets(folder / "input_pipeline.md")


def figures_progressive_resize(folder: Path) -> list[str]:
    """The step's samples/s at each size of the default schedule, then the schedule's expected time
    against all-224 (benchmarks/progressive_resize.py)."""
    lines = _bullets(folder / "progressive_resize.md")
    if not lines:
        raise ValueError("progressive_resize.md has no figures")
    return lines


def figures_batch_study(folder: Path) -> list[str]:
    """The study's verdict lines by the rule, then each arm's seeds (benchmarks/batch_scaling_gpu.py)."""
    text = (folder / "batch_scaling_gpu.md").read_text()
    verdicts = text.split("## Verdicts", 1)[1].split("## Runs", 1)[0]
    jobs = json.loads((folder / "batch_scaling_gpu_jobs.json").read_text())
    seeds = sorted({j["seed"] for j in jobs})
    return [f"{len(jobs)} runs, seeds {', '.join(map(str, seeds))}, on {jobs[0]['machine'] if jobs else '?'}",
            *(line[2:] for line in verdicts.splitlines() if line.startswith("- "))]


def figures_encoder_kernels(folder: Path) -> list[str]:
    """Each variant's paired ratio against the fused QKV per network and length, then each
    compile.dynamic setting's frames and cost (benchmarks/encoder_kernels.py's encoder_kernels.json)."""
    record = json.loads((folder / "encoder_kernels.json").read_text())
    lines = [f"{case['shape']} at {case['length']}: {variant} {statistics.median(ratios):.2f}x the fused step's time"
             for case in record["cases"] for variant, ratios in case["ratios"].items() if variant != "fused"]
    for row in record["dynamic"]["rows"]:
        train, val = row["train"], row["val"]
        lines.append(f"compile.dynamic {row['dynamic']}: frames {train['frames_compiled']} / {val['frames_compiled']}"
                     f" (train / val), compile {train['compile_s']:.1f} / {val['compile_s']:.1f} s, epoch + val "
                     f"{train['total_s'] + val['total_s']:.1f} s")
    if not lines:
        raise ValueError("encoder_kernels.json has no figures")
    return lines


def figures_serve_text(folder: Path) -> list[str]:
    """Each text model's served figures at every concurrency (all lengths mixed for the encoder) and its
    server's memory, from trainer/deploy/load_text.py's deploy_load.json."""
    lines = []
    for name in ("encoder", "gpt"):
        report = json.loads((folder / name / "deploy_load.json").read_text())
        for row in report["rows"]:
            f = row["figures"]
            if report["generating"]:
                lines.append(f"gpt at concurrency {row['concurrency']}: {_num(f['tokens_per_s'])} tokens/s, time to first "
                             f"token P50 {f['ttft_p50_ms']:.1f} ms (P99 {f['ttft_p99_ms']:.1f}), "
                             f"{f['tpot_p50_ms']:.2f} ms per token")
            elif row["bin"] == "all":
                lines.append(f"encoder at concurrency {row['concurrency']}: {_num(row['qps'])} QPS, P50 "
                             f"{row['p50_ms']:.1f} ms, P99 {row['p99_ms']:.1f} ms, mean batch {f['mean_batch']:.1f}")
        total = report["memory_mib"]["total"]
        lines.append(f"{name} server memory: RSS {_num(total['rss_mib'])} MiB, PSS {_num(total['pss_mib'])} MiB")
    return lines


def _runs(folder: Path, name: str = "runs.json") -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """benchmarks/check_runs.py's record and its rows, at least one."""
    record = json.loads((folder / name).read_text())
    if not record["rows"]:
        raise ValueError(f"{name} has no run")
    return record, record["rows"]


def _rate(row: dict[str, Any]) -> str:
    return f"{_num(row.get('units_per_s'))} {row.get('unit') or 'samples'}/s"


def _why(row: dict[str, Any]) -> str:
    return f"{row['name']} {row['status']}" + (f": {row['error']}" if row.get("error") else "")


def _util(row: dict[str, Any]) -> str:
    util = row.get("device_utilisation") or {}
    return f"GPU util {util['gpu_util_mean']:.0f}%" if util.get("sampled") else "GPU util not sampled"


def figures_data_stage(folder: Path) -> list[str]:
    """The step alone, then each end-to-end run against its loader alone: which bounds it
    (input-bound or compute-bound) and how near it comes; then each run's loader settings and GPU
    utilisation (benchmarks/data_stage.py)."""
    record = json.loads((folder / "data_stage.json").read_text())
    rows = record["rows"]
    if not rows:
        raise ValueError("data_stage.json has no run")
    step = record.get("step_alone") or {}
    cells = []
    for row in rows:
        if row["status"] != "completed":
            cells.append(f"{row['name']} {row['status']}")
            continue
        of_bound = f", {row['of_bound']:.2f} of it" if row.get("of_bound") else ""
        cells.append(f"{row['name']} {_num(row['samples_per_s'])} (loader alone {_num(row.get('loader_alone'))}: "
                     f"{row.get('bound') or 'bound unknown'}{of_bound})")
    lines = [f"img/s on {record.get('images', 0):,} JPEGs, {record.get('device') or '?'}: step alone "
             f"{_num(step.get('samples_per_s'))}; " + ", ".join(cells)]
    if step.get("error"):
        lines.append(f"step alone failed: {step['error']}")
    for row in rows:
        if row["status"] != "completed":
            lines.append(f"{row['name']} {row['status']}" + (f": {row['error']}" if row.get("error") else ""))
            continue
        settings = row.get("settings") or {}
        lines.append(f"{row['name']}: {_util(row)}; decode {settings.get('data.decode')}, copy_overlap "
                     f"{settings.get('data.copy_overlap')}, {settings.get('data.num_workers')} workers x prefetch "
                     f"{settings.get('data.prefetch_factor')} ({row.get('queued_batches')} batches queued, timed "
                     f"after {row.get('warmup')} steps), pinned {settings.get('data.pin_memory')}")
    return lines


def figures_overhead(folder: Path) -> list[str]:
    """framework/loop per row against the goal first, then each row's rates, MFU and the defaults'
    cost (benchmarks/gpu_overhead.py)."""
    record = json.loads((folder / "overhead.json").read_text())
    rows = record["rows"]
    if not rows:
        raise ValueError("overhead.json has no row")
    goal = record.get("goal", 0.98)
    done = [r for r in rows if r["status"] == "ok"]
    device = next((r["device"] for r in done if r.get("device")), "?")

    def name(row: dict[str, Any]) -> str:
        return f"{row['row']}{' (eager stand-in)' if row.get('stand_in') else ''}"

    def ratio(row: dict[str, Any]) -> str:
        spread = row.get("ratios") or []
        return f"{row['ratio']:.3f}x" + (f" ({min(spread):.3f}-{max(spread):.3f})" if len(spread) > 1 else "")

    met = sum(1 for r in done if r.get("within_goal"))
    cells = [f"{name(r)} {ratio(r)}" if r["status"] == "ok" else f"{name(r)} failed" for r in rows]
    lines = [f"framework/loop on {device}: {', '.join(cells)}; goal >= {goal:.2f}x met by {met} of {len(rows)}"]
    for row in rows:
        if row["status"] != "ok":
            lines.append(f"{row['row']}: failed: {row.get('error')}")
            continue
        unit = row.get("unit") or "samples"
        defaults = ""
        if row.get("defaults_ratio") is not None:
            defaults = (f"; with the default clipping + non-finite guard: {row['defaults_ratio']:.3f}x of the loop, "
                        f"{row['step_cost_ratio']:.3f}x of the bare framework")
        frames = row.get("frames_compiled") or {}
        compiled = ("; frames compiled " + ", ".join(f"{side} {n}" for side, n in frames.items())
                    if any(frames.values()) else "")
        lines.append(f"{name(row)}: {ratio(row)} framework/loop, goal >= {goal:.2f}x "
                     f"{'met' if row.get('within_goal') else 'NOT met'}; loop {_num(row['hand_rate'])} {unit}/s (MFU "
                     f"{_pct(row.get('hand_mfu'))}), framework {_num(row['framework_rate'])} (MFU "
                     f"{_pct(row.get('framework_mfu'))}; its meter {_num(row.get('meter_rate'))}){defaults}{compiled}")
    notes = sorted({r["mfu_note"] for r in done if r.get("mfu_note")})
    return lines + ([f"MFU peak: {'; '.join(notes)}"] if notes else [])


def figures_ceiling(folder: Path) -> list[str]:
    """Each model's fastest setting against its goal, then every setting (benchmarks/gpu_ceiling.py)."""
    record = json.loads((folder / "ceiling.json").read_text())
    rows = record["rows"]
    if not rows:
        raise ValueError("ceiling.json has no setting")
    verdicts = [line for line in _bullets(folder / "ceiling.md") if not line.startswith("MFU peak")
                and any(line.startswith(f"{model}: ") for model in record.get("best", {}))]
    settings = [f"{r['setting']}{' (eager stand-in)' if r.get('stand_in') else ''}: "
                + (f"{_num(r['rate'])} {r['unit']}/s, MFU {_pct(r.get('mfu'))}"
                                       if r["status"] == "ok" else f"failed: {r.get('error')}") for r in rows]
    return ["; ".join(verdicts) or "no setting completed", *settings]


def _pair(folder: Path, what: str) -> list[str]:
    """Two runs of benchmarks/check_runs.py: the second against the first."""
    _, rows = _runs(folder)
    device = next((r["device"] for r in rows if r.get("device")), "?")
    if len(rows) < 2:
        return [f"{what}: only {rows[0]['name']} ran ({rows[0]['status']})"]
    first, second = rows[0], rows[1]
    done = [r for r in (first, second) if r["status"] == "completed" and r.get("units_per_s")]
    if len(done) < 2:
        return [f"{what}: " + "; ".join(_why(r) for r in (first, second) if r not in done)] + \
            [f"{r['name']}: {_rate(r)}, peak {_num(r.get('peak_mib'))} MiB" for r in done]
    lines = [f"{what}: {second['units_per_s'] / first['units_per_s']:.2f}x ({second['name']} {_rate(second)} vs "
             f"{first['name']} {_num(first['units_per_s'])}), MFU {_pct(second.get('mfu'))} vs {_pct(first.get('mfu'))}, "
             f"peak {_num(second.get('peak_mib'))} vs {_num(first.get('peak_mib'))} MiB on {device}"]
    for row in (first, second):
        settings = ", ".join(f"{k} {v}" for k, v in (row.get("settings") or {}).items())
        lines.append(f"{row['name']}: {_rate(row)}, {row.get('windows')} windows, {row['seconds']:.0f} s in all; {settings}")
    return lines


def figures_reduce_overhead(folder: Path) -> list[str]:
    """compile=reduce_overhead (CUDA graphs) against compile=default on the ResNet-50 base."""
    return _pair(folder, "reduce_overhead vs default compile")


def figures_fsdp(folder: Path) -> list[str]:
    """trainer=fsdp on one device against the default strategy, or the framework's refusal."""
    _, rows = _runs(folder)
    fsdp = next((r for r in rows if r["name"] == "fsdp"), None)
    if fsdp is not None and fsdp["status"] == "refused":
        return [f"trainer=fsdp trainer.devices=1 refused by the framework: {fsdp['error']}"] + \
            [f"{r['name']}: {_rate(r)}, peak {_num(r.get('peak_mib'))} MiB" for r in rows if r is not fsdp]
    return _pair(folder, "fsdp on one device vs the default strategy")


def figures_profile_memory(folder: Path) -> list[str]:
    """The profile's step time and top categories, with its NVTX line, then the memory plan's
    headline (modelled and measured peak, the parts, what each practice would change)."""
    _, rows = _runs(folder)
    profile = next((r for r in rows if r["name"] == "profile"), None)
    plan_row = next((r for r in rows if r["name"] == "memory_plan"), None)
    key, lines = [], []
    if profile is not None and profile.get("profile"):
        p = profile["profile"]
        top = ", ".join(f"{c['category']} {c['share']:.0%}" for c in p["categories"][:4])
        key.append(f"profile {p['step_ms']:.1f} ms/step: {top}")
        lines += [f"profile: {p['steps']} steps on {'the device' if p['on_device'] else 'the CPU'}, memory-bound "
                  f"operators {_pct(p.get('memory_bound_share'))}; {p.get('nvtx') or 'no NVTX line'}",
                  *(f"profile: unusual: {flag}" for flag in p.get("unusual") or [])]
    elif profile is not None:
        key.append(_why(profile))
    plan = (plan_row or {}).get("memory_plan")
    if plan:
        measured = plan.get("measured_peak")
        key.append(f"memory plan at batch {plan['batch_size']}: peak modelled {plan['modelled_peak'] / 2**20:,.0f} MiB"
                   + (f", measured {measured / 2**20:,.0f} MiB" if isinstance(measured, (int, float)) else ""))
        parts = ", ".join(f"{name} {value / 2**20:,.0f}" for name, value in plan["bytes"].items())
        lines.append(f"memory plan on {plan['device']} (MiB): {parts}; {plan['peak_how']}")
        lines += [f"memory plan: {p['practice']}: peak {p['peak'] / 2**20:,.0f} MiB ({p['how']})"
                  for p in plan.get("practices") or []]
    elif plan_row is not None:
        key.append(_why(plan_row) if plan_row["status"] != "completed" else "memory plan: not in summary.json")
    if not key:
        raise ValueError("runs.json has neither the profile nor the memory plan run")
    return ["; ".join(key), *lines]


def figures_gpt(folder: Path) -> list[str]:
    """+recipe=gpt_small shortened: tokens/s and MFU."""
    _, rows = _runs(folder)
    row = rows[0]
    if row["status"] != "completed":
        return [_why(row)]
    settings = ", ".join(f"{k} {v}" for k, v in (row.get("settings") or {}).items())
    return [f"gpt_small: {_rate(row)}, MFU {_pct(row.get('mfu'))} on {row.get('device') or '?'} "
            f"({row.get('steps')} steps, {row.get('windows')} windows)",
            f"{_num(row.get('samples_per_s'))} sequences/s; peak {_num(row.get('peak_mib'))} MiB; {settings}",
            *([f"MFU peak: {row['mfu_note']}"] if row.get("mfu_note") else [])]


FIGURES: dict[str, Callable[[Path], list[str]]] = {
    "environment": figures_environment, "overhead": figures_overhead, "ceiling": figures_ceiling,
    "step_cost": figures_step_cost, "ladder": figures_ladder,
    "data_stage": figures_data_stage, "gpu_tests": figures_gpu_tests, "practices": figures_practices,
    "reduce_overhead": figures_reduce_overhead, "fsdp": figures_fsdp, "profile_memory": figures_profile_memory,
    "gpt": figures_gpt, "input_pipeline": figures_input_pipeline, "progressive_resize": figures_progressive_resize,
    "batch_study": figures_batch_study, "encoder_kernels": figures_encoder_kernels, "serve_text": figures_serve_text,
}


def figures(step: str, folder: Path) -> int:
    reader = FIGURES.get(step)
    if reader is None:
        print("(no key figures for this step)")
        return 0
    try:
        lines = reader(folder)
    except FileNotFoundError as ex:
        print(f"no figures: {Path(ex.filename).name if ex.filename else ex} not written")
        return 1
    except Exception as ex:  # noqa: BLE001 - a broken record is reported in the summary, not fatal
        print(f"no figures: {type(ex).__name__}: {ex}")
        return 1
    print("\n".join(lines))
    return 0


# -- the ladder: img/s and MFU per stage ---------------------------------------------------------

def ladder(sweep: Path, out: Path, check: bool) -> int:
    """One row per job of the ladder's multirun: the comparison's own rows (trainer/measure/comparison.py:
    stage, status, img/s, speed-up over the first stage, peak memory), plus what its table leaves
    out, read from each job's summary.json: MFU and the settings that make a stage."""
    jobs = load_jobs(sweep)
    stages: list[dict[str, Any]] = []
    device = ""
    for job, row in zip(jobs, comparison_rows(jobs)):
        stage: dict[str, Any] = {"job": row.number, "stage": row.stage, "status": row.status,
                                 "samples_per_s": row.samples_per_s, "speedup": row.speedup, "peak_mib": row.peak_mib}
        summary = job.summary
        if summary is not None:
            derived = summary.get("derived", {})
            throughput = summary.get("throughput") or {}
            device = device or (summary.get("device") or {}).get("name", "")
            stage.update(
                windows=throughput.get("windows"), mfu=throughput.get("mfu"), mfu_note=throughput.get("mfu_note"),
                precision=(summary.get("hyperparameters") or {}).get("precision"),
                channels_last=(derived.get("precision.channels_last") or {}).get("value"),
                compile=(derived.get("compile") or {}).get("value"),
                optimizer=(derived.get("optimizer.implementation") or {}).get("value"),
                steps=summary.get("steps"), error=summary.get("error"))
        stages.append(stage)
    completed = sum(1 for s in stages if s["status"] == "completed")
    out.mkdir(parents=True, exist_ok=True)
    (out / "ladder.json").write_text(json.dumps({"sweep": str(sweep), "device": device, "completed": completed,
                                                 "stages": stages}, indent=2) + "\n")
    lines = [f"ResNet-50 ladder on {device or 'unknown device'}: throughput (median window after warm-up, "
             f"device synchronized) and MFU of each stage, from its summary.json. Multirun: `{sweep}`.", "",
             "| stage | status | img/s | speed-up | MFU | precision | channels_last | compile | optimizer | peak MiB |",
             "|---|---|---:|---:|---:|---|---|---|---|---:|"]
    for s in stages:
        lines.append(f"| {s['stage']} | {s['status']} | {_num(s.get('samples_per_s'))} | "
                     f"{_fmt(s.get('speedup'), '{:.2f}x')} | {_pct(s.get('mfu'))} | {s.get('precision') or '-'} | "
                     f"{s.get('channels_last', '-')} | {s.get('compile') or '-'} | {s.get('optimizer') or '-'} | "
                     f"{_num(s.get('peak_mib'))} |")
    notes = sorted({s["mfu_note"] for s in stages if s.get("mfu_note")})
    if notes:
        lines += ["", "MFU peaks: " + "; ".join(notes)]
    (out / "ladder_mfu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if check and (not stages or completed < len(stages)):
        print(f"{completed} of {len(stages)} ladder stages completed", file=sys.stderr)
        return 1
    return 0


# -- summary.md ----------------------------------------------------------------------------------

def summary(results: Path) -> int:
    rows = [line.split("\t") for line in (results / "steps.tsv").read_text().splitlines() if line.strip()]
    header, rows = rows[0], rows[1:]
    steps = [dict(zip(header, row)) for row in rows]
    meta = json.loads((results / "run.json").read_text()) if (results / "run.json").is_file() else {}
    failed = [s["step"] for s in steps if s["status"] not in ("ok", "skipped")]
    skipped = [s["step"] for s in steps if s["status"] == "skipped"]
    total = sum(float(s["seconds"]) for s in steps)
    lines = [f"# GPU check: {'dry run on the CPU' if meta.get('dry_run') else 'GPU run'}", "",
             f"- command: `{meta.get('command', 'benchmarks/gpu_check.sh')}`",
             f"- started: {meta.get('started', '?')}; steps took {total:.0f} s in all (budget "
             f"{sum(int(s['budget_s']) for s in steps)} s)",
             f"- result: {'every step ok' if not failed and not skipped else 'failed: ' + ', '.join(failed)}"
             + (f"; skipped: {', '.join(skipped)}" if skipped else "")]

    def figure_lines(step: str) -> list[str]:
        figures_file = results / step / "figures.md"
        return ([line for line in figures_file.read_text().splitlines() if line.strip()]
                if figures_file.is_file() else [])

    # The question the check answers first: the framework against a hand-written loop (and the ceiling).
    for step in ("overhead", "ceiling"):
        if any(s["step"] == step for s in steps) and figure_lines(step):
            lines.append(f"- {step}: {figure_lines(step)[0]}")
    lines += ["", "| step | status | duration | budget (limit) | key figures |", "|---|---|---:|---:|---|"]
    details: list[str] = []
    for s in steps:
        step_lines = figure_lines(s["step"])
        first = step_lines[0] if step_lines else "-"
        limit = f" ({s['limit_s']} s)" if s["limit_s"] != "-" else ""
        lines.append(f"| {s['step']} | {s['status']} | {float(s['seconds']):.1f} s | {s['budget_s']} s{limit} | "
                     f"{first.replace('|', '/')} |")
        details += ["", f"## {s['step']}", "", f"- status: {s['status']} (exit {s['exit']}); files in `{s['step']}/`"]
        details += [f"- {line}" for line in step_lines[1:]]
    (results / "summary.md").write_text("\n".join(lines + details) + "\n")
    print("\n".join(lines))
    return 0


# -- helpers -------------------------------------------------------------------------------------

def _fmt(value: Any, pattern: str) -> str:
    return pattern.format(value) if isinstance(value, (int, float)) and math.isfinite(value) else "-"


def _num(value: Any) -> str:
    return _fmt(value, "{:,.0f}")


def _pct(value: Any) -> str:
    return _fmt(value, "{:.1%}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    env = commands.add_parser("environment")
    env.add_argument("out", type=Path)
    env.add_argument("--require-cuda", action="store_true")
    fig = commands.add_parser("figures")
    fig.add_argument("step")
    fig.add_argument("folder", type=Path)
    lad = commands.add_parser("ladder")
    lad.add_argument("sweep", type=Path)
    lad.add_argument("out", type=Path)
    lad.add_argument("--check", action="store_true", help="exit 1 unless every stage completed")
    summ = commands.add_parser("summary")
    summ.add_argument("results", type=Path)
    args = parser.parse_args(argv)
    if args.command == "environment":
        return environment(args.out, args.require_cuda)
    if args.command == "figures":
        return figures(args.step, args.folder)
    if args.command == "ladder":
        return ladder(args.sweep, args.out, args.check)
    return summary(args.results)


if __name__ == "__main__":
    sys.exit(main())
