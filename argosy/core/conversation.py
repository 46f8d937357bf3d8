"""Conversations as sessions hold them, and back: messages <-> session events, stored history
-> chat-template messages, and the prompt of a continued conversation.

Session events keep messages in the chat shape (role, content as text or text parts,
`tool_calls`, `tool_call_id`, `reasoning`) whatever dialect wrote them. A generated turn is
not a message in the log: it is the spans, tool uses and finish that follow the inputs; read
back it becomes one assistant message (text, reasoning, tool calls).

Continuing a conversation (previous_response_id) reuses the KV cache of the turn before:
the new prompt is the previous prompt's token ids + the ids generated then + the token ids
of the rest of the newly rendered conversation, whenever the newly rendered text starts with
exactly the text those ids spell (the chat template renders the history as the model saw
it). When the template writes the last answer otherwise (a tool call re-serialized, reasoning
dropped, a stop string cut), the previous prompt's ids alone are extended the same way; when
even that fails (other instructions or tools) the conversation is tokenized afresh, and the
prefix cache still serves whatever token prefix the two share.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from argosy.chat.images import IMAGE_SENTINEL, ImagePart, image_from_url
from argosy.chat.messages import Message, ToolCallRecord
from argosy.sessions.events import MessageAppended, SessionEvent, SpanGenerated, ToolUsed
from argosy.sessions.store import StoredEvent

_CHAT_EXTRAS = ("tool_calls", "tool_call_id", "reasoning_content", "reasoning")


def chat_message_events(messages: Iterable[Any]) -> list[SessionEvent]:
    """Chat-completions messages (pydantic models: role, content, name, extras) as events."""
    events: list[SessionEvent] = []
    for message in messages:
        extra = getattr(message, "model_extra", None) or {}
        reasoning = extra.get("reasoning_content", extra.get("reasoning"))
        events.append(
            MessageAppended(
                role=message.role,
                content=message.content,
                tool_calls=extra.get("tool_calls"),
                tool_call_id=extra.get("tool_call_id"),
                name=message.name,
                reasoning=reasoning if isinstance(reasoning, str) else None,
            )
        )
    return events


def message_events(messages: Iterable[Message]) -> list[SessionEvent]:
    """Neutral chat messages (argosy/chat/messages.py) as the session records them: chat's
    shape, calls as `{id, type, function: {name, arguments}}`."""
    return [
        MessageAppended(
            role=message.role,
            content=message.content,
            tool_calls=[
                {
                    "id": call.call_id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in message.tool_calls
            ]
            or None,
            tool_call_id=message.tool_call_id,
            name=message.name,
            reasoning=message.reasoning,
        )
        for message in messages
    ]


def content_text(content: str | list[dict[str, Any]] | None, images: bool = False) -> str:
    """A message's text: a string as is, text parts joined (with `images`, IMAGE_SENTINEL where
    each stored image part stands: what the chat layer renders)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(
        IMAGE_SENTINEL if images and part.get("type") == "input_image" else str(part.get("text", ""))
        for part in content
        if isinstance(part.get("text"), str) or (images and part.get("type") == "input_image")
    )


def image_part(image: ImagePart) -> dict[str, Any]:
    """An image as a stored message part (Responses' input_image: a data: URL of its bytes)."""
    data = base64.b64encode(image.data).decode()
    return {"type": "input_image", "image_url": f"data:image/{image.format.lower()};base64,{data}"}


def message_images(message: MessageAppended, where: str) -> list[ImagePart]:
    """The images of a stored message's parts, in order (read again from their data: URLs)."""
    if not isinstance(message.content, list):
        return []
    return [
        image_from_url(part.get("image_url"), where)
        for part in message.content
        if part.get("type") == "input_image"
    ]


def generated_message(events: Sequence[SessionEvent]) -> MessageAppended | None:
    """A generated turn (spans, tool uses) as the assistant message it amounts to."""
    text = "".join(e.text for e in events if isinstance(e, SpanGenerated) and e.channel == "text")
    reasoning = "".join(e.text for e in events if isinstance(e, SpanGenerated) and e.channel == "reasoning")
    calls = [
        {"id": e.call_id, "type": "function", "function": {"name": e.name, "arguments": e.arguments}}
        for e in events
        if isinstance(e, ToolUsed)
    ]
    if not (text or reasoning or calls or any(isinstance(e, SpanGenerated) for e in events)):
        return None
    return MessageAppended(
        role="assistant", content=text, tool_calls=calls or None, reasoning=reasoning or None
    )


def history_messages(stored: Iterable[StoredEvent]) -> list[MessageAppended]:
    """A session's conversation: its messages, each generated turn as one assistant message."""
    messages: list[MessageAppended] = []
    turn: list[SessionEvent] = []

    def close_turn() -> None:
        message = generated_message(turn)
        if message is not None:
            messages.append(message)
        turn.clear()

    for stored_event in stored:
        event = stored_event.event
        if isinstance(event, MessageAppended):
            close_turn()
            messages.append(event)
        elif isinstance(event, SpanGenerated | ToolUsed):
            turn.append(event)
        else:  # Finished, ToolParseFailed: a turn ends or nothing to render
            close_turn()
    close_turn()
    return messages


def generated_token_ids(stored: Iterable[StoredEvent], after_seq: int) -> list[int]:
    """The ids the model generated after `after_seq`, in order (the spans hold all of them)."""
    ids: list[int] = []
    for stored_event in stored:
        if stored_event.seq > after_seq and isinstance(stored_event.event, SpanGenerated):
            ids.extend(stored_event.event.token_ids)
    return ids


def continued_prompt(
    candidates: Sequence[list[int]],
    full_text: str,
    decode: Callable[[list[int]], str],
    encode: Callable[[str], list[int]],
) -> tuple[int, list[int]] | None:
    """The first of `candidates` (token ids the model saw before) whose text `full_text`
    extends, extended to it: (its position, the ids). None when none is a proper prefix."""
    for position, ids in enumerate(candidates):
        if not ids:
            continue
        text = decode(ids)
        if full_text.startswith(text) and len(full_text) > len(text):
            return position, ids + encode(full_text[len(text) :])
    return None


def chat_message(message: MessageAppended) -> Message:
    """A stored message as the neutral chat Message (argosy/chat/messages.py) the chat layer
    renders; `developer` is `system` there."""
    calls = [
        ToolCallRecord(
            name=str((call.get("function") or {}).get("name", "")),
            arguments=_arguments_text((call.get("function") or {}).get("arguments", "{}")),
            call_id=call.get("id"),
        )
        for call in message.tool_calls or []
    ]
    return Message(
        role="system" if message.role == "developer" else message.role,
        content=content_text(message.content, images=True),
        name=message.name,
        reasoning=message.reasoning,
        tool_calls=calls,
        tool_call_id=message.tool_call_id,
    )


def _arguments_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
