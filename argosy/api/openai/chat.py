"""OpenAI `POST /v1/chat/completions`: request model, to_core(), and rendering of events.

The request becomes a neutral ChatInput (openai_chat_input.py) and then a CoreRequest
(chat_request.py); the core's channel events come back as `message.content`,
`message.reasoning_content` and `message.tool_calls`. As vLLM's, `add_generation_prompt`
(default true) and `continue_final_message` (default false: true continues the final
assistant message, and the reply is only the text generated after it; a 400 naming it with
another final role, or with add_generation_prompt true) shape the prompt's end.

Streaming: per choice a role chunk first, then deltas per channel (`content`,
`reasoning_content`, `tool_calls`: a call's `index`, `id`, `type` and `function.name` once,
then `function.arguments` fragments), then one chunk with its finish_reason; with
`stream_options.include_usage` a last chunk with `choices: []` and the usage (earlier chunks
carry `usage: null`); with `continuous_usage_stats` every chunk carries the usage so far.
Logprobs ride on the next chunk of their choice (every generated token is reported once).
While no token is ready (a long prefill, a queue) a `: keep-alive` SSE comment goes out every
`--sse-keepalive-s` seconds (api/framing.py).

Top-level `enable_thinking` (vLLM's and SGLang's spelling) is a template variable, as in
`chat_template_kwargs` (whose value wins); named in x-argosy-degraded when the template reads
none. Every field this server does not know is named in x-argosy-degraded. A stored completion
(`store: true`) answers with its session's id in the `x-argosy-session-id` header and in the
completion's `metadata.argosy_session_id` (with the request's own `metadata`).

The completion and every chunk carry `system_fingerprint`: the model's configuration as it
bears on the numerics (ModelService.system_fingerprint: weights, dtype, compiled decode,
kernels); the sampling used is in the `x-argosy-sampling` header (api/wire.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr
from starlette.requests import Request
from starlette.responses import Response

from argosy.api.framing import keepalive_events, sse_frames
from argosy.api.openai.chat_input import chat_input_from_wire
from argosy.api.openai.common import (
    SamplingFields,
    render_error,
    usage_json,
)
from argosy.api.openai.content import text_of_parts
from argosy.api.openapi import takes
from argosy.api.route import ModelRoute, RouteCall, run_route
from argosy.api.wire import named_unknown, respond, token_logprob_json
from argosy.chat.events import (
    Event,
    Finish,
    LogprobsDelta,
    ReasoningDelta,
    TextDelta,
    TokenLogprobs,
    ToolCallArgsDelta,
    ToolCallStart,
)
from argosy.chat.images import ImagePart
from argosy.chat.messages import ChatInput, check_continuation
from argosy.core.chat_request import prepare_chat
from argosy.core.constraints import check_chat_options
from argosy.core.conversation import chat_message_events
from argosy.core.recording import SessionRecorder, SessionSpec
from argosy.core.service import ModelService
from argosy.core.stream import CollectedChoice, CoreRequest, CoreStream, collect
from argosy.errors import InvalidRequestError
from argosy.sampling_params import MAX_LOGPROBS

router = APIRouter()
log = logging.getLogger("argosy.api")
# a stored completion's (`store: true`) session: /v1/argosy/sessions/{id} reads it, forks it
SESSION_HEADER = "x-argosy-session-id"


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None  # a string or content parts: read by ChatCompletionRequest.check
    name: str | None = None

    def read_content(self, where: str, images: list[ImagePart] | None = None) -> None:
        """Content parts joined into the text they carry; a 400 naming the part if malformed.
        With `images`, image parts are read into it (else refused)."""
        if self.content is None or isinstance(self.content, str):
            return
        if not isinstance(self.content, list):
            raise InvalidRequestError(f"'{where}' must be a string or a list of content parts.", where)
        self.content = "".join(text_of_parts(self.content, where, images=images))


def read_chat_messages(
    messages: list[ChatMessage], template_kwargs: dict[str, Any] | None, images: list[ImagePart] | None = None
) -> None:
    """Each message's content parts joined into its text (a 400 naming a malformed part), and
    `chat_template_kwargs` kept off the variables the request's own fields set. What every
    request that renders OpenAI chat messages checks first (chat completions, /tokenize).
    With `images`, the messages' image parts are read into it."""
    for position, message in enumerate(messages):
        message.read_content(f"messages[{position}].content", images)
    reserved = {"messages", "add_generation_prompt", "continue_final_message", "tools"} & set(
        template_kwargs or {}
    )
    if reserved:
        raise InvalidRequestError(
            f"chat_template_kwargs may not set {', '.join(sorted(reserved))}: the request's own fields do.",
            param="chat_template_kwargs",
        )


