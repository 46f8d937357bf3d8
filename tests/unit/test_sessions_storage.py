"""SQLite failures that are the disk's become StorageError / StorageFullError naming the store.

SQLite gives the same result codes for a real full or read-only disk as for its own limits:
`PRAGMA max_page_count` at the database's size makes the next growth SQLITE_FULL, and
`PRAGMA query_only` makes every write SQLITE_READONLY. (tests/faults/test_storage.py fills a
real disk under a real server.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from argosy.errors import StorageError, StorageFullError
from argosy.sessions.events import MessageAppended
from argosy.sessions.sqlite import SqliteSessionStore


def test_full_then_room_again(tmp_path: Path) -> None:
    with SqliteSessionStore(tmp_path / "s.sqlite3") as store:
        kept = store.create(metadata={"n": 1}, events=[MessageAppended("user", "hello")])
        conn = store._connection()
        (pages,) = conn.execute("PRAGMA page_count").fetchone()
        conn.execute(f"PRAGMA max_page_count = {pages}")
        with pytest.raises(StorageFullError) as caught:
            for _ in range(200):  # until a page must be added
                store.create(metadata={"big": "x" * 4000}, events=[MessageAppended("user", "y" * 4000)])
        assert caught.value.kind == "storage_full" and caught.value.code == "storage_full"
        assert "session store is out of disk space" in caught.value.message
        assert [e.event for e in store.read(kept.id)] == [MessageAppended("user", "hello")]
        conn.execute("PRAGMA max_page_count = 1073741823")
        store.append(kept.id, [MessageAppended("assistant", "hi")])
        assert len(store.read(kept.id)) == 2


def test_read_only_then_writable_again(tmp_path: Path) -> None:
    with SqliteSessionStore(tmp_path / "s.sqlite3") as store:
        kept = store.create(events=[MessageAppended("user", "hello")])
        conn = store._connection()
        conn.execute("PRAGMA query_only = 1")
        with pytest.raises(StorageError) as caught:
            store.append(kept.id, [MessageAppended("assistant", "hi")])
        assert not isinstance(caught.value, StorageFullError)
        assert caught.value.kind == "storage_unavailable" and "read-only" in caught.value.message
        with pytest.raises(StorageError):
            store.create(events=[MessageAppended("user", "again")])
        assert store.get(kept.id) is not None and len(store.read(kept.id)) == 1  # reads work
        conn.execute("PRAGMA query_only = 0")
        store.append(kept.id, [MessageAppended("assistant", "hi")])
        assert len(store.read(kept.id)) == 2


def test_storage_errors_render_as_503_and_507() -> None:
    from argosy.api.errors import openai_error_body, status_of

    assert status_of(StorageError("read-only")) == 503
    assert status_of(StorageFullError("full")) == 507
    body = openai_error_body(StorageFullError("The session store is out of disk space."))
    assert body["error"]["type"] == "server_error" and body["error"]["code"] == "storage_full"
