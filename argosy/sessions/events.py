"""The events of a session's append-only log: plain, JSON-able dataclasses.

A session records a generation in the order it happened: the messages that went in, the
spans the model generated (per channel), the tool calls it made, the tool calls that failed
to parse, and how it finished. Nothing here knows HTTP or a dialect: message content parts
and tool calls are kept as the JSON-able data the dialect handed over (tuples come back as
lists after a round trip through the store).

`kind` is each event type's persistent name, stored next to its JSON payload: never rename
one. Adding a field with a default is a compatible change; old rows decode with the default.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from argosy.errors import ArgosyError, InvalidRequestError

SPAN_CHANNELS = ("text", "reasoning", "tool_call")


@dataclass(frozen=True, slots=True)
class MessageAppended:
    """A message entered the conversation (system, developer, user, assistant or tool).

    `content` is text, a list of parts (JSON-able dicts, e.g. {"type": "text", "text": ...}),
    or None; `tool_calls` are an assistant's calls and `tool_call_id` the call a tool message
    answers.
    """

    kind: ClassVar[str] = "message"

    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None

    def __post_init__(self) -> None:
        if not self.role:
            raise InvalidRequestError("a message needs a role", "role")


@dataclass(frozen=True, slots=True)
class SpanGenerated:
    """Text the model generated on one channel, with the token ids that produced it.

    `logprobs`: a text span's per-token logprobs, when its generation kept them (a Responses
    request that includes `message.output_text.logprobs`), as argosy/core/session_log.py
    records them; None otherwise, and then left out of the stored payload."""

    kind: ClassVar[str] = "span"

    channel: str  # one of SPAN_CHANNELS
    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if self.channel not in SPAN_CHANNELS:
            raise InvalidRequestError(
                f"span channel must be one of {', '.join(SPAN_CHANNELS)}, got {self.channel!r}", "channel"
            )


@dataclass(frozen=True, slots=True)
class ToolUsed:
    """The model called a tool; `arguments` is the JSON text it generated."""

    kind: ClassVar[str] = "tool_use"

    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolParseFailed:
    """Generated text looked like a tool call but did not parse; kept verbatim."""

    kind: ClassVar[str] = "tool_parse_failure"

    raw_text: str
    reason: str


@dataclass(frozen=True, slots=True)
class Finished:
    """The generation ended: `reason` as the core reports it ("stop", "length", "tool_calls"…)."""

    kind: ClassVar[str] = "finish"

    reason: str
    usage: dict[str, Any] = field(default_factory=dict)


SessionEvent = MessageAppended | SpanGenerated | ToolUsed | ToolParseFailed | Finished

EVENT_TYPES: dict[str, type[SessionEvent]] = {
    cls.kind: cls for cls in (MessageAppended, SpanGenerated, ToolUsed, ToolParseFailed, Finished)
}


# Optional fields added later: absent from the payload while None (rows stay as they were).
_LEFT_OUT_WHEN_NONE = frozenset({"logprobs"})


def encode_event(event: SessionEvent) -> tuple[str, str]:
    """(kind, JSON payload) of an event; InvalidRequestError when a field is not JSON-able."""
    if type(event) not in EVENT_TYPES.values():
        raise InvalidRequestError(f"not a session event: {type(event).__name__}")
    fields = {
        key: value
        for key, value in asdict(event).items()
        if value is not None or key not in _LEFT_OUT_WHEN_NONE
    }
    try:
        payload = json.dumps(fields, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"{event.kind} event is not JSON-serialisable: {exc}") from exc
    return event.kind, payload


def decode_event(kind: str, payload: str) -> SessionEvent:
    """The event stored as (kind, payload); ArgosyError for a kind this version does not know."""
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise ArgosyError(f"unknown session event kind {kind!r} (written by a newer Argosy?)")
    return cls(**json.loads(payload))
