"""Files replaced atomically: a crash or a concurrent reader sees the old file or the new one,
never half of one. Free of torch, so the report and the CLI can use it without importing it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable


def replace_atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """`write(tmp)` fills a temporary file in the target's folder; it is fsynced and renamed over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    replace_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
