"""OpenAI `/v1/responses`: create (stream or not), retrieve, delete, list input items.

A response is a session (responses_store.py). A new conversation creates one holding the
input; `previous_response_id` forks the previous response's session at its end and appends
the new input, so the client re-sends nothing (and it runs in the previous response's QoS
class unless it names its own) and the new prompt extends the previous
prompt + output token for token (responses_request.build_turn): the engine's prefix cache
serves those tokens (usage.input_tokens_details.cached_tokens). Two responses may continue the
same one: each is its own fork. As in OpenAI's API, `instructions` are not carried over: each
turn's own instructions are its system message.

The input is committed before generating, the output once the generation ends and before the
client is answered (so an immediate continuation sees it); a server killed mid-generation
leaves the session ending at its input, and continuing it works (the interrupted turn simply
has no answer).

Streams are framed as OpenAI frames them (`event: <type>` + `data:`, no [DONE]); a
request timeout, learned once under way, ends the stream as an SSE comment (sse.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from argosy.api.errors import openai_error_body
from argosy.api.framing import SSEResponse, keepalive_events, sse_frames
from argosy.api.openai.responses.background import BackgroundJob, BackgroundJobs
from argosy.api.openai.responses.items import conversation_items, input_events, output_items
from argosy.api.openai.responses.request import ResponsesRequest, build_turn
from argosy.api.openai.responses.store import (
    RESPONSE_KIND,
    StoredResponse,
    finished_response_json,
    load_response,
    not_found,
    response_id_of,
    response_json,
    stored_response_json,
)
from argosy.api.openai.responses.stream import ResponseStreamRenderer
from argosy.api.openapi import SSE_EVENT, query, takes
from argosy.api.route import ModelRoute, RouteCall, run_route
from argosy.api.wire import generation_headers, respond
from argosy.core.recording import SessionRecorder, SessionSpec
from argosy.core.registry import ModelRegistry
from argosy.core.service import ModelService
from argosy.core.stream import CoreStream
from argosy.errors import ArgosyError, InvalidRequestError, NotFoundError, StorageError
from argosy.sessions.events import SessionEvent
from argosy.sessions.store import Session, SessionStore

router = APIRouter()
log = logging.getLogger("argosy.api")

ROUTE = "POST /v1/responses"


def _open_session(
    store: SessionStore,
    previous: StoredResponse | None,
    metadata: dict[str, Any],
    is_ephemeral: bool,
    inputs: list[SessionEvent],
) -> Session:
    if previous is None:
        return store.create(metadata=metadata, ephemeral=is_ephemeral, events=inputs)
    return store.fork(
        previous.key,
        at_event=previous.session.last_seq,
        metadata=metadata,
        ephemeral=is_ephemeral,
        events=inputs,
    )


def _in_flight(request: Request) -> set[str]:
    state = request.app.state
    if not hasattr(state, "responses_in_flight"):
        state.responses_in_flight = set()
    flying: set[str] = state.responses_in_flight
    return flying


def _jobs(request: Request) -> BackgroundJobs:
    state = request.app.state
    if not hasattr(state, "background_responses"):
        state.background_responses = BackgroundJobs()
    jobs: BackgroundJobs = state.background_responses
    return jobs


def _recorder(request: Request) -> SessionRecorder:
    recorder: SessionRecorder | None = request.app.state.sessions
    if recorder is None:
        raise ArgosyError("This server keeps no sessions; /v1/responses needs them.")
    return recorder


# -- create ---------------------------------------------------------------------------------------


class CreateResponseRoute(ModelRoute[ResponsesRequest]):
    route = ROUTE
    body_type = ResponsesRequest

    async def serve(self, body: ResponsesRequest, service: ModelService, call: RouteCall) -> Response:
        request = call.request
        inputs = input_events(body.input)
        model_id = call.model_id
        recorder = _recorder(request)
        previous = None
        if body.previous_response_id is not None:
            previous = await recorder.read(
                load_response, recorder.store, body.previous_response_id, "previous_response_id"
            )
            if previous.key in _in_flight(request):
                raise InvalidRequestError(
                    f"Previous response with id '{body.previous_response_id}' is still in progress.",
                    "previous_response_id",
                )
        if previous is not None:  # a fork runs in its parent's QoS class unless it names one
            call.inherit_qos(previous.metadata.get("qos"))
        turn = await build_turn(service, body, inputs, previous)
        created_at = int(time.time())
        echo = body.echo(model_id, created_at)
        input_from = previous.session.last_seq + 1 if previous is not None else 1
        metadata = {
            "kind": RESPONSE_KIND,
            "response": echo,
            "prompt_ids": turn.prepared.prompt_ids,
            "prompt_source": turn.prompt_source,
            "input_from_seq": input_from,
            "output_from_seq": input_from + len(inputs),
            "qos": call.qos,  # what a continuation inherits
        }
        spec = SessionSpec(
            inputs=[list(inputs)],
            metadata=metadata,
            is_ephemeral=not body.store,
            keeps_logprobs=body.includes_logprobs,  # a retrieved response lists them too
            continues=previous.key if previous is not None else None,
        )
        core_request = turn.prepared.core_request(
            body.sampling(), batch_invariant=body.batch_invariant, session=spec, prompt_param="input"
        )
        stream = call.start(core_request)  # every check, and admission, before the session opens
        degraded = body.degraded_fields() + turn.degraded
        try:
            session = await recorder.write(
                "open response session",
                _open_session,
                recorder.store,
                previous,
                metadata,
                not body.store,
                inputs,
            )
            key = session.id
            spec.session_id, spec.input_end_seq = key, session.last_seq
        except NotFoundError:  # the previous response was deleted meanwhile
            stream.close()
            raise not_found(body.previous_response_id or "", "previous_response_id") from None
        except StorageError:
            if body.store:  # a response asked to be kept must not be served unkept: 507/503
                stream.close()
                raise
            log.exception("could not record the unstored response; serving it")
            key = uuid.uuid4().hex
        except Exception:
            log.exception("could not store the response; serving it unstored")
            key, spec.is_ephemeral = uuid.uuid4().hex, True  # the core records it as it can
            degraded.append("store")
        response_id = response_id_of(key)
        flying = _in_flight(request)
        if body.background:
            job = BackgroundJob(key, stream)
            job.run(_stream_events(stream, key, echo, flying))
            _jobs(request).add(job)
            call.is_detached = True  # the job, not this request, owns the generation now
            if body.stream:
                return SSEResponse(
                    _sse(job.follow(keepalive_s=call.keepalive_s), stream.degraded),
                    headers=generation_headers(stream, degraded),
                )
            queued = response_json(response_id, echo, status="queued", output=[], usage=None)
            return JSONResponse(queued, headers=generation_headers(stream, degraded))
        return await respond(
            request,
            stream,
            degraded,
            is_streaming=body.stream,
            frames=lambda: _sse(_stream_events(stream, key, echo, flying, call.keepalive_s), stream.degraded),
            complete=lambda: _complete(stream, response_id, echo, flying),
        )


@router.post("/v1/responses")
@takes(ResponsesRequest, streams=True)
async def create_response(request: Request) -> Response:
    return await run_route(request, CreateResponseRoute())


async def _committed(stream: CoreStream) -> bool:
    """Wait until the generation's events are stored; False (logged already) if not."""
    if stream.record is None or stream.record.committed is None:
        return False
    try:
        await asyncio.wrap_future(stream.record.committed)
    except Exception:
        return False
    return True


