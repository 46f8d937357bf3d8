"""Sessions (SPEC §5): durable, forkable, append-only event logs of generations."""

from argosy.sessions.events import (
    Finished,
    MessageAppended,
    SessionEvent,
    SpanGenerated,
    ToolParseFailed,
    ToolUsed,
)
from argosy.sessions.sqlite import SqliteSessionStore
from argosy.sessions.store import ForkPoint, Session, SessionInfo, SessionStore, StoredEvent
from argosy.sessions.sweeper import Sweeper

__all__ = [
    "Finished",
    "ForkPoint",
    "MessageAppended",
    "Session",
    "SessionEvent",
    "SessionInfo",
    "SessionStore",
    "SpanGenerated",
    "SqliteSessionStore",
    "StoredEvent",
    "Sweeper",
    "ToolParseFailed",
    "ToolUsed",
]
