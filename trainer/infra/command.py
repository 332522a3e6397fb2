"""The command the person typed, so that help, examples and hints repeat it rather than another.

One entry point answers to three names (trainer/cli.py): `python train.py` in a checkout,
`python -m trainer` and the `gpu-practice-train` script where the package is installed. A wheel user
has no train.py, and a checkout user may never have installed the script; each is shown its own."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

#: The console script's name (pyproject.toml's [project.scripts]).
SCRIPT = "gpu-practice-train"
MODULE = "python -m trainer"
CHECKOUT = "python train.py"


def invoked_as(argv: Sequence[str] | None = None) -> str:
    """`python train.py`, `python -m trainer` or `gpu-practice-train`, from ``argv[0]``; the module
    form when it cannot tell (an embedding program, a notebook)."""
    first = (sys.argv if argv is None else argv)[:1]
    if not first:
        return MODULE
    path = Path(first[0])
    if path.name == "train.py":
        return CHECKOUT
    if path.name == SCRIPT or path.stem == SCRIPT:
        return SCRIPT
    return MODULE


def subcommand(name: str, argv: Sequence[str] | None = None) -> str:
    """How to type one of the entry point's subcommands (`scaffold`, `deploy`) from the same start."""
    return f"{invoked_as(argv)} {name}"
