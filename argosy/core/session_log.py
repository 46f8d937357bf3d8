"""ChoiceLog: one choice's neutral events (and its token ids) -> the session events recorded.

Consecutive deltas of one channel become one SpanGenerated; a tool call becomes a span on the
`tool_call` channel holding its arguments text, then a ToolUsed; a call that failed to parse
a ToolParseFailed (its text came back on another channel too, as the parser says); the finish
a Finished with the usage.

Token ids: every generated id lands in exactly one span, so joining the spans' `token_ids` in
order gives the choice's output ids exactly (a continued conversation rebuilds its prompt from
them). Ids are given to the span of the next event that follows them, since an engine output
produces its events after its ids arrive; ids that no event follows (the end-of-sequence
token, text held back at the end) join the last span, or an empty text span when there is none.

Logprobs, when the generation keeps them (SessionSpec.keeps_logprobs), go the same way: the
entries of a LogprobsDelta (or of a TextDelta, for a choice without channels) join the span
of the next event that carries something, leftovers the last span. Only text spans keep
theirs (what a Responses client reads back as `output_text.logprobs`), as `logprob_record`
writes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from argosy.chat.events import (
    Finish,
    LogprobsDelta,
    ReasoningDelta,
    TextDelta,
    TokenCandidate,
    TokenLogprobs,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolParseFailure,
    Usage,
)
from argosy.sessions.events import Finished, SessionEvent, SpanGenerated, ToolParseFailed, ToolUsed


@dataclass(slots=True)
class _Span:
    channel: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None


@dataclass(slots=True)
class _Call:
    call_id: str
    name: str
    arguments: str = ""


def usage_record(usage: Usage) -> dict[str, Any]:
    """A generation's usage as a session's Finished event stores it."""
    record: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "cached_tokens": usage.cached_tokens,
    }
    if usage.spec_proposed_tokens is not None:
        record["spec_proposed_tokens"] = usage.spec_proposed_tokens
        record["spec_accepted_tokens"] = usage.spec_accepted_tokens or 0
    return record


def logprob_record(entry: TokenLogprobs) -> dict[str, Any]:
    """A token's logprobs as a span stores them (JSON: bytes as hex, -inf as null)."""
    return {
        **_candidate_record(entry.chosen),
        "text": entry.text,
        "top": [_candidate_record(c) for c in entry.top],
    }


def logprobs_of(records: list[dict[str, Any]]) -> list[TokenLogprobs]:
    """The entries `logprob_record` stored, back (a token's text is its bytes, decoded)."""
    return [
        TokenLogprobs(_candidate(record), record["text"], [_candidate(top) for top in record["top"]])
        for record in records
    ]


def _candidate_record(candidate: TokenCandidate) -> dict[str, Any]:
    logprob = candidate.logprob
    return {
        "id": candidate.token_id,
        "bytes": candidate.token_bytes.hex(),
        "logprob": logprob if logprob is None or math.isfinite(logprob) else None,
    }


def _candidate(record: dict[str, Any]) -> TokenCandidate:
    token_bytes = bytes.fromhex(record["bytes"])
    logprob = record["logprob"]
    return TokenCandidate(
        record["id"],
        token_bytes.decode("utf-8", errors="replace"),
        token_bytes,
        float("-inf") if logprob is None else float(logprob),
    )


class ChoiceLog:
    """Accumulates one choice's output as session events; `events()` at the end.
    `keeps_logprobs`: text spans keep their tokens' logprobs (see the module docstring)."""

    def __init__(self, *, keeps_logprobs: bool = False) -> None:
        self._items: list[_Span | SessionEvent] = []
        self._pending_ids: list[int] = []
        self._pending_logprobs: list[TokenLogprobs] = []
        self._keeps_logprobs = keeps_logprobs
        self._calls: dict[int, tuple[_Call, _Span]] = {}
        self.finish: Finished | None = None

    @property
    def num_token_ids(self) -> int:
        spans = (item for item in self._items if isinstance(item, _Span))
        return sum(len(span.token_ids) for span in spans) + len(self._pending_ids)

    def add_token_ids(self, token_ids: list[int]) -> None:
        self._pending_ids.extend(token_ids)

    def add(self, event: Any) -> None:
        """Take one neutral event of this choice; kinds with nothing to record are skipped."""
        if isinstance(event, LogprobsDelta):
            self._add_logprobs(event.logprobs)
        elif isinstance(event, TextDelta):
            self._add_logprobs(event.logprobs)  # a choice without channels: its own text's
            self._extend("text", event.text)
        elif isinstance(event, ReasoningDelta):
            self._extend("reasoning", event.text)
        elif isinstance(event, ToolCallStart):
            span = _Span("tool_call")
            self._take_pending(span)
            self._items.append(span)
            self._calls[event.call_index] = (_Call(event.call_id, event.name), span)
        elif isinstance(event, ToolCallArgsDelta):
            call, span = self._calls[event.call_index]
            call.arguments += event.fragment
            span.text += event.fragment
            self._take_pending(span)
        elif isinstance(event, ToolCallEnd):
            call, _ = self._calls[event.call_index]
            self._items.append(ToolUsed(call_id=call.call_id, name=call.name, arguments=call.arguments))
        elif isinstance(event, ToolParseFailure):
            self._items.append(ToolParseFailed(raw_text=event.text, reason=event.reason))
        elif isinstance(event, Finish):
            self.finish = Finished(reason=event.reason, usage=usage_record(event.usage))

    def events(self, unfinished_reason: str = "abort", usage: Usage | None = None) -> list[SessionEvent]:
        """Everything recorded, ending with a Finished (`unfinished_reason` when the choice
        never finished — cancelled, failed, timed out before its Finish — with `usage`, what
        it had used by then)."""
        if self._pending_ids or self._pending_logprobs:
            spans = [item for item in self._items if isinstance(item, _Span)]
            if not spans:
                spans = [_Span("text")]
                self._items.append(spans[0])
            self._take_pending(spans[-1])
        events: list[SessionEvent] = [
            SpanGenerated(item.channel, item.text, list(item.token_ids), item.logprobs)
            if isinstance(item, _Span)
            else item
            for item in self._items
        ]
        unfinished = Finished(unfinished_reason, usage_record(usage) if usage is not None else {})
        events.append(self.finish or unfinished)
        return events

    def _add_logprobs(self, entries: list[TokenLogprobs] | None) -> None:
        if self._keeps_logprobs and entries:
            self._pending_logprobs.extend(entries)

    def _extend(self, channel: str, text: str) -> None:
        if not text:  # ids stay pending for the next event that carries something
            return
        last = self._items[-1] if self._items else None
        if not isinstance(last, _Span) or last.channel != channel:
            last = _Span(channel)
            self._items.append(last)
        last.text += text
        self._take_pending(last)

    def _take_pending(self, span: _Span) -> None:
        span.token_ids.extend(self._pending_ids)
        self._pending_ids = []
        if self._keeps_logprobs and span.channel == "text":
            span.logprobs = (span.logprobs or []) + [logprob_record(e) for e in self._pending_logprobs]
        self._pending_logprobs = []
