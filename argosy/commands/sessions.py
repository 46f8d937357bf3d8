"""`argosy sessions [list | show ID | fork ID [N] | delete ID]`: the stored conversations, read
from the session store in --data-dir (the server may be running: SQLite in WAL mode lets both
read and write)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from argosy.commands.models import CommandError, table
from argosy.core.recording import SESSIONS_FILE
from argosy.errors import ArgosyError
from argosy.sessions.events import encode_event
from argosy.sessions.sqlite import SqliteSessionStore


def _store(data_dir: str) -> SqliteSessionStore:
    path = Path(data_dir).expanduser() / SESSIONS_FILE
    if not path.is_file():
        raise CommandError(f"no session store at {path} (set --data-dir to the server's)")
    return SqliteSessionStore(path)


def _when(seconds: float) -> str:
    return datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M:%S")


def cmd_sessions(data_dir: str, action: str, session_id: str | None, at: int | None, limit: int) -> str:
    with _store(data_dir) as store:
        try:
            if action == "list":
                rows = [("ID", "UPDATED", "EVENTS", "KIND", "MODEL", "FORKED FROM")]
                for session in store.recent(limit):
                    meta = session.metadata
                    parent = (
                        f"{session.parent.session_id}@{session.parent.at_event}" if session.parent else "-"
                    )
                    rows.append(
                        (session.id, _when(session.updated_at), str(session.last_seq), str(meta.get("kind", "-")),
                         str(meta.get("model", "-")), parent)
                    )  # fmt: skip
                return table(rows)
            if session_id is None:
                raise CommandError(f"`argosy sessions {action}` needs a session id")
            if action == "show":
                found = store.get(session_id)
                if found is None:
                    raise CommandError(f"no session {session_id!r}")
                session = found
                lines = [
                    f"session {session.id}  created {_when(session.created_at)}  {json.dumps(session.metadata)}"
                ]
                for stored in store.read(session_id):
                    payload = encode_event(stored.event)[1]
                    lines.append(f"{stored.seq:>4}  {type(stored.event).__name__:<20} {payload[:200]}")
                return "\n".join(lines)
            if action == "fork":
                child = store.fork(session_id, at_event=at)
                return f"forked {session_id} at event {child.last_seq}: {child.id}"
            if action == "delete":
                store.delete(session_id)
                return f"deleted {session_id}"
        except ArgosyError as exc:
            raise CommandError(exc.message) from None
    raise CommandError(f"unknown action {action!r}: list, show, fork, delete")
