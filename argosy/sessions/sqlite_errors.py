"""SQLite failures that are the disk's, not the request's, as the typed storage errors every
dialect renders (507 when full, 503 otherwise): the store's methods are wrapped in
`storage_errors`, which names the store's file (its `path`)."""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Callable
from typing import Any, TypeVar

from argosy.errors import StorageError, StorageFullError

# SQLite's primary result codes that say the disk, not the request, is at fault
_SQLITE_FULL = 13
_SQLITE_STORAGE_CODES = {
    3: "permission denied",  # SQLITE_PERM
    5: "database busy",  # SQLITE_BUSY
    6: "database locked",  # SQLITE_LOCKED
    8: "read-only",  # SQLITE_READONLY (a read-only file or file system)
    10: "disk I/O error",  # SQLITE_IOERR
    14: "cannot open the database file",  # SQLITE_CANTOPEN
}
_R = TypeVar("_R")


def storage_errors(method: Callable[..., _R]) -> Callable[..., _R]:
    """A store operation whose SQLite failure is the disk's (full, read-only, failing) raises
    StorageFullError / StorageError naming the store, so the client gets a 507/503 that says
    storage and the server stays up; it succeeds again once the disk does."""

    @functools.wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> _R:
        try:
            return method(self, *args, **kwargs)
        except sqlite3.Error as exc:
            code = getattr(exc, "sqlite_errorcode", None)
            primary = code & 0xFF if isinstance(code, int) else None
            if primary == _SQLITE_FULL:
                raise StorageFullError(
                    f"The session store is out of disk space ({self.path}: {exc}); nothing was stored."
                ) from exc
            if primary in _SQLITE_STORAGE_CODES:
                raise StorageError(
                    f"The session store is unavailable: {_SQLITE_STORAGE_CODES[primary]} ({self.path}: {exc})."
                ) from exc
            raise

    return guarded
