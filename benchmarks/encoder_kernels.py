"""The encoder's kernels measured: fused against unfused QKV, the FFN eager against compiled, and compile's dynamic shapes on bucketed batches.

    python benchmarks/encoder_kernels.py --out benchmarks/results/encoder_kernels_cpu.md
    python benchmarks/encoder_kernels.py --device cuda --out benchmarks/results/gpu/DATE/encoder_kernels_cuda.md
    python benchmarks/encoder_kernels.py --quick --out /tmp/encoder_kernels.md     # CI: the shape of the report

Part 1, the kernels: one training step's forward and backward (no optimizer step) of `model=encoder`,
randomly initialised, at sequence lengths 128 and 512, for two shapes: `+recipe=encoder_tiny_text`'s
network (2 blocks of width 128) and BERT-base's (12 x 768, `+recipe=bert_base_text`). Variants of the
same network (the same seed gives the same parameters in every layout): `fused` (one QKV matmul, the
default), `unfused` (``model.fused_qkv=false``: three), `fused, FFN compiled` (each block's feed-forward
alone through torch.compile, the rest eager) and, with ``--variants``, `compiled` (the whole network, as
``compile=default``). Each batch holds rows of random lengths between half the length and the length,
padded, so the key-padding mask does its work. The variants take turns round by round in one process (the
order reversed every other round), ``--steps`` steps a round sized to about ``--round-s`` seconds;
reported: ms a step (median and range over the rounds), positions/s, and each variant's time against
`fused` paired by round. A compiled variant's first step (the compile) is reported apart. Before timing,
every variant's logits are checked against `fused`'s (eval mode). On a CPU a case whose eager step
takes more than ``--max-step-s`` is left out and said so (BERT-base at 512 on a small CPU).

Part 2, dynamic shapes: one epoch of `data=text_classification`'s training batches (the built-in set,
length-grouped, padded to a multiple of 8: their lengths vary), then its validation batches, through
`+recipe=encoder_tiny_text`'s network and AdamW, eager and then compiled by the `compile` group's
builder (`trainer.groups.compile.apply_compile`) with ``dynamic`` None (torch's automatic dynamic
shapes), false (a graph per length, up to Dynamo's recompile limit, eager past it) and true (one graph
with a symbolic length: what ``compile.dynamic=null`` resolves to for these batches). Reported: frames
compiled in training and in validation (each one past the first a recompile), graphs, graph breaks,
whether the recompile limit was hit, the distinct lengths, the compile's cost (each compiling step's
time less the same batch's eager time), the epoch's time and the median step of the steps that compiled
nothing.

Results: the .md and a .json beside it with the command, machine, start, duration and load.
``--quick`` (CI): the small network at length 128, one round of one step, and part 2 through Dynamo's
``eager`` backend (the same frames and recompiles, none of Inductor's code generation): the times of a
quick run mean nothing."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from trainer.groups.compile import CompileConfig, apply_compile, compile_counts, resolve_dynamic  # noqa: E402
from trainer.infra.fingerprint import cpu_name, git_commit  # noqa: E402
from trainer.models.encoder import Encoder  # noqa: E402

TINY, BASE = "encoder_tiny_text (2 x 128, 4 heads)", "BERT-base (12 x 768, 12 heads)"
#: name -> the network's shape (the tiny recipe's vocabulary is its WordPiece's 4,096; BERT's 30,522).
SHAPES: dict[str, dict[str, Any]] = {
    TINY: {"vocab_size": 4096, "layers": 2, "heads": 4, "width": 128, "ffn_width": 512},
    BASE: {"vocab_size": 30522, "layers": 12, "heads": 12, "width": 768, "ffn_width": 3072},
}
LENGTHS = (128, 512)
#: The recipes' batch of 32 sequences; BERT-base on a CPU 2 (a step of 32 x 512 would take minutes).
BATCH = {("cpu", TINY): 32, ("cpu", BASE): 2, ("cuda", TINY): 32, ("cuda", BASE): 32}
#: name -> (fused_qkv, what is compiled: nothing, each block's FFN, or the network).
VARIANTS: dict[str, tuple[bool, str]] = {"fused": (True, "none"), "unfused": (False, "none"),
                                         "fused, FFN compiled": (True, "ffn"), "compiled": (True, "network")}
#: --variants' names of them.
SHORT = {"fused": "fused", "unfused": "unfused", "ffn": "fused, FFN compiled", "compiled": "compiled"}
DYNAMIC: dict[str, Optional[bool]] = {"None": None, "false": False, "true": True}
CLASSES, DROPOUT, SEED = 8, 0.1, 0


@dataclass(frozen=True)
class Settings:
    device: torch.device
    precision: str  # fp32 or bf16 (autocast)
    backend: str  # torch.compile's backend: inductor, or eager for --quick
    rounds: int
    round_s: float
    steps: Optional[int]  # per round; None: sized to round_s
    max_step_s: Optional[float]
    batch: Optional[int]  # sequences a step in part 1; None: BATCH's

    def autocast(self) -> Any:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16")

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


# --- part 1: the kernels -------------------------------------------------------------------------

def build(shape: dict[str, Any], variant: str, settings: Settings, max_positions: int) -> Encoder:
    """The variant's network: the same seed, so the same parameters in every variant."""
    fused, compiled = VARIANTS[variant]
    torch.manual_seed(SEED)
    net = Encoder(shape["vocab_size"], max_positions, CLASSES, layers=shape["layers"], heads=shape["heads"],
                  width=shape["width"], ffn_width=shape["ffn_width"], dropout=DROPOUT, fused_qkv=fused)
    net = net.to(settings.device).train()
    if compiled == "ffn":
        for block in net.blocks:  # the same code object: one graph serves every block (Dynamo lifts the weights)
            block.ffn.compile(backend=settings.backend, dynamic=False)
    elif compiled == "network":
        net.compile(backend=settings.backend, dynamic=False)
    return net


