"""The channel stage of a chat choice: its raw output events in, channel events out.

The core runs one ChoiceChannels per choice of a chat request (CoreRequest.channels): each
TextDelta's text goes through the family's channel parser (argosy/chat/parsing.py) and comes
out as text / reasoning / tool-call events, the same for every dialect. Logprobs go their own
way: the raw delta's entries become a LogprobsDelta, ahead of the channel events of that
text, so every generated token is reported whichever channel (or marker) its text went to.

Finish reason: "length" when the budget ran out or the output ended inside a call (a call cut
off), else "tool_calls" when the choice made calls, else the engine's own reason.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable

from argosy.chat.events import (
    ChannelEvent,
    Event,
    Finish,
    LogprobsDelta,
    TextDelta,
    ToolCallStart,
    ToolParseFailure,
)
from argosy.chat.families import ChatFamily
from argosy.chat.markers import SpecialTextFilter
from argosy.chat.parser_options import ParserOptions
from argosy.chat.parsing import make_channel_parser

log = logging.getLogger("argosy.api")


@dataclasses.dataclass(frozen=True, slots=True)
class ChannelSpec:
    """How a chat request's output is split: the family's markers and call syntax, the
    request's parser options, and special tokens' text to remove before parsing.
    `repair_budget`: calls failing their schema the core may write again, over the whole
    request (argosy/core/tool_repair.py; the parser hands them over when `options.
    can_repair_calls`)."""

    family: ChatFamily
    options: ParserOptions
    strip_texts: tuple[str, ...] = ()
    repair_budget: int = 0


class ChoiceChannels:
    def __init__(self, spec: ChannelSpec, choice_index: int) -> None:
        self._index = choice_index
        self._parser = make_channel_parser(spec.family, spec.options, choice_index=choice_index)
        self._filter = SpecialTextFilter(spec.strip_texts)
        self._has_calls = False
        self._is_call_cut_off = False

    def process(self, events: Iterable[Event]) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if isinstance(event, TextDelta):
                if event.logprobs:
                    out.append(LogprobsDelta(self._index, event.logprobs))
                out.extend(self._observe(self._parser.feed(self._filter.feed(event.text))))
            elif isinstance(event, Finish):
                rest = self._filter.flush()
                if rest:
                    out.extend(self._observe(self._parser.feed(rest)))
                out.extend(self._observe(self._parser.finish()))
                out.append(dataclasses.replace(event, reason=self._finish_reason(event.reason)))
            else:
                out.append(event)
        return out

    def _observe(self, events: list[ChannelEvent]) -> list[ChannelEvent]:
        for event in events:
            if isinstance(event, ToolCallStart):
                self._has_calls = True
            elif isinstance(event, ToolParseFailure):
                self._is_call_cut_off |= event.is_unterminated
                log.info(
                    "choice %d: tool call not parsed (%s%s): %.200r",
                    self._index,
                    event.reason,
                    ", kept as a call" if event.call_index is not None else "",
                    event.text,
                )
        return events

    def _finish_reason(self, reason: str) -> str:
        if reason == "length" or self._is_call_cut_off:
            return "length"
        return "tool_calls" if self._has_calls else reason
