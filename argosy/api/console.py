"""The web console (`GET /console`) and the routes it reads, all under /v1/argosy/ (behind the
API key where keys are set; the page itself holds no data and asks for the key).

- `GET /v1/argosy/requests?limit=N`: the last finished requests (the ring buffer), accepted
  and refused alike; `GET /v1/argosy/requests/stream`: SSE, those first, then every request's
  `started` and `finished` events as they happen.
- `GET /v1/argosy/sessions?limit=N`, `GET /v1/argosy/sessions/{id}` (its event log as
  messages), `POST /v1/argosy/sessions/{id}/fork` (`{"at_event": N}`: a new session that sees
  the first N events).
- `GET /v1/argosy/stats`: per loaded chat model its engine's running / waiting requests, KV
  and prefix-cache figures; over the ring buffer's last `window` seconds, TTFT and
  inter-token latency percentiles and tokens per second (argosy/core/stats.py);
  `GET /v1/argosy/stats/history`: the server's own snapshots of the last hour.
- `GET /v1/argosy/requests/{id}`: one listed request, with its headers and bodies.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import asdict, is_dataclass
from importlib import resources
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from argosy.api.framing import SSEResponse, data_frame
from argosy.core.events import EventBus, RequestEvent, RingBuffer
from argosy.core.registry import ModelRegistry
from argosy.core.stats import StatsHistory, snapshot
from argosy.errors import InvalidRequestError, NotFoundError, StorageError

router = APIRouter()
MAX_LIMIT = 1000


def _limit(request: Request, default: int) -> int:
    try:
        value = int(request.query_params.get("limit", default))
    except ValueError:
        raise InvalidRequestError("limit must be an integer", "limit") from None
    if not 1 <= value <= MAX_LIMIT:
        raise InvalidRequestError(f"limit must be 1..{MAX_LIMIT}", "limit")
    return value


@router.get("/console", response_class=HTMLResponse, include_in_schema=False)
async def console_page() -> HTMLResponse:
    page = resources.files("argosy.api").joinpath("console.html").read_text(encoding="utf-8")
    return HTMLResponse(page, headers={"cache-control": "no-cache"})


@router.get("/v1/argosy/requests")
async def recent_requests(request: Request) -> JSONResponse:
    ring: RingBuffer = request.app.state.recent_requests
    events = ring.recent(_limit(request, 200))
    return JSONResponse({"object": "list", "data": [e.as_json() for e in events]})


@router.get("/v1/argosy/requests/stream", include_in_schema=False)  # endless: no fuzzer's case
async def request_stream(request: Request) -> Response:
    ring: RingBuffer = request.app.state.recent_requests
    bus: EventBus = request.app.state.events
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[RequestEvent] = asyncio.Queue(maxsize=10_000)

    def observe(event: RequestEvent) -> None:
        loop.call_soon_threadsafe(_offer, queue, event)

    backlog = ring.recent(_limit(request, 200))
    bus.subscribe(observe)

    async def frames() -> AsyncIterator[bytes]:
        try:
            for event in backlog:
                yield data_frame(event.as_json())
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), timeout=15)
                except TimeoutError:
                    yield b": keep-alive\n\n"
                    continue
                yield data_frame(event.as_json())
        finally:
            bus.observers.remove(observe)

    return SSEResponse(frames())


def _offer(queue: asyncio.Queue[RequestEvent], event: RequestEvent) -> None:
    if not queue.full():  # a console that stopped reading loses events, never the server's memory
        queue.put_nowait(event)


@router.get("/v1/argosy/requests/{request_id}")
async def request_detail(request: Request, request_id: str) -> JSONResponse:
    """(After /requests/stream, which it would shadow.) One listed request: its finished event, and (while kept) its headers and bodies."""
    ring: RingBuffer = request.app.state.recent_requests
    event = next((e for e in reversed(ring.recent()) if e.request_id == request_id), None)
    if event is None:
        raise NotFoundError(
            f"No recent request with id '{request_id}' (the console keeps the last "
            f"{request.app.state.server_config.events_ring_size}).",
            code="request_not_found",
        )
    exchange = request.app.state.exchanges.get(request_id)
    return JSONResponse({**event.as_json(), "exchange": exchange.as_json() if exchange is not None else None})


def _store(request: Request) -> Any:
    sessions = request.app.state.sessions
    if sessions is None:
        raise StorageError("This server runs without a session store.")
    return sessions.store


def _jsonable(value: Any) -> Any:
    return asdict(value) if is_dataclass(value) and not isinstance(value, type) else value


@router.get("/v1/argosy/sessions")
async def list_sessions(request: Request) -> JSONResponse:
    store = _store(request)
    sessions = await asyncio.to_thread(store.recent, _limit(request, 50))
    return JSONResponse({"object": "list", "data": [_session_json(s) for s in sessions]})


def _session_json(session: Any) -> dict[str, Any]:
    parent = session.parent
    return {
        "id": session.id,
        "created_at": session.created_at,
        "updated_at": session.updated_at,
        "metadata": session.metadata,
        "num_events": session.last_seq,
        "forked_from": None
        if parent is None
        else {"session_id": parent.session_id, "at_event": parent.at_event},
    }


@router.get("/v1/argosy/sessions/{session_id}")
async def session_events(request: Request, session_id: str) -> JSONResponse:
    store = _store(request)
    session = await asyncio.to_thread(store.get, session_id)
    if session is None:
        raise NotFoundError(f"No session with id '{session_id}'.", code="session_not_found")
    events = await asyncio.to_thread(store.read, session_id)
    return JSONResponse(
        {
            **_session_json(session),
            "events": [
                {"seq": e.seq, "created_at": e.created_at, "kind": e.event.kind, **_jsonable(e.event)}
                for e in events
            ],
        }
    )


@router.post("/v1/argosy/sessions/{session_id}/fork")
async def fork_session(request: Request, session_id: str) -> JSONResponse:
    store = _store(request)
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError:
        raise InvalidRequestError('The body must be JSON: {"at_event": N}.') from None
    at = body.get("at_event") if isinstance(body, dict) else None
    if at is not None and (not isinstance(at, int) or isinstance(at, bool)):
        raise InvalidRequestError("at_event must be an integer", "at_event")
    if await asyncio.to_thread(store.get, session_id) is None:
        raise NotFoundError(f"No session with id '{session_id}'.", code="session_not_found")
    child = await asyncio.to_thread(store.fork, session_id, at)
    return JSONResponse(_session_json(child))


@router.get("/v1/argosy/stats")
async def stats(request: Request) -> JSONResponse:
    registry: ModelRegistry = request.app.state.registry
    ring: RingBuffer = request.app.state.recent_requests
    try:
        window = float(request.query_params.get("window", 300))
    except ValueError:
        raise InvalidRequestError("window must be a number of seconds", "window") from None
    if not window > 0:
        raise InvalidRequestError("window must be a number of seconds > 0", "window")
    return JSONResponse(snapshot(registry, ring.recent(), window))


@router.get("/v1/argosy/stats/history")
async def stats_history(request: Request) -> JSONResponse:
    """The server's snapshots of the last hour (every `interval_s`, each over the `window_s`
    before it); `since`: only those taken after that time (seconds since the epoch)."""
    history: StatsHistory = request.app.state.stats_history
    since = request.query_params.get("since")
    try:
        after = float(since) if since is not None else None
    except ValueError:
        raise InvalidRequestError("since must be a time in seconds since the epoch", "since") from None
    return JSONResponse(
        {
            "object": "list",
            "interval_s": history.interval_s,
            "window_s": history.window_s,
            "data": history.since(after),
        }
    )
