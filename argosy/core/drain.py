"""Drain: the server's graceful stop on SIGTERM / SIGINT, in one place.

    serving --begin()--> draining --(idle, or the grace ran out, or force())--> aborting
            --(idle, or ABORT_WAIT_S)--> stopped

While *serving*, requests come and go (`request_started` / `request_finished` count the
ones in flight). From `begin()` on, the HTTP edge refuses new requests with
ServerDrainingError (503 + Retry-After; /health says "draining"), and `run()` waits for the
work in flight — the counted requests and the live generations `live()` reports, which
include background jobs that outlive their HTTP request — for at most `grace_s`. Work still
running then is aborted with ServerDrainingError (a stream ends with a framed error event),
and `run()` waits up to ABORT_WAIT_S more for those endings to be sent and recorded before it
returns; the caller then stops the HTTP server and closes the session store. `force()` (a
second signal) skips what is left of the grace: the abort happens at once.

`run()` only waits and aborts; it never stops anything else, so it is testable without a
server.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from argosy.errors import ArgosyError, ServerDrainingError

log = logging.getLogger("argosy")

STATES = ("serving", "draining", "aborting", "stopped")
ABORT_WAIT_S = 5.0  # after the abort: time for the error frames to go out and the commits to queue
POLL_S = 0.05


def _no_live_work() -> int:
    return 0


def _abort_nothing(error: ArgosyError) -> int:
    return 0


class Drain:
    """The drain's state and the count of requests in flight. One per server; the event loop's
    thread is the only one that touches it."""

    def __init__(self, grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        self.grace_s = grace_s
        self.state = "serving"
        self.num_requests = 0  # HTTP requests in flight (not /health)
        self.num_aborted = 0  # generations stopped when the grace ran out
        self.is_forced = False  # force(): the grace was cut short
        self._clock = clock
        self._deadline: float | None = None  # when the grace runs out (set by begin)

    # -- state -------------------------------------------------------------------------------
    @property
    def is_serving(self) -> bool:
        return self.state == "serving"

    def begin(self) -> bool:
        """Stop admitting and start the grace; False when a drain had begun already."""
        if self.state != "serving":
            return False
        self.state = "draining"
        self._deadline = self._clock() + self.grace_s
        return True

    def force(self) -> None:
        """End the grace now (a second signal): what still runs is aborted at once."""
        if self.state == "serving":
            self.begin()
        self.is_forced = True
        self._deadline = self._clock()

    def grace_left_s(self) -> float:
        if self._deadline is None:
            return self.grace_s
        return max(0.0, self._deadline - self._clock())

    def retry_after_s(self) -> int:
        """What a refused client is told to wait: until this process is gone at the latest
        (a restarted or other instance may serve by then), at least 1 s."""
        return max(1, math.ceil(self.grace_left_s()))

    def refusal(self) -> ServerDrainingError:
        return ServerDrainingError(
            f"The server is shutting down and takes no new requests; retry after {self.retry_after_s()} s.",
            retry_after_s=self.retry_after_s(),
        )

    def abort_error(self) -> ServerDrainingError:
        why = (
            "at once (a second signal)" if self.is_forced else f"after the {self.grace_s:g} s shutdown grace"
        )
        return ServerDrainingError(
            f"The server is shutting down: this generation was stopped {why}. Retry it.", retry_after_s=1
        )

    # -- requests in flight --------------------------------------------------------------------
    def request_started(self) -> None:
        self.num_requests += 1

    def request_finished(self) -> None:
        self.num_requests -= 1

    # -- the drain -------------------------------------------------------------------------------
    async def run(
        self,
        live: Callable[[], int] = _no_live_work,
        abort: Callable[[ArgosyError], int] = _abort_nothing,
    ) -> None:
        """Wait for the work in flight (up to the grace), abort what is left, wait for the
        aborted work to end (up to ABORT_WAIT_S); then the state is `stopped`. `live()`:
        generations running (besides the counted requests); `abort(error)`: stop every live
        generation with `error`, returning how many it stopped."""
        self.begin()

        def is_idle() -> bool:
            return self.num_requests <= 0 and live() <= 0

        log.info(
            "draining: %d requests and %d generations in flight; grace %g s",
            self.num_requests,
            live(),
            self.grace_s,
        )
        while not is_idle() and self.grace_left_s() > 0:
            await asyncio.sleep(min(POLL_S, max(self.grace_left_s(), 0.001)))
        if not is_idle():
            self.state = "aborting"
            error = self.abort_error()
            stop_waiting = self._clock() + ABORT_WAIT_S
            while True:
                # again on every poll: a generation that started after the first abort (its
                # request was in flight, past admission) is stopped too
                self.num_aborted += abort(error)
                if is_idle() or self._clock() >= stop_waiting:
                    break
                await asyncio.sleep(POLL_S)
            log.warning(
                "drain: %s; %d generations aborted (%d requests still open)",
                "cut short by a second signal" if self.is_forced else f"the {self.grace_s:g} s grace ran out",
                self.num_aborted,
                self.num_requests,
            )
        self.state = "stopped"
        log.info("drained")
