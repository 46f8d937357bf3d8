"""Request events: every HTTP request — /health, unknown routes and requests refused by the
gate included — produces a `started` and a `finished` RequestEvent, fanned out to observers
(an EventBus): a JSON-lines file (JsonlSink, rotated), an in-memory ring of the last N
requests (RingBuffer, which the console reads), Prometheus metrics (argosy/core/metrics.py).

The HTTP edge fills one RequestRecord per request as it learns things (its route template
and dialect once routed, the key's name once authenticated, the model once resolved, the
error it answered with, the generation's usage and timing once its stream closed) and emits
the events from it (api/transport.py, RequestEventsMiddleware). An observer must be quick
and must not raise: one that does is logged and the request goes on.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("argosy.events")

MAX_ERROR_CHARS = 500  # of an error message kept in an event


@dataclass(slots=True)
class RequestRecord:
    """What is known of one request so far (mutable; the events are snapshots of it)."""

    request_id: str
    method: str
    path: str
    client: str | None = None
    route: str | None = None  # "POST /v1/chat/completions" (the route's template) once routed
    dialect: str = "argosy"  # openai | anthropic | ollama | argosy (health, metrics, console)
    key_name: str | None = None  # the API key's name, once authenticated
    model_id: str | None = None  # once resolved (a served model's id: never a client's string)
    status: int | None = None
    error_kind: str | None = None  # the refusal's kind (unauthorized, rate_limited, not_found...)
    error: str | None = None  # the refusal's message, as the body said it
    # a generation's, once its stream closed
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    ttft_s: float | None = None  # arrival -> first output
    queue_s: float | None = None  # the engine took it -> first scheduled, as the engine says
    decode_tokens: int | None = None  # tokens after each choice's first output
    decode_s: float | None = None  # the span they took (inter-token latency = decode_s / decode_tokens)
    sampling: dict[str, Any] | None = None  # the effective sampling (x-argosy-sampling)
    started: float = field(default_factory=time.perf_counter)
    started_at: float = field(default_factory=time.time)  # wall clock

    def refused(self, kind: str, message: str) -> None:
        self.error_kind = kind
        self.error = message[:MAX_ERROR_CHARS]

    def event(self, kind: str) -> RequestEvent:
        return RequestEvent(
            kind=kind,
            request_id=self.request_id,
            route=self.route or f"{self.method} {self.path}",
            dialect=self.dialect,
            client=self.client,
            key_name=self.key_name,
            model_id=self.model_id,
            status=self.status,
            duration_s=time.perf_counter() - self.started if kind == "finished" else 0.0,
            error_kind=self.error_kind,
            error=self.error,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            finish_reason=self.finish_reason,
            ttft_s=self.ttft_s,
            queue_s=self.queue_s,
            decode_tokens=self.decode_tokens,
            decode_s=self.decode_s,
            sampling=self.sampling,
            timestamp=time.time(),
        )


@dataclass(frozen=True, slots=True)
class RequestEvent:
    kind: str  # started | finished
    request_id: str
    route: str  # "POST /v1/chat/completions"; an unrouted request: its method and path
    dialect: str
    client: str | None
    key_name: str | None
    model_id: str | None
    status: int | None  # finished: the HTTP status sent (499: the client left first)
    duration_s: float
    error_kind: str | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    ttft_s: float | None = None
    queue_s: float | None = None
    decode_tokens: int | None = None
    decode_s: float | None = None
    sampling: dict[str, Any] | None = None
    timestamp: float = 0.0  # wall clock, seconds since the epoch

    def as_json(self) -> dict[str, Any]:
        return {key: value for key, value in asdict(self).items() if value is not None}


class EventObserver(Protocol):
    def __call__(self, event: RequestEvent) -> None: ...


class EventBus:
    """Fans each event out to its observers; one that raises is logged, never the request's
    problem."""

    def __init__(self, observers: list[EventObserver] | None = None) -> None:
        self.observers: list[EventObserver] = list(observers or [])

    def subscribe(self, observer: EventObserver) -> None:
        self.observers.append(observer)

    def emit(self, event: RequestEvent) -> None:
        for observer in self.observers:
            try:
                observer(event)
            except Exception:
                log.exception("request event observer %r failed", observer)


class RingBuffer:
    """The last `size` finished requests (a `started` event is not kept: its finish follows)."""

    def __init__(self, size: int = 1000) -> None:
        self._events: deque[RequestEvent] = deque(maxlen=size)

    def __call__(self, event: RequestEvent) -> None:
        if event.kind == "finished":
            self._events.append(event)

    def recent(self, limit: int | None = None) -> list[RequestEvent]:
        events = list(self._events)
        return events if limit is None else events[-limit:]


class JsonlSink:
    """One JSON object per event and line in `path`, rotated at `max_bytes` (path.1 ... path.N,
    the oldest dropped). Writes are synchronous and small; a failing disk is logged once per
    minute and the event dropped."""

    def __init__(self, path: str | Path, max_bytes: int = 64 * 2**20, backups: int = 3) -> None:
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.backups = backups
        self._lock = threading.Lock()
        self._last_failure = 0.0

    def __call__(self, event: RequestEvent) -> None:
        line = json.dumps(event.as_json(), ensure_ascii=False, separators=(",", ":")) + "\n"
        with self._lock:
            try:
                if self.path.exists() and self.path.stat().st_size + len(line) > self.max_bytes:
                    self._rotate()
                with self.path.open("a", encoding="utf-8") as out:
                    out.write(line)
            except OSError:
                now = time.monotonic()
                if now - self._last_failure > 60:
                    log.exception("cannot write the events log %s; events are dropped", self.path)
                    self._last_failure = now

    def _rotate(self) -> None:
        for index in range(self.backups, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{index}")
            newer = self.path if index == 1 else self.path.with_name(f"{self.path.name}.{index - 1}")
            if newer.exists():
                os.replace(newer, older)


def dialect_of(path: str) -> str:
    """The dialect a path belongs to (its error envelope and its label in metrics)."""
    if path.startswith("/api/"):
        return "ollama"
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path in ("/tokenize", "/detokenize", "/tokenizer_info"):
        return "openai"  # vLLM's routes, in OpenAI's error shape
    if path.startswith("/v1/argosy") or not path.startswith("/v1/"):
        return "argosy"
    return "openai"
