"""Background responses (`background: true`): the generation runs as a task of the server,
not of the HTTP request that created it.

The create call answers at once with the Response `queued` (or, with `stream: true`, follows
the job's events; a client that goes away stops following, the generation goes on). The job
keeps every stream event it produced, numbered as the Responses stream numbers them, so
`GET /v1/responses/{id}?stream=true&starting_after=N` replays from event N + 1 and then
follows live. `POST /v1/responses/{id}/cancel` stops the generation; what it produced is
committed with the finish `abort` (status `cancelled`).

State that must survive a restart lives in the session store: the input is committed before
the job starts and the output when it ends, so a job that was running when the server stopped
reads back as `failed` with a reason (store.stored_response_json), never `in_progress`.
Finished jobs stay followable in memory for KEEP_FINISHED_S (at most MAX_KEPT of them).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from argosy.core.stream import CoreStream

log = logging.getLogger("argosy.api")

KEEP_FINISHED_S = 3600.0
MAX_KEPT = 256


class BackgroundJob:
    """One background response: its task, the events it emitted, its status."""

    def __init__(self, key: str, stream: CoreStream) -> None:
        self.key = key
        self.stream = stream
        self.events: list[dict[str, Any]] = []
        self.status = "queued"  # queued -> in_progress -> a final status
        self.finished_at: float | None = None
        self.task: asyncio.Task[None] | None = None
        self._changed = asyncio.Condition()

    @property
    def is_done(self) -> bool:
        return self.finished_at is not None

    def run(self, events: AsyncIterator[dict[str, Any] | None]) -> None:
        self.task = asyncio.create_task(self._run(events), name=f"background-{self.key}")

    async def _run(self, events: AsyncIterator[dict[str, Any] | None]) -> None:
        try:
            async for payload in events:
                if payload is not None:  # a keep-alive is for a live reader, not kept
                    await self._append(payload)
        except asyncio.CancelledError:
            await self._finish("cancelled")
            raise
        except Exception as exc:  # the stream renders failures itself; this is a last guard
            log.exception("background response %s failed", self.key)
            await self._append(
                {
                    "type": "error",
                    "code": "server_error",
                    "message": f"{type(exc).__name__}: {exc}",
                    "param": None,
                    "sequence_number": len(self.events),
                }
            )
            await self._finish("failed")
        finally:
            with contextlib.suppress(Exception):
                await events.aclose()  # type: ignore[attr-defined]
        if not self.is_done:
            await self._finish(self.status if self.status not in ("queued", "in_progress") else "completed")

    async def _append(self, payload: dict[str, Any]) -> None:
        async with self._changed:
            self.events.append(payload)
            kind = payload.get("type", "")
            if kind.startswith("response.") and isinstance(payload.get("response"), dict):
                status = payload["response"].get("status")
                if isinstance(status, str) and kind not in ("response.created", "response.in_progress"):
                    self.status = status
            elif self.status == "queued" and kind not in ("response.created", "response.in_progress"):
                self.status = "in_progress"  # its first output: the generation has started
            self._changed.notify_all()

    async def _finish(self, status: str) -> None:
        async with self._changed:
            self.status = status
            self.finished_at = time.monotonic()
            self._changed.notify_all()

    async def follow(
        self, starting_after: int | None = None, keepalive_s: float = 0.0
    ) -> AsyncIterator[dict[str, Any] | None]:
        """The job's events after sequence number `starting_after` (all when None), then the
        live ones until it ends; a None (a keep-alive) whenever none came for `keepalive_s`
        seconds (0: never)."""
        position = 0 if starting_after is None else max(0, starting_after + 1)  # never a negative index
        while True:
            is_idle = False
            async with self._changed:
                while position >= len(self.events) and not self.is_done and not is_idle:
                    try:
                        await asyncio.wait_for(self._changed.wait(), keepalive_s or None)
                    except TimeoutError:
                        is_idle = True
                pending = self.events[position:]
                is_done = self.is_done
            if is_idle and not pending:
                yield None
            for payload in pending:
                yield payload
            position += len(pending)
            if is_done and position >= len(self.events):
                return

    async def cancel(self) -> None:
        """Stop the generation; returns once its output is committed."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        record = self.stream.record
        if record is not None and record.committed is not None:
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(record.committed)


class BackgroundJobs:
    """The server's background responses by session key (in memory, bounded)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._jobs: dict[str, BackgroundJob] = {}
        self._clock = clock

    def get(self, key: str) -> BackgroundJob | None:
        self._forget_old()
        return self._jobs.get(key)

    def add(self, job: BackgroundJob) -> None:
        self._forget_old()
        self._jobs[job.key] = job

    def _forget_old(self) -> None:
        now = self._clock()
        finished = sorted(
            (j for j in self._jobs.values() if j.finished_at is not None), key=lambda j: j.finished_at or 0.0
        )
        for job in finished:
            assert job.finished_at is not None
            if now - job.finished_at > KEEP_FINISHED_S or len(self._jobs) > MAX_KEPT:
                del self._jobs[job.key]
