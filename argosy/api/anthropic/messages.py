"""Anthropic `POST /v1/messages` and `POST /v1/messages/count_tokens`.

The body becomes a neutral ChatInput (wire.py), then a CoreRequest (core/chat_request.py),
as OpenAI chat's does; the core's events come back as a message or its stream (render.py).
Errors on these routes are Anthropic's envelope (`api/errors.py`, registered in app.py).
The `anthropic-version` header is accepted and changes nothing; `anthropic-beta` values are
accepted, those whose behaviour this server lacks named as degraded.

Honoured: system, messages (text, tool_use, tool_result, thinking blocks), tools, tool_choice
(with disable_parallel_tool_use), stop_sequences, temperature, top_p, top_k, max_tokens,
`output_config.format` (a json_schema: constrained decoding, as chat's response_format),
`thinking` (`enabled` / `disabled` switch the template's `enable_thinking`; `adaptive` leaves
the model's default), `thinking.budget_tokens` on a model that reasons (once its reasoning
has run that many tokens, the reasoning's end marker is forced and the answer follows),
`output_config.effort` (the template's `reasoning_effort`), `seed` (an Argosy extension, as
on the OpenAI routes), and prefill: a conversation ending with an assistant message is
continued (the prompt ends with that message's text left open; the reply's content is only
what follows it, as Anthropic's is). The stream sends `ping` after `message_start` and
whenever no other event has gone out for PING_EVERY_S seconds. `thinking.display: omitted`
returns thinking blocks with empty text and their signature (no thinking_delta is streamed). Named in `x-argosy-degraded`
when they would change something on Anthropic and do not here: `thinking.budget_tokens` on
a reasoning model whose markers the budget cannot follow (no one-token start marker and a
prompt that does not open the reasoning), `thinking` on a model that does not reason (or
whose template has no switch), `output_config.effort` unless the model reasons and its
template reads `reasoning_effort`, `thinking: between_tools` (thinking is off, but what the
model writes between tool calls comes back as text blocks, not thinking blocks), any
`anthropic-beta` other than KNOWN_BETAS (as `anthropic-beta:<name>`), `service_tier` (other than
standard_only), `cache_control` (the prefix cache works by itself), `speed` (other than
standard), `inference_geo`, `container`, `diagnostics`, and any field this server does not
know. `metadata` is accepted, and so are `user_profile_id` and `workspace_id` (they change no
output).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import Field, PrivateAttr
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from argosy.api.anthropic.render import MessageStream, message_id, message_json
from argosy.api.anthropic.wire import chat_input_from_wire
from argosy.api.errors import anthropic_error_body
from argosy.api.framing import sse_frames
from argosy.api.openapi import takes
from argosy.api.route import ModelRoute, RouteCall, run_route
from argosy.api.wire import StopField, WireModel, degraded_headers, named_unknown, respond
from argosy.chat.events import Finish
from argosy.chat.messages import ChatInput, check_continuation
from argosy.chat.profile import ChatProfile
from argosy.core.chat_request import prepare_chat
from argosy.core.constraints import check_chat_options
from argosy.core.conversation import message_events
from argosy.core.recording import SessionSpec
from argosy.core.service import ModelService
from argosy.core.stream import CoreRequest, CoreStream, collect
from argosy.errors import InvalidRequestError
from argosy.sampling_params import RequestSampling

router = APIRouter()

EFFORTS = ("low", "medium", "high", "xhigh", "max")
THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")
# anthropic-beta values whose behaviour this server has (any other is named as degraded)
KNOWN_BETAS = frozenset(
    {
        "token-counting-2024-11-01",  # /v1/messages/count_tokens
        "prompt-caching-2024-07-31",  # the prefix cache is automatic
        # input_json_delta streams as it is decoded (a forced call; an `auto` call of a tool
        # with a schema is sent once its arguments pass it: argosy/chat/call_guard.py)
        "fine-grained-tool-streaming-2025-05-14",
        "interleaved-thinking-2025-05-14",  # reasoning may open between tool calls
        "output-128k-2025-02-19",  # max_tokens is bounded by the model's context only
        "structured-outputs-2025-11-13",  # output_config.format / strict tools
    }
)


def beta_degraded(request: Request) -> list[str]:
    """Betas a client turned on that change nothing here, as `anthropic-beta:<name>`."""
    header = ",".join(request.headers.getlist("anthropic-beta"))
    betas = [beta.strip() for beta in header.split(",") if beta.strip()]
    return [f"anthropic-beta:{beta}" for beta in named_unknown(b for b in betas if b not in KNOWN_BETAS)]


# A stream sends a ping after message_start, then one whenever no event went out for this long
# (a long prompt's prefill, a queue): proxies and clients see the connection alive.
PING_EVERY_S = 15.0
PING: dict[str, Any] = {"type": "ping"}
# what the chat layer names (OpenAI's words) -> this dialect's field
_DEGRADED_NAMES = {
    "response_format": "output_config.format",
    "tools": "tools",
    "reasoning_budget": "thinking.budget_tokens",
}


def _refuse(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"Invalid '{param}': {message}.", param)


class AnthropicMessage(WireModel):
    role: Literal["user", "assistant"]
    content: Any = Field()  # a string or content blocks: read by wire.py, naming the block


class CountTokensRequest(WireModel):
    """What both routes read to build the prompt."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Any = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    thinking: Any = None
    output_config: Any = None
    # Accepted; no effect here (named in x-argosy-degraded where they would have one).
    metadata: Any = None  # like these two: who asks, which changes no output
    user_profile_id: str | None = None
    workspace_id: str | None = None
    service_tier: str | None = None
    cache_control: Any = None
    speed: str | None = None
    inference_geo: Any = None
    container: Any = None
    diagnostics: Any = None
    _chat: ChatInput | None = PrivateAttr(default=None)

    def check(self) -> None:
        """Every refusal that needs no model."""
        chat = self.chat_input()
        check_continuation(chat)
        check_chat_options(chat.tools, chat.tool_choice, chat.output_format)

    # -- thinking and output_config ----------------------------------------------------------

    def thinking_config(self) -> dict[str, Any] | None:
        if self.thinking is None:
            return None
        if not isinstance(self.thinking, dict):
            raise _refuse("thinking", "expected an object")
        kind = self.thinking.get("type")
        if kind not in THINKING_TYPES:
            raise _refuse("thinking.type", f"expected one of {', '.join(THINKING_TYPES)}, got {kind!r}")
        budget = self.thinking.get("budget_tokens")
        if kind == "enabled":
            if budget is None:
                raise InvalidRequestError(
                    "Missing required parameter: 'thinking.budget_tokens'.", "thinking.budget_tokens"
                )
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
                raise _refuse("thinking.budget_tokens", "expected a positive integer")
        display = self.thinking.get("display")
        if display not in (None, "summarized", "omitted"):
            raise _refuse("thinking.display", f"expected 'summarized' or 'omitted', got {display!r}")
        return self.thinking

    @property
    def omits_thinking(self) -> bool:
        """`thinking.display: omitted`: thinking blocks come back empty, with their signature."""
        return isinstance(self.thinking, dict) and self.thinking.get("display") == "omitted"

    def output_config_value(self, key: str) -> Any:
        if self.output_config is None:
            return None
        if not isinstance(self.output_config, dict):
            raise _refuse("output_config", "expected an object")
        return self.output_config.get(key)

    def effort(self) -> str | None:
        effort = self.output_config_value("effort")
        if effort is not None and effort not in EFFORTS:
            raise _refuse("output_config.effort", f"expected one of {', '.join(EFFORTS)}, got {effort!r}")
        return effort

    def chat_input(self) -> ChatInput:
        """The request in neutral terms (checked: a malformed field is a 400 naming it)."""
        if self._chat is None:
            kwargs: dict[str, Any] = {}
            thinking = self.thinking_config()
            if thinking is not None and thinking["type"] != "adaptive":  # between_tools: thinking off
                kwargs["enable_thinking"] = thinking["type"] == "enabled"
            effort = self.effort()
            if effort is not None:
                kwargs["reasoning_effort"] = effort
            chat = chat_input_from_wire(
                self.system,
                [(m.role, m.content) for m in self.messages],
                tools=self.tools,
                tool_choice=self.tool_choice,
                output_format=self.output_config_value("format"),
                template_kwargs=kwargs,
            )
            # prefill: a final assistant message is continued, not answered
            chat.continue_final_message = self.messages[-1].role == "assistant"
            chat.add_generation_prompt = not chat.continue_final_message
            if thinking is not None and thinking["type"] == "enabled":
                chat.reasoning_budget = thinking["budget_tokens"]
            self._chat = chat
        return self._chat

    # -- what is not honoured ------------------------------------------------------------------

    def degraded_fields(self) -> list[str]:
        """Fields never honoured (those that depend on the model: `model_degraded`)."""
        asks = {
            # one tier here: `standard_only` is what runs; `auto` may use priority capacity there
            "service_tier": self.service_tier not in (None, "standard_only"),
            "cache_control": self.cache_control is not None,
            "speed": self.speed not in (None, "standard"),
            "inference_geo": self.inference_geo is not None,
            "container": self.container is not None,
            "diagnostics": self.diagnostics is not None,
            # thinking is off; what a model writes between tool calls comes back as text blocks
            "thinking.between_tools": isinstance(self.thinking, dict)
            and self.thinking.get("type") == "between_tools",
        }
        return [name for name, is_asked in asks.items() if is_asked] + self.unknown_fields()

    def unknown_fields(self) -> list[str]:
        return named_unknown(self.model_extra or {})

    def model_degraded(self, profile: ChatProfile, chat_degraded: list[str]) -> list[str]:
        """What this model does not honour of thinking / effort, and the chat layer's names."""
        degraded = [_DEGRADED_NAMES.get(name, name) for name in chat_degraded]
        thinking = self.thinking_config()
        kind = thinking["type"] if thinking is not None else None
        # (a reasoner's budget_tokens is the chat layer's to name: `reasoning_budget`)
        cannot_switch = profile.has_reasoning and not profile.reads("enable_thinking")
        if (kind == "enabled" and not profile.has_reasoning) or (kind == "disabled" and cannot_switch):
            degraded.append("thinking")
        if self.effort() is not None and not (profile.has_reasoning and profile.reads("reasoning_effort")):
            degraded.append("output_config.effort")
        return degraded


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stream: bool = False
    stop_sequences: StopField = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # an Argosy extension
    # an Argosy extension: calls failing their schema repaired per request (None: the server's)
    tool_repair_budget: int | None = Field(None, ge=0)

    def chat_input(self) -> ChatInput:
        chat = super().chat_input()
        chat.tool_repair_budget = self.tool_repair_budget
        return chat

    def sampling(self) -> RequestSampling:
        return RequestSampling(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            max_tokens=self.max_tokens,
            stop=self.stop_sequences,
        )