def make_batch(vocab_size: int, length: int, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of random lengths in [length / 2, length] padded with 0 to `length`, and their labels."""
    generator = torch.Generator().manual_seed(SEED)
    ids = torch.randint(1, vocab_size, (batch, length), generator=generator)
    kept = torch.randint(length // 2, length + 1, (batch, 1), generator=generator)
    ids = ids.masked_fill(torch.arange(length) >= kept, 0)
    return ids.to(device), torch.randint(0, CLASSES, (batch,), generator=generator).to(device)


def step_seconds(net: Encoder, ids: torch.Tensor, labels: torch.Tensor, settings: Settings, steps: int = 1) -> float:
    """Seconds a step of forward, loss and backward, over `steps` steps (gradients dropped each step)."""
    settings.sync()
    start = time.perf_counter()
    for _ in range(steps):
        net.zero_grad(set_to_none=True)
        with settings.autocast():
            loss = F.cross_entropy(net(ids).float(), labels)
        loss.backward()
    settings.sync()
    return (time.perf_counter() - start) / steps


def logit_differences(nets: dict[str, Encoder], ids: torch.Tensor, settings: Settings) -> dict[str, float]:
    """The largest difference of each variant's eval logits from `fused`'s (the same network)."""
    with torch.no_grad(), settings.autocast():
        logits = {name: net.eval()(ids).float() for name, net in nets.items()}
    for net in nets.values():
        net.train()
    reference = logits["fused"]
    return {name: float((value - reference).abs().max()) for name, value in logits.items()}


def time_rounds(nets: dict[str, Encoder], batch: tuple[torch.Tensor, torch.Tensor], settings: Settings,
                steps: int) -> dict[str, list[float]]:
    """Seconds a step of each variant per round, the variants interleaved (the order reversed every other round)."""
    times: dict[str, list[float]] = {name: [] for name in nets}
    names = list(nets)
    for index in range(settings.rounds):
        for name in names if index % 2 == 0 else reversed(names):
            times[name].append(step_seconds(nets[name], *batch, settings, steps))
    return times


def measure_case(shape_name: str, length: int, variants: Sequence[str], settings: Settings) -> dict[str, Any]:
    """One shape at one length: the variants' first steps, logits, then the interleaved rounds."""
    shape, batch_size = SHAPES[shape_name], settings.batch or BATCH[(settings.device.type, shape_name)]
    batch = make_batch(shape["vocab_size"], length, batch_size, settings.device)
    case: dict[str, Any] = {"shape": shape_name, "length": length, "batch": batch_size, **shape}
    nets = {"fused": build(shape, "fused", settings, max(LENGTHS))}
    first = {"fused": step_seconds(nets["fused"], *batch, settings)}
    eager_step = step_seconds(nets["fused"], *batch, settings)
    if settings.max_step_s is not None and eager_step > settings.max_step_s:
        return {**case, "skipped": f"one eager step took {eager_step:.1f} s, more than --max-step-s "
                                   f"{settings.max_step_s:g}"}
    for name in variants:
        if name != "fused":
            nets[name] = build(shape, name, settings, max(LENGTHS))
            first[name] = step_seconds(nets[name], *batch, settings)
    case["logit_difference"] = differences = logit_differences(nets, batch[0], settings)
    tolerance = 5e-2 if settings.precision == "bf16" else 1e-4  # bf16 rounds each matmul's output to 8 bits
    if max(differences.values()) > tolerance:
        raise SystemExit(f"error: {shape_name} at {length}: a variant's logits differ from fused's by more than "
                         f"{tolerance:g}: {differences}")
    steps = settings.steps or max(1, round(settings.round_s / max(eager_step, 1e-6)))
    times = time_rounds(nets, batch, settings, steps)
    ratios = {name: [t / f for t, f in zip(times[name], times["fused"])] for name in nets}
    return {**case, "steps_per_round": steps, "first_step_s": first, "times_s": times, "ratios": ratios}


# --- part 2: compile's dynamic shapes on bucketed batches ------------------------------------------

def bucketed_batches(cache_dir: Optional[str], max_length: int, batch_size: int) -> dict[str, Any]:
    """`data=text_classification`'s training batches in one epoch's shuffled order and its validation
    batches (the built-in set), as the data module gives them, and the tokenizer's vocabulary."""
    from trainer.data.labelled_text import LabelledTextData
    from trainer.data.text import LengthGroupedBatches

    data = LabelledTextData(batch_size=batch_size, max_length=max_length, cache_dir=cache_dir)
    data.setup("fit")
    train = LengthGroupedBatches(data.train_set, batch_size)
    order = np.random.default_rng(SEED).permutation(len(train))
    val = data.val_set
    val_batches = [val.batch(np.arange(start, min(start + batch_size, len(val))))
                   for start in range(0, len(val), batch_size)]
    meta = data.prepared().meta
    return {"train": [train[int(i)] for i in order], "val": val_batches, "vocab_size": int(meta["vocab_size"]),
            "pad_id": int(meta["pad_id"]), "classes": len(meta["classes"])}


def epoch_network(data: dict[str, Any], dynamic: str, settings: Settings, max_length: int) -> Encoder:
    """`+recipe=encoder_tiny_text`'s network, fresh, eager (`dynamic` "eager") or compiled as ``compile=default``
    with `dynamic` does it (the group's builder; Dynamo's own backend under --quick)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(SEED)
    net = Encoder(data["vocab_size"], max_length, data["classes"], pad_token_id=data["pad_id"], pooling="mean",
                  **{k: v for k, v in SHAPES[TINY].items() if k != "vocab_size"}).to(settings.device)
    if dynamic != "eager" and settings.backend == "inductor":
        apply_compile(net, "default", CompileConfig("default", False, DYNAMIC[dynamic]))
    elif dynamic != "eager":
        net.compile(backend=settings.backend, dynamic=DYNAMIC[dynamic])
    return net


def run_epoch(data: dict[str, Any], dynamic: str, settings: Settings, max_length: int) -> dict[str, Any]:
    """One training epoch (AdamW steps) and a validation pass: each step's seconds and the frames
    Dynamo compiled during it (a compile's backward is compiled in its step too)."""
    net = epoch_network(data, dynamic, settings, max_length)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)
    record: dict[str, Any] = {"dynamic": dynamic}
    for phase in ("train", "val"):
        before, seconds, frames = compile_counts(), [], []
        net.train(phase == "train")
        for ids, labels in data[phase]:
            ids, labels = ids.to(settings.device), labels.to(settings.device)
            counted = compile_counts()["frames_compiled"]
            settings.sync()
            start = time.perf_counter()
            with torch.set_grad_enabled(phase == "train"), settings.autocast():
                loss = F.cross_entropy(net(ids).float(), labels)
            if phase == "train":
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            settings.sync()
            seconds.append(time.perf_counter() - start)
            frames.append(compile_counts()["frames_compiled"] - counted)
        after = compile_counts()
        record[phase] = {"seconds": seconds, "frames": frames, **{key: after[key] - before[key] for key in after}}
    record["recompile_limit_hit"] = any(record[phase]["recompile_limit_hits"] for phase in ("train", "val"))
    return record


def summarize_epoch(record: dict[str, Any], eager: dict[str, Any], lengths: dict[str, list[int]]) -> dict[str, Any]:
    """Frames, recompiles, and the compile's cost: each step that compiled a frame, less the same
    batch's eager step; the steady step is the median of the steps that compiled nothing."""
    out: dict[str, Any] = {"dynamic": record["dynamic"], "recompile_limit_hit": record["recompile_limit_hit"]}
    for phase in ("train", "val"):
        seconds, frames = record[phase]["seconds"], record[phase]["frames"]
        compiling = [index for index, count in enumerate(frames) if count]
        steady = [s for s, count in zip(seconds, frames) if not count] or seconds
        out[phase] = {"frames_compiled": record[phase]["frames_compiled"], "graphs": record[phase]["graphs"],
                      "graph_breaks": record[phase]["graph_breaks"], "lengths": len(set(lengths[phase])),
                      "steps": len(seconds), "compiling_steps": len(compiling),
                      "compile_s": sum(seconds[i] - eager[phase]["seconds"][i] for i in compiling),
                      "total_s": sum(seconds), "steady_step_ms": 1e3 * statistics.median(steady)}
    frames_compiled = out["train"]["frames_compiled"] + out["val"]["frames_compiled"]
    out["recompiles"] = max(0, frames_compiled - 1)
    return out


def measure_dynamic(settings: Settings, cache_dir: Optional[str], max_length: int, batch_size: int,
                    batches: Optional[int], settings_to_run: Sequence[str]) -> dict[str, Any]:
    """Part 2: the eager epoch (after one to warm up), then each compile.dynamic setting's, summarised."""
    data = bucketed_batches(cache_dir, max_length, batch_size)
    if batches is not None:
        data["train"] = data["train"][:batches]
    lengths = {phase: [int(ids.shape[1]) for ids, _ in data[phase]] for phase in ("train", "val")}
    rows_per_batch = {phase: [int(ids.shape[0]) for ids, _ in data[phase]] for phase in ("train", "val")}
    run_epoch(data, "eager", settings, max_length)  # warm-up: the allocator's and the kernels' first calls
    eager = run_epoch(data, "eager", settings, max_length)
    rows = [summarize_epoch(eager, eager, lengths)]
    for dynamic in settings_to_run:
        rows.append(summarize_epoch(run_epoch(data, dynamic, settings, max_length), eager, lengths))
    resolved, how = resolve_dynamic(CompileConfig("default", False, None), variable_shapes=True)
    return {"max_length": max_length, "batch": batch_size, "lengths": lengths, "rows_per_batch": rows_per_batch,
            "rows": rows, "null_resolves_to": str(resolved).lower(), "null_how": how,
            "recompile_limit": int(torch._dynamo.config.recompile_limit)}


# --- the report ----------------------------------------------------------------------------------

def describe(values: Sequence[float], scale: float = 1.0, digits: int = 1) -> str:
    form = f"{{:,.{digits}f}}"
    return (f"{form.format(scale * statistics.median(values))} "
            f"({form.format(scale * min(values))}-{form.format(scale * max(values))})")


def kernel_lines(cases: list[dict[str, Any]]) -> list[str]:
    lines = ["| network | length | batch | variant | ms a step | positions/s | against fused, paired by round "
             "| first step, s | logits vs fused |", "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for case in cases:
        if "skipped" in case:
            lines.append(f"| {case['shape']} | {case['length']} | {case['batch']} | left out: {case['skipped']} "
                         "| | | | | |")
            continue
        for name, times in case["times_s"].items():
            positions = case["batch"] * case["length"] / statistics.median(times)
            lines.append(f"| {case['shape']} | {case['length']} | {case['batch']} | {name} | {describe(times, 1e3)} | "
                         f"{positions:,.0f} | **{describe(case['ratios'][name], digits=2)}x** | "
                         f"{case['first_step_s'][name]:.2f} | {case['logit_difference'][name]:.1e} |")
    return lines


def dynamic_lines(dynamic: dict[str, Any]) -> list[str]:
    lines = ["| compile.dynamic | frames compiled, train / val | recompiles | recompile limit hit | graphs | graph "
             "breaks | compile cost, s (train / val) | epoch + val, s | steady step, ms (train / val) |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for row in dynamic["rows"]:
        train, val = row["train"], row["val"]
        name = {"eager": "eager (compile=off)", "true": f"true (what null resolves to here: "
                f"{dynamic['null_resolves_to']})"}.get(row["dynamic"], row["dynamic"])
        lines.append(f"| {name} | {train['frames_compiled']} / {val['frames_compiled']} | {row['recompiles']} | "
                     f"{'yes' if row['recompile_limit_hit'] else 'no'} | {train['graphs'] + val['graphs']} | "
                     f"{train['graph_breaks'] + val['graph_breaks']} | {train['compile_s']:.1f} / {val['compile_s']:.1f} "
                     f"| {train['total_s'] + val['total_s']:.1f} | {train['steady_step_ms']:.1f} / "
                     f"{val['steady_step_ms']:.1f} |")
    return lines


def write(out: Path, record: dict[str, Any]) -> None:
    lines = ["# The encoder's kernels: fused against unfused QKV, the FFN compiled, dynamic shapes", "",
             f"Machine: {record['machine']}; torch {record['torch']}; device {record['device_name']}; "
             f"{record['threads']} torch thread(s); precision {record['precision']}; compile backend "
             f"{record['backend']}; commit {record['commit']}.", "",
             f"Command: `{record['command']}` (started {record['started']}, {record['duration_s']:.0f} s; load "
             f"average {record['load_at_start']:.2f} at the start, {record['load_at_end']:.2f} at the end)", "",
             "## Forward and backward of one step", "",
             f"Randomly initialised networks, dropout {DROPOUT}, rows of random lengths from half the length to "
             f"the length, padded; {record['rounds']} rounds, the variants interleaved. ms a step and the ratio: "
             "median (range) over the rounds; the first step holds a compiled variant's compile.", "",
             *kernel_lines(record["cases"]), "", *(dynamic_section(record["dynamic"]) if record["dynamic"] else [])]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")


def dynamic_section(dynamic: dict[str, Any]) -> list[str]:
    lengths = dynamic["lengths"]
    return ["## compile's dynamic shapes on bucketed batches", "",
            f"`data=text_classification` (the built-in set, max_length {dynamic['max_length']}, batch "
            f"{dynamic['batch']}): {len(lengths['train'])} training batches of {len(set(lengths['train']))} "
            f"lengths ({min(lengths['train'])}-{max(lengths['train'])}), then {len(lengths['val'])} validation "
            f"batches of {len(set(lengths['val']))} lengths; `+recipe=encoder_tiny_text`'s network and AdamW. "
            f"Dynamo's recompile limit: {dynamic['recompile_limit']} per function. A recompile is a frame "
            "compiled after the first; the compile cost is the compiling steps' time less the same batches' "
            f"eager time. compile.dynamic=null: {dynamic['null_how']}.", "",
            *dynamic_lines(dynamic), ""]


def machine(device: torch.device) -> tuple[str, str]:
    cpu = f"{cpu_name()}, {len(os.sched_getaffinity(0))} of {os.cpu_count()} cores"
    return cpu, torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--round-s", type=float, default=None, help="seconds of steps a round and variant "
                        "(default: 3 on a CPU, 1 on CUDA)")
    parser.add_argument("--steps", type=int, default=None, help="steps a round (default: sized to --round-s)")
    parser.add_argument("--max-step-s", type=float, default=None, help="leave out a case whose eager step takes "
                        "longer (default: 6 on a CPU, none on CUDA)")
    parser.add_argument("--variants", default="fused,unfused,ffn", help="comma-separated, of: " + ", ".join(
                        f"{short} ({name})" for short, name in SHORT.items()) + "; fused always runs")
    parser.add_argument("--shapes", default="tiny,base", help="comma-separated, of: tiny, base")
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    parser.add_argument("--precision", choices=("fp32", "bf16"), default=None, help="default: bf16 autocast on "
                        "CUDA, fp32 on a CPU")
    parser.add_argument("--backend", default=None, help="torch.compile's backend (default: inductor; eager with "
                        "--quick)")
    parser.add_argument("--batch", type=int, default=None, help="part 1: sequences a step (default: 32; "
                        "BERT-base on a CPU 2)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--data-batch", type=int, default=32, help="part 2: the data's batch_size (the recipe's)")
    parser.add_argument("--max-length", type=int, default=128, help="part 2: the data's max_length (the recipe's)")
    parser.add_argument("--dynamic", default=",".join(DYNAMIC), help="part 2: the compile.dynamic settings, of: "
                        f"{', '.join(DYNAMIC)} (eager always runs); empty: no part 2")
    parser.add_argument("--batches", type=int, default=None, help="part 2: only the first training batches")
    parser.add_argument("--cache-dir", default=None, help="part 2: the data's cache (default: the framework's)")
    parser.add_argument("--quick", action="store_true", help="CI: the small network at 128, batch 8, one round of "
                        "one step; part 2 on 16 batches of 8 through Dynamo's eager backend; one torch thread")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def settings_from(args: argparse.Namespace) -> Settings:
    device = torch.device(args.device)
    cpu = device.type == "cpu"
    if args.quick:
        args.shapes, args.lengths, args.rounds, args.steps, args.batch = "tiny", "128", 1, 1, 8
        args.data_batch, args.batches, args.threads = 8, 16, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    return Settings(device, args.precision or ("fp32" if cpu else "bf16"),
                    args.backend or ("eager" if args.quick else "inductor"), args.rounds,
                    args.round_s or (3.0 if cpu else 1.0), args.steps,
                    args.max_step_s if args.max_step_s is not None else (6.0 if cpu else None), args.batch)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse(argv)
    settings = settings_from(args)
    if settings.device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32, as precision.tf32 on CUDA (fp32 runs)
    started, clock, load = datetime.now(timezone.utc).isoformat(timespec="seconds"), time.perf_counter(), os.getloadavg()[0]
    given = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in given if v not in SHORT]
    if unknown:
        raise SystemExit(f"error: --variants: unknown {', '.join(unknown)} (of: {', '.join(SHORT)})")
    variants = ["fused", *(SHORT[v] for v in given if v != "fused")]
    if any(v not in DYNAMIC for v in args.dynamic.split(",") if v.strip()):
        raise SystemExit(f"error: --dynamic: '{args.dynamic}' (of: {', '.join(DYNAMIC)})")
    cases = []
    for shape in ({"tiny": TINY, "base": BASE}[s.strip()] for s in args.shapes.split(",")):
        for length in (int(v) for v in args.lengths.split(",")):
            cases.append(measure_case(shape, length, variants, settings))
            print(json.dumps({k: v for k, v in cases[-1].items() if k in ("shape", "length", "skipped", "ratios")}),
                  flush=True)
    wanted = [v.strip() for v in args.dynamic.split(",") if v.strip()]
    dynamic = (measure_dynamic(settings, args.cache_dir, args.max_length, args.data_batch, args.batches, wanted)
               if wanted else None)
    cpu, device_name = machine(settings.device)
    command = "python benchmarks/encoder_kernels.py " + " ".join(argv if argv is not None else sys.argv[1:])
    commit = git_commit(REPO) or {}
    write(args.out, {"command": command.strip(), "started": started, "duration_s": time.perf_counter() - clock,
                     "machine": cpu, "device_name": device_name, "torch": torch.__version__,
                     "threads": torch.get_num_threads(), "precision": settings.precision, "backend": settings.backend,
                     "commit": f"{commit.get('commit', 'unknown')}{' (with local changes)' if commit.get('dirty') else ''}",
                     "rounds": settings.rounds, "load_at_start": load, "load_at_end": os.getloadavg()[0],
                     "cases": cases, "dynamic": dynamic})
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
