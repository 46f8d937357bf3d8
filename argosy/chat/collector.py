"""The non-streaming message of one choice: its channel events collected.

`parse_text` runs a whole output through a fresh parser; `ChannelCollector` collects the
events a streaming parser produced. Both give the same `ParsedOutput` for the same text.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

from argosy.chat.events import (
    INVALID_ARGUMENTS,
    ChannelEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallInvalid,
    ToolCallStart,
    ToolParseFailure,
)
from argosy.chat.parser_options import ChannelParser


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    call_index: int
    call_id: str
    name: str
    arguments: str  # JSON text, as the model wrote it


class ParsedOutput(NamedTuple):
    """The non-streaming message of one choice."""

    content: str
    reasoning: str
    tool_calls: list[ParsedToolCall]
    parse_failures: list[ToolParseFailure]

    @property
    def is_call_cut_off(self) -> bool:
        """The output ended inside a call: finish reason "length"."""
        return any(failure.is_unterminated for failure in self.parse_failures)


class ChannelCollector:
    """Collects channel events into the non-streaming message."""

    def __init__(self) -> None:
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._calls: dict[int, tuple[str, str, list[str]]] = {}
        self._failures: list[ToolParseFailure] = []

    def add(self, events: Iterable[ChannelEvent]) -> None:
        for event in events:
            if isinstance(event, TextDelta):
                self._content.append(event.text)
            elif isinstance(event, ReasoningDelta):
                self._reasoning.append(event.text)
            elif isinstance(event, ToolCallStart):
                self._calls[event.call_index] = (event.call_id, event.name, [])
            elif isinstance(event, ToolCallArgsDelta):
                self._calls[event.call_index][2].append(event.fragment)
            elif isinstance(event, ToolParseFailure):
                self._failures.append(event)
            elif isinstance(event, ToolCallInvalid):  # unresolved (no core): its text, as with no repair
                self._content.append(event.text)
                self._failures.append(ToolParseFailure(event.index, event.text, INVALID_ARGUMENTS))

    def result(self) -> ParsedOutput:
        calls = [
            ParsedToolCall(call_index, call_id, name, "".join(fragments))
            for call_index, (call_id, name, fragments) in sorted(self._calls.items())
        ]
        return ParsedOutput("".join(self._content), "".join(self._reasoning), calls, list(self._failures))


def parse_text(parser: ChannelParser, text: str) -> ParsedOutput:
    """Run a whole output through a fresh parser: the non-streaming result."""
    collector = ChannelCollector()
    collector.add(parser.feed(text))
    collector.add(parser.finish())
    return collector.result()