async def to_core(body: MessagesRequest, service: ModelService) -> tuple[CoreRequest, list[str]]:
    """The CoreRequest, and the fields this model does not honour (x-argosy-degraded)."""
    prepared = await prepare_chat(service, body.chat_input())
    degraded = body.model_degraded(service.chat_profile(), prepared.degraded)
    return prepared.core_request(body.sampling()), degraded


async def _stream_events(
    body: MessagesRequest, stream: CoreStream, model_id: str, context_length: int
) -> AsyncIterator[dict[str, Any]]:
    writer = MessageStream(
        message_id(),
        model_id,
        body.stop_sequences,
        omit_thinking=body.omits_thinking,
        context_length=context_length,
    )
    async with stream:
        for frame in writer.start(stream.usage):
            yield frame
        yield PING
        # closed here, not left to the garbage collector: its wait for the next event ends
        # before the stream's engine requests are aborted
        async with contextlib.aclosing(stream.with_heartbeats(PING_EVERY_S)) as events:
            async for event in events:
                if event is None:
                    yield PING
                    continue
                frames = (
                    writer.finish(event, stream.usage)
                    if isinstance(event, Finish)
                    else writer.on_event(event)
                )
                for frame in frames:
                    yield frame


async def _complete(
    body: MessagesRequest, stream: CoreStream, model_id: str, context_length: int
) -> dict[str, Any]:
    async with stream:
        results = await collect(stream)
        usage = stream.usage
    result = results[0]
    return message_json(
        response_id=message_id(),
        model_id=model_id,
        parsed=result.channels.result(),
        finish_reason=result.finish_reason,
        stop_reason=result.stop_reason,
        stop_sequences=body.stop_sequences,
        usage=usage,
        omit_thinking=body.omits_thinking,
        context_length=context_length,
    )


