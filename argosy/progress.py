"""Long steps on a terminal: a live status line ("building the native kernels for this CPU
— first start only … 12 s"), redrawn every second with the time so far and the step's latest
detail; where stderr is not a terminal (a service, a log file, CI) nothing is drawn and the
step's own log lines are all there is.

Log records written meanwhile are not garbled: while a line is drawn, a filter on the root
logger's handlers wipes it before each record, and the next tick draws it again below.
Only one line is live at a time; a step that starts while another is drawn just logs.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from types import TracebackType
from typing import TextIO

_CLEAR = "\r\x1b[K"
_live: list[StatusLine] = []
_live_lock = threading.Lock()


class _WipeBeforeRecords(logging.Filter):
    def __init__(self, line: StatusLine) -> None:
        super().__init__()
        self.line = line

    def filter(self, record: logging.LogRecord) -> bool:
        self.line.wipe()
        return True


class StatusLine:
    """`with StatusLine("compiling …") as line: … line.update("graph 2 of 4") …`. Drawn only
    on a terminal and only once the step has lasted `delay_s` (a warm start's quick steps
    draw nothing)."""

    def __init__(
        self, label: str, stream: TextIO | None = None, interval_s: float = 1.0, delay_s: float = 1.0
    ) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self.delay_s = delay_s
        self.detail = ""
        self.started = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._drawn = False
        self._lock = threading.Lock()
        self._filter = _WipeBeforeRecords(self)

    @property
    def live(self) -> bool:
        return self._thread is not None

    def update(self, detail: str) -> None:
        self.detail = detail

    def text(self) -> str:
        elapsed = time.monotonic() - self.started
        detail = f" ({self.detail})" if self.detail else ""
        return f"{self.label}{detail} … {elapsed:.0f} s"

    def draw(self) -> None:
        with self._lock:
            try:
                self.stream.write(_CLEAR + self.text())
                self.stream.flush()
                self._drawn = True
            except (OSError, ValueError):  # the terminal went away: stop drawing
                self._stop.set()

    def wipe(self) -> None:
        with self._lock:
            if self._drawn:
                try:
                    self.stream.write(_CLEAR)
                    self.stream.flush()
                except (OSError, ValueError):
                    pass
                self._drawn = False

    def __enter__(self) -> StatusLine:
        self.started = time.monotonic()
        if not _isatty(self.stream):
            return self
        with _live_lock:
            if _live:
                return self  # another line is drawn: this step only logs
            _live.append(self)
        for handler in logging.getLogger().handlers:
            handler.addFilter(self._filter)
        self._thread = threading.Thread(target=self._tick, name="status-line", daemon=True)
        self._thread.start()
        return self

    def _tick(self) -> None:
        if self._stop.wait(self.delay_s):
            return
        while not self._stop.is_set():
            self.draw()
            self._stop.wait(self.interval_s)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.wipe()
        for handler in logging.getLogger().handlers:
            handler.removeFilter(self._filter)
        with _live_lock:
            _live.remove(self)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
