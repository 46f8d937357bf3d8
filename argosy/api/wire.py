"""What every dialect's request bodies and answers share: the body model that reads `null` as
"not sent", stop strings and their bounds, unknown fields named, the degraded-fields header,
token logprobs as OpenAI and Ollama list them, and `respond` (a generation's stream or its one
JSON object).

Every generation's answer, in every dialect, streamed or not, carries two headers
(`generation_headers`): `x-argosy-degraded` (the fields accepted but not honoured) and
`x-argosy-sampling`, the sampling the engine runs after precedence (request > operator >
model's generation_config > fallback), as compact JSON:

    x-argosy-sampling: {"temperature":0.7,"top_p":1.0,"top_k":40,"min_p":0.0,"seed":8134…,
                        "max_tokens":2035,"presence_penalty":0.0,"frequency_penalty":0.0,
                        "repetition_penalty":1.0}

`seed` is the one drawn when the request sent none (null: greedy, no seed is used);
`max_tokens` the limit actually applied (the room left in the context when nobody set one);
with more than one choice (n > 1, or a batch of prompts) `seeds` lists each choice's seed.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, model_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from argosy.api.framing import SSEResponse
from argosy.api.transport import run_unless_disconnected
from argosy.chat.events import TokenCandidate, TokenLogprobs
from argosy.core.stream import CoreStream

DEGRADED_HEADER = "x-argosy-degraded"
SAMPLING_HEADER = "x-argosy-sampling"
# OpenAI takes up to 4 stop sequences, vLLM any number; 16 leaves room for every real use. A
# stop string's length is what the detokenizer holds back while streaming (a partial match
# may still complete), so 1000 characters bounds that delay and the per-step search.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000  # characters in one stop string
MAX_NAMED_UNKNOWN = 16  # unknown fields named in the degraded header; the rest are counted
_FIELD_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


def _stop_list(value: Any) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ValueError("stop must be a string or a list of strings")
    if len(value) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(value)}")
    longest = max((len(s) for s in value), default=0)
    if longest > MAX_STOP_CHARS:
        raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters, got {longest}")
    return list(value)


StopField = Annotated[Any, BeforeValidator(_stop_list)]


class WireModel(BaseModel):
    """A request body (or part of one) as OpenAI reads it: a field sent as `null` is a field not
    sent, so it takes its default (`"stream": null` is not streaming; the openai spec marks such
    fields nullable and SDKs send nulls). Fields whose default is None already accept null."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            key: value
            for key, value in data.items()
            if value is not None
            or key not in fields
            or fields[key].is_required()
            or fields[key].default is None
        }


def named_unknown(names: Any) -> list[str]:
    """Unknown field names as the degraded header lists them: header-safe names, sorted, at
    most MAX_NAMED_UNKNOWN, the rest counted."""
    names = sorted(names)
    safe = [name for name in names if _FIELD_NAME.match(name)][:MAX_NAMED_UNKNOWN]
    rest = len(names) - len(safe)
    return safe + ([f"{rest} more unknown fields"] if rest else [])


def finite_logprob(logprob: float | None) -> float | None:
    """JSON has no -inf: a token masked out entirely reports a very small number instead."""
    return logprob if logprob is None or math.isfinite(logprob) else -9999.0


def candidate_json(candidate: TokenCandidate) -> dict[str, Any]:
    """A token as OpenAI's (and Ollama's) logprobs list it: {token, logprob, bytes}."""
    return {
        "token": candidate.token,
        "logprob": finite_logprob(candidate.logprob),
        "bytes": list(candidate.token_bytes),
    }


def token_logprob_json(entry: TokenLogprobs) -> dict[str, Any]:
    """One generated token with its alternatives: {token, logprob, bytes, top_logprobs: [...]},
    the entry of chat's `logprobs.content` and of a Responses `output_text.logprobs`."""
    return {**candidate_json(entry.chosen), "top_logprobs": [candidate_json(c) for c in entry.top]}


def degraded_headers(fields: list[str]) -> dict[str, str]:
    """Fields accepted but not honoured, named so nobody mistakes them for obeyed."""
    return {DEGRADED_HEADER: ", ".join(fields)} if fields else {}


def sampling_headers(stream: CoreStream) -> dict[str, str]:
    """The effective sampling of `stream`'s choices (CoreStream.effective_sampling), compact
    JSON (ASCII: numbers, null, keys)."""
    return {SAMPLING_HEADER: json.dumps(stream.effective_sampling(), separators=(",", ":"))}


def generation_headers(stream: CoreStream, degraded: list[str]) -> dict[str, str]:
    """The headers of every generation's answer: the degraded fields and the sampling used."""
    return {**degraded_headers(degraded), **sampling_headers(stream)}


async def respond(
    request: Request,
    stream: CoreStream,
    degraded: list[str],
    *,
    is_streaming: bool,
    frames: Callable[[], AsyncIterator[bytes]],
    complete: Callable[[], Awaitable[dict[str, Any]]],
    stream_type: type[SSEResponse] = SSEResponse,
    headers: dict[str, str] | None = None,
) -> Response:
    """The answer to a generation: its `frames` (SSE, or `stream_type`'s framing), or the JSON
    `complete` builds (the work cancelled, and 499 answered to nobody, if the client leaves
    first), with `generation_headers`. `degraded` names the fields not honoured; what the
    stream learns under way (`stream.degraded`) joins them. `headers`: the route's own."""
    if is_streaming:
        return stream_type(frames(), headers={**generation_headers(stream, degraded), **(headers or {})})
    result = await run_unless_disconnected(request, complete())
    if result is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(
        result, headers={**generation_headers(stream, degraded + stream.degraded), **(headers or {})}
    )
