"""The core's neutral events -> Anthropic Messages: a whole message, or its stream of events.

A message's content is blocks: `thinking` (reasoning, with a `signature`: a hash of its text,
opaque and stable, so a client can hand the block back), `text`, and `tool_use` (`id`
`toolu_…`, `name`, `input` the parsed arguments object). Non-streaming, the blocks come in
that order; streaming, in the order the model wrote them, each one
`content_block_start` -> `content_block_delta`s (`thinking_delta` then one `signature_delta`,
`text_delta`, `input_json_delta` with `partial_json`) -> `content_block_stop`, between
`message_start` (empty content, the input usage) and `message_delta` (stop_reason,
stop_sequence, the whole usage: counts there are cumulative) + `message_stop`.

Usage as Anthropic counts it: `input_tokens` are the prompt tokens not read from the cache,
`cache_read_input_tokens` our prefix-cache hits (their sum is the prompt, what count_tokens
says), `cache_creation_input_tokens` 0 (the prefix cache keeps every prompt by itself; no
request pays to write it).

stop_reason: "stop" -> `end_turn`, or `stop_sequence` (with `stop_sequence` the string) when
one of the request's stop_sequences ended it; "length" -> `max_tokens`, or
`model_context_window_exceeded` when the prompt and output filled the model's context first;
"tool_calls" -> `tool_use`.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any

from argosy.api.anthropic.wire import wire_tool_id
from argosy.chat.collector import ParsedOutput
from argosy.chat.events import (
    Event,
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)

_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def thinking_signature(thinking: str) -> str:
    """An opaque, stable signature for a thinking block (Anthropic's are encrypted; ours is a
    hash of the text: the same thinking handed back signs the same)."""
    return "argosy:" + hashlib.sha256(thinking.encode("utf-8")).hexdigest()


def usage_json(usage: Usage) -> dict[str, int]:
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
    }


def stop_json(
    finish_reason: str | None,
    stop_reason: int | str | None,
    stop_sequences: list[str] | None,
    usage: Usage | None = None,
    context_length: int | None = None,
) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice: a "length" finish with the context
    full (prompt and output fill `context_length`) is `model_context_window_exceeded`."""
    if finish_reason == "stop" and isinstance(stop_reason, str) and stop_reason in (stop_sequences or []):
        return "stop_sequence", stop_reason
    context_full = (
        usage is not None
        and context_length is not None
        and usage.prompt_tokens + usage.completion_tokens >= context_length
    )
    if finish_reason == "length" and context_full:
        return "model_context_window_exceeded", None
    return _STOP_REASONS.get(finish_reason or "stop", "end_turn"), None


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the `input` object; arguments that are not a JSON object (a call
    cut off by max_tokens) are an empty input."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_json(parsed: ParsedOutput, *, omit_thinking: bool = False) -> list[dict[str, Any]]:
    """The blocks of a message; `omit_thinking` (display: omitted): a thinking block's text is
    left out, its signature (of the whole text) kept."""
    blocks: list[dict[str, Any]] = []
    if parsed.reasoning:
        blocks.append(
            {
                "type": "thinking",
                "thinking": "" if omit_thinking else parsed.reasoning,
                "signature": thinking_signature(parsed.reasoning),
            }
        )
    if parsed.content:  # Anthropic refuses an empty text block handed back: none is sent
        blocks.append({"type": "text", "text": parsed.content})
    for call in parsed.tool_calls:
        blocks.append(
            {
                "type": "tool_use",
                "id": wire_tool_id(call.call_id),
                "name": call.name,
                "input": tool_input(call.arguments),
            }
        )
    return blocks


def message_json(
    *,
    response_id: str,
    model_id: str,
    parsed: ParsedOutput,
    finish_reason: str | None,
    stop_reason: int | str | None,
    stop_sequences: list[str] | None,
    usage: Usage,
    omit_thinking: bool = False,
    context_length: int | None = None,
) -> dict[str, Any]:
    reason, sequence = stop_json(finish_reason, stop_reason, stop_sequences, usage, context_length)
    return {
        "id": response_id,
        "type": "message",
        "role": "assistant",
        "model": model_id,
        "content": content_json(parsed, omit_thinking=omit_thinking),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_json(usage),
    }


class MessageStream:
    """One choice's events -> Anthropic stream events (dicts with their `type`), a block open
    at a time: a new channel closes the open block and starts its own."""

    def __init__(
        self,
        response_id: str,
        model_id: str,
        stop_sequences: list[str] | None,
        *,
        omit_thinking: bool = False,
        context_length: int | None = None,
    ) -> None:
        self.response_id = response_id
        self.context_length = context_length
        self.omit_thinking = omit_thinking  # display: omitted: no thinking_delta, the signature only
        self.model_id = model_id
        self.stop_sequences = stop_sequences
        self._index = -1  # the open block's index (-1: none yet)
        self._open: str | None = None  # its type
        self._call_index: int | None = None  # the open tool_use block's call
        self._thinking: list[str] = []

    def start(self, usage: Usage) -> list[dict[str, Any]]:
        message: dict[str, Any] = {
            "id": self.response_id,
            "type": "message",
            "role": "assistant",
            "model": self.model_id,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage_json(usage),
        }
        return [{"type": "message_start", "message": message}]

    def on_event(self, event: Event) -> list[dict[str, Any]]:
        if isinstance(event, TextDelta):
            if not event.text:
                return []
            frames = self._open_block("text", {"type": "text", "text": ""})
            return [*frames, self._delta({"type": "text_delta", "text": event.text})]
        if isinstance(event, ReasoningDelta):
            if not event.text:
                return []
            frames = self._open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self._thinking.append(event.text)
            if self.omit_thinking:
                return frames
            return [*frames, self._delta({"type": "thinking_delta", "thinking": event.text})]
        if isinstance(event, ToolCallStart):
            block = {"type": "tool_use", "id": wire_tool_id(event.call_id), "name": event.name, "input": {}}
            frames = self._close_block()
            frames += self._open_block("tool_use", block)
            self._call_index = event.call_index
            return frames
        if isinstance(event, ToolCallArgsDelta):
            if self._open != "tool_use" or event.call_index != self._call_index or not event.fragment:
                return []
            return [self._delta({"type": "input_json_delta", "partial_json": event.fragment})]
        if isinstance(event, ToolCallEnd):
            return self._close_block() if self._open == "tool_use" else []
        return []  # logprobs, parse failures (logged by the core), prompt echo: not in this dialect

    def finish(self, event: Finish, usage: Usage) -> list[dict[str, Any]]:
        reason, sequence = stop_json(
            event.reason, event.stop_reason, self.stop_sequences, usage, self.context_length
        )
        return [
            *self._close_block(),
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage_json(usage),
            },
            {"type": "message_stop"},
        ]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self._index, "delta": delta}

    def _open_block(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        if self._open == kind and kind != "tool_use":
            return []
        frames = self._close_block()
        self._index += 1
        self._open = kind
        return [*frames, {"type": "content_block_start", "index": self._index, "content_block": block}]

    def _close_block(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        frames: list[dict[str, Any]] = []
        if self._open == "thinking":
            signature = thinking_signature("".join(self._thinking))
            frames.append(self._delta({"type": "signature_delta", "signature": signature}))
            self._thinking = []
        frames.append({"type": "content_block_stop", "index": self._index})
        self._open = None
        self._call_index = None
        return frames
