"""OpenAI `POST /v1/chat/completions`: request model, to_core(), and rendering of events.

Streaming: per choice a role chunk first, then content deltas, then one chunk with its
finish_reason; with `stream_options.include_usage` a last chunk with `choices: []` and the
usage (earlier chunks carry `usage: null`); with `continuous_usage_stats` every chunk
carries the usage so far.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from argosy.api.core import Core, CoreRequest, CoreStream, collect
from argosy.api.openai_common import (
    SamplingFields,
    degraded_headers,
    finite_logprob,
    render_error,
    usage_json,
)
from argosy.api.sse import SSEResponse, sse_frames
from argosy.api.transport import read_model, run_unless_disconnected
from argosy.chat.events import Finish, TextDelta, TokenCandidate, TokenLogprobs
from argosy.errors import InvalidRequestError
from argosy.sampling_params import MAX_LOGPROBS

router = APIRouter()

_MEDIA_PARTS = {"image_url": "images", "input_audio": "audio", "file": "files", "video_url": "video"}


def _content_text(value: Any) -> str | None:
    """String content as is; text parts joined; media refused (the models served are text-only)."""
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("content must be a string or a list of content parts")
    texts: list[str] = []
    for position, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in _MEDIA_PARTS:
            raise ValueError(f"this model does not accept {_MEDIA_PARTS[kind]} (part {position} is {kind!r})")
        elif kind == "text":
            raise ValueError(f"content part {position} is a text part without a string 'text'")
        else:
            raise ValueError(f"content part {position} has unsupported type {kind!r}")
    return "".join(texts)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[Any, BeforeValidator(_content_text)] = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    # Accepted; not honoured until the chat layer's tools / structured output land.
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    reasoning_effort: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None

    def check(self) -> None:
        """Cross-field checks that need no model."""
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true.", param="top_logprobs")
        reserved = {"messages", "add_generation_prompt", "tools"} & set(self.chat_template_kwargs or {})
        if reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {', '.join(sorted(reserved))}: the request's own fields do.",
                param="chat_template_kwargs",
            )
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, dict)
        if forced and not self.tools:
            raise InvalidRequestError(
                "tool_choice forces a tool call, but no tools were given.", "tool_choice"
            )

    def degraded_fields(self) -> list[str]:
        asks = {
            "tools": bool(self.tools),
            "tool_choice": self.tool_choice not in (None, "none", "auto"),
            "response_format": self.response_format is not None
            and self.response_format.get("type") != "text",
            "functions": bool(self.functions),
            "function_call": self.function_call not in (None, "none", "auto"),
            "reasoning_effort": self.reasoning_effort is not None,
            "modalities": any(m != "text" for m in self.modalities or []),
            "audio": self.audio is not None,
            "prediction": self.prediction is not None,
            "web_search_options": self.web_search_options is not None,
        }
        return [name for name, is_asked in asks.items() if is_asked]

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _template_message(message: ChatMessage) -> dict[str, Any]:
    rendered: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": message.content,
    }
    if message.name is not None:
        rendered["name"] = message.name
    extra = message.model_extra or {}
    for key in ("tool_calls", "tool_call_id", "reasoning_content", "reasoning"):
        if key in extra:
            rendered[key] = extra[key]
    return rendered


def to_core(body: ChatCompletionRequest, core: Core, request_id: str = "-") -> CoreRequest:
    kwargs = dict(body.chat_template_kwargs or {})
    if body.tools:
        kwargs["tools"] = body.tools
    prompt_ids = core.encode_chat([_template_message(m) for m in body.messages], kwargs)
    return CoreRequest(
        prompts=[prompt_ids],
        sampling=body.request_sampling(
            max_tokens=body.max_completion_tokens or body.max_tokens, logprobs=body.num_logprobs
        ),
        n=body.n,
        route="POST /v1/chat/completions",
        prompt_param="messages",
        request_id=request_id,
    )


# -- rendering ------------------------------------------------------------------------------


def _candidate_json(candidate: TokenCandidate) -> dict[str, Any]:
    return {
        "token": candidate.token,
        "logprob": finite_logprob(candidate.logprob),
        "bytes": list(candidate.token_bytes),
    }


def logprobs_json(entries: list[TokenLogprobs]) -> dict[str, Any]:
    """OpenAI chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
    return {
        "content": [
            {**_candidate_json(e.chosen), "top_logprobs": [_candidate_json(c) for c in e.top]}
            for e in entries
        ]
    }


async def _stream_chunks(
    body: ChatCompletionRequest, stream: CoreStream, model_id: str
) -> AsyncIterator[dict[str, Any]]:
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    wants_logprobs = body.num_logprobs is not None

    def chunk(choice: dict[str, Any]) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "id": response_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model_id,
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
        async for event in stream:
            if isinstance(event, TextDelta):
                logprobs = logprobs_json(event.logprobs or []) if wants_logprobs else None
                yield chunk(
                    {
                        "index": event.index,
                        "delta": {"content": event.text},
                        "logprobs": logprobs,
                        "finish_reason": None,
                    }
                )
            elif isinstance(event, Finish):
                yield chunk(
                    {"index": event.index, "delta": {}, "logprobs": None, "finish_reason": event.reason}
                )
        if body.include_usage:
            yield {
                "id": response_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model_id,
                "choices": [],
                "usage": usage_json(stream.usage),
            }


async def _complete(stream: CoreStream, model_id: str) -> dict[str, Any]:
    async with stream:
        results = await collect(stream)
        usage = stream.usage
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_id,
        "choices": [
            {
                "index": r.index,
                "message": {"role": "assistant", "content": r.text},
                "logprobs": logprobs_json(r.logprobs) if r.logprobs is not None else None,
                "finish_reason": r.finish_reason,
            }
            for r in results
        ],
        "usage": usage_json(usage),
    }


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    core: Core = request.app.state.core
    body = await read_model(request, ChatCompletionRequest)
    body.check()
    model_id = core.resolve_model(body.model)
    stream = core.start(to_core(body, core, request.state.request_id))
    headers = degraded_headers(body.degraded_fields())
    if body.stream:
        return SSEResponse(sse_frames(_stream_chunks(body, stream, model_id), render_error), headers=headers)
    result = await run_unless_disconnected(request, _complete(stream, model_id))
    if result is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(result, headers=headers)
