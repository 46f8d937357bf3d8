"""Requests on their way to the engine: the HTTP layer has them, their prompt is still being
rendered and tokenized. AsyncEngine counts them so an idle engine can wait for a burst's
stragglers (argosy/engine/async_engine.py); this module has no torch import, so the HTTP
layer can use it freely."""

from __future__ import annotations

import contextvars
from collections.abc import Callable


class Arrival:
    """One request on its way; `done()` (idempotent) once it reached the engine or gave up."""

    __slots__ = ("_on_done",)

    def __init__(self, on_done: Callable[[], None] | None = None) -> None:
        self._on_done = on_done

    def done(self) -> None:
        on_done, self._on_done = self._on_done, None
        if on_done is not None:
            on_done()


# set by the HTTP layer for the request it is handling; AsyncEngine.generate marks it done
current_arrival: contextvars.ContextVar[Arrival | None] = contextvars.ContextVar(
    "argosy_arrival", default=None
)
