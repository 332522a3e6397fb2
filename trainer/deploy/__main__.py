"""``python -m trainer.deploy {export,bench} RUN_DIR|CKPT [options]``: the deployment layer's commands."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from trainer.errors import UserError, exit_with, full_error_requested


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trainer.deploy")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="the inference form of a trained run: ONNX, torch.export, "
                                                "safetensors and model.json")
    export.add_argument("source", type=Path, help="a run folder (its best checkpoint) or a .ckpt inside one")
    export.add_argument("--out", type=Path, help="where to write (default: RUN_DIR/export)")
    export.add_argument("--checkpoint", choices=("best", "last"), default="best",
                        help="with a run folder: its best checkpoint (default) or last.ckpt")
    bench = commands.add_parser("bench", help="latency P50/P90/P99 and throughput per batch size: eager, folded, "
                                              "compiled (CUDA) and ONNX Runtime")
    bench.add_argument("source", type=Path, help="a run folder or a .ckpt inside one")
    bench.add_argument("--batch-sizes", default="1,8,32,128", help="comma-separated (default 1,8,32,128)")
    bench.add_argument("--calls", type=int, default=100, help="timed calls per variant and batch size")
    bench.add_argument("--budget-s", type=float, default=3.0, help="at most this long per variant and batch size")
    bench.add_argument("--warmup", type=int, default=10, help="untimed calls first")
    bench.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when there is one")
    args = parser.parse_args(argv)
    try:
        for line in _run(args):
            print(line)
    except UserError as ex:
        if full_error_requested():
            raise
        exit_with(ex.line())


def _run(args: argparse.Namespace) -> list[str]:
    # torch and the exporters are imported only once the arguments are known (fast --help and errors)
    if args.command == "export":
        from trainer.deploy.export import export_run

        return export_run(args.source, out=args.out, which=args.checkpoint).lines()
    from trainer.deploy.bench import bench_run, table

    sizes = _batch_sizes(args.batch_sizes)
    timings, written = bench_run(args.source, sizes, warmup=args.warmup, calls=args.calls, budget_s=args.budget_s,
                                 device=args.device)
    return [*table(timings), f"written: {written} (and .json, .png beside it)"]


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise UserError("--batch-sizes", f"'{text}' is not a list of positive integers", "e.g. 1,8,32,128")
    return sizes


if __name__ == "__main__":
    main()
