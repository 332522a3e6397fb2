"""The optimizer's step alone, fused against foreach (and the per-tensor loop), on this machine.

    .venv/bin/python benchmarks/optimizer_kernels.py --out benchmarks/results/optimizer_kernels_cpu.md

What `optimizer.implementation=auto` rests on (trainer/groups/optimizer/build.py): for each parameter
set (the host-overhead benchmark's 8 tensors, the default SmallCNN's, ResNet-18's and ResNet-50's),
AdamW and SGD with momentum take `--rounds` interleaved rounds of `--steps` steps per kernel on the
same random gradients; the figure is each kernel's best round (another process on the machine only
ever adds time) in microseconds per step of this thread's CPU time, and fused's speed-up over
foreach. One torch thread, as a step's own work has on a GPU machine's main thread."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torchvision
from torch import nn

REPO = Path(__file__).resolve().parent.parent
for folder in (REPO, REPO / "benchmarks"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from host_overhead import machine as host_machine  # noqa: E402
from trainer.models.small_cnn import SmallCNN  # noqa: E402

NETWORKS: dict[str, Callable[[], nn.Module]] = {
    "host-overhead network (8 tensors)": lambda: SmallCNN(10, in_channels=1, widths=(4,)),
    "default SmallCNN (digits)": lambda: SmallCNN(10, in_channels=1),
    "ResNet-18": lambda: torchvision.models.resnet18(num_classes=10),
    "ResNet-50": lambda: torchvision.models.resnet50(num_classes=1000),
}
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "AdamW": lambda params, **kernel: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, **kernel),
    "SGD momentum": lambda params, **kernel: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4, **kernel),
}
KERNELS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}


def best_step_us(kernels: dict[str, Callable[[], torch.optim.Optimizer]], rounds: int, steps: int) -> dict[str, float]:
    """Each kernel's best round, the kernels interleaved round by round."""
    optimizers = {name: build() for name, build in kernels.items()}
    best = {name: float("inf") for name in optimizers}
    for optimizer in optimizers.values():
        for _ in range(3):
            optimizer.step()
    for _ in range(rounds):
        for name, optimizer in optimizers.items():
            start = time.thread_time()
            for _ in range(steps):
                optimizer.step()
            best[name] = min(best[name], (time.thread_time() - start) / steps * 1e6)
    return best


def measure(rounds: int, steps: int, networks: list[str]) -> list[dict[str, Any]]:
    rows = []
    for network in networks:
        torch.manual_seed(0)
        params = [p for p in NETWORKS[network]().parameters()]
        for p in params:
            p.grad = torch.randn_like(p)
        n = sum(p.numel() for p in params)
        for optimizer, build in OPTIMIZERS.items():
            kernels = {kernel: (lambda b=build, k=args, ps=params: b(ps, **k)) for kernel, args in KERNELS.items()}
            heavy = n > 5_000_000  # ResNet-18 and -50: fewer steps a round (a foreach step takes tens of ms)
            best = best_step_us(kernels, max(2, rounds // 2) if heavy else rounds, max(2, steps // 20) if heavy else steps)
            rows.append({"network": network, "tensors": len(params), "parameters": n, "optimizer": optimizer, **best})
            print(f"{network}, {optimizer}: " + ", ".join(f"{k} {v:,.0f} us" for k, v in best.items()), flush=True)
    return rows


def write(out: Path, rows: list[dict[str, Any]], command: str) -> None:
    m = host_machine()
    machine = f"{m['cpu']}, {m['usable_cores']} of {m['cores']} cores, torch {m['torch']}, Python {m['python']}"
    lines = ["# The optimizer's step alone: fused against foreach and the per-tensor loop", "",
             f"Machine: {machine}, 1 torch thread. Command: `{command}`.", "",
             "Best round of each kernel, microseconds of this thread's CPU time per `optimizer.step()`, "
             "the kernels interleaved; same random gradients.", "",
             "| network | tensors | parameters | optimizer | fused | foreach | for_loop | fused vs foreach |",
             "|---|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['network']} | {r['tensors']} | {r['parameters']:,} | {r['optimizer']} | {r['fused']:,.0f} | "
                     f"{r['foreach']:,.0f} | {r['for_loop']:,.0f} | {r['foreach'] / r['fused']:.1f}x |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--networks", default=",".join(NETWORKS), help="comma-separated, of: " + ", ".join(NETWORKS))
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "optimizer_kernels.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = measure(args.rounds, args.steps, [name.strip() for name in args.networks.split(",")])
    write(args.out, rows, "python benchmarks/optimizer_kernels.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
