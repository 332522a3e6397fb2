"""User mistakes as one actionable line.

A `UserError` is bad input (config, data, checkpoint, environment): the person can fix it. It is
reported as a single line naming the key or file, what is wrong and what is allowed, with exit
code 2 and no traceback. Anything else is a bug in the framework and keeps its traceback."""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Iterable, Iterator, NoReturn

EXIT_USER_ERROR = 2


class UserError(Exception):
    """Bad input the person can fix. `where` is a config key (``data.root``) or a file path."""

    def __init__(self, where: str, problem: str, allowed: str | None = None) -> None:
        self.where = where
        self.problem = problem
        self.allowed = allowed
        super().__init__(self.line())

    def line(self) -> str:
        return one_line(f"{self.where}: {self.problem}" + (f"; allowed: {self.allowed}" if self.allowed else ""))


def choices(values: Iterable[object]) -> str:
    """Render allowed values the same way everywhere: ``a, b, c``."""
    return ", ".join(str(v) for v in values)


def full_error_requested() -> bool:
    """Hydra's own switch for full tracebacks, honoured for our errors too."""
    return os.environ.get("HYDRA_FULL_ERROR", "") not in ("", "0")


@contextmanager
def one_line_on_user_error() -> Iterator[None]:
    """The body of a command-line tool: a `UserError` ends the process with its one line and exit
    code 2 (its traceback with HYDRA_FULL_ERROR=1)."""
    try:
        yield
    except UserError as ex:
        if full_error_requested():
            raise
        exit_with(ex.line())


def exit_with(line: str) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.write(f"error: {one_line(line)}\n")
    sys.stderr.flush()
    sys.exit(EXIT_USER_ERROR)


# The one-line forms every report uses: a message whose lines all matter (joined), a message
# whose first line says it (the rest is detail), and an exception as ``Type: first line``.
def one_line(text: object) -> str:
    """Every non-blank line of `text`, stripped and joined with spaces."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def first_line(text: object, limit: int | None = None) -> str:
    """The first non-blank line of `text`, stripped (empty when there is none), cut at `limit`."""
    line = next((part.strip() for part in str(text).splitlines() if part.strip()), "")
    return line if limit is None else line[:limit]


def exception_line(ex: BaseException, limit: int | None = None) -> str:
    """``Type: first line of the message``, or just ``Type`` for an exception without a message."""
    message = first_line(ex, limit)
    return f"{type(ex).__name__}: {message}" if message else type(ex).__name__
