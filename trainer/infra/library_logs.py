"""Library messages during a run: through the run's own handlers, without the noise.

Lightning installs stream handlers of its own and prints advertising tips; some of its warnings
contradict settings the run chose and printed with their reasons. Both are handled here, once."""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Iterator

LIBRARY_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric", "torchmetrics")


class _DropAdverts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Tip:" not in str(record.msg)


def route_library_logs() -> None:
    """Send library messages through the run's own handlers (console and the run folder's log
    file) once, instead of also through the stream handlers Lightning installs for itself, and
    drop its advertising tips."""
    root = logging.getLogger()
    if not root.handlers:
        return
    for name in LIBRARY_LOGGERS:
        library_log = logging.getLogger(name)
        for handler in list(library_log.handlers):
            if type(handler) is logging.StreamHandler:
                library_log.removeHandler(handler)
        library_log.propagate = True
    for handler in root.handlers:
        if not any(isinstance(f, _DropAdverts) for f in handler.filters):
            handler.addFilter(_DropAdverts())


@contextlib.contextmanager
def quiet_library_warnings() -> Iterator[None]:
    with warnings.catch_warnings():
        # The loader settings were chosen and printed with their reasons above; Lightning's
        # generic "few workers" hint would only contradict them (e.g. in-memory data).
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        # Lightning 2.6 calls a torch pytree API that newer torch deprecates: nothing to act on.
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
        # The data modules keep the place in the data order themselves (trainer/data/base.py),
        # which Lightning cannot see; and the resume line says which checkpoint was read.
        warnings.filterwarnings("ignore", message=".*your dataloader is not resumable.*")
        warnings.filterwarnings("ignore", message=".*The dirpath has changed from.*")
        yield
