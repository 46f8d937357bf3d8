"""Requests on their way to the engine: the HTTP layer has them, their prompt is still being
rendered and tokenized. AsyncEngine counts them so an idle engine can wait for a burst's
stragglers (argosy/engine/async_engine.py). Plain: the core hands an Arrival back to
`generate(arrival=...)`, no context variable carries it."""

from __future__ import annotations

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