async def _complete(
    stream: CoreStream, response_id: str, echo: dict[str, Any], flying: set[str]
) -> dict[str, Any]:
    key = response_id.removeprefix("resp_")
    flying.add(key)
    try:
        async with stream:
            async for _ in stream:
                pass  # the record gathers the output
        await _committed(stream)
    finally:
        flying.discard(key)  # in flight until stored: a retrieve between would read `failed`
    events = _output_events(stream)
    return finished_response_json(response_id, echo, events, output_items(events, key))


def _output_events(stream: CoreStream) -> list[SessionEvent]:
    """The generation's output as its session records it (whether or not the store took it)."""
    record = stream.record
    return record.outputs[0] if record is not None and record.outputs else []


async def _stream_events(
    stream: CoreStream, key: str, echo: dict[str, Any], flying: set[str], keepalive_s: float = 0.0
) -> AsyncIterator[dict[str, Any] | None]:
    """The response's stream events; a None (a keep-alive comment) whenever none came for
    `keepalive_s` seconds (0: never, as for a background job's stored events)."""
    response_id = response_id_of(key)
    renderer = ResponseStreamRenderer(key)
    in_progress = response_json(response_id, echo, status="in_progress", output=[], usage=None)
    yield renderer.lifecycle("response.created", in_progress)
    yield renderer.lifecycle("response.in_progress", in_progress)
    flying.add(key)
    try:
        async with stream, contextlib.aclosing(keepalive_events(stream, keepalive_s)) as events:
            async for event in events:
                if event is None:
                    yield None
                    continue
                for payload in renderer.on_event(event):
                    yield payload
        await _committed(stream)
    finally:
        flying.discard(key)  # in flight until stored: a retrieve between would read `failed`
    final = finished_response_json(response_id, echo, _output_events(stream), renderer.items)
    kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
        final["status"], "response.failed"
    )
    yield renderer.lifecycle(kind, final)


