"""The HTTP side of the one pipeline (argosy/core/pipeline.py). Every model route is a
ModelRoute: its body type, its cheap checks, the model and QoS it names, and `serve` (prepare,
start, render). `run_route` runs the skeleton around it, so no route re-implements a step:

    read body (size-limited by the middleware) -> parse -> route.check -> QoS -> policy hook
    -> resolve + acquire the model (load on request) -> route.serve (prepare -> admit ->
    start -> render) -> request events (started / finished / rejected)

The model lease is held until the generation's stream closes (streaming responses end after
this function returns), or until `serve` returns when no stream was started. A generation's
request record notes the sampling it runs as it starts (`RequestRecord.sampling`: the dict
the x-argosy-sampling header carries, api/wire.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from argosy.api.framing import SSEResponse
from argosy.api.transport import read_model, request_record
from argosy.config import QOS_CLASSES
from argosy.core.access_log import tagged_route
from argosy.core.admission import QOS_HEADER, request_qos
from argosy.core.events import RequestRecord
from argosy.core.pipeline import Pipeline, RequestContext
from argosy.core.registry import Lease
from argosy.core.stream import CoreRequest, CoreStream

BodyT = TypeVar("BodyT", bound=BaseModel)


class RouteCall:
    """One run of a route: what `serve` needs beyond the body and the model's service."""

    def __init__(
        self, request: Request, ctx: RequestContext, pipeline: Pipeline, lease: Lease, qos: str
    ) -> None:
        self.request = request
        self.ctx = ctx
        self.pipeline = pipeline
        self.lease = lease
        self.qos = qos
        self.stream: CoreStream | None = None
        self.is_detached = False  # the stream outlives the HTTP response (a background job)
        self.lease_handed_off = False  # a streamed answer without a CoreStream releases it
        self.log_tags: tuple[str, ...] = ()  # the access log's tags of its route (fim, stream)

    @property
    def request_id(self) -> str:
        return self.ctx.request_id

    @property
    def keepalive_s(self) -> float:
        """Seconds without a frame before an SSE stream sends a keep-alive (0: never)."""
        config = getattr(self.request.app.state, "server_config", None)
        return float(getattr(config, "sse_keepalive_s", 0.0))

    @property
    def model_id(self) -> str:
        """The model the request named: its model's id, or the LoRA adapter's name."""
        assert self.ctx.model_id is not None
        return self.ctx.adapter or self.ctx.model_id

    def inherit_qos(self, qos: Any) -> None:
        """Run in `qos`, a parent's class (a continued conversation's), unless the request named
        its own; the policy hook caps it as it caps a default (a key's highest class)."""
        if self.ctx.qos_is_explicit or qos not in QOS_CLASSES or qos == self.qos:
            return
        self.ctx.qos = qos
        self.pipeline.policy(self.ctx, self.pipeline.registry.resolve(self.model_id).spec)
        self.qos = self.ctx.qos

    def start(self, core_request: CoreRequest) -> CoreStream:
        """Admit and start a generation on the leased model; the lease and the request's
        'finished' event go with the stream's end."""
        core_request.qos = self.qos
        core_request.request_id = self.ctx.request_id
        core_request.route = tagged_route(self.ctx.route, self.log_tags)
        core_request.arrival = self.pipeline.arrival(self.ctx)
        if core_request.adapter is None:  # else llama.cpp's per-request `lora` chose one
            core_request.adapter = self.ctx.adapter
        stream: CoreStream = self.lease.service.start(core_request)
        self.stream = stream
        stream.on_close.append(self.lease.release)
        if self.ctx.record is not None:
            record = self.ctx.record
            record.sampling = stream.effective_sampling()  # as x-argosy-sampling says it
            stream.on_close.append(lambda: note_generation(record, stream))
        return stream

    def release_with(self, response: SSEResponse) -> SSEResponse:
        """A streamed answer that runs no CoreStream (audio): the model's lease is held until
        its frames end, whatever ends them."""
        response.closers.append(self.lease.release)
        self.lease_handed_off = True
        return response


def note_generation(record: RequestRecord, stream: CoreStream) -> None:
    """What a finished generation tells its request's events: usage, finish, timing."""
    usage = stream.usage
    record.prompt_tokens = usage.prompt_tokens
    record.completion_tokens = usage.completion_tokens
    record.cached_tokens = usage.cached_tokens
    record.finish_reason = stream.choices[0].finish_reason if stream.choices else None
    record.ttft_s = stream.timing.ttft_s
    record.queue_s = stream.timing.queue_s
    record.decode_tokens, record.decode_s = stream.timing.decode()


class ModelRoute(Generic[BodyT]):
    """A route that serves a model. Subclasses set `route`, `body_type`, `kind` and write
    `serve`; `check`, `model_name` and `qos` have the common defaults."""

    route: ClassVar[str]  # e.g. "POST /v1/chat/completions"
    kind: ClassVar[str | tuple[str, ...] | None] = "chat"  # the model kind(s) it serves (None: any)
    body_type: type[BodyT]

    async def read(self, request: Request) -> BodyT:
        """The request's body as `body_type` (a route without a body reads its query)."""
        return await read_model(request, self.body_type)

    def check(self, body: BodyT) -> None:
        check: Callable[[], None] | None = getattr(body, "check", None)
        if check is not None:
            check()

    def model_name(self, body: BodyT) -> str | None:
        name: str | None = getattr(body, "model", None)
        return name

    def qos(self, body: BodyT, request: Request) -> str:
        return request_qos(getattr(body, "priority", None), request.headers.get(QOS_HEADER))

    def log_tags(self, body: BodyT) -> tuple[str, ...]:
        """The access log's tags for this request's line: "stream" for a streamed answer."""
        return ("stream",) if getattr(body, "stream", False) is True else ()

    async def serve(self, body: BodyT, service: Any, call: RouteCall) -> Response:
        raise NotImplementedError


def request_context(request: Request, route: str) -> RequestContext:
    state = request.scope.get("state", {})
    record = request_record(request.scope)
    return RequestContext(
        request_id=state.get("request_id", "-"),
        route=route,
        headers=dict(request.headers),
        client=record.client if record is not None else (request.client.host if request.client else None),
        arrivals=state.get("arrivals"),
        key_name=record.key_name if record is not None else None,
        record=record,
    )


async def run_route(request: Request, route: ModelRoute[Any]) -> Response:
    pipeline: Pipeline = request.app.state.pipeline
    ctx = request_context(request, route.route)
    call: RouteCall | None = None
    lease: Lease | None = None
    try:
        body = await route.read(request)
        route.check(body)
        ctx.qos = route.qos(body, request)
        ctx.qos_is_explicit = getattr(body, "priority", None) is not None or QOS_HEADER in request.headers
        lease = await pipeline.acquire(ctx, route.model_name(body), route.kind)
        call = RouteCall(request, ctx, pipeline, lease, ctx.qos)
        call.log_tags = route.log_tags(body)
        response = await route.serve(body, lease.service, call)
    finally:
        if lease is not None and (call is None or (call.stream is None and not call.lease_handed_off)):
            lease.release()  # no generation holds it (else the stream releases it as it ends)
    if call.stream is not None and isinstance(response, SSEResponse) and not call.is_detached:
        # a client gone before the first frame leaves the stream never entered: close it anyway
        response.closers.append(call.stream.close)
    return response
