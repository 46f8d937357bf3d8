"""HTTP plumbing every dialect shares: body size limit, JSON body -> pydantic model,
request ids, cancelling work when the client goes away, and the 503s of a draining server.

The middlewares are plain ASGI (not BaseHTTPMiddleware), so they neither buffer streamed
responses nor get between a streaming response and the client's disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import pydantic
from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from argosy.api.errors import APIError, from_validation_error
from argosy.core.drain import Drain
from argosy.core.events import EventBus, RequestEvent, RequestRecord, dialect_of
from argosy.core.exchanges import BodyCapture, Exchange, ExchangeStore, redact_headers
from argosy.errors import ArgosyError

ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)
T = TypeVar("T")

_CLIENT_REQUEST_ID = re.compile(r"^[\x21-\x7e]{1,200}$")  # printable ASCII, no spaces


def payload_too_large(limit: int) -> APIError:
    return APIError(
        "payload_too_large",
        f"The request body is larger than this server's limit of {limit} bytes.",
        code="request_too_large",
    )


class BodyLimitMiddleware:
    """413 for a body over the route's limit (`limit_for(scope)`): at once when
    Content-Length says so, else while it streams in (the count raises inside the handler's
    body read)."""

    def __init__(
        self,
        app: ASGIApp,
        limit_for: Callable[[Scope], int],
        render: Callable[[Scope, APIError], JSONResponse],
    ) -> None:
        self.app = app
        self.limit_for = limit_for
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes = self.limit_for(scope)
        declared = Headers(scope=scope).get("content-length")
        if declared is not None:
            if not declared.isdigit():
                error = APIError("invalid_request", "The Content-Length header is not a number.")
                await self.render(scope, error)(scope, receive, send)
                return
            if int(declared) > max_bytes:
                await self.render(scope, payload_too_large(max_bytes))(scope, receive, send)
                return
        num_received = 0

        async def counting_receive() -> Message:
            nonlocal num_received
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > max_bytes:
                    raise payload_too_large(max_bytes)
            return message

        await self.app(scope, counting_receive, send)


class RequestIdMiddleware:
    """`x-request-id` on every response: the client's own when it sent a sane one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("x-request-id")
        request_id = given if given and _CLIENT_REQUEST_ID.match(given) else f"req-{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["x-request-id"] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


def request_record(scope: Scope) -> RequestRecord | None:
    """The request's RequestRecord (RequestEventsMiddleware puts it in the scope's state)."""
    record: RequestRecord | None = scope.get("state", {}).get("record")
    return record


class RequestEventsMiddleware:
    """A RequestRecord for every request, and its `started` / `finished` events on `events`:
    finished once the app is done with it (a stream's end included, with what its generation
    told the record as it closed), with the status sent; 499 when nothing was sent (the client
    left first), 500 when the app raised before answering."""

    def __init__(
        self,
        app: ASGIApp,
        events: EventBus,
        exchanges: ExchangeStore | None = None,
        body_limit: int = 0,
        listed: Callable[[RequestEvent], bool] = lambda event: True,
    ) -> None:
        self.app = app
        self.events = events
        # the console's request detail: each listed request's headers and bodies (their first
        # `body_limit` bytes), keys redacted
        self.exchanges = exchanges if body_limit > 0 else None
        self.body_limit = body_limit
        self.listed = listed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.exchanges is not None:
            await self._recorded(scope, receive, send, self.exchanges)
            return
        await self._observed(scope, receive, send, None)

    async def _recorded(self, scope: Scope, receive: Receive, send: Send, store: ExchangeStore) -> None:
        headers = redact_headers(scope.get("headers", []))
        exchange = Exchange(
            scope.get("state", {}).get("request_id", "-"), headers, BodyCapture(self.body_limit)
        )
        exchange.request.set_type(headers)

        async def receive_and_keep() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                exchange.request.add(message.get("body", b""))
            return message

        async def send_and_keep(message: Message) -> None:
            if message["type"] == "http.response.start":
                exchange.response_headers = redact_headers(message.get("headers", []))
                exchange.response = BodyCapture(self.body_limit)
                exchange.response.set_type(exchange.response_headers)
            elif message["type"] == "http.response.body" and exchange.response is not None:
                exchange.response.add(message.get("body", b""))
            await send(message)

        await self._observed(scope, receive_and_keep, send_and_keep, (store, exchange))

    async def _observed(
        self, scope: Scope, receive: Receive, send: Send, keep: tuple[ExchangeStore, Exchange] | None
    ) -> None:
        state = scope.setdefault("state", {})
        client = scope.get("client")
        record = RequestRecord(
            request_id=state.get("request_id", "-"),
            method=scope["method"],
            path=scope["path"],
            client=client[0] if client else None,
            dialect=dialect_of(scope["path"]),
        )
        state["record"] = record
        self.events.emit(record.event("started"))

        async def send_and_watch(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_watch)
        except BaseException:
            if record.status is None:
                record.status = 500
            raise
        finally:
            if record.status is None:
                record.status = 499  # nothing was sent: the client is gone
            template = getattr(scope.get("route"), "path", None)
            if template is not None:
                record.route = f"{scope['method']} {template}"
            finished = record.event("finished")
            if keep is not None and self.listed(finished):
                keep[0].put(keep[1])  # before the event: a console that sees it can open it
            self.events.emit(finished)


class Arriving(Protocol):
    def done(self) -> None: ...


class ArrivalMiddleware:
    """Counts each POST to a generation route as arriving at the engines from its start until
    it reaches its model's engine (the core hands the count to `generate`) or its response
    ends, so an idle engine can wait for a burst's stragglers (argosy/engine/async_engine.py).
    The count travels in the request's scope state (`arrivals`), read by the route runner."""

    def __init__(self, app: ASGIApp, arriving: Callable[[], Arriving], paths: tuple[str, ...]) -> None:
        self.app = app
        self.arriving = arriving
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        arrivals = self.arriving()
        scope.setdefault("state", {})["arrivals"] = arrivals
        try:
            await self.app(scope, receive, send)
        finally:
            arrivals.done()


async def read_model(request: Request, model: type[ModelT]) -> ModelT:
    """The JSON body as `model`; malformed JSON and wrong fields become a 400 naming them."""
    body = await request.body()
    try:
        return model.model_validate_json(body)
    except pydantic.ValidationError as exc:
        raise from_validation_error(exc) from None


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`; if the client disconnects first, cancel it and return None.

    Call after the body has been read: from then on the only message left to receive is
    the disconnect.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    finally:
        watcher.cancel()
        task.cancel()


class DrainMiddleware:
    """The server's drain (argosy/core/drain.py) at the HTTP edge: counts the requests in
    flight, and once the drain began refuses new ones with 503 + Retry-After in their
    dialect's error shape and `connection: close` (a client reconnects, to another instance
    behind a balancer). `/health` passes always and is not counted: it says "draining"."""

    def __init__(
        self,
        app: ASGIApp,
        drain: Drain,
        render: Callable[[Scope, ArgosyError], JSONResponse],
        exempt_paths: tuple[str, ...] = ("/health",),
    ) -> None:
        self.app = app
        self.drain = drain
        self.render = render
        self.exempt_paths = exempt_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.exempt_paths:
            await self.app(scope, receive, send)
            return
        if not self.drain.is_serving:
            response = self.render(scope, self.drain.refusal())
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        self.drain.request_started()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.request_finished()
