"""The live status line of long steps (argosy/progress.py): drawn on a terminal only, redrawn
with the time and the step's detail, wiped before log records and at the end, one at a time."""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Iterator

import pytest

from argosy.progress import StatusLine

CLEAR = "\r\x1b[K"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def terminal() -> Iterator[Terminal]:
    stream = Terminal()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("LOG %(message)s\n"))
    handler.terminator = ""
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield stream
    finally:
        root.removeHandler(handler)


def wait_for(condition: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline
        time.sleep(0.005)


def test_not_a_terminal_draws_nothing() -> None:
    stream = io.StringIO()
    with StatusLine("building", stream=stream, interval_s=0.01, delay_s=0) as line:
        line.update("step 1")
        time.sleep(0.05)
        assert not line.live
    assert stream.getvalue() == ""


def test_a_terminal_gets_a_live_line_wiped_at_the_end(terminal: Terminal) -> None:
    with StatusLine("compiling the decode step", stream=terminal, interval_s=0.01, delay_s=0) as line:
        line.update("graph 2 of 4")
        wait_for(lambda: "graph 2 of 4" in terminal.getvalue())
    out = terminal.getvalue()
    assert out.startswith(CLEAR) and CLEAR + "compiling the decode step (graph 2 of 4) … 0 s" in out
    assert out.endswith(CLEAR) and "\n" not in out


def test_log_records_are_written_on_a_wiped_line(terminal: Terminal) -> None:
    with StatusLine("converting", stream=terminal, interval_s=0.01, delay_s=0):
        wait_for(lambda: "converting" in terminal.getvalue())
        logging.getLogger("argosy.test").warning("a record")
        wait_for(lambda: terminal.getvalue().count("converting") >= 3)
    before, after = terminal.getvalue().split("LOG a record\n")
    assert before.endswith(CLEAR) and after.startswith(CLEAR + "converting")
    logging.getLogger("argosy.test").warning("after")  # the filter is gone with the line
    assert terminal.getvalue().endswith(CLEAR + "LOG after\n")


def test_a_quick_step_draws_nothing_and_one_line_is_live_at_a_time(terminal: Terminal) -> None:
    with StatusLine("quick", stream=terminal, interval_s=0.01, delay_s=10):
        pass
    assert terminal.getvalue() == ""
    with (
        StatusLine("outer", stream=terminal, interval_s=0.01, delay_s=0) as outer,
        StatusLine("inner", stream=terminal, interval_s=0.01, delay_s=0) as inner,
    ):
        assert outer.live and not inner.live
        wait_for(lambda: "outer" in terminal.getvalue())
    assert "inner" not in terminal.getvalue()
