"""Files replaced atomically: a crash or a concurrent reader sees the old file or the new one,
never half of one; and the empty folders a write that failed leaves behind, removed. Free of torch,
so the report and the CLI can use it without importing it."""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Callable


def replace_atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """`write(tmp)` fills a temporary file in the target's folder; it is fsynced and renamed over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        # mkstemp makes the file private (0600), and a writer may make its own file in its place
        # (safetensors' save_file does, 0600 again); the result gets the permissions any new file
        # gets here (0666 less the umask, 0644 usually), as a plain open() would give it.
        os.chmod(tmp, 0o666 & ~_umask())
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    # The rename itself is durable only once the folder's entry is on disk; some file systems
    # cannot sync a folder, and the rename is still atomic.
    with contextlib.suppress(OSError):
        folder = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)


def _umask() -> int:
    # Linux reports it without changing it; os.umask() can only be read by setting it, which
    # for a moment would apply to files other threads create.
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_text_atomic(path: Path, text: str) -> None:
    replace_atomic(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json_atomic(path: Path, data: Any) -> None:
    """`data` as indented JSON: tensors as numbers or lists, non-finite floats as strings."""
    write_text_atomic(path, json.dumps(_jsonable(data), indent=2) + "\n")


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if callable(getattr(value, "numel", None)) and callable(getattr(value, "tolist", None)):  # a tensor, duck-typed
        return _jsonable(value.item() if value.numel() == 1 else value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)  # a Path, or anything else


def remove_empty_folders(folder: Path, below: Path) -> None:
    """`folder`, then its parents, each while it is empty, up to but not including `below`; nothing
    when `folder` is not inside `below`. One at a time: a folder another process has just written
    into is no longer empty and stays, with everything above it."""
    folder, below = folder.resolve(), below.resolve()
    if below not in folder.parents:
        return
    while folder != below:
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent
