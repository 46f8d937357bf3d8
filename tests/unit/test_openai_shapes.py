"""OpenAI shapes no e2e request reaches, checked against the published spec without a server:
every error kind's body, a Response in each status, a reasoning turn streamed and listed
(the e2e model does not think). And the checker itself: it fails, naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from argosy.api.errors import ERROR_TABLE, APIError, openai_error_body
from argosy.api.openai.responses.items import conversation_items, output_items
from argosy.api.openai.responses.store import finished_response_json, response_json
from argosy.api.openai.responses.stream import ResponseStreamRenderer
from argosy.chat.events import (
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from argosy.core.session_log import ChoiceLog
from argosy.sessions.events import Finished, MessageAppended, SessionEvent, SpanGenerated
from argosy.sessions.store import StoredEvent
from tests.openai_schema import SchemaViolation, validate, violations

# -- the checker ----------------------------------------------------------------------------------

CHOICE: dict[str, Any] = {
    "index": 0,
    "message": {"role": "assistant", "content": "Hi", "refusal": None},
    "logprobs": None,
    "finish_reason": "stop",
}
CHAT: dict[str, Any] = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1,
    "model": "m",
    "choices": [CHOICE],
}


def test_a_missing_required_field_is_named_by_its_path() -> None:
    validate("CreateChatCompletionResponse", CHAT)
    message = {"role": "assistant", "content": "Hi"}
    broken = {**CHAT, "choices": [{**CHOICE, "message": message}]}
    assert violations("CreateChatCompletionResponse", broken) == [
        '$.choices[0].message: \'refusal\' is a required property (value {"role": "assistant", "content": "Hi"})'
    ]
    with pytest.raises(SchemaViolation, match=r"\$\.choices\[0\]\.message: 'refusal'"):
        validate("CreateChatCompletionResponse", broken)


def test_nullable_true_admits_null_and_nothing_else() -> None:
    """`nullable: true` (OpenAPI 3.0, still in the chunk schema) is honoured, not ignored."""
    chunk = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {}, "finish_reason": None}],
        "usage": None,
    }
    validate("CreateChatCompletionStreamResponse", chunk)
    chunk["choices"] = [{"index": 0, "delta": {}, "finish_reason": "done"}]
    assert violations("CreateChatCompletionStreamResponse", chunk) == [
        "$.choices[0].finish_reason: 'done' is not one of "
        "['stop', 'length', 'tool_calls', 'content_filter', 'function_call'] (value \"done\")"
    ]


def test_a_union_member_is_checked_as_the_arm_its_type_names() -> None:
    delta = {"type": "response.output_text.delta", "item_id": "m", "output_index": 0, "content_index": 0}
    assert violations("ResponseStreamEvent", {**delta, "delta": "x", "sequence_number": 3}) == [
        "$: 'logprobs' is a required property (value "
        '{"type": "response.output_text.delta", "item_id": "m", "output_index": 0, "content_index": 0, '
        '"delta": "x", "sequence_number": 3})'
    ]
    unknown = violations("ResponseStreamEvent", {"type": "response.nope", "sequence_number": 0})
    assert len(unknown) == 1 and "is not valid under any of the given schemas" in unknown[0]


# -- errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(ERROR_TABLE))
def test_every_error_kind_renders_an_error_response(kind: str) -> None:
    validate("ErrorResponse", openai_error_body(APIError(kind, "Something.", param="x", code="c")))
    validate("ErrorResponse", openai_error_body(APIError(kind, "Something.")))


# -- responses ------------------------------------------------------------------------------------

ECHO: dict[str, Any] = {
    "created_at": 1,
    "model": "m",
    "instructions": None,
    "max_output_tokens": None,
    "parallel_tool_calls": True,
    "previous_response_id": None,
    "reasoning": {"effort": None, "summary": None},
    "store": True,
    "temperature": None,
    "text": {"format": {"type": "text"}},
    "tool_choice": "auto",
    "tools": [{"type": "function", "name": "weather"}],
    "top_p": None,
    "user": None,
    "metadata": {},
    "background": True,
}
USAGE = Usage(prompt_tokens=10, completion_tokens=7, cached_tokens=0)
TURN = [
    ReasoningDelta(0, "think "),
    ReasoningDelta(0, "more"),
    TextDelta(0, "Let me check."),
    ToolCallStart(0, 0, "call_a", "weather"),
    ToolCallArgsDelta(0, 0, '{"city": '),
    ToolCallArgsDelta(0, 0, '"Paris"}'),
    ToolCallEnd(0, 0),
    TextDelta(0, "Done."),
    Finish(0, "tool_calls", USAGE),
]


def logged(events: list[Any]) -> list[SessionEvent]:
    log = ChoiceLog()
    for event in events:
        log.add(event)
    return log.events()


@pytest.mark.parametrize("status", ["queued", "in_progress"])
def test_an_unfinished_response(status: str) -> None:
    body = response_json("resp_k", ECHO, status=status, output=[], usage=None)
    validate("Response", body)
    assert "usage" not in body and "user" not in body
    assert body["tools"] == [{"type": "function", "name": "weather", "parameters": None, "strict": False}]


@pytest.mark.parametrize(
    ("reason", "status"),
    [("stop", "completed"), ("length", "incomplete"), ("abort", "cancelled"), ("error", "failed")],
)
def test_a_finished_response(reason: str, status: str) -> None:
    usage = {"prompt_tokens": 10, "completion_tokens": 7, "cached_tokens": 0}
    events: list[SessionEvent] = [SpanGenerated("text", "Hi", [1]), Finished(reason, usage)]
    body = finished_response_json("resp_k", {**ECHO, "user": "u-1"}, events, output_items(events, "k"))
    validate("Response", body)
    assert body["status"] == status and body["user"] == "u-1"
    assert body["usage"]["input_tokens_details"] == {"cached_tokens": 0, "cache_write_tokens": 0}


def test_a_reasoning_turn_streamed() -> None:
    renderer = ResponseStreamRenderer("k")
    events = [
        renderer.lifecycle(
            "response.created", response_json("resp_k", ECHO, status="in_progress", output=[], usage=None)
        )
    ]
    for event in TURN:
        events += renderer.on_event(event)
    final = finished_response_json("resp_k", ECHO, logged(TURN), renderer.items)
    events.append(renderer.lifecycle("response.completed", final))
    for event in events:
        validate("ResponseStreamEvent", event)
    kinds = {event["type"] for event in events}
    assert {"response.reasoning_text.delta", "response.function_call_arguments.done"} <= kinds
    assert [item["type"] for item in final["output"]] == ["reasoning", "message", "function_call", "message"]


def test_a_conversation_listed_as_input_items() -> None:
    stored = [
        StoredEvent(1, 0.0, MessageAppended("developer", "Be brief."), "a"),
        StoredEvent(2, 0.0, MessageAppended("user", "Weather?"), "a"),
        *(StoredEvent(3 + n, 0.0, event, "a") for n, event in enumerate(logged(TURN))),
        StoredEvent(20, 0.0, MessageAppended("tool", "sunny", tool_call_id="call_a"), "b"),
        StoredEvent(21, 0.0, MessageAppended("assistant", "It is sunny."), "b"),
    ]
    items = conversation_items(stored)
    assert {item["type"] for item in items} == {
        "message",
        "reasoning",
        "function_call",
        "function_call_output",
    }
    page = {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"],
        "last_id": items[-1]["id"],
        "has_more": False,
    }
    validate("ResponseItemList", page)