def wire_chat_input(
    messages: list[ChatMessage],
    *,
    template_kwargs: dict[str, Any],
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: list[Any] | None = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool | None = None,
    response_format: Any = None,
) -> ChatInput:
    """OpenAI chat messages (read by `read_chat_messages`) and options as a neutral ChatInput
    (a malformed field is a 400 naming it)."""
    chat = chat_input_from_wire(
        [(m.role, m.content, m.name, m.model_extra or {}) for m in messages],
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
        response_format=response_format,
        template_kwargs=template_kwargs,
    )
    chat.add_generation_prompt = add_generation_prompt
    chat.continue_final_message = continue_final_message
    return chat


def check_chat_input(chat: ChatInput) -> None:
    """The cross-field checks of a chat that need no model (continuation, tools, format)."""
    check_continuation(chat)
    check_chat_options(chat.tools, chat.tool_choice, chat.output_format)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    store: bool = False  # keep its session (else ephemeral: swept first, after an hour)
    tools: list[Any] | None = None  # checked in openai_chat_input.py, naming the exact field
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: Any = None
    reasoning_effort: str | None = None  # a template variable (honoured if the template reads it)
    # Qwen3's switch, as vLLM and SGLang take it at the top level (chat_template_kwargs' wins)
    enable_thinking: bool | None = None
    # an Argosy extension: `auto` calls failing their tool's schema written again under its
    # grammar, at most this many (0: none, sent back as text); None: --tool-repair-budget
    tool_repair_budget: int | None = Field(None, ge=0)
    metadata: dict[str, str] | None = None  # kept with a stored completion's session
    # vLLM's: the prompt ends with a new assistant turn (the default), or with no new turn, or
    # with the final assistant message left open and continued (the reply is the continuation)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Accepted; not honoured.
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    _chat: ChatInput | None = PrivateAttr(default=None)
    _images: list[ImagePart] = PrivateAttr(default_factory=list)

    def check(self) -> None:
        """Content parts, then cross-field checks that need no model."""
        read_chat_messages(self.messages, self.chat_template_kwargs, self._images)
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true.", param="top_logprobs")
        check_chat_input(self.chat_input())

    def chat_input(self) -> ChatInput:
        """The request in neutral terms (checked: a malformed field is a 400 naming it)."""
        if self._chat is None:
            kwargs = dict(self.chat_template_kwargs or {})
            if self.reasoning_effort is not None:
                kwargs.setdefault("reasoning_effort", self.reasoning_effort)
            if self.enable_thinking is not None:
                kwargs.setdefault("enable_thinking", self.enable_thinking)
            self._chat = wire_chat_input(
                self.messages,
                template_kwargs=kwargs,
                add_generation_prompt=self.add_generation_prompt,
                continue_final_message=self.continue_final_message,
                tools=self.tools,
                tool_choice=self.tool_choice,
                parallel_tool_calls=self.parallel_tool_calls,
                response_format=self.response_format,
            )
            self._chat.tool_repair_budget = self.tool_repair_budget
            self._chat.images = self._images
        return self._chat

    def degraded_fields(self) -> list[str]:
        """Fields never honoured, and every field this server does not know (named, not
        silently dropped); those honoured or not depending on the model come from
        `to_core` (`reasoning_effort` when the template does not read it, a response_format
        a forced call overrides...)."""
        asks = {
            "functions": bool(self.functions),
            "function_call": self.function_call not in (None, "none", "auto"),
            "modalities": any(m != "text" for m in self.modalities or []),
            "audio": self.audio is not None,
            "prediction": self.prediction is not None,
            "web_search_options": self.web_search_options is not None,
        }
        return [name for name, is_asked in asks.items() if is_asked] + named_unknown(self.model_extra or {})

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


