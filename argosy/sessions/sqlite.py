"""SqliteSessionStore: the embedded default SessionStore, one SQLite file in WAL mode.

Durability: WAL with synchronous=NORMAL. A transaction is committed once its frames are in
the WAL file; the OS holds them even if the process dies, so everything committed before a
`kill -9` is there on the next open (SQLite replays the WAL). Only an OS crash or power loss
can lose the last few commits, never corrupt the file; `synchronous="FULL"` closes that gap
at the cost of an fsync per commit.

Threads: each thread gets its own connection, kept until close() (so meant for a bounded
pool of threads); readers run in parallel under WAL. Writers take an in-process lock, then
BEGIN IMMEDIATE, so they queue instead of spinning on SQLITE_BUSY; `busy_timeout` covers
other processes sharing the file.

Deleting a session with forks: its row is hidden (`deleted_at`) and its events past the
furthest fork point trimmed; the rest is purged when the last fork referring to it goes,
recursively up the chain. Forks therefore never copy and deletion never rewrites them.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from argosy.errors import ArgosyError, InvalidRequestError, NotFoundError
from argosy.sessions.events import SessionEvent, decode_event, encode_event
from argosy.sessions.sqlite_errors import storage_errors
from argosy.sessions.sqlite_schema import ensure_schema
from argosy.sessions.store import DEFAULT_TTL_SECONDS, ForkPoint, Session, StoredEvent
from argosy.sessions.sweeper import Sweeper

_SESSION_COLUMNS = "id, created_at, updated_at, metadata, is_ephemeral, last_seq, parent_id, parent_at"
_SWEEP_BATCH = 256  # deletions per write transaction, so appends are not held up for long

# The full logical history: walk up the fork chain, narrowing the visible seq range at each
# fork point, and take each ancestor's own events within it. Ranges never overlap, because a
# fork's own events start after its fork point.
_READ_HISTORY = """
WITH RECURSIVE chain(id, through) AS (
    SELECT id, last_seq FROM sessions WHERE id = ?
    UNION ALL
    SELECT s.parent_id, MIN(c.through, s.parent_at)
    FROM chain AS c JOIN sessions AS s ON s.id = c.id
    WHERE s.parent_id IS NOT NULL
)
SELECT e.seq, e.created_at, e.kind, e.payload, e.session_id
FROM chain AS c JOIN events AS e ON e.session_id = c.id AND e.seq <= c.through
ORDER BY e.seq
"""


class SqliteSessionStore:
    """SessionStore on one SQLite file. See the module docstring for durability and threads.

    Retention (`sweep`): sessions not updated for `ttl_seconds` are deleted, ephemeral ones
    after `ephemeral_ttl_seconds`; then, past `max_sessions` visible sessions or `max_bytes`
    of stored event payloads, the least recently updated go, ephemeral ones first.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        ttl_seconds: float = DEFAULT_TTL_SECONDS,
        ephemeral_ttl_seconds: float = 3600.0,
        max_sessions: int | None = None,
        max_bytes: int | None = None,
        busy_timeout_ms: int = 10_000,
        synchronous: str = "NORMAL",
        clock: Callable[[], float] = time.time,
    ) -> None:
        if str(path) == ":memory:" or str(path).startswith("file:"):
            raise InvalidRequestError("the session store needs a file path", "path")
        if ttl_seconds <= 0 or ephemeral_ttl_seconds <= 0:
            raise InvalidRequestError("session TTLs must be positive", "ttl_seconds")
        if max_sessions is not None and max_sessions < 0:
            raise InvalidRequestError("max_sessions must be at least 0", "max_sessions")
        if max_bytes is not None and max_bytes < 0:
            raise InvalidRequestError("max_bytes must be at least 0", "max_bytes")
        if synchronous not in ("NORMAL", "FULL"):
            raise InvalidRequestError("synchronous must be NORMAL or FULL", "synchronous")
        self.path = Path(path)
        self.ttl_seconds = ttl_seconds
        self.ephemeral_ttl_seconds = ephemeral_ttl_seconds
        self.max_sessions = max_sessions
        self.max_bytes = max_bytes
        self._busy_timeout_ms = busy_timeout_ms
        self._synchronous = synchronous
        self._clock = clock
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._connections_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._sweeper: Sweeper | None = None
        self._is_closed = False

        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            conn = self._connection()
            # persistent in the file; must run outside a transaction
            (mode,) = conn.execute("PRAGMA journal_mode = WAL").fetchone()
            if str(mode).lower() != "wal":
                raise ArgosyError(f"could not put {self.path} in WAL mode (got {mode})")
            ensure_schema(conn)
        except sqlite3.DatabaseError as exc:
            self.close()
            raise ArgosyError(f"cannot open session database {self.path}: {exc}") from exc
        except BaseException:
            self.close()
            raise

    # ---- SessionStore ------------------------------------------------------------------

    @storage_errors
    def create(
        self,
        metadata: Mapping[str, Any] | None = None,
        ephemeral: bool = False,
        events: Sequence[SessionEvent] = (),
    ) -> Session:
        metadata_json = _dump_metadata(metadata or {})
        encoded = [encode_event(event) for event in events]
        session_id = uuid.uuid4().hex
        with self._write() as conn:
            now = self._clock()
            conn.execute(
                "INSERT INTO sessions (id, created_at, updated_at, metadata, is_ephemeral, last_seq)"
                " VALUES (?, ?, ?, ?, ?, 0)",
                (session_id, now, now, metadata_json, int(ephemeral)),
            )
            _insert_events(conn, session_id, 0, encoded, now)
            return _load_session(conn, session_id)

    @storage_errors
    def append(self, session_id: str, events: Sequence[SessionEvent]) -> list[int]:
        encoded = [encode_event(event) for event in events]
        with self._write() as conn:
            last_seq = _visible_row(conn, session_id, "last_seq")[0]
            return _insert_events(conn, session_id, last_seq, encoded, self._clock())

    @storage_errors
    def read(self, session_id: str) -> list[StoredEvent]:
        conn = self._connection()
        conn.execute("BEGIN")  # one snapshot for the check and the history
        try:
            _visible_row(conn, session_id, "id")
            rows = conn.execute(_READ_HISTORY, (session_id,)).fetchall()
        finally:
            conn.execute("COMMIT")
        return [
            StoredEvent(seq=seq, created_at=created_at, event=decode_event(kind, payload), session_id=owner)
            for seq, created_at, kind, payload, owner in rows
        ]

    @storage_errors
    def get(self, session_id: str) -> Session | None:
        conn = self._connection()
        row = conn.execute(
            f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE id = ? AND deleted_at IS NULL", (session_id,)
        ).fetchone()
        return None if row is None else _session_from_row(row)

    @storage_errors
    def recent(self, limit: int = 50) -> list[Session]:
        """The most recently updated visible sessions, newest first (the CLI's listing)."""
        rows = self._connection().execute(
            f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE deleted_at IS NULL ORDER BY updated_at DESC LIMIT ?",
            (limit,),
        )
        return [_session_from_row(row) for row in rows]

    @storage_errors
    def fork(
        self,
        session_id: str,
        at_event: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        ephemeral: bool = False,
        events: Sequence[SessionEvent] = (),
    ) -> Session:
        metadata_json = None if metadata is None else _dump_metadata(metadata)
        encoded = [encode_event(event) for event in events]
        child_id = uuid.uuid4().hex
        with self._write() as conn:
            parent_last_seq, parent_metadata = _visible_row(conn, session_id, "last_seq, metadata")
            at = parent_last_seq if at_event is None else at_event
            if not 0 <= at <= parent_last_seq:
                raise InvalidRequestError(
                    f"at_event must be between 0 and {parent_last_seq} for session {session_id!r}, got {at}",
                    "at_event",
                )
            now = self._clock()
            conn.execute(
                "INSERT INTO sessions (id, created_at, updated_at, parent_id, parent_at, metadata,"
                " is_ephemeral, last_seq) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (child_id, now, now, session_id, at, metadata_json or parent_metadata, int(ephemeral), at),
            )
            _insert_events(conn, child_id, at, encoded, now)
            return _load_session(conn, child_id)

    @storage_errors
    def delete(self, session_id: str) -> None:
        with self._write() as conn:
            _visible_row(conn, session_id, "id")
            _delete(conn, session_id, self._clock())

    @storage_errors
    def sweep(self, now: float | None = None) -> int:
        now = self._clock() if now is None else now
        num_deleted = self._sweep_where(
            "(updated_at < ? OR (is_ephemeral = 1 AND updated_at < ?))",
            (now - self.ttl_seconds, now - self.ephemeral_ttl_seconds),
            now,
        )
        if self.max_sessions is not None:
            num_deleted += self._sweep_over_count(self.max_sessions, now)
        if self.max_bytes is not None:
            num_deleted += self._sweep_over_bytes(self.max_bytes, now)
        return num_deleted

    def close(self) -> None:
        """Stop the sweeper and close every thread's connection. Call once no operation is
        in flight; later calls raise ArgosyError."""
        if self._sweeper is not None:
            self._sweeper.stop()
            self._sweeper = None
        self._is_closed = True
        with self._connections_lock:
            connections, self._connections = self._connections, []
        for conn in connections:
            conn.close()

    # ---- extras ------------------------------------------------------------------------

    def start_sweeper(self, interval_s: float) -> Sweeper:
        """Run `sweep()` now and every `interval_s` on a daemon thread; `close()` stops it."""
        if self._sweeper is None:
            self._sweeper = Sweeper(self, interval_s)
            self._sweeper.start()
        return self._sweeper

    @storage_errors
    def total_bytes(self) -> int:
        """Stored event payload bytes, hidden sessions' kept events included."""
        (num_bytes,) = (
            self._connection().execute("SELECT COALESCE(SUM(num_bytes), 0) FROM sessions").fetchone()
        )
        return int(num_bytes)

    def __enter__(self) -> SqliteSessionStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- tables kept beside the sessions (argosy/sessions/jobs.py) -------------------------

    def reader(self) -> sqlite3.Connection:
        """This thread's connection, for reads of a table kept in this file."""
        return self._connection()

    def transaction(self) -> contextlib.AbstractContextManager[sqlite3.Connection]:
        """One write transaction on this file (the store's writers queue with it)."""
        return self._write()

    # ---- internals ---------------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        if self._is_closed:
            raise ArgosyError(f"session store {self.path} is closed")
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            # check_same_thread=False only so close() may close every thread's connection
            conn = sqlite3.connect(
                self.path,
                timeout=self._busy_timeout_ms / 1000,
                isolation_level=None,
                check_same_thread=False,
            )
            try:
                conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")
                conn.execute("PRAGMA foreign_keys = ON")
                # WAL + NORMAL: a COMMIT that returned survives kill -9 of this process (the
                # frames are in the WAL file, replayed on open); only power loss can drop the
                # last commits.
                conn.execute(f"PRAGMA synchronous = {self._synchronous}")
            except BaseException:
                conn.close()
                raise
            self._local.conn = conn
            with self._connections_lock:
                self._connections.append(conn)
        return conn

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: committed when the block ends, rolled back if it raises."""
        conn = self._connection()
        with self._write_lock:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise

    def _sweep_where(self, condition: str, params: tuple[float, ...], now: float) -> int:
        num_deleted = 0
        while True:
            with self._write() as conn:
                ids = [
                    row[0]
                    for row in conn.execute(
                        f"SELECT id FROM sessions WHERE deleted_at IS NULL AND {condition}"
                        " ORDER BY updated_at, rowid LIMIT ?",
                        (*params, _SWEEP_BATCH),
                    )
                ]
                for session_id in ids:
                    _delete(conn, session_id, now)
            num_deleted += len(ids)
            if len(ids) < _SWEEP_BATCH:
                return num_deleted

    def _sweep_over_count(self, max_sessions: int, now: float) -> int:
        num_deleted = 0
        while True:
            with self._write() as conn:
                (num_visible,) = conn.execute(
                    "SELECT COUNT(*) FROM sessions WHERE deleted_at IS NULL"
                ).fetchone()
                num_excess = min(num_visible - max_sessions, _SWEEP_BATCH)
                if num_excess <= 0:
                    return num_deleted
                for session_id in _least_recently_updated(conn, num_excess):
                    _delete(conn, session_id, now)
            num_deleted += num_excess

    def _sweep_over_bytes(self, max_bytes: int, now: float) -> int:
        # Hidden sessions' kept events count too; deleting a session with forks may free
        # nothing, so go one victim at a time and re-measure.
        num_deleted = 0
        while True:
            with self._write() as conn:
                for _ in range(_SWEEP_BATCH):
                    (num_bytes,) = conn.execute("SELECT COALESCE(SUM(num_bytes), 0) FROM sessions").fetchone()
                    victims = _least_recently_updated(conn, 1) if num_bytes > max_bytes else []
                    if not victims:
                        return num_deleted
                    _delete(conn, victims[0], now)
                    num_deleted += 1


def _dump_metadata(metadata: Mapping[str, Any]) -> str:
    try:
        return json.dumps(dict(metadata), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"session metadata is not JSON-serialisable: {exc}", "metadata") from exc


def _visible_row(conn: sqlite3.Connection, session_id: str, columns: str) -> tuple[Any, ...]:
    row = conn.execute(
        f"SELECT {columns} FROM sessions WHERE id = ? AND deleted_at IS NULL", (session_id,)
    ).fetchone()
    if row is None:
        raise NotFoundError(f"session {session_id!r} not found (never created, deleted or expired)")
    return tuple(row)


def _session_from_row(row: tuple[Any, ...]) -> Session:
    session_id, created_at, updated_at, metadata, is_ephemeral, last_seq, parent_id, parent_at = row
    return Session(
        id=session_id,
        created_at=created_at,
        updated_at=updated_at,
        metadata=json.loads(metadata),
        is_ephemeral=bool(is_ephemeral),
        last_seq=last_seq,
        parent=None if parent_id is None else ForkPoint(parent_id, parent_at),
    )


def _load_session(conn: sqlite3.Connection, session_id: str) -> Session:
    row = conn.execute(f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE id = ?", (session_id,)).fetchone()
    return _session_from_row(row)


def _insert_events(
    conn: sqlite3.Connection, session_id: str, last_seq: int, encoded: list[tuple[str, str]], now: float
) -> list[int]:
    """Give `encoded` the seqs after `last_seq` and insert them (inside the caller's transaction)."""
    if not encoded:
        return []
    seqs = list(range(last_seq + 1, last_seq + 1 + len(encoded)))
    conn.executemany(
        "INSERT INTO events (session_id, seq, kind, created_at, payload) VALUES (?, ?, ?, ?, ?)",
        [(session_id, seq, kind, now, payload) for seq, (kind, payload) in zip(seqs, encoded, strict=True)],
    )
    num_bytes = sum(len(payload.encode()) for _, payload in encoded)
    conn.execute(
        "UPDATE sessions SET last_seq = ?, updated_at = MAX(updated_at, ?), num_bytes = num_bytes + ?"
        " WHERE id = ?",
        (seqs[-1], now, num_bytes, session_id),
    )
    return seqs


def _least_recently_updated(conn: sqlite3.Connection, limit: int) -> list[str]:
    rows = conn.execute(
        "SELECT id FROM sessions WHERE deleted_at IS NULL ORDER BY is_ephemeral DESC, updated_at, rowid LIMIT ?",
        (limit,),
    )
    return [row[0] for row in rows]


def _fork_reach(conn: sqlite3.Connection, session_id: str) -> int | None:
    """The furthest seq of `session_id` any direct fork refers to; None when it has no forks."""
    (num_forks, furthest) = conn.execute(
        "SELECT COUNT(*), MAX(parent_at) FROM sessions WHERE parent_id = ?", (session_id,)
    ).fetchone()
    return furthest if num_forks else None


def _trim(conn: sqlite3.Connection, session_id: str, through_seq: int) -> None:
    """Drop a hidden session's own events no fork can reach any more."""
    conn.execute("DELETE FROM events WHERE session_id = ? AND seq > ?", (session_id, through_seq))
    conn.execute(
        "UPDATE sessions SET num_bytes = (SELECT COALESCE(SUM(LENGTH(CAST(payload AS BLOB))), 0)"
        " FROM events WHERE session_id = ?) WHERE id = ?",
        (session_id, session_id),
    )


def _delete(conn: sqlite3.Connection, session_id: str, now: float) -> None:
    """Delete a visible session: hide it while forks refer to it, else purge it and any
    hidden ancestors this leaves unreferenced."""
    reach = _fork_reach(conn, session_id)
    if reach is not None:
        conn.execute("UPDATE sessions SET deleted_at = ? WHERE id = ?", (now, session_id))
        _trim(conn, session_id, reach)
        return
    while True:
        (parent_id,) = conn.execute("SELECT parent_id FROM sessions WHERE id = ?", (session_id,)).fetchone()
        conn.execute("DELETE FROM sessions WHERE id = ?", (session_id,))  # events cascade
        if parent_id is None:
            return
        (parent_deleted_at,) = conn.execute(
            "SELECT deleted_at FROM sessions WHERE id = ?", (parent_id,)
        ).fetchone()
        if parent_deleted_at is None:
            return
        reach = _fork_reach(conn, parent_id)
        if reach is not None:
            _trim(conn, parent_id, reach)
            return
        session_id = parent_id
