"""Responses API items <-> session events (pure translation, no HTTP, no engine).

Input: `input` is a string (one user message) or a list of items: messages (`input_text` /
`output_text` / `refusal` parts, or a string), `function_call`, `function_call_output` and
`reasoning` items. They become MessageAppended events in the chat shape: consecutive
`function_call` items join the assistant message before them (or open one) as its
`tool_calls`; a `function_call_output` is a `tool` message answering its `call_id`; a
reasoning item's text goes with the assistant message after it. Media parts are refused (the
models served are text-only), naming the part (`input[2].content[0]`).

Output: a turn's generated events become output items, grouped the way the stream emits them
(responses_stream.py): a run of reasoning spans is one `reasoning` item, a run of text spans
one assistant `message`, each tool use one `function_call`. An output with no item at all is
one empty message. Item ids are `{kind}_{response key}_{output index}`, so the response
created, streamed and later retrieved name its items alike.

Logprobs (`include: ["message.output_text.logprobs"]`): a message's `output_text` part lists
the tokens of its text spans (the session keeps them: session_log.ChoiceLog), each as chat
lists it; a token that accounts for none of the text (the end-of-sequence token, a token past
a stop string) is left out, as OpenAI lists none, so the tokens' bytes join to the text.
Without the include, `logprobs` is [] (the spec requires the key).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from argosy.api.openai.content import text_of_parts
from argosy.api.wire import token_logprob_json
from argosy.chat.events import TokenLogprobs
from argosy.chat.images import IMAGE_SENTINEL, ImagePart
from argosy.core.conversation import content_text, image_part
from argosy.core.session_log import logprobs_of
from argosy.errors import InvalidRequestError
from argosy.sessions.events import Finished, MessageAppended, SessionEvent, SpanGenerated, ToolUsed
from argosy.sessions.store import StoredEvent

_MESSAGE_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")
_ITEM_PREFIX = {"message": "msg", "reasoning": "rs", "function_call": "fc", "function_call_output": "fco"}


# -- input items -> events --------------------------------------------------------------------


@dataclass(slots=True)
class _Draft:
    """A message being assembled (function calls may still join it)."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tool_call_id: str | None = None
    reasoning: str | None = None

    def freeze(self) -> MessageAppended:
        return MessageAppended(
            role=self.role,
            content=self.content,
            tool_calls=self.tool_calls or None,
            tool_call_id=self.tool_call_id,
            reasoning=self.reasoning,
        )


def input_events(value: Any, param: str = "input") -> list[MessageAppended]:
    """The `input` of a request as messages; InvalidRequestError naming the faulty item."""
    if isinstance(value, str):
        return [MessageAppended("user", value)]
    if not isinstance(value, list):
        raise InvalidRequestError(f"'{param}' must be a string or a list of input items.", param)
    drafts: list[_Draft] = []
    reasoning: list[str] = []  # reasoning items waiting for the assistant message they precede
    for position, item in enumerate(value):
        where = f"{param}[{position}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"'{where}' must be an object (an input item).", where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            content = _message_content(item.get("content"), f"{where}.content", images=True)
            draft = _Draft(_role(item, where), content)
            if draft.role == "assistant" and reasoning:
                draft.reasoning, reasoning = "".join(reasoning), []
            drafts.append(draft)
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _arguments(item, where)},
            }
            last = drafts[-1] if drafts else None
            if last is None or last.role != "assistant":
                last = _Draft("assistant", "")
                drafts.append(last)
            if reasoning and last.reasoning is None:
                last.reasoning, reasoning = "".join(reasoning), []
            last.tool_calls.append(call)
        elif kind == "function_call_output":
            output = _message_content(item.get("output"), f"{where}.output")
            drafts.append(_Draft("tool", output, tool_call_id=_string(item, "call_id", where)))
        elif kind == "reasoning":
            reasoning.append(_reasoning_text(item))
        elif kind == "item_reference":
            raise InvalidRequestError(
                f"'{where}': item references are not supported; send the item itself, or continue "
                "the stored conversation with previous_response_id.",
                where,
            )
        else:
            raise InvalidRequestError(
                f"'{where}': input items of type {kind!r} are not supported.", f"{where}.type"
            )
    if not drafts:
        raise InvalidRequestError(f"'{param}' holds no message.", param)
    return [draft.freeze() for draft in drafts]


def _role(item: dict[str, Any], where: str) -> str:
    role = item.get("role")
    if role not in _MESSAGE_ROLES:
        raise InvalidRequestError(
            f"'{where}.role' must be one of {', '.join(_MESSAGE_ROLES)}, got {role!r}.", f"{where}.role"
        )
    return str(role)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"Missing required parameter: '{where}.{key}'.", f"{where}.{key}")
    return value


def _arguments(item: dict[str, Any], where: str) -> str:
    value = item.get("arguments", "{}")
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    raise InvalidRequestError(f"'{where}.arguments' must be a JSON string.", f"{where}.arguments")


