"""The input side of a language model: the tokens per second `data=text`'s loader delivers per host
core, packed and bucketed, against the tokens per second a training step of the model consumes.

The loader is timed in this process with no workers (the batches are made where they are timed:
one core's worth) over `--batches` batches, after a warm-up, in `--rounds` interleaved rounds; the
step is the recipe's model (`+recipe=gpt_tiny_text`'s GPT, or `--model gpt_small`) taking a
forward, backward and AdamW step on a resident batch on this machine's device. The ratio says how
many host cores keep one device fed (the tokenization itself happened once, in the prepare step,
so the loader only slices memory-mapped token arrays). Figures depend on the machine: compare the
ratio, not the rates, across machines.

    python benchmarks/text_pipeline.py                     # about 1 min on 2 CPU cores
    python benchmarks/text_pipeline.py --quick --out /tmp/text_pipeline.md   # CI: the outputs only
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from trainer.data.loader import resolve_loader  # noqa: E402
from trainer.data.text import TextData  # noqa: E402
from trainer.infra.fingerprint import cpu_name  # noqa: E402
from trainer.models.gpt import GPT  # noqa: E402

MODELS = {"gpt_tiny": dict(layers=4, heads=4, width=128), "gpt_small": dict(layers=12, heads=12, width=768)}


def loader_rate(data: TextData, batches: int) -> float:
    """Tokens per second of the training loader with no workers (one core), after a warm-up batch."""
    data.apply_loader(resolve_loader(0, False, False, "auto", in_memory=False, cuda=False))
    iterator = iter(data.train_dataloader())
    next(iterator)
    tokens, started = 0, time.perf_counter()
    for _ in range(batches):
        _, targets = next(iterator)
        tokens += int((targets != -100).sum())
    return tokens / (time.perf_counter() - started)


def step_rate(model: str, vocab: int, length: int, batch: int, steps: int, device: torch.device) -> float:
    """Tokens per second a forward, backward and optimizer step of the model consumes."""
    net = GPT(vocab, length, **MODELS[model]).to(device)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    ids = torch.randint(0, vocab, (batch, length + 1), device=device)

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(net(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return steps * batch * length / (time.perf_counter() - started)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rates: dict[str, list[float]] = {"packed": [], "bucketed": [], "step": []}
    datas = {mode: TextData(batch_size=args.batch, sequence_length=args.length, sequences=mode,
                            max_corpus_mb=args.corpus_mb, vocab_size=2048) for mode in ("packed", "bucketed")}
    vocab = 0
    for data in datas.values():
        vocab = int(data.inspect().model_inputs()["vocab_size"])
        data.setup("fit")
    for _ in range(args.rounds):  # interleaved, so a slow moment of the machine hits every arm
        for mode, data in datas.items():
            rates[mode].append(loader_rate(data, args.batches))
        rates["step"].append(step_rate(args.model, vocab, args.length, args.batch, args.steps, device))
    return {"rates": rates, "device": device, "vocab": vocab}


def report(args: argparse.Namespace, measured: dict[str, Any], started: str, seconds: float) -> list[str]:
    rates, device = measured["rates"], measured["device"]
    step = statistics.median(rates["step"])
    name = torch.cuda.get_device_name() if device.type == "cuda" else cpu_name()
    lines = ["# The input side of a language model", "",
             f"`{' '.join(['python benchmarks/text_pipeline.py', *sys.argv[1:]])}`: started {started}, {seconds:.0f} s, "
             f"on {platform.node()} ({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f} at the end), the step on "
             f"{device.type} ({name}). {args.model}, batch {args.batch} x {args.length} tokens, the built-in corpus "
             f"({args.corpus_mb} MB); medians of {args.rounds} interleaved rounds (range in brackets).", "",
             "| | tokens/s | per host core | cores to feed the step |", "|---|---:|---:|---:|"]
    for mode in ("packed", "bucketed"):
        rate = statistics.median(rates[mode])
        lines.append(f"| loader, {mode} | {rate:,.0f} [{min(rates[mode]):,.0f}-{max(rates[mode]):,.0f}] | {rate:,.0f} "
                     f"| {step / rate:.3f} |")
    lines.append(f"| the step consumes | {step:,.0f} [{min(rates['step']):,.0f}-{max(rates['step']):,.0f}] | | |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "text_pipeline_cpu.md")
    parser.add_argument("--model", choices=sorted(MODELS), default="gpt_tiny")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--corpus-mb", type=float, default=6.0)
    parser.add_argument("--quick", action="store_true", help="a few batches and steps, one round: the outputs only")
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.steps, args.rounds, args.batch = 5, 1, 1, 4
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    clock = time.monotonic()
    measured = measure(args)
    lines = report(args, measured, started, time.monotonic() - clock)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
