"""DrainingServer: uvicorn's Server, stopping the way argosy/core/drain.py says.

uvicorn alone, on SIGTERM / SIGINT, closes its listening socket at once (a new client gets
"connection refused", not an answer), gives the requests in flight its own short timeout,
and re-raises the signal once it is done (the exit status says "killed by a signal"). Here
the first signal begins the drain instead: the socket stays open, so a new request gets
503 + Retry-After and /health says "draining"; the work in flight runs on for the grace and
what is left then is aborted with a framed error; only then is uvicorn told to exit
(`should_exit`: its usual shutdown closes the socket and the idle connections). The signal
is not re-raised: a drained server exits 0.

A second signal ends the grace at once (what still runs is aborted, with its framed error);
a third one stops waiting for open connections (uvicorn's `force_exit`).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn

from argosy.core.drain import Drain
from argosy.errors import ArgosyError

log = logging.getLogger("argosy")


class DrainingServer(uvicorn.Server):
    """`live()`: generations running that no HTTP request holds (background jobs);
    `abort(error)`: stop every live generation (see Drain.run); `on_stopped()`: runs on the
    event loop once uvicorn has shut down (lifespan included), before the loop is torn down."""

    def __init__(
        self,
        config: uvicorn.Config,
        drain: Drain,
        live: Callable[[], int],
        abort: Callable[[ArgosyError], int],
        on_stopped: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.drain = drain
        self._live = live
        self._abort = abort
        self._on_stopped = on_stopped  # called on the loop once uvicorn has shut down
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        await super().serve(sockets)
        if self._on_stopped is not None:
            self._on_stopped()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler runs between two bytecodes of the loop's own thread: hand the work
        # to the loop (call_soon_threadsafe also wakes it from its select).
        loop = self._loop
        if loop is None or loop.is_closed():
            self.should_exit = True  # before start-up: nothing is in flight
            return
        loop.call_soon_threadsafe(self.on_signal, sig)

    def on_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if self._drain_task is None:
            log.info(
                "%s: draining (new requests get 503; in-flight ones have %g s; again to abort them now)",
                name,
                self.drain.grace_s,
            )
            self._drain_task = asyncio.create_task(self._drain_then_exit(), name="drain")
        elif self.drain.state == "draining":
            log.warning("%s again: aborting the requests in flight now", name)
            self.drain.force()
        else:
            log.warning("%s again: exiting without waiting for open connections", name)
            self.force_exit = True

    async def _drain_then_exit(self) -> None:
        try:
            await self.drain.run(self._live, self._abort)
        except Exception:
            log.exception("the drain failed; stopping now")
        finally:
            self.should_exit = True
