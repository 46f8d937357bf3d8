"""SessionStore: durable, forkable, append-only event logs (SPEC §5).

Invariants every store keeps:
- A session's events carry `seq` 1, 2, 3, … with no gaps, in append order. A fork's own
  events continue the numbering after its fork point, so `seq` is always the position in
  the session's full logical history.
- `append` is atomic: all of its events are committed, or none.
- A fork is copy-on-write: the child refers to its parent's events up to `at_event` and
  never copies them. Appending to either never changes what the other reads.
- Deleting a session that still has forks hides it at once (get -> None, everything else
  NotFoundError) but keeps the rows its forks refer to until the last fork is gone.

How the dialects use it (one or two calls each):
- Responses API, new response: `create(metadata=params, events=[...input messages])`, then
  `append` the generated spans and `Finished` as they are committed.
- `previous_response_id`: `fork(previous_id, metadata=params, events=[...new input])` forks at
  the previous response's end and adds the new turn in one transaction; then `append`.
- Chat completions: `create(metadata=..., ephemeral=not store)`; ephemeral sessions are the
  first to go when the store sweeps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from argosy.sessions.events import SessionEvent

DEFAULT_TTL_SECONDS = 30 * 86400


@dataclass(frozen=True, slots=True)
class ForkPoint:
    """Where a fork branched off: it sees `session_id`'s history through seq `at_event`."""

    session_id: str
    at_event: int  # 0: none of the parent's events


@dataclass(frozen=True, slots=True)
class Session:
    """A session's metadata. `last_seq` is the seq of the newest event in its full logical
    history (inherited events included); 0 when empty."""

    id: str
    created_at: float
    updated_at: float  # creation or the last append, whichever is later
    metadata: dict[str, Any]
    is_ephemeral: bool
    last_seq: int
    parent: ForkPoint | None = None


SessionInfo = Session  # the name the Sessions issue gives get()'s result


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """An event as committed. `session_id` is the session whose own log holds it: an
    ancestor's id for events a fork inherits."""

    seq: int
    created_at: float
    event: SessionEvent
    session_id: str


class SessionStore(Protocol):
    def create(
        self,
        metadata: Mapping[str, Any] | None = None,
        ephemeral: bool = False,
        events: Sequence[SessionEvent] = (),
    ) -> Session:
        """A new session holding `events` (seq 1…), created atomically with them."""
        ...

    def append(self, session_id: str, events: Sequence[SessionEvent]) -> list[int]:
        """Commit `events` atomically; their seqs. NotFoundError for an unknown session."""
        ...

    def read(self, session_id: str) -> list[StoredEvent]:
        """The full logical history, by seq: for a fork, its ancestors' events through the
        fork points, then its own."""
        ...

    def get(self, session_id: str) -> Session | None: ...

    def fork(
        self,
        session_id: str,
        at_event: int | None = None,
        metadata: Mapping[str, Any] | None = None,
        ephemeral: bool = False,
        events: Sequence[SessionEvent] = (),
    ) -> Session:
        """A new session that sees `session_id`'s history through `at_event` (default: its
        last event) followed by `events`. `metadata` None copies the parent's.
        InvalidRequestError when `at_event` is outside 0..last_seq."""
        ...

    def delete(self, session_id: str) -> None:
        """Remove the session from view; NotFoundError when it is unknown or already gone."""
        ...

    def sweep(self, now: float | None = None) -> int:
        """Apply retention (TTL, then size caps, least recently updated first); the number of
        sessions deleted."""
        ...

    def close(self) -> None: ...
