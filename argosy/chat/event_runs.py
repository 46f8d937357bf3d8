"""EventRuns: a parser's output, where adjacent deltas of one kind go out as one event."""

from __future__ import annotations

from argosy.chat.events import ChannelEvent, ReasoningDelta, TextDelta, ToolCallArgsDelta


class EventRuns:
    """Collects a choice's channel events; a run of deltas with one key ("text", "reasoning" or
    a call index) becomes one event when another key or event comes, or on `drain`."""

    __slots__ = ("_choice_index", "_out", "_run_key", "_run_parts")

    def __init__(self, choice_index: int) -> None:
        self._choice_index = choice_index
        self._out: list[ChannelEvent] = []
        self._run_key: str | int | None = None
        self._run_parts: list[str] = []

    def delta(self, key: str | int, text: str) -> None:
        if not text:
            return
        if key != self._run_key:
            self._close_run()
            self._run_key = key
        self._run_parts.append(text)

    def event(self, event: ChannelEvent) -> None:
        self._close_run()
        self._out.append(event)

    def drain(self) -> list[ChannelEvent]:
        self._close_run()
        out, self._out = self._out, []
        return out

    def _close_run(self) -> None:
        key, text = self._run_key, "".join(self._run_parts)
        if key is None:
            return
        if key == "text":
            self._out.append(TextDelta(self._choice_index, text))
        elif key == "reasoning":
            self._out.append(ReasoningDelta(self._choice_index, text))
        else:
            assert isinstance(key, int)
            self._out.append(ToolCallArgsDelta(self._choice_index, key, text))
        self._run_key, self._run_parts = None, []
