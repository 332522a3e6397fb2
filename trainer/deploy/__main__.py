"""``python -m trainer.deploy {export,bench,serve,load} RUN_DIR|CKPT [options]`` and
``python -m trainer.deploy weights CKPT OUT.safetensors``: the deployment layer's commands."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional

from trainer.deploy import (DEFAULT_BATCH_TIMEOUT_MS, DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_BYTES,
                            DEFAULT_MAX_CHARS, DEFAULT_MAX_NEW_TOKENS, DEFAULT_MAX_PIXELS)
from trainer.infra.errors import UserError, one_line_on_user_error
from trainer.infra.extras import require


def main(argv: Optional[list[str]] = None, prog: str = "python -m trainer.deploy") -> None:
    """`prog`: how the person typed it (also `python -m trainer deploy` and `gpu-practice-train deploy`)."""
    parser = argparse.ArgumentParser(prog=prog)
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
    serve = commands.add_parser("serve", help="the exported model behind a batching HTTP server (LitServe): POST "
                                              "an image or a text to /predict, a prompt to /generate, GET /health")
    serve.add_argument("source", type=Path, help="an export folder (model.json), a run folder or a .ckpt inside one; "
                                                 "a run is exported first when it has no export of its checkpoint")
    _server_options(serve)
    serve.add_argument("--port", type=int, default=8000, help="default 8000")
    serve.add_argument("--host", choices=("127.0.0.1", "0.0.0.0", "::"), default="127.0.0.1",
                       help="default 127.0.0.1 (loopback only)")
    serve.add_argument("--top-k", type=int, default=5, help="classes per answer unless the request says ?k=N")
    serve.add_argument("--max-bytes", type=int, default=DEFAULT_MAX_BYTES,
                       help=f"largest image accepted, in bytes (413 above; default {DEFAULT_MAX_BYTES:,}; base64 in "
                            "JSON or a data URL may take a third more)")
    serve.add_argument("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS,
                       help=f"largest image accepted, in pixels, read from its header before decoding (413 above; "
                            f"default {DEFAULT_MAX_PIXELS:,})")
    serve.add_argument("--max-chars", type=int, default=DEFAULT_MAX_CHARS,
                       help=f"an encoder's longest text accepted, in characters (413 above; default "
                            f"{DEFAULT_MAX_CHARS:,}); the model reads at most its max_length tokens of it")
    serve.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                       help=f"a language model's most tokens per request (max_tokens above it: 413; default "
                            f"{DEFAULT_MAX_NEW_TOKENS})")
    serve.add_argument("--runtime", choices=("auto", "onnxruntime", "torch"), default="auto",
                       help="auto: ONNX Runtime on the CPU, the torch.export program on CUDA")
    load = commands.add_parser("load", help="QPS and P50/P99 of the server at several concurrencies, batching on "
                                            "and off, in one run")
    load.add_argument("source", type=Path, help="a run folder or a .ckpt inside one")
    _server_options(load)
    load.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrent callers (default 1,8,32)")
    load.add_argument("--requests", type=int, default=2000, help="at most this many requests per measurement")
    load.add_argument("--budget-s", type=float, default=10.0, help="at most this long per measurement")
    load.add_argument("--rounds", type=int, default=2, help="each measurement this many times, servers taking turns")
    weights = commands.add_parser("weights", help="a checkpoint's model weights alone, as safetensors (no run "
                                                  "folder needed, no extra installed)")
    weights.add_argument("checkpoint", type=Path, help="a training checkpoint (.ckpt)")
    weights.add_argument("out", type=Path, help="the safetensors file to write")
    args = parser.parse_args(argv)
    with one_line_on_user_error():
        for line in _run(args):
            print(line)


def _run(args: argparse.Namespace) -> list[str]:
    # torch and the exporters are imported only once the arguments are known (fast --help and errors)
    if args.command == "weights":  # torch and safetensors alone: the core installs them
        from trainer.deploy.export import export_safetensors

        return [f"wrote {export_safetensors(args.checkpoint, args.out)}"]
    require("deploy", f"python -m trainer.deploy {args.command}")
    if args.command == "export":
        from trainer.deploy.export import export_run

        return export_run(args.source, out=args.out, which=args.checkpoint).lines()
    if args.command == "serve":
        _positive(args, "port", "max_batch_size", "top_k", "max_bytes", "max_pixels", "max_chars", "max_new_tokens")
        _serve(args)
        return []
    if args.command == "load":
        from trainer.deploy.load import load_run

        _positive(args, "max_batch_size", "requests", "rounds")
        text = _text_export(args.source)
        if text is not None:  # one server, by length bin and concurrency (load_text.py)
            from trainer.deploy.export import locate
            from trainer.deploy.load_text import load_text_run

            measured = load_text_run(locate(args.source)[0], *text, _batch_sizes(args.concurrency, "--concurrency"),
                                     args.requests, args.budget_s, args.max_batch_size, args.batch_timeout_ms,
                                     ["--device", args.device] if args.device else [])
            return [*measured.lines(), f"written: {measured.markdown} (and .json beside it)"]
        report = load_run(args.source, _batch_sizes(args.concurrency, "--concurrency"), requests=args.requests,
                          budget_s=args.budget_s, rounds=args.rounds, max_batch_size=args.max_batch_size,
                          batch_timeout_ms=args.batch_timeout_ms, device=args.device)
        return [*report.lines(), f"written: {report.markdown} (and .json beside it)"]
    from trainer.deploy.bench import bench_run, table

    timings, written = bench_run(args.source, _batch_sizes(args.batch_sizes), warmup=args.warmup, calls=args.calls,
                                 budget_s=args.budget_s, device=args.device)
    return [*table(timings), f"written: {written} (and .json, .png beside it)"]


def _text_export(source: Path) -> Optional[tuple[Path, dict[str, Any]]]:
    """(export folder, card) when `source` is (or exports to) a text model's export, else None."""
    from trainer.deploy.export import export_folder, load_card

    folder = export_folder(source)
    card = load_card(folder / "model.json")
    return (folder, card) if card.get("task") in ("sequence_classification", "language_model") else None


