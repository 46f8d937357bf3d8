"""What each dialect's streamed request is, for bench/dialects.py: its body (the same greedy
prompt), a parser of its stream's lines (first text delta, tokens from its own usage), and one
request streamed and timed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

PROMPT = "Write a long, detailed essay about the history of the printing press."
SEED = 0


@dataclass
class StreamResult:
    """One streamed request as the client saw it; `num_tokens` from the final usage."""

    ttft_s: float | None = None
    latency_s: float = 0.0
    num_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def is_ok(self) -> bool:
        return self.error is None and self.ttft_s is not None and self.num_tokens is not None


@dataclass
class StreamState:
    """What a dialect's line parser fills in while the stream runs."""

    sent: float
    result: StreamResult = field(default_factory=StreamResult)
    is_done: bool = False

    def text(self, text: str) -> None:
        if text and self.result.ttft_s is None:
            self.result.ttft_s = time.perf_counter() - self.sent


# -- the three dialects: request body and line parser -------------------------------------------


def openai_body(model: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": SEED,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def openai_line(line: str, state: StreamState) -> None:
    if not line.startswith("data:"):
        return
    payload = line[5:].strip()
    if payload == "[DONE]":
        state.is_done = True
        return
    chunk = json.loads(payload)
    if "error" in chunk:
        state.result.error = str(chunk["error"])[:200]
        return
    for choice in chunk.get("choices") or []:
        state.text((choice.get("delta") or {}).get("content") or "")
        if choice.get("finish_reason"):
            state.result.finish_reason = choice["finish_reason"]
    if chunk.get("usage"):
        state.result.num_tokens = int(chunk["usage"]["completion_tokens"])


def anthropic_body(model: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "seed": SEED,  # an Argosy extension, as on the OpenAI routes
        "stream": True,
    }


def anthropic_line(line: str, state: StreamState) -> None:
    if not line.startswith("data:"):
        return  # `event:` names repeat the data's `type`
    event = json.loads(line[5:].strip())
    kind = event.get("type")
    if kind == "content_block_delta":
        delta = event.get("delta") or {}
        if delta.get("type") == "text_delta":
            state.text(delta.get("text") or "")
    elif kind == "message_delta":
        state.result.finish_reason = (event.get("delta") or {}).get("stop_reason")
        state.result.num_tokens = int(event["usage"]["output_tokens"])
    elif kind == "message_stop":
        state.is_done = True
    elif kind == "error":
        state.result.error = str(event.get("error"))[:200]


def ollama_body(model: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": True,
        "options": {"num_predict": max_tokens, "temperature": 0.0, "seed": SEED},
    }


def ollama_line(line: str, state: StreamState) -> None:
    if not line.strip():
        return
    chunk = json.loads(line)
    if "error" in chunk:
        state.result.error = str(chunk["error"])[:200]
        return
    state.text((chunk.get("message") or {}).get("content") or "")
    if chunk.get("done"):
        state.result.finish_reason = chunk.get("done_reason")
        state.result.num_tokens = int(chunk["eval_count"])
        state.is_done = True


@dataclass(frozen=True)
class Dialect:
    path: str
    body: Callable[[str, int], dict[str, Any]]
    parse_line: Callable[[str, StreamState], None]


ROUTES = {
    "openai": Dialect("/v1/chat/completions", openai_body, openai_line),
    "anthropic": Dialect("/v1/messages", anthropic_body, anthropic_line),
    "ollama": Dialect("/api/chat", ollama_body, ollama_line),
}


async def stream_one(http: httpx.AsyncClient, dialect: str, model: str, max_tokens: int) -> StreamResult:
    route = ROUTES[dialect]
    body = route.body(model, max_tokens)
    state = StreamState(sent=time.perf_counter())
    try:
        async with http.stream("POST", route.path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                state.result.error = f"HTTP {response.status_code}: {text[:200]}"
                return state.result
            async for line in response.aiter_lines():
                route.parse_line(line, state)
                if state.result.error is not None or state.is_done:
                    break
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        state.result.error = f"{type(error).__name__}: {error}"[:200]
    state.result.latency_s = time.perf_counter() - state.sent
    if state.result.error is None and not state.is_done:
        state.result.error = "stream ended without its final event"
    return state.result


# -- rounds, figures -----------------------------------------------------------------------------