class MessagesRoute(ModelRoute[MessagesRequest]):
    route = "POST /v1/messages"
    body_type = MessagesRequest

    async def serve(self, body: MessagesRequest, service: ModelService, call: RouteCall) -> Response:
        model_id = call.model_id
        core_request, model_degraded = await to_core(body, service)
        core_request.session = SessionSpec(
            inputs=[message_events(body.chat_input().messages)],
            metadata={"kind": "message", "model": model_id, "request_id": call.request_id},
        )
        stream = call.start(core_request)
        degraded = body.degraded_fields() + model_degraded + beta_degraded(call.request)
        context_length = service.description.context_length
        return await respond(
            call.request,
            stream,
            degraded,
            is_streaming=body.stream,
            frames=lambda: sse_frames(
                _stream_events(body, stream, model_id, context_length),
                anthropic_error_body,
                stream.degraded,
                event_key="type",
                done=False,
            ),
            complete=lambda: _complete(body, stream, model_id, context_length),
        )


class CountTokensRoute(ModelRoute[CountTokensRequest]):
    """The prompt /v1/messages would run, counted; nothing is generated."""

    route = "POST /v1/messages/count_tokens"
    body_type = CountTokensRequest

    async def serve(self, body: CountTokensRequest, service: ModelService, call: RouteCall) -> Response:
        prepared = await prepare_chat(service, body.chat_input())
        degraded = (
            body.degraded_fields()
            + body.model_degraded(service.chat_profile(), prepared.degraded)
            + beta_degraded(call.request)
        )
        return JSONResponse({"input_tokens": len(prepared.prompt_ids)}, headers=degraded_headers(degraded))


@router.post("/v1/messages")
@takes(MessagesRequest, streams=True, errors="AnthropicError")
async def messages(request: Request) -> Response:
    return await run_route(request, MessagesRoute())


@router.post("/v1/messages/count_tokens")
@takes(CountTokensRequest, errors="AnthropicError")
async def count_tokens(request: Request) -> Response:
    return await run_route(request, CountTokensRoute())
