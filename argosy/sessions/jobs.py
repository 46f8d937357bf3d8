"""JobStore: audio jobs kept in the session store's SQLite file (table `jobs`), so a finished
result survives a restart and a job that was queued or running when the server stopped runs
again when it starts.

A job row holds its request (JSON), its input (the text to speak or the uploaded audio), and,
once finished, its result bytes and media type or its error. Finished jobs are kept until
deleted or older than the store's TTL (`sweep`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from argosy.sessions.sqlite import SqliteSessionStore

FINAL_STATES = ("completed", "failed", "cancelled")


@dataclass(slots=True)
class Job:
    id: str
    task: str  # speech | transcription | music
    model: str
    status: str  # queued | in_progress | completed | failed | cancelled
    created_at: float
    request: dict[str, Any] = field(default_factory=dict)
    started_at: float | None = None
    finished_at: float | None = None
    result_type: str | None = None
    result_bytes: int | None = None
    error: str | None = None
    attempts: int = 0

    @property
    def is_final(self) -> bool:
        return self.status in FINAL_STATES


_COLUMNS = (
    "id, task, model, status, created_at, request, started_at, finished_at, result_type, "
    "length(result), error, attempts"
)


def _job(row: tuple[Any, ...]) -> Job:
    return Job(
        id=row[0],
        task=row[1],
        model=row[2],
        status=row[3],
        created_at=row[4],
        request=json.loads(row[5]),
        started_at=row[6],
        finished_at=row[7],
        result_type=row[8],
        result_bytes=row[9],
        error=row[10],
        attempts=row[11],
    )


class JobStore:
    def __init__(self, store: SqliteSessionStore) -> None:
        self.store = store

    def add(self, job: Job, data: bytes) -> None:
        with self.store.transaction() as conn:
            conn.execute(
                "INSERT INTO jobs (id, task, model, status, created_at, request, input) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (job.id, job.task, job.model, job.status, job.created_at, json.dumps(job.request), data),
            )

    def get(self, job_id: str) -> Job | None:
        row = self.store.reader().execute(f"SELECT {_COLUMNS} FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else _job(row)

    def input(self, job_id: str) -> bytes:
        row = self.store.reader().execute("SELECT input FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return bytes(row[0]) if row is not None else b""

    def result(self, job_id: str) -> tuple[bytes, str] | None:
        row = (
            self.store.reader()
            .execute("SELECT result, result_type FROM jobs WHERE id = ?", (job_id,))
            .fetchone()
        )
        return None if row is None or row[0] is None else (bytes(row[0]), str(row[1]))

    def started(self, job_id: str, now: float) -> None:
        with self.store.transaction() as conn:
            conn.execute(
                "UPDATE jobs SET status = 'in_progress', started_at = ?, attempts = attempts + 1 WHERE id = ?",
                (now, job_id),
            )

    def finished(
        self, job_id: str, status: str, *, result: bytes | None = None, result_type: str | None = None,
        error: str | None = None, now: float | None = None,
    ) -> None:  # fmt: skip
        with self.store.transaction() as conn:
            conn.execute(
                "UPDATE jobs SET status = ?, finished_at = ?, result = ?, result_type = ?, error = ?, input = ? "
                "WHERE id = ?",
                (status, now or time.time(), result, result_type, error, b"", job_id),
            )

    def delete(self, job_id: str) -> bool:
        with self.store.transaction() as conn:
            return conn.execute("DELETE FROM jobs WHERE id = ?", (job_id,)).rowcount > 0

    def unfinished(self) -> list[Job]:
        """Jobs a previous run left queued or running, oldest first: they run again."""
        rows = self.store.reader().execute(
            f"SELECT {_COLUMNS} FROM jobs WHERE status IN ('queued', 'in_progress') ORDER BY created_at"
        )
        return [_job(row) for row in rows]

    def requeue(self, job_id: str) -> None:
        with self.store.transaction() as conn:
            conn.execute("UPDATE jobs SET status = 'queued', started_at = NULL WHERE id = ?", (job_id,))

    def sweep(self, older_than_s: float, now: float | None = None) -> int:
        cutoff = (now or time.time()) - older_than_s
        with self.store.transaction() as conn:
            return conn.execute(
                "DELETE FROM jobs WHERE status IN ('completed', 'failed', 'cancelled') AND finished_at < ?",
                (cutoff,),
            ).rowcount
