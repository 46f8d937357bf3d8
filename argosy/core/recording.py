"""The core's way to the session store: every generation runs in a session (SPEC §5).

SessionRecorder owns the server's store and does every write on one thread, in the order the
writes were submitted, so a generation's output always lands after its inputs and a
continuation that waited for its predecessor's commit sees it. Reads run on worker threads
(SQLite in WAL mode reads in parallel with the writer).

A dialect describes what a generation records with a SessionSpec (its input messages per
prompt, metadata, ephemeral or not) on the CoreRequest; the core keeps a GenerationRecord per
stream: it opens the sessions as the generation starts (the inputs are committed while the
engine prefills, never waited for), logs each choice's events (session_log.ChoiceLog) and
commits them in one append when the stream ends. A choice j > 0 of a prompt is a fork of
choice 0's session at the end of the inputs, so n samples are n branches of one
conversation. The Responses API opens its session itself, before generating (its id is the
response id), and waits for the commit before it answers.

Recording never breaks a generation: a failed write is logged, and the response is served.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from argosy.chat.events import Usage
from argosy.core.session_log import ChoiceLog
from argosy.sessions.events import MessageAppended, SessionEvent
from argosy.sessions.sqlite import SqliteSessionStore
from argosy.sessions.store import SessionStore

log = logging.getLogger("argosy.sessions")

T = TypeVar("T")

SESSIONS_FILE = "sessions.sqlite3"
_MAX_SWEEP_INTERVAL_S = 600.0


def open_recorder(data_dir: Path, *, ttl_seconds: float, max_bytes: int | None) -> SessionRecorder:
    """The store in `data_dir` (created if missing), with its sweeper running."""
    store = SqliteSessionStore(data_dir / SESSIONS_FILE, ttl_seconds=ttl_seconds, max_bytes=max_bytes)
    store.start_sweeper(min(_MAX_SWEEP_INTERVAL_S, ttl_seconds / 4))
    return SessionRecorder(store)


class SessionRecorder:
    """A SessionStore with one writer thread (submission order) and threaded reads."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self._writer = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="argosy-sessions"
        )

    def submit(self, what: str, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        """Queue a write; a failure is logged (as `what`) and left in the future."""
        future = self._writer.submit(fn, *args)
        future.add_done_callback(lambda done: _log_failure(done, what))
        return future

    async def write(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(self.submit(what, fn, *args))

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.to_thread(fn, *args)

    def close(self) -> None:
        """Finish the queued writes, then close the store (and its sweeper)."""
        self._writer.shutdown(wait=True)
        self.store.close()


def _log_failure(future: concurrent.futures.Future[Any], what: str) -> None:
    if future.cancelled():
        return
    exc = future.exception()
    if exc is not None:
        log.error("session store: %s failed: %s: %s", what, type(exc).__name__, exc)


@dataclass(slots=True)
class SessionSpec:
    """What a generation records. `inputs[p]`: the events (messages) that prompt p's session
    starts with. `session_id`: a session the dialect opened already, holding its inputs
    through seq `input_end_seq` (one prompt, n == 1); the output is appended to it.
    `keeps_logprobs`: text spans keep their tokens' logprobs (session_log.ChoiceLog), for a
    dialect that rebuilds them from the session (a stored response)."""

    inputs: list[list[SessionEvent]]
    metadata: dict[str, Any] = field(default_factory=dict)
    is_ephemeral: bool = True
    session_id: str | None = None
    input_end_seq: int = 0
    keeps_logprobs: bool = False
    continues: str | None = None  # the session this turn carries on from (a previous response's)

    def affinity(self) -> tuple[str, ...]:
        """The sessions this generation belongs with: where the one it continues ran, a fleet
        runs it too (argosy/fleet/placement.py)."""
        return tuple(key for key in (self.continues, self.session_id) if key)


def prompt_spec(prompts: Sequence[list[int]], metadata: dict[str, Any]) -> SessionSpec:
    """The spec of a generation whose dialect gave none: each prompt's token ids, as is."""
    inputs: list[list[SessionEvent]] = [
        [MessageAppended("prompt", [{"type": "token_ids", "token_ids": list(ids)}])] for ids in prompts
    ]
    return SessionSpec(inputs=inputs, metadata=metadata)


class GenerationRecord:
    """One CoreStream's sessions: open at the start, log the events, commit at the end.
    Never raises: a failure is logged and the rest of the generation goes unrecorded.

    `choice_prompts[i]` is the prompt index of choice i (choices of one prompt are adjacent,
    the first of them recorded in the prompt's own session).
    """

    def __init__(self, recorder: SessionRecorder, spec: SessionSpec, choice_prompts: list[int]) -> None:
        self.spec = spec
        self.logs = [ChoiceLog(keeps_logprobs=spec.keeps_logprobs) for _ in choice_prompts]
        self.committed: concurrent.futures.Future[list[str]] | None = None
        self.outputs: list[list[SessionEvent]] = []  # per choice, once committed (stored or not)
        self._recorder = recorder
        self._choice_prompts = choice_prompts
        self._opened: list[concurrent.futures.Future[str]] = []
        self._is_broken = False

    def open(self) -> None:
        """Queue the creation of each prompt's session with its inputs (unless the dialect
        opened it)."""
        if self.spec.session_id is not None:
            return
        try:
            for inputs in self.spec.inputs:
                self._opened.append(self._recorder.submit("create session", self._create, inputs))
        except Exception:  # e.g. the writer is shut down: the generation goes on, unrecorded
            self._break("open")

    def add_token_ids(self, index: int, token_ids: list[int]) -> None:
        if not self._is_broken:
            try:
                self.logs[index].add_token_ids(token_ids)
            except Exception:
                self._break("log token ids")

    def add(self, event: Any) -> None:
        if not self._is_broken:
            try:
                self.logs[event.index].add(event)
            except Exception:
                self._break(f"log {type(event).__name__}")

    def commit(
        self, unfinished_reason: str, usages: Sequence[Usage] | None = None
    ) -> concurrent.futures.Future[list[str]] | None:
        """Queue the output of every choice (`usages[i]`: choice i's usage so far, recorded
        when it never finished); the future gives each choice's session id (None when
        recording broke: nothing is written, the generation was served)."""
        if self._is_broken:
            return None
        try:
            self.outputs = [
                choice_log.events(unfinished_reason, usages[i] if usages is not None else None)
                for i, choice_log in enumerate(self.logs)
            ]
            self.committed = self._recorder.submit("record generation", self._write, self.outputs)
        except Exception:
            self._break("commit")
        return self.committed

    def _break(self, what: str) -> None:
        log.exception("session recording failed (%s); the generation goes on unrecorded", what)
        self._is_broken = True

    def _create(self, inputs: list[SessionEvent]) -> str:
        spec = self.spec
        return self._recorder.store.create(
            metadata=spec.metadata, ephemeral=spec.is_ephemeral, events=inputs
        ).id

    def _write(self, outputs: list[list[SessionEvent]]) -> list[str]:
        store = self._recorder.store
        session_ids: list[str] = []
        seen_prompts: set[int] = set()
        for prompt_index, events in zip(self._choice_prompts, outputs, strict=True):
            if self.spec.session_id is not None:
                base, input_end = self.spec.session_id, self.spec.input_end_seq
            else:
                base, input_end = self._opened[prompt_index].result(), len(self.spec.inputs[prompt_index])
            if prompt_index in seen_prompts:
                fork = store.fork(base, at_event=input_end, ephemeral=self.spec.is_ephemeral, events=events)
                session_ids.append(fork.id)
            else:
                store.append(base, events)
                session_ids.append(base)
                seen_prompts.add(prompt_index)
        return session_ids


def new_record(
    recorder: SessionRecorder | None,
    spec: SessionSpec | None,
    prompts: Sequence[list[int]],
    route: str,
    choices: Sequence[Any],
) -> GenerationRecord | None:
    """The record of a generation about to start (None when the server keeps no sessions);
    a generation whose dialect described no session records its raw prompts."""
    if recorder is None:
        return None
    spec = spec or prompt_spec(prompts, {"kind": "generation", "route": route})
    return GenerationRecord(recorder, spec, [choice.prompt_index for choice in choices])
