"""tests.helpers.in_forked_child, which the compile and export checks run in: a failure comes back with
its traceback, a long report comes back whole, and a child that hangs fails its test at the timeout
instead of hanging the pytest worker (it once blocked reading the child's pipe past any timeout)."""

from __future__ import annotations

import time

import pytest

from tests.helpers import in_forked_child


def test_a_hung_child_fails_at_its_timeout():
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="past 1 s"):
        in_forked_child(lambda: time.sleep(60), timeout=1)
    assert time.monotonic() - started < 30  # not the child's 60 s


def test_a_failure_comes_back_with_its_traceback():
    def failing() -> None:
        raise ValueError("the child's own words")

    with pytest.raises(AssertionError, match="the child's own words") as raised:
        in_forked_child(failing, timeout=30)
    assert "Traceback" in str(raised.value)


def test_a_long_report_comes_back_whole():
    def failing() -> None:
        raise AssertionError("x" * 200_000 + "end")

    with pytest.raises(AssertionError, match="x{1000}end"):
        in_forked_child(failing, timeout=30)
