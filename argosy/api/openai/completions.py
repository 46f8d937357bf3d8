"""OpenAI legacy `POST /v1/completions`: a raw prompt, no chat template.

`prompt` is a string, a list of strings, a list of token ids or a list of token-id lists;
a list is a batch, answered as one choice per prompt × n, `index` in that order. `logprobs`
(0..20) uses the legacy shape — `tokens`, `token_logprobs`, `top_logprobs` (token ->
logprob, the chosen token always included), `text_offset` (character offsets into the
returned `text`) — and `"".join(tokens)` is exactly `text`. With `echo` the prompt comes
first: one entry per prompt token, the first with a null logprob. Completions and chunks
carry `system_fingerprint` (ModelService.system_fingerprint), as chat's do.

`suffix` asks for fill-in-the-middle (argosy/chat/fim.py): each prompt is the text before the
gap, laid out in the model's own FIM tokens and stopped at its FIM end markers; it runs with
QoS inline, on the model's satellite where the models file names one. Its `max_tokens`
defaults to 128 (the reference's FIM contract; 16 otherwise). `fim_mode` ("psm" / "spm") picks
the layout where the model was trained on it, else it is named in x-argosy-degraded. The
answer's `model` is the requested model; `fim.served_by` (on the answer, or on each streamed
finish chunk) names the model that generated it.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter
from pydantic import BeforeValidator, Field
from starlette.requests import Request
from starlette.responses import Response

from argosy.api.framing import keepalive_events, sse_frames
from argosy.api.openai.common import (
    SamplingFields,
    render_error,
    usage_json,
)
from argosy.api.openapi import takes
from argosy.api.route import ModelRoute, RouteCall, run_route
from argosy.api.wire import finite_logprob, named_unknown, respond
from argosy.chat.events import Finish, PromptEcho, TextDelta, TokenLogprobs
from argosy.chat.fim import FIM_MODES, fim_max_tokens
from argosy.core.admission import QOS_HEADER
from argosy.core.recording import SessionSpec
from argosy.core.registry import ModelRegistry
from argosy.core.service import ModelService
from argosy.core.stream import CoreRequest, CoreStream, collect
from argosy.errors import InvalidRequestError
from argosy.sampling_params import MAX_LOGPROBS
from argosy.sessions.events import MessageAppended, SessionEvent

router = APIRouter()

_PROMPT_SHAPES = "a string, a list of strings, a list of token ids, or a list of lists of token ids"


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    )


def _prompts(value: Any) -> list[str | list[int]]:
    """Normalize `prompt` to a list of prompts, each a string or a list of token ids."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise ValueError(f"prompt must be {_PROMPT_SHAPES}")
    if not value:
        raise ValueError("prompt must not be empty")
    if all(isinstance(p, str) for p in value):
        return list(value)
    if _is_token_ids(value):
        return [list(value)]
    if all(_is_token_ids(p) for p in value):
        return [list(p) for p in value]
    raise ValueError(f"prompt must be {_PROMPT_SHAPES} (token ids are non-negative integers)")


class CompletionRequest(SamplingFields):
    prompt: Annotated[Any, BeforeValidator(_prompts)]
    # OpenAI's (and vLLM's) default for the legacy endpoint: 16 tokens, not the rest of the context
    max_tokens: int | None = Field(16, ge=1)
    suffix: str | None = None
    fim_mode: str | None = None  # "psm" | "spm": the FIM layout (argosy/chat/fim.py)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1)

    @property
    def is_fim(self) -> bool:
        return self.suffix is not None

    def check(self) -> None:
        """Refusals that need no model."""
        if self.is_fim and not all(isinstance(p, str) for p in self.prompt):
            raise InvalidRequestError(
                "With 'suffix' (fill-in-the-middle) the prompt is the text before the gap, not token ids.",
                param="suffix",
            )
        if self.fim_mode is not None and self.fim_mode not in FIM_MODES:
            raise InvalidRequestError(
                f"fim_mode must be one of {', '.join(map(repr, FIM_MODES))}, got {self.fim_mode!r}.",
                param="fim_mode",
            )
        if self.is_fim and self.echo:
            raise InvalidRequestError(
                "'echo' cannot be combined with 'suffix': a fill-in-the-middle prompt is not the text sent.",
                param="echo",
            )
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidRequestError(
                f"best_of must be at least n ({self.n}), got {self.best_of}.", param="best_of"
            )

    def degraded_fields(self) -> list[str]:
        # best_of > n would generate best_of samples and return the n best: we return n samples.
        # Any field this server does not know is named too, not silently dropped.
        best_of = ["best_of"] if self.best_of is not None and self.best_of > self.n else []
        # fim_mode without a suffix: there is no gap to lay out
        fim_mode = ["fim_mode"] if self.fim_mode is not None and not self.is_fim else []
        return best_of + fim_mode + named_unknown(self.model_extra or {})

    def fim_degraded(self, service: ModelService) -> list[str]:
        """fim_mode when the model serving the gap was not trained on that layout."""
        fim = service.fim
        return ["fim_mode"] if self.is_fim and fim is not None and not fim.honours(self.fim_mode) else []


