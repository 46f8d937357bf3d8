"""Sweeper: applies a session store's retention on a daemon thread, every `interval_s`."""

from __future__ import annotations

import logging
import threading

from argosy.errors import InvalidRequestError
from argosy.sessions.store import SessionStore

logger = logging.getLogger(__name__)


class Sweeper:
    """Calls `store.sweep()` once at start, then every `interval_s` until `stop()`.

    A failed sweep is logged and retried next interval; it never stops the thread.
    """

    def __init__(self, store: SessionStore, interval_s: float) -> None:
        if interval_s <= 0:
            raise InvalidRequestError("sweep interval must be positive", "interval_s")
        self._store = store
        self._interval_s = interval_s
        self._stop_requested = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="argosy-session-sweeper", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the thread to end and wait for it (a sweep in progress finishes first)."""
        self._stop_requested.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop_requested.is_set():
            try:
                num_deleted = self._store.sweep()
                if num_deleted:
                    logger.info("session sweep deleted %d session(s)", num_deleted)
            except Exception:
                logger.exception("session sweep failed; retrying in %.0f s", self._interval_s)
            self._stop_requested.wait(self._interval_s)
