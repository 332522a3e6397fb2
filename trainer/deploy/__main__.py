"""``python -m trainer.deploy export RUN_DIR|CKPT [--out DIR] [--checkpoint best|last]``"""

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
    args = parser.parse_args(argv)
    from trainer.deploy.export import export_run  # torch only once the arguments are known

    try:
        report = export_run(args.source, out=args.out, which=args.checkpoint)
    except UserError as ex:
        if full_error_requested():
            raise
        exit_with(ex.line())
    for line in report.lines():
        print(line)


if __name__ == "__main__":
    main()
