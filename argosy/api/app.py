"""build_app(core, config): the routers, the middlewares and one way to render errors."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import Scope

from argosy.api import admin, console, metrics, rerank
from argosy.api import lora as lora_routes
from argosy.api import tokenizer as tokenizer_routes
from argosy.api.anthropic import messages as anthropic_messages
from argosy.api.errors import (
    APIError,
    anthropic_error_body,
    anthropic_status_of,
    headers_of,
    internal_error,
    ollama_error_body,
    ollama_status_of,
    openai_error_body,
    status_of,
)
from argosy.api.gate import Gate, GateMiddleware
from argosy.api.ollama import generate as ollama_generate
from argosy.api.ollama import models as ollama_models
from argosy.api.ollama import pull as ollama_pull
from argosy.api.openai import audio_jobs as openai_audio_jobs
from argosy.api.openai import chat as openai_chat
from argosy.api.openai import completions as openai_completions
from argosy.api.openai import embeddings as openai_embeddings
from argosy.api.openai import images as openai_images
from argosy.api.openai import models as openai_models
from argosy.api.openai import realtime as openai_realtime
from argosy.api.openai import speech as openai_speech
from argosy.api.openai import transcriptions as openai_transcriptions
from argosy.api.openai.responses import route as openai_responses
from argosy.api.openapi import openapi_document
from argosy.api.transport import (
    ArrivalMiddleware,
    BodyLimitMiddleware,
    DrainMiddleware,
    RequestEventsMiddleware,
    RequestIdMiddleware,
    request_record,
)
from argosy.config import ServerConfig
from argosy.core.drain import Drain
from argosy.core.events import EventBus, JsonlSink, RequestEvent, RingBuffer
from argosy.core.exchanges import ExchangeStore
from argosy.core.jobs import JobQueue
from argosy.core.metrics import ServerMetrics
from argosy.core.pipeline import Pipeline
from argosy.core.recording import SessionRecorder
from argosy.core.registry import ModelRegistry
from argosy.core.stats import StatsHistory, snapshot
from argosy.errors import ArgosyError, InvalidRequestError
from argosy.sessions.jobs import JobStore
from argosy.sessions.sqlite import SqliteSessionStore

log = logging.getLogger("argosy.access")

ErrorRenderer = Callable[[ArgosyError], dict[str, Any]]
ErrorStatus = Callable[[ArgosyError], int]


class ErrorRenderers:
    """Each dialect's error envelope and statuses, registered by route path, or by a path
    prefix that is a dialect's own (`/api/`: Ollama): an error on a route renders in that
    route's dialect; anything else, unknown routes included, in OpenAI's."""

    def __init__(self, default: ErrorRenderer = openai_error_body, status: ErrorStatus = status_of) -> None:
        self.default = (default, status)
        self._by_path: dict[str, tuple[ErrorRenderer, ErrorStatus]] = {}
        self._by_prefix: list[tuple[str, tuple[ErrorRenderer, ErrorStatus]]] = []

    def register(self, path: str, render: ErrorRenderer, status: ErrorStatus = status_of) -> None:
        self._by_path[path] = (render, status)

    def register_prefix(self, prefix: str, render: ErrorRenderer, status: ErrorStatus = status_of) -> None:
        self._by_prefix.append((prefix, (render, status)))

    def dialect_for(self, scope: Scope) -> tuple[ErrorRenderer, ErrorStatus]:
        route = scope.get("route")
        path_format = getattr(route, "path", None) if route is not None else None
        if path_format is not None and path_format in self._by_path:
            return self._by_path[path_format]
        path = scope.get("path", "")
        if path in self._by_path:
            return self._by_path[path]
        return next((dialect for prefix, dialect in self._by_prefix if path.startswith(prefix)), self.default)

    def for_scope(self, scope: Scope) -> ErrorRenderer:
        return self.dialect_for(scope)[0]


def _renderers(request_or_scope: Any) -> ErrorRenderers:
    app = request_or_scope["app"] if isinstance(request_or_scope, dict) else request_or_scope.app
    renderers: ErrorRenderers = app.state.error_renderers
    return renderers


def error_response(scope: Scope, error: ArgosyError) -> JSONResponse:
    """`error` in the dialect of the route it happened on; its request's record notes it."""
    render, status = _renderers(scope).dialect_for(scope)
    record = request_record(scope)
    if record is not None:
        record.refused(error.kind, error.message)
    return JSONResponse(render(error), status_code=status(error), headers=headers_of(error))