def _sse(events: AsyncIterator[dict[str, Any] | None], late_degraded: list[str]) -> AsyncIterator[bytes]:
    """SSE as OpenAI frames the Responses stream: `event: <type>` + data; no [DONE]. A failure
    is one `error` event (type, code, message, param, sequence_number). What was degraded only
    once under way (`late_degraded`, read at the end: a request timeout) closes the stream as
    an SSE comment."""
    next_number = [0]

    async def numbered() -> AsyncIterator[dict[str, Any] | None]:
        try:
            async for payload in events:
                if payload is not None:  # None: a keep-alive
                    next_number[0] = payload["sequence_number"] + 1
                yield payload
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    def render_error(error: ArgosyError) -> dict[str, Any]:
        body = openai_error_body(error)["error"]
        return {
            "type": "error",
            "code": body["code"] or body["type"],
            "message": body["message"],
            "param": body["param"],
            "sequence_number": next_number[0],
        }

    return sse_frames(numbered(), render_error, late_degraded, event_key="type", done=False)


# -- retrieve, delete, input items ---------------------------------------------------------------


@router.get(
    "/v1/responses/{response_id}",
    responses={200: {"content": {"text/event-stream": {"schema": SSE_EVENT}}}},
    openapi_extra={
        "parameters": [
            query("stream", {"type": "boolean"}, "Replay a background response's events, then follow it."),
            query(
                "starting_after",
                {"type": "integer", "minimum": 0},
                "With stream: the sequence number to resume after.",
            ),
        ]
    },
)
async def retrieve_response(request: Request, response_id: str) -> Response:
    """The stored response; `?stream=true` (a background response) replays its stream events
    after `starting_after` and follows it live."""
    recorder = _recorder(request)
    stored = await recorder.read(load_response, recorder.store, response_id)
    job = _jobs(request).get(stored.key)
    if request.query_params.get("stream", "false").lower() == "true":
        if job is None:
            raise InvalidRequestError(
                "Only a background response can be streamed after it was created, and this server no "
                "longer holds this one's events; retrieve it without 'stream'.",
                "stream",
            )
        keepalive_s = float(getattr(request.app.state.server_config, "sse_keepalive_s", 0.0))
        return SSEResponse(_sse(job.follow(_starting_after(request), keepalive_s), []))
    in_flight = stored.key in _in_flight(request)
    status = job.status if job is not None and in_flight else "in_progress"
    return JSONResponse(stored_response_json(stored, is_in_flight=in_flight, status_in_flight=status))