async def to_core(body: ChatCompletionRequest, service: ModelService) -> tuple[CoreRequest, list[str]]:
    """The CoreRequest, and the fields this model does not honour (x-argosy-degraded)."""
    prepared = await prepare_chat(service, body.chat_input())
    degraded = list(prepared.degraded)
    if body.reasoning_effort is not None and not service.chat_profile().reads("reasoning_effort"):
        degraded.append("reasoning_effort")
    if body.enable_thinking is not None and not service.chat_profile().reads("enable_thinking"):
        degraded.append("enable_thinking")
    sampling = body.request_sampling(
        max_tokens=body.max_completion_tokens or body.max_tokens, logprobs=body.num_logprobs
    )
    core_request = prepared.core_request(sampling, n=body.n)
    return core_request, degraded


# -- rendering ------------------------------------------------------------------------------


def logprobs_json(entries: list[TokenLogprobs]) -> dict[str, Any]:
    """OpenAI chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...],
    "refusal": null} (the spec requires both keys; no model here refuses as a channel)."""
    return {"content": [token_logprob_json(e) for e in entries], "refusal": None}


async def _stream_chunks(
    body: ChatCompletionRequest, stream: CoreStream, model_id: str, fingerprint: str, keepalive_s: float
) -> AsyncIterator[dict[str, Any] | None]:
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    wants_logprobs = body.num_logprobs is not None

    def chunk(choice: dict[str, Any]) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "id": response_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model_id,
            "system_fingerprint": fingerprint,
            "choices": [choice],
        }
        if body.continuous_usage:
            payload["usage"] = usage_json(stream.usage)
        elif body.include_usage:
            payload["usage"] = None
        return payload

    async with stream:
        for index in range(len(stream.choices)):
            yield chunk(
                {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            )
        pending: list[list[TokenLogprobs]] = [[] for _ in stream.choices]  # logprobs not yet sent
        async with contextlib.aclosing(keepalive_events(stream, keepalive_s)) as events:
            async for event in events:
                if event is None:
                    yield None  # nothing for a while: a keep-alive comment
                    continue
                if isinstance(event, LogprobsDelta):
                    pending[event.index].extend(event.logprobs)
                    continue
                delta = _delta_json(event)
                if delta is None and not isinstance(event, Finish):
                    continue
                logprobs = None
                if wants_logprobs and (pending[event.index] or not isinstance(event, Finish)):
                    logprobs, pending[event.index] = logprobs_json(pending[event.index]), []
                yield chunk(
                    {
                        "index": event.index,
                        "delta": delta or {},
                        "logprobs": logprobs,
                        "finish_reason": event.reason if isinstance(event, Finish) else None,
                    }
                )
        if body.include_usage:
            yield {
                "id": response_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model_id,
                "system_fingerprint": fingerprint,
                "choices": [],
                "usage": usage_json(stream.usage),
            }


def _delta_json(event: Event) -> dict[str, Any] | None:
    """A channel event as a chunk's `delta` (None: nothing to send for it)."""
    if isinstance(event, TextDelta):
        return {"content": event.text}
    if isinstance(event, ReasoningDelta):
        return {"reasoning_content": event.text}
    if isinstance(event, ToolCallStart):
        function = {"name": event.name, "arguments": ""}
        call = {"index": event.call_index, "id": event.call_id, "type": "function", "function": function}
        return {"tool_calls": [call]}
    if isinstance(event, ToolCallArgsDelta):
        return {"tool_calls": [{"index": event.call_index, "function": {"arguments": event.fragment}}]}
    return None


def _message_json(result: CollectedChoice) -> dict[str, Any]:
    parsed = result.channels.result()
    # `refusal` is required by the spec (null: no refusal channel exists here)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content, "refusal": None}
    if parsed.reasoning:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["content"] = parsed.content or None
        message["tool_calls"] = [
            {
                "id": call.call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in parsed.tool_calls
        ]
    return message


async def _complete(
    stream: CoreStream, model_id: str, fingerprint: str, metadata: dict[str, str] | None
) -> dict[str, Any]:
    async with stream:
        results = await collect(stream)
        usage = stream.usage
    completion = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_id,
        "system_fingerprint": fingerprint,
        "choices": [
            {
                "index": r.index,
                "message": _message_json(r),
                "logprobs": logprobs_json(r.logprobs) if r.logprobs is not None else None,
                "finish_reason": r.finish_reason,
            }
            for r in results
        ],
        "usage": usage_json(usage),
    }
    if metadata is not None:
        completion["metadata"] = metadata
    return completion


class ChatCompletionsRoute(ModelRoute[ChatCompletionRequest]):
    route = "POST /v1/chat/completions"
    body_type = ChatCompletionRequest

    async def serve(self, body: ChatCompletionRequest, service: ModelService, call: RouteCall) -> Response:
        model_id = call.model_id
        core_request, chat_degraded = await to_core(body, service)
        core_request.batch_invariant = body.batch_invariant
        core_request.lora_ids = body.lora_ids()
        metadata: dict[str, Any] = {
            "kind": "chat.completion",
            "model": model_id,
            "request_id": call.request_id,
        }
        if body.metadata:
            metadata["metadata"] = body.metadata
        spec = SessionSpec(
            inputs=[chat_message_events(body.messages)], metadata=metadata, is_ephemeral=not body.store
        )
        core_request.session = spec
        stream = call.start(core_request)
        degraded = body.degraded_fields() + chat_degraded
        try:  # admitted first: a refused request leaves no session behind
            session_id = await open_stored_session(call, spec) if body.store else None
        except BaseException:  # cancelled (the client left): the generation never runs
            stream.close()
            raise
        if body.store and session_id is None:
            degraded.append("store")
        fingerprint = service.system_fingerprint
        return await respond(
            call.request,
            stream,
            degraded,
            is_streaming=body.stream,
            frames=lambda: sse_frames(
                _stream_chunks(body, stream, model_id, fingerprint, call.keepalive_s),
                render_error,
                stream.degraded,
            ),
            complete=lambda: _complete(stream, model_id, fingerprint, _stored_metadata(body, session_id)),
            headers={SESSION_HEADER: session_id} if session_id is not None else None,
        )


async def open_stored_session(call: RouteCall, spec: SessionSpec) -> str | None:
    """Open a stored completion's session now, holding its input, so its id can go in the
    answer's headers before the first token (the core appends the output to it); None when
    the server keeps no sessions or the store failed (logged; the core records as it can)."""
    recorder: SessionRecorder | None = call.request.app.state.sessions
    if recorder is None:
        return None
    try:
        session = await recorder.write(
            "open chat session", recorder.store.create, spec.metadata, spec.is_ephemeral, spec.inputs[0]
        )
    except Exception:
        log.exception("could not open the stored completion's session; serving it")
        return None
    spec.session_id, spec.input_end_seq = session.id, session.last_seq
    return session.id


def _stored_metadata(body: ChatCompletionRequest, session_id: str | None) -> dict[str, str] | None:
    """The completion's `metadata`: a stored one's, with its session's id (None: not stored)."""
    if session_id is None:
        return None
    return {**(body.metadata or {}), "argosy_session_id": session_id}


@router.post("/v1/chat/completions")
@takes(ChatCompletionRequest, streams=True)
async def chat_completions(request: Request) -> Response:
    return await run_route(request, ChatCompletionsRoute())