async def _on_argosy_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ArgosyError)
    response = error_response(request.scope, exc)
    log.info(
        "%s %s -> %d %s: %s", request.method, request.url.path, response.status_code, exc.kind, exc.message
    )
    return response


async def _on_http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    route = f"{request.method} {request.url.path}"
    error: ArgosyError
    if exc.status_code == 404:
        error = APIError("not_found", f"Invalid URL ({route}).", code="unknown_url")
    elif exc.status_code == 405:
        allowed = (exc.headers or {}).get("allow") or (exc.headers or {}).get("Allow")
        error = APIError(
            "method_not_allowed",
            f"Method {request.method} is not allowed for {request.url.path}.",
            code="method_not_allowed",
            headers={"allow": allowed} if allowed else None,
        )
    else:
        error = APIError("invalid_request" if exc.status_code < 500 else "internal_error", str(exc.detail))
    return await _on_argosy_error(request, error)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    return await _on_argosy_error(request, InvalidRequestError(f"Invalid request: {exc}"))


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    logging.getLogger("argosy.api").exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(request.scope, internal_error(exc))


# the routes that start generations (counted as arriving at the engine, see ArrivalMiddleware)
GENERATION_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/api/chat",
    "/api/generate",
)


# the routes whose bodies may be large (prompts, conversations, inputs to embed): up to
# --max-body-bytes; every other route takes at most --max-small-body-bytes
LARGE_BODY_PATHS = frozenset(
    {
        *GENERATION_PATHS,
        "/v1/messages/count_tokens",
        "/v1/embeddings",
        "/api/embed",
        "/api/embeddings",
        "/v1/rerank",
        "/rerank",
        "/v2/rerank",
        "/v1/score",
        "/tokenize",
        "/detokenize",
    }
)
# the routes that take audio uploads: up to --max-audio-body-bytes
# (and /v1/images/edits: refused unread, so an image upload gets its 400, not a 413)
AUDIO_BODY_PATHS = frozenset(
    {"/v1/audio/transcriptions", "/v1/audio/translations", "/v1/audio/generate", "/v1/images/edits"}
)
# image prompts are short text: a body past this is not a prompt
IMAGE_BODY_PATHS = frozenset({"/v1/images/generations"})
MAX_IMAGE_BODY_BYTES = 64 * 1024
# what a browser page may read of a response (CORS)
EXPOSED_HEADERS = [
    "x-request-id",
    "x-argosy-degraded",
    "x-argosy-sampling",
    "x-argosy-session-id",
    "retry-after",
]

# the routes that answer in Anthropic's error envelope; Ollama's: everything under /api/
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
OLLAMA_PREFIX = "/api/"


def listed(event: RequestEvent) -> bool:
    """Whether the console lists a finished request: not its own successful reads (it polls
    every 2 s: an hour of them would push every real request out of the buffer) nor health
    probes (counted in /metrics)."""
    is_read = event.route.startswith(("GET /v1/argosy/", "GET /console")) and (event.status or 0) < 400
    return not is_read and event.route != "GET /health"


def _listed_only(ring: RingBuffer) -> Callable[[RequestEvent], None]:
    def observe(event: RequestEvent) -> None:
        if listed(event):
            ring(event)

    return observe


def _audio_jobs(
    registry: ModelRegistry, config: ServerConfig, sessions: SessionRecorder | None
) -> JobQueue | None:
    """The audio job queue, kept in the session store's file (None without one)."""
    store = getattr(sessions, "store", None)
    if not isinstance(store, SqliteSessionStore):
        return None
    return JobQueue(
        JobStore(store), openai_audio_jobs.job_runners(registry), max_pending=config.max_audio_jobs
    )