def _starting_after(request: Request) -> int | None:
    value = request.query_params.get("starting_after")
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()):  # sequence numbers start at 0
        raise InvalidRequestError(
            f"starting_after must be a sequence number (an integer >= 0), got {value!r}.", "starting_after"
        )
    return int(value)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: str) -> JSONResponse:
    """Cancel a background response: its generation stops, what it produced is kept (status
    `cancelled`). Cancelling one that already ended returns it as it is."""
    recorder = _recorder(request)
    stored = await recorder.read(load_response, recorder.store, response_id)
    if not stored.metadata.get("response", {}).get("background"):
        raise InvalidRequestError("Only responses created with 'background': true can be cancelled.", None)
    job = _jobs(request).get(stored.key)
    if job is not None and not job.is_done:
        await job.cancel()
        stored = await recorder.read(load_response, recorder.store, response_id)
    in_flight = stored.key in _in_flight(request)
    return JSONResponse(stored_response_json(stored, is_in_flight=in_flight))


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> JSONResponse:
    recorder = _recorder(request)
    stored = await recorder.read(load_response, recorder.store, response_id)
    try:
        await recorder.write("delete response", recorder.store.delete, stored.key)
    except NotFoundError:
        raise not_found(response_id) from None
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@router.get(
    "/v1/responses/{response_id}/input_items",
    openapi_extra={
        "parameters": [
            query("order", {"type": "string", "enum": ["asc", "desc"]}, "Item order (default desc)."),
            query("limit", {"type": "integer", "minimum": 1, "maximum": 100}, "Items per page (default 20)."),
            query("after", {"type": "string"}, "Start after this item id."),
        ]
    },
)
async def list_input_items(request: Request, response_id: str) -> JSONResponse:
    """Everything the response was generated from, as items: earlier turns (their inputs and
    outputs) and its own input. `order` asc|desc (default desc), `limit` 1..100 (20),
    `after` an item id."""
    params = request.query_params
    order = params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequestError(f"order must be 'asc' or 'desc', got {order!r}.", "order")
    try:
        limit = int(params.get("limit", "20"))
    except ValueError:
        raise InvalidRequestError("limit must be an integer.", "limit") from None
    if not 1 <= limit <= 100:
        raise InvalidRequestError(f"limit must be between 1 and 100, got {limit}.", "limit")
    recorder = _recorder(request)
    stored = await recorder.read(load_response, recorder.store, response_id)
    items = conversation_items(stored.prior_events)
    if order == "desc":
        items.reverse()
    after = params.get("after")
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise InvalidRequestError(
                f"No input item with id {after!r} in response '{response_id}'.", "after"
            )
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return JSONResponse(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > limit,
        }
    )


@router.get("/v1/argosy/responses/{response_id}/prompt")
async def response_prompt(request: Request, response_id: str) -> JSONResponse:
    """The prompt a stored response was generated from, as the model saw it (introspection)."""
    recorder = _recorder(request)
    stored = await recorder.read(load_response, recorder.store, response_id)
    prompt_ids = list(stored.metadata.get("prompt_ids", []))
    model_id = stored.metadata.get("response", {}).get("model")
    registry: ModelRegistry = request.app.state.registry
    lease = await registry.acquire(registry.resolve(model_id, "chat"))
    try:
        prompt = lease.service.decode(prompt_ids)
    finally:
        lease.release()
    return JSONResponse(
        {
            "id": response_id,
            "prompt": prompt,
            "prompt_token_ids": prompt_ids,
            "prompt_source": stored.metadata.get("prompt_source"),
        }
    )
