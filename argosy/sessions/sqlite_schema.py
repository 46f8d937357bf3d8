"""The SQLite session store's schema, its version, and the migrations between versions.

`sessions` holds one row per session, hidden ones included (`deleted_at` set: deleted, but
kept while forks refer to its events). `events` holds each session's own events only; a
fork reaches its inherited events through `parent_id` / `parent_at`. `jobs` holds the audio
jobs (argosy/sessions/jobs.py): their request, input and result, so a restart loses none.

To change the schema: bump SCHEMA_VERSION, change _CREATE for new files, and add the step
from the old version to _MIGRATIONS (statements run in one transaction with the version bump).
"""

from __future__ import annotations

import sqlite3

from argosy.errors import ArgosyError

SCHEMA_VERSION = 2

_JOBS = (
    """CREATE TABLE jobs (
        id TEXT PRIMARY KEY,
        task TEXT NOT NULL,
        model TEXT NOT NULL,
        status TEXT NOT NULL,
        created_at REAL NOT NULL,
        started_at REAL,
        finished_at REAL,
        request TEXT NOT NULL,
        input BLOB NOT NULL,
        result BLOB,
        result_type TEXT,
        error TEXT,
        attempts INTEGER NOT NULL DEFAULT 0
    )""",
    "CREATE INDEX jobs_by_status ON jobs(status, created_at)",
)

_CREATE = (
    "CREATE TABLE schema_version (version INTEGER NOT NULL)",
    """CREATE TABLE sessions (
        id TEXT PRIMARY KEY,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        parent_id TEXT REFERENCES sessions(id),
        parent_at INTEGER,
        metadata TEXT NOT NULL,
        is_ephemeral INTEGER NOT NULL,
        last_seq INTEGER NOT NULL,
        num_bytes INTEGER NOT NULL DEFAULT 0,
        deleted_at REAL,
        CHECK ((parent_id IS NULL) = (parent_at IS NULL))
    )""",
    "CREATE INDEX sessions_by_parent ON sessions(parent_id) WHERE parent_id IS NOT NULL",
    "CREATE INDEX sessions_by_update ON sessions(updated_at) WHERE deleted_at IS NULL",
    """CREATE TABLE events (
        session_id TEXT NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
        seq INTEGER NOT NULL,
        kind TEXT NOT NULL,
        created_at REAL NOT NULL,
        payload TEXT NOT NULL,
        PRIMARY KEY (session_id, seq)
    ) WITHOUT ROWID""",
    *_JOBS,
)

# version n -> the statements that take a version-n database to n + 1
_MIGRATIONS: dict[int, tuple[str, ...]] = {1: _JOBS}


def ensure_schema(conn: sqlite3.Connection) -> None:
    """Create the schema in an empty database or migrate an older one to SCHEMA_VERSION.

    `conn` must be in autocommit mode (isolation_level=None); runs in one IMMEDIATE
    transaction so two processes opening a new file do not both create it.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        has_version = conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
        ).fetchone()
        if has_version is None:
            for statement in _CREATE:
                conn.execute(statement)
            conn.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
        else:
            (version,) = conn.execute("SELECT version FROM schema_version").fetchone()
            if version > SCHEMA_VERSION:
                raise ArgosyError(
                    f"session database has schema version {version}; this Argosy reads up to {SCHEMA_VERSION}"
                )
            while version < SCHEMA_VERSION:
                for statement in _MIGRATIONS[version]:
                    conn.execute(statement)
                version += 1
            conn.execute("UPDATE schema_version SET version = ?", (version,))
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