def to_core(body: CompletionRequest, service: ModelService) -> CoreRequest:
    stops: list[int] = []
    max_tokens = body.max_tokens
    if body.suffix is not None:  # fill in the middle: each prompt is the text before the gap
        fim = [service.encode_fim(str(p), body.suffix, body.fim_mode) for p in body.prompt]
        prompts, stops = [ids for ids, _ in fim], fim[0][1]
        if "max_tokens" not in body.model_fields_set:
            max_tokens = fim_max_tokens(
                service.options.operator_sampling.max_tokens,
                service.description.context_length,
                max(len(ids) for ids in prompts),
            )
    else:
        prompts = [service.encode_text(p) if isinstance(p, str) else p for p in body.prompt]
    sampling = body.request_sampling(max_tokens=max_tokens, logprobs=body.logprobs)
    sampling.stop_token_ids = [*(sampling.stop_token_ids or []), *stops]
    if body.echo and body.logprobs is not None:
        sampling.prompt_logprobs = body.logprobs
    return CoreRequest(
        prompts=prompts,
        sampling=sampling,
        n=body.n,
        echo=body.echo,
        prompt_param="prompt",
    )


# -- rendering ------------------------------------------------------------------------------


def legacy_logprobs(entries: list[TokenLogprobs], text_offset: int) -> dict[str, Any]:
    """The legacy logprobs object for `entries`, offsets counted from `text_offset`."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float | None] | None] = []
    offsets: list[int] = []
    for entry in entries:
        tokens.append(entry.text)
        offsets.append(text_offset)
        text_offset += len(entry.text)
        logprob = finite_logprob(entry.chosen.logprob)
        token_logprobs.append(logprob)
        if logprob is None:
            top_logprobs.append(None)
            continue
        top = {c.token: finite_logprob(c.logprob) for c in entry.top}
        top.setdefault(entry.chosen.token, logprob)
        top_logprobs.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _merge(first: dict[str, Any] | None, second: dict[str, Any]) -> dict[str, Any]:
    if first is None:
        return second
    return {key: first[key] + second[key] for key in first}


async def _stream_chunks(
    body: CompletionRequest,
    stream: CoreStream,
    model_id: str,
    fingerprint: str,
    keepalive_s: float,
    fim: dict[str, Any] | None = None,
) -> AsyncIterator[dict[str, Any] | None]:
    response_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    wants_logprobs = body.logprobs is not None
    num_chars = [0] * len(stream.choices)  # text streamed so far, per choice (text_offset base)

    def chunk(index: int, text: str, logprobs: dict[str, Any] | None, finish: str | None) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "id": response_id,
            "object": "text_completion",
            "created": created,
            "model": model_id,
            "system_fingerprint": fingerprint,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        }
        # With include_usage, earlier chunks carry no `usage` key: unlike the chat chunk's, the
        # spec's completion object (chunks share its shape) has a `usage` that is never null.
        if body.continuous_usage:
            payload["usage"] = usage_json(stream.usage)
        return payload

    async with stream, contextlib.aclosing(keepalive_events(stream, keepalive_s)) as events:
        async for event in events:
            if event is None:
                yield None  # nothing for a while: a keep-alive comment
            elif isinstance(event, PromptEcho | TextDelta):
                logprobs = (
                    legacy_logprobs(event.logprobs or [], num_chars[event.index]) if wants_logprobs else None
                )
                num_chars[event.index] += len(event.text)
                yield chunk(event.index, event.text, logprobs, None)
            elif isinstance(event, Finish):
                finish = chunk(event.index, "", None, event.reason)
                yield finish if fim is None else finish | {"fim": fim}
        if body.include_usage:
            yield {
                "id": response_id,
                "object": "text_completion",
                "created": created,
                "model": model_id,
                "system_fingerprint": fingerprint,
                "choices": [],
                "usage": usage_json(stream.usage),
            }


async def _complete(
    body: CompletionRequest,
    stream: CoreStream,
    model_id: str,
    fingerprint: str,
    fim: dict[str, Any] | None = None,
) -> dict[str, Any]:
    async with stream:
        results = await collect(stream)
        usage = stream.usage
    choices = []
    for r in results:
        prefix = r.echo.text if r.echo is not None else ""
        logprobs = None
        if body.logprobs is not None:
            logprobs = _merge(
                legacy_logprobs(r.echo.logprobs or [], 0) if r.echo is not None else None,
                legacy_logprobs(r.logprobs or [], len(prefix)),
            )
        choices.append(
            {
                "index": r.index,
                "text": prefix + r.text,
                "logprobs": logprobs,
                "finish_reason": r.finish_reason,
            }
        )
    answer = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_id,
        "system_fingerprint": fingerprint,
        "choices": choices,
        "usage": usage_json(usage),
    }
    return answer if fim is None else answer | {"fim": fim}


class CompletionsRoute(ModelRoute[CompletionRequest]):
    route = "POST /v1/completions"
    body_type = CompletionRequest

    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry

    def model_name(self, body: CompletionRequest) -> str | None:
        # fill in the middle goes to the model's satellite where the models file names one
        return self.registry.fim_model(body.model) if body.is_fim else body.model

    def qos(self, body: CompletionRequest, request: Request) -> str:
        if body.is_fim and body.priority is None and QOS_HEADER not in request.headers:
            return "inline"  # an editor's completion: a person is waiting on every keystroke
        return super().qos(body, request)

    def log_tags(self, body: CompletionRequest) -> tuple[str, ...]:
        return ("fim", *super().log_tags(body)) if body.is_fim else super().log_tags(body)

    async def serve(self, body: CompletionRequest, service: ModelService, call: RouteCall) -> Response:
        core_request = to_core(body, service)
        core_request.batch_invariant = body.batch_invariant
        core_request.lora_ids = body.lora_ids()
        core_request.session = _session_spec(body, call.model_id, call.request_id)
        stream = call.start(core_request)
        fingerprint = service.system_fingerprint
        # the answer names the model asked for; a gap a satellite filled says so in `fim`
        model_id = self.registry.resolve(body.model, "chat").spec.id if body.is_fim else call.model_id
        fim = {"served_by": call.model_id} if body.is_fim else None
        return await respond(
            call.request,
            stream,
            body.degraded_fields() + body.fim_degraded(service),
            is_streaming=body.stream,
            frames=lambda: sse_frames(
                _stream_chunks(body, stream, model_id, fingerprint, call.keepalive_s, fim),
                render_error,
                stream.degraded,
            ),
            complete=lambda: _complete(body, stream, model_id, fingerprint, fim),
        )


@router.post("/v1/completions")
@takes(CompletionRequest, streams=True)
async def completions(request: Request) -> Response:
    return await run_route(request, CompletionsRoute(request.app.state.registry))


def _session_spec(body: CompletionRequest, model_id: str, request_id: str) -> SessionSpec:
    """Each prompt is a raw 'prompt' message: its text, or its token ids as one part."""
    inputs: list[list[SessionEvent]] = [
        [
            MessageAppended("prompt", p)
            if isinstance(p, str)
            else MessageAppended("prompt", [{"type": "token_ids", "token_ids": p}])
        ]
        for p in body.prompt
    ]
    metadata = {"kind": "text_completion", "model": model_id, "request_id": request_id}
    return SessionSpec(inputs=inputs, metadata=metadata)