def _serve(args: argparse.Namespace) -> None:
    """The API by the export card's task: images (serve.py), an encoder (serve_text.py), a language
    model (serve_generate.py)."""
    import torch

    from trainer.deploy.serve import _check_port

    _check_port(args.host, args.port)  # before any export: a busy port is said at once
    text = _text_export(args.source)
    target = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if text is not None and text[1]["task"] == "language_model":
        from trainer.deploy.serve_generate import serve_generator

        serve_generator(*text, target, args.port, args.host, args.max_bytes, args.max_new_tokens)
    elif text is not None:
        from trainer.deploy.serve_text import serve_encoder

        serve_encoder(*text, target, args.port, args.host, args.max_batch_size, args.batch_timeout_ms, args.top_k,
                      args.max_bytes, args.runtime, max_chars=args.max_chars)
    else:
        from trainer.deploy.serve import serve

        serve(args.source, port=args.port, host=args.host, max_batch_size=args.max_batch_size,
              batch_timeout_ms=args.batch_timeout_ms, top_k=args.top_k, max_bytes=args.max_bytes,
              max_pixels=args.max_pixels, runtime=args.runtime, device=args.device)


def _server_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-batch-size", type=int, default=DEFAULT_MAX_BATCH_SIZE,
                        help="dynamic batching: at most this many requests per batch (1: no batching; default "
                             f"{DEFAULT_MAX_BATCH_SIZE})")
    parser.add_argument("--batch-timeout-ms", type=float, default=DEFAULT_BATCH_TIMEOUT_MS,
                        help="dynamic batching: wait at most this long after a batch's first request for more "
                             f"(default {DEFAULT_BATCH_TIMEOUT_MS:g}: a batch is what queued while the last one ran)")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when there is one")


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) < 1:
            raise UserError("--" + name.replace("_", "-"), f"{getattr(args, name)} is not a positive integer",
                            "1 or more")
    if getattr(args, "batch_timeout_ms", 0) < 0:
        raise UserError("--batch-timeout-ms", f"{args.batch_timeout_ms:g} is negative", "0 or more milliseconds")


def _batch_sizes(text: str, option: str = "--batch-sizes") -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise UserError(option, f"'{text}' is not a list of positive integers", "e.g. 1,8,32,128")
    return sizes


if __name__ == "__main__":
    main()