def build_app(
    registry: ModelRegistry,
    config: ServerConfig,
    *,
    sessions: SessionRecorder | None = None,
    pipeline: Pipeline | None = None,
    preloaded: list[str] | None = None,
    events: EventBus | None = None,
) -> FastAPI:
    """The HTTP app over `registry`. `preloaded`: the models /health waits for; `events`: where
    every request's started / finished events go (argosy/core/events.py)."""
    app = FastAPI(title="Argosy", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.registry = registry
    app.state.server_config = config
    app.state.gate = gate = Gate.from_config(config)
    app.state.pipeline = pipeline or Pipeline(registry, policy=gate.policy)
    app.state.sessions = sessions
    app.state.audio_jobs = _audio_jobs(registry, config, sessions)
    app.state.preloaded = preloaded if preloaded is not None else [registry.entries[0].spec.id]
    app.state.events = events if events is not None else EventBus()
    app.state.drain = Drain(config.shutdown_grace)  # SIGTERM / SIGINT: argosy/api/server.py
    app.state.recent_requests = RingBuffer(config.events_ring_size)  # the console reads these
    app.state.events.subscribe(_listed_only(app.state.recent_requests))
    app.state.exchanges = ExchangeStore(config.events_ring_size)  # and their bodies
    app.state.stats_history = StatsHistory(  # the console's charts (a lifespan service)
        lambda window: snapshot(registry, app.state.recent_requests.recent(), window)
    )
    if config.events_log is not None:
        app.state.events.subscribe(JsonlSink(config.events_log, config.events_log_max_bytes))
    app.state.metrics = ServerMetrics(registry)
    app.state.events.subscribe(app.state.metrics.observe)
    app.state.error_renderers = ErrorRenderers()
    for path in ANTHROPIC_PATHS:
        app.state.error_renderers.register(path, anthropic_error_body, anthropic_status_of)
    app.state.error_renderers.register_prefix(OLLAMA_PREFIX, ollama_error_body, ollama_status_of)
    routers = [
        module.router
        for module in (
            admin,
            metrics,
            openai_models,
            openai_chat,
            openai_completions,
            openai_responses,
            openai_embeddings,
            rerank,
            lora_routes,
            openai_transcriptions,
            openai_speech,
            openai_audio_jobs,
            openai_images,
            openai_realtime,
            tokenizer_routes,
            console,
            anthropic_messages,
            ollama_generate,
            ollama_models,
            ollama_pull,
        )
    ]
    for router in routers:
        app.include_router(router)
    app.openapi = lambda: openapi_document(app, routers)  # type: ignore[method-assign]
    app.add_exception_handler(ArgosyError, _on_argosy_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(Exception, _on_unexpected)
    # Added last = outermost: the request id is on every response, 413s included.
    app.add_middleware(ArrivalMiddleware, arriving=registry.arriving, paths=GENERATION_PATHS)

    def body_limit(scope: Scope) -> int:
        path = scope["path"]
        if path in AUDIO_BODY_PATHS:
            return config.max_audio_body_bytes
        if path in IMAGE_BODY_PATHS:
            return min(MAX_IMAGE_BODY_BYTES, config.max_small_body_bytes)
        return config.max_body_bytes if path in LARGE_BODY_PATHS else config.max_small_body_bytes

    app.add_middleware(BodyLimitMiddleware, limit_for=body_limit, render=error_response)
    app.add_middleware(GateMiddleware, gate=gate, render=error_response)
    app.add_middleware(DrainMiddleware, drain=app.state.drain, render=error_response)
    if config.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=config.allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=EXPOSED_HEADERS,
        )
    app.add_middleware(
        RequestEventsMiddleware,
        events=app.state.events,
        exchanges=app.state.exchanges,
        body_limit=config.console_body_bytes,
        listed=listed,
    )
    app.add_middleware(RequestIdMiddleware)
    return app