def _message_content(value: Any, where: str, images: bool = False) -> str | list[dict[str, Any]]:
    """A string as is; parts as text parts, and with `images` input_image parts (data: URLs,
    read and checked now; stored as they came, so a continued conversation has them), other
    media refused naming the part."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise InvalidRequestError(f"'{where}' must be a string or a list of content parts.", where)
    read: list[ImagePart] | None = [] if images else None
    texts = text_of_parts(value, where, text_types=frozenset(_TEXT_PARTS), refusals=True, images=read)
    pictures = iter(read or [])
    return [
        image_part(next(pictures)) if text == IMAGE_SENTINEL else {"type": "text", "text": text}
        for text in texts
    ]


def _reasoning_text(item: dict[str, Any]) -> str:
    pieces = item.get("content") or item.get("summary") or []
    return "".join(
        p.get("text", "") for p in pieces if isinstance(p, dict) and isinstance(p.get("text"), str)
    )


# -- events -> items ----------------------------------------------------------------------------


def item_id(kind: str, key: str, index: int | str) -> str:
    return f"{_ITEM_PREFIX[kind]}_{key}_{index}"


def output_items(events: Sequence[SessionEvent], key: str) -> list[dict[str, Any]]:
    """One generated turn's output items (see the module docstring for the grouping)."""
    items: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for event in events:
        if isinstance(event, SpanGenerated) and event.channel in ("text", "reasoning") and event.text:
            kind = "message" if event.channel == "text" else "reasoning"
            if current is None or current["type"] != kind:
                current = _new_item(kind, item_id(kind, key, len(items)))
                items.append(current)
            current["content"][0]["text"] += event.text
            if kind == "message" and event.logprobs:
                current["content"][0]["logprobs"] += output_text_logprobs(logprobs_of(event.logprobs))
        elif isinstance(event, ToolUsed):
            current = function_call_item(item_id("function_call", key, len(items)), event)
            items.append(current)
    if not items:
        items.append(_new_item("message", item_id("message", key, 0)))
    finish = next((e for e in events if isinstance(e, Finished)), None)
    if finish is not None and finish.reason == "length" and items[-1]["type"] != "function_call":
        items[-1]["status"] = "incomplete"  # cut off while it was open (a call closes itself)
    return items


def _new_item(kind: str, new_id: str) -> dict[str, Any]:
    if kind == "message":
        return message_item(new_id, "")
    return {
        "id": new_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": ""}],
        "status": "completed",
    }


def message_item(new_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": new_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [output_text_part(text)],
    }


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def output_text_logprobs(entries: Iterable[TokenLogprobs]) -> list[dict[str, Any]]:
    """Tokens of an output_text part as its `logprobs` list them (see the module docstring)."""
    return [token_logprob_json(entry) for entry in entries if _is_in_text(entry)]


def _is_in_text(entry: TokenLogprobs) -> bool:
    """Whether the token is part of the output text: it accounts for some of it, or holds part
    of a character a later token completes (its bytes alone are no whole UTF-8 text)."""
    if entry.text:
        return True
    try:
        entry.chosen.token_bytes.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def function_call_item(new_id: str, call: ToolUsed, status: str = "completed") -> dict[str, Any]:
    return {
        "id": new_id,
        "type": "function_call",
        "call_id": call.call_id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


def input_item(message: MessageAppended, key: str, seq: int) -> list[dict[str, Any]]:
    """A stored input message as the items a client sent for it."""
    if message.role == "tool":
        return [
            {
                "id": item_id("function_call_output", key, f"i{seq}"),
                "type": "function_call_output",
                "call_id": message.tool_call_id,
                "output": content_text(message.content),
                "status": "completed",
            }
        ]
    items: list[dict[str, Any]] = []
    text = content_text(message.content)
    if message.role != "assistant":
        stored = message.content if isinstance(message.content, list) else [{"type": "text", "text": text}]
        parts = [
            part
            if part.get("type") == "input_image"
            else {"type": "input_text", "text": part.get("text", "")}
            for part in stored
        ]
        items.append(
            {
                "id": item_id("message", key, f"i{seq}"),
                "type": "message",
                "role": message.role,
                "content": parts,
                "status": "completed",
            }
        )
    elif text or not message.tool_calls:
        items.append(message_item(item_id("message", key, f"i{seq}"), text))
    for position, call in enumerate(message.tool_calls or []):
        function = call.get("function") or {}
        used = ToolUsed(
            str(call.get("id", "")), str(function.get("name", "")), str(function.get("arguments", ""))
        )
        items.append(function_call_item(item_id("function_call", key, f"i{seq}.{position}"), used))
    return items


def conversation_items(stored: Iterable[StoredEvent]) -> list[dict[str, Any]]:
    """A stored conversation as items, oldest first: input messages as sent, each generated
    turn as the output items of the response (session) it belongs to."""
    items: list[dict[str, Any]] = []
    turn: list[SessionEvent] = []
    turn_owner = ""

    def close_turn() -> None:
        if any(isinstance(e, SpanGenerated | ToolUsed) for e in turn):
            items.extend(output_items(turn, turn_owner))
        turn.clear()

    for stored_event in stored:
        event = stored_event.event
        if isinstance(event, MessageAppended):
            close_turn()
            items.extend(input_item(event, stored_event.session_id, stored_event.seq))
        elif isinstance(event, SpanGenerated | ToolUsed | Finished):
            if turn and stored_event.session_id != turn_owner:
                close_turn()
            turn_owner = stored_event.session_id
            turn.append(event)
            if isinstance(event, Finished):
                close_turn()
    close_turn()
    return items
