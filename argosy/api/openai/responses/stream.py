"""The Responses API's stream: neutral events -> the SDK's event sequence (pure, no I/O).

    response.created, response.in_progress,
    per output item: response.output_item.added,
      message:       content_part.added, output_text.delta*, output_text.done, content_part.done
      reasoning:     content_part.added, reasoning_text.delta*, reasoning_text.done, content_part.done
      function_call: function_call_arguments.delta*, function_call_arguments.done
    response.output_item.done,
    then response.completed (or response.incomplete / response.failed).

Logprobs (when included): a LogprobsDelta's tokens go to the next event that carries
something, as the session log gives them to spans (session_log.ChoiceLog), leftovers to the
last item; a message's go on its `output_text.delta` events (those of that delta) and its
part (all of them, also on `output_text.done`); other items' are dropped.

Every event carries `sequence_number` (0, 1, 2, ...). Items are grouped as
responses_items.output_items groups a stored turn (a run of one channel is one item; each
tool call its own), and get the same ids, so the streamed, the stored and the retrieved
response agree. Only choice 0 exists here (the Responses API has no `n`).
"""

from __future__ import annotations

import copy
from typing import Any

from argosy.api.openai.responses.items import (
    function_call_item,
    item_id,
    message_item,
    output_text_logprobs,
    output_text_part,
)
from argosy.chat.events import (
    Finish,
    LogprobsDelta,
    ReasoningDelta,
    TextDelta,
    TokenLogprobs,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)
from argosy.sessions.events import ToolUsed

_PART_OF = {"message": "output_text", "reasoning": "reasoning_text"}
_TEXT_EVENT_OF = {"message": "response.output_text", "reasoning": "response.reasoning_text"}


class ResponseStreamRenderer:
    """Turns one response's neutral events into SDK stream events (dicts)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.items: list[dict[str, Any]] = []  # as done (or so far), in output order
        self._num_events = 0
        self._current: dict[str, Any] | None = None
        self._call_items: dict[int, dict[str, Any]] = {}
        self._pending_logprobs: list[TokenLogprobs] = []  # for the next event that carries something

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        payload = {"type": kind, **fields, "sequence_number": self._num_events}
        self._num_events += 1
        return payload

    def lifecycle(self, kind: str, response: dict[str, Any]) -> dict[str, Any]:
        return self.event(kind, response=response)

    def on_event(self, event: Any) -> list[dict[str, Any]]:
        if getattr(event, "index", 0) != 0:
            return []
        if isinstance(event, LogprobsDelta):
            self._pending_logprobs += event.logprobs
            return []
        if isinstance(event, TextDelta):
            self._pending_logprobs += event.logprobs or []
            return self._text("message", event.text)
        if isinstance(event, ReasoningDelta):
            return self._text("reasoning", event.text)
        if isinstance(event, ToolCallStart):
            self._pending_logprobs = []
            out = self._close()
            new_id = item_id("function_call", self.key, len(self.items))
            item = function_call_item(new_id, ToolUsed(event.call_id, event.name, ""), status="in_progress")
            self._open(item)
            self._call_items[event.call_index] = item
            return [
                *out,
                self.event("response.output_item.added", output_index=self._index(), item=_copy(item)),
            ]
        if isinstance(event, ToolCallArgsDelta):
            self._pending_logprobs = []
            item = self._call_items[event.call_index]
            item["arguments"] += event.fragment
            return [
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=self.items.index(item),
                    delta=event.fragment,
                )
            ]
        if isinstance(event, ToolCallEnd):
            return self._close()
        if isinstance(event, Finish):
            return self.finish(event.reason)
        return []

    def finish(self, reason: str) -> list[dict[str, Any]]:
        """Close the open item (incomplete when cut by length); an output with no item at all
        gets one empty message, as a stored one reads back."""
        out: list[dict[str, Any]] = []
        if not self.items:
            out += self._open_text_item("message")
        if self.items[-1]["type"] == "message":  # leftovers join the last item (if a message)
            self.items[-1]["content"][0]["logprobs"] += output_text_logprobs(self._pending_logprobs)
        self._pending_logprobs = []
        out += self._close("incomplete" if reason == "length" else "completed")
        return out

    # -- items ---------------------------------------------------------------------------
    def _index(self) -> int:
        return len(self.items) - 1

    def _open(self, item: dict[str, Any]) -> None:
        self.items.append(item)
        self._current = item

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        out: list[dict[str, Any]] = []
        if self._current is None or self._current["type"] != kind:
            out += self._close()
            out += self._open_text_item(kind)
        item = self._current
        assert item is not None
        item["content"][0]["text"] += text
        delta: dict[str, Any] = {"item_id": item["id"], "output_index": self._index(), "content_index": 0}
        if kind == "message":
            delta["logprobs"] = output_text_logprobs(self._pending_logprobs)
            item["content"][0]["logprobs"] += delta["logprobs"]
        self._pending_logprobs = []
        out.append(self.event(f"{_TEXT_EVENT_OF[kind]}.delta", **delta, delta=text))
        return out

    def _open_text_item(self, kind: str) -> list[dict[str, Any]]:
        new_id = item_id(kind, self.key, len(self.items))
        if kind == "message":
            item = message_item(new_id, "", status="in_progress")
            part: dict[str, Any] = output_text_part("")
        else:
            item = {"id": new_id, "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        announced = _copy(item)
        announced["content"] = []
        item["content"] = [part]
        self._open(item)
        index = self._index()
        return [
            self.event("response.output_item.added", output_index=index, item=announced),
            self.event(
                "response.content_part.added",
                item_id=new_id,
                output_index=index,
                content_index=0,
                part=_copy(part),
            ),
        ]

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        item, self._current = self._current, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = status
        out: list[dict[str, Any]] = []
        if item["type"] in _PART_OF:
            part = item["content"][0]
            done: dict[str, Any] = {"item_id": item["id"], "output_index": index, "content_index": 0}
            if item["type"] == "message":
                done["logprobs"] = list(part["logprobs"])
            out.append(self.event(f"{_TEXT_EVENT_OF[item['type']]}.done", **done, text=part["text"]))
            out.append(
                self.event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=_copy(part),
                )
            )
        else:
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        out.append(self.event("response.output_item.done", output_index=index, item=_copy(item)))
        return out


def _copy(value: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(value)
