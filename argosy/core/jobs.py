"""JobQueue: long audio work (speech of a whole document, transcription of a long file) run as
jobs of the server, not of the HTTP request that asked for them.

A job is submitted with its input, stored (argosy/sessions/jobs.py) before the submit call
answers, and run by one worker task, oldest first (the audio models run one request at a
time anyway: a second worker would only queue behind it). At most `max_pending` jobs wait or
run; past that a submit is refused with 503 + Retry-After. A job's runner is chosen by its
task; what it returns (bytes and a media type) is stored as the result, what it raises as the
job's error (`failed`). Deleting a job cancels it first if it is waiting or running.

Restart: a job that was queued or running when the server stopped is queued again when the
queue starts (its input is kept until it finishes); finished results are read from the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from argosy.errors import ArgosyError, ConflictError, NotFoundError, OverloadedError
from argosy.sessions.jobs import Job, JobStore

log = logging.getLogger("argosy.jobs")

Runner = Callable[[Job, bytes], Awaitable[tuple[bytes, str]]]


class JobQueue:
    def __init__(self, store: JobStore, runners: dict[str, Runner], max_pending: int = 16) -> None:
        self.store = store
        self.runners = runners
        self.max_pending = max_pending
        self._pending: list[str] = []  # queued, oldest first
        self._running: tuple[str, asyncio.Task[Any]] | None = None
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task[None] | None = None

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        """Queue what a previous run left unfinished and start the worker (idempotent)."""
        if self._worker is not None:
            return
        self._wake = asyncio.Event()
        for job in await asyncio.to_thread(self.store.unfinished):
            if job.status == "in_progress":
                await asyncio.to_thread(self.store.requeue, job.id)
            self._pending.append(job.id)
            log.info("audio job %s (%s) queued again after a restart", job.id, job.task)
        self._worker = asyncio.create_task(self._work(), name="audio-jobs")
        if self._pending:
            self._wake.set()

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
            self._worker = None

    # -- requests -------------------------------------------------------------------------
    async def submit(self, task: str, model: str, request: dict[str, Any], data: bytes) -> Job:
        await self.start()
        if task not in self.runners:
            raise ArgosyError(f"no runner for audio jobs of task {task!r}")
        if len(self._pending) + (self._running is not None) >= self.max_pending:
            raise OverloadedError(
                f"{self.max_pending} audio jobs are already waiting or running; try again later.",
                retry_after_s=30,
            )
        job = Job(
            id=f"audiojob_{uuid.uuid4().hex}",
            task=task,
            model=model,
            status="queued",
            created_at=time.time(),
            request=request,
        )
        await asyncio.to_thread(self.store.add, job, data)
        self._pending.append(job.id)
        assert self._wake is not None
        self._wake.set()
        return job

    async def get(self, job_id: str) -> Job:
        job = await asyncio.to_thread(self.store.get, job_id)
        if job is None:
            raise NotFoundError(f"No audio job with id '{job_id}'.", code="job_not_found")
        return job

    async def result(self, job_id: str) -> tuple[bytes, str]:
        job = await self.get(job_id)
        if not job.is_final:
            raise ConflictError(
                f"Audio job '{job_id}' is {job.status}; its result is not ready.", code="job_not_finished"
            )
        if job.status != "completed":
            reason = f": {job.error}" if job.error else ""
            raise ConflictError(f"Audio job '{job_id}' {job.status}{reason}", code=f"job_{job.status}")
        found = await asyncio.to_thread(self.store.result, job_id)
        if found is None:
            raise ConflictError(f"Audio job '{job_id}' has no result.", code="job_failed")
        return found

    async def delete(self, job_id: str) -> None:
        await self.get(job_id)  # 404 first
        if job_id in self._pending:
            self._pending.remove(job_id)
        if self._running is not None and self._running[0] == job_id:
            self._running[1].cancel()
        await asyncio.to_thread(self.store.delete, job_id)

    # -- the worker -----------------------------------------------------------------------
    async def _work(self) -> None:
        assert self._wake is not None
        while True:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            job_id = self._pending.pop(0)
            task = asyncio.create_task(self._run(job_id), name=f"audio-job-{job_id}")
            self._running = (job_id, task)
            try:
                await asyncio.shield(task)
            except asyncio.CancelledError:
                if not task.cancelled():  # the worker itself is stopping
                    task.cancel()
                    raise
            finally:
                self._running = None

    async def _run(self, job_id: str) -> None:
        job = await asyncio.to_thread(self.store.get, job_id)
        if job is None or job.is_final:
            return
        await asyncio.to_thread(self.store.started, job_id, time.time())
        data = await asyncio.to_thread(self.store.input, job_id)
        started = time.monotonic()
        try:
            result, media_type = await self.runners[job.task](job, data)
        except asyncio.CancelledError:
            log.info("audio job %s cancelled", job_id)
            raise
        except ArgosyError as exc:
            await asyncio.to_thread(self.store.finished, job_id, "failed", error=exc.message)
            log.info("audio job %s failed: %s", job_id, exc.message)
            return
        except Exception as exc:
            log.exception("audio job %s failed", job_id)
            await asyncio.to_thread(self.store.finished, job_id, "failed", error=f"internal error: {exc}")
            return
        await asyncio.to_thread(
            self.store.finished, job_id, "completed", result=result, result_type=media_type
        )
        log.info("audio job %s (%s) completed in %.1f s", job_id, job.task, time.monotonic() - started)
