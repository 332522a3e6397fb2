"""Tokens per second of `trainer.models.gpt.generate` with and without its KV cache, side by side.

Two shapes of `model=gpt`, randomly initialised (the speed of a forward does not depend on what the
weights learned): `+recipe=gpt_tiny_text`'s network (4 blocks of width 128, 2,048 tokens, 128
positions) and a wider one with a longer context (6 blocks of width 384, 1,024 positions). For each,
greedy generation of 112 and 256 new tokens after a 16-token prompt, batch 1, on one device: with the
cache (a new token runs one position) and without (every new token runs the whole context again),
in interleaved rounds; both must give the same tokens (checked at every round). Reported: tokens/s
per round (median and range) and the ratio of the two, paired by round.

    python benchmarks/generation_speed.py --out benchmarks/results/generation_speed_cpu.md
    python benchmarks/generation_speed.py --quick --out /tmp/generation.md     # CI: one small round
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from trainer.infra.fingerprint import cpu_name  # noqa: E402
from trainer.models.gpt import GPT, generate  # noqa: E402

#: name -> the network's shape.
SHAPES: dict[str, dict[str, Any]] = {
    "gpt_tiny_text (4 x 128, 128 positions)": {"vocab_size": 2048, "max_positions": 128, "layers": 4, "heads": 4,
                                                "width": 128},
    "6 x 384, 1,024 positions": {"vocab_size": 8192, "max_positions": 1024, "layers": 6, "heads": 6, "width": 384},
}
#: New tokens per shape by default: the tiny one's whole context after the prompt, 256 for the other
#: (without the cache, a thousand would take minutes a round on a CPU).
NEW_TOKENS = {"gpt_tiny_text (4 x 128, 128 positions)": 112, "6 x 384, 1,024 positions": 256}
PROMPT_TOKENS = 16


def one_run(net: GPT, prompt: torch.Tensor, new_tokens: int, cache: bool) -> tuple[float, torch.Tensor]:
    """(tokens/s, the tokens) of one greedy generation."""
    start = time.perf_counter()
    out = generate(net, prompt, new_tokens, greedy=True, cache=cache)
    if out.is_cuda:
        torch.cuda.synchronize()
    return new_tokens / (time.perf_counter() - start), out


def measure(shape: dict[str, Any], rounds: int, new_tokens: int, device: torch.device) -> dict[str, Any]:
    torch.manual_seed(0)
    net = GPT(**shape).to(device).eval()
    prompt = torch.randint(0, shape["vocab_size"], (1, PROMPT_TOKENS), device=device)
    one_run(net, prompt, 4, cache=True)  # warm-up
    one_run(net, prompt, 4, cache=False)
    runs: dict[str, list[float]] = {"cache": [], "no cache": []}
    for index in range(rounds):
        order = ("cache", "no cache") if index % 2 == 0 else ("no cache", "cache")
        outputs = {}
        for name in order:
            rate, outputs[name] = one_run(net, prompt, new_tokens, cache=name == "cache")
            runs[name].append(rate)
        if not torch.equal(outputs["cache"], outputs["no cache"]):
            raise SystemExit("error: the cached and uncached generations differ")
    ratios = [a / b for a, b in zip(runs["cache"], runs["no cache"])]
    return {"shape": shape, "new_tokens": new_tokens, "runs": runs, "ratios": ratios}


def describe(values: Sequence[float], digits: int = 0) -> str:
    form = f"{{:,.{digits}f}}"
    return f"{form.format(statistics.median(values))} ({form.format(min(values))}-{form.format(max(values))})"


def write(out: Path, record: dict[str, Any]) -> None:
    lines = ["# Generation with and without the KV cache", "",
             f"Machine: {record['machine']}; torch {torch.__version__}; device {record['device']}; "
             f"{record['threads']} torch thread(s).", "",
             f"Command: `{record['command']}` ({record['started']}, {record['duration_s']:.0f} s)", "",
             f"Greedy generation after a {PROMPT_TOKENS}-token prompt, batch 1, randomly initialised networks; "
             f"{record['rounds']} interleaved rounds; the cached and uncached tokens are the same in every round.",
             "", "| network | new tokens | tokens/s with the cache | without | ratio, paired by round |",
             "|---|---:|---:|---:|---:|"]
    for name, result in record["results"].items():
        lines.append(f"| {name} | {result['new_tokens']} | {describe(result['runs']['cache'])} | "
                     f"{describe(result['runs']['no cache'])} | **{describe(result['ratios'], 1)}x** |")
    lines.append("")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=None, help="for every shape (default: 112 and 256)")
    parser.add_argument("--quick", action="store_true", help="one round of 24 tokens, the small network only (CI)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    started, clock = datetime.now(timezone.utc).isoformat(timespec="seconds"), time.perf_counter()
    shapes = dict(list(SHAPES.items())[:1]) if args.quick else SHAPES
    rounds = 1 if args.quick else args.rounds
    results = {}
    for name, shape in shapes.items():
        new_tokens = 24 if args.quick else args.new_tokens or NEW_TOKENS[name]
        results[name] = measure(shape, rounds, new_tokens, device)
        print(f"{name}: cache {describe(results[name]['runs']['cache'])} tokens/s, "
              f"no cache {describe(results[name]['runs']['no cache'])}", flush=True)
    command = "python benchmarks/generation_speed.py " + " ".join(argv if argv is not None else sys.argv[1:])
    write(args.out, {"command": command.strip(), "started": started, "duration_s": time.perf_counter() - clock,
                     "machine": f"{cpu_name()}, {os.cpu_count()} cores",
                     "device": str(device), "threads": torch.get_num_threads(), "rounds": rounds,
                     "load_at_start": os.getloadavg()[0], "results": results})
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
