"""Responses API translation, pinned exactly: input items -> messages, generated events ->
output items, the streamed event sequence, and that streamed and stored outputs agree."""

from __future__ import annotations

from typing import Any

import pytest

from argosy.api.openai.responses.items import conversation_items, input_events, output_items
from argosy.api.openai.responses.stream import ResponseStreamRenderer
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
    Usage,
)
from argosy.core.session_log import ChoiceLog
from argosy.errors import InvalidRequestError
from argosy.sessions.events import Finished, MessageAppended, SpanGenerated, ToolUsed
from argosy.sessions.store import StoredEvent

# -- input ------------------------------------------------------------------------------------


def test_a_string_is_one_user_message() -> None:
    assert input_events("Hi") == [MessageAppended("user", "Hi")]


def test_message_items_keep_roles_and_text_parts() -> None:
    events = input_events(
        [
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]},
        ]
    )
    assert events == [
        MessageAppended("developer", "Be brief."),
        MessageAppended("user", [{"type": "text", "text": "Hi"}]),
        MessageAppended("assistant", [{"type": "text", "text": "Hello"}]),
    ]


def test_function_calls_join_the_assistant_turn_and_outputs_are_tool_messages() -> None:
    events = input_events(
        [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Two calls."}]},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Paris"}'},
            {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": {"city": "Rome"}},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "rain"}],
            },
        ]
    )
    assert events == [
        MessageAppended("user", "Weather in Paris and Rome?"),
        MessageAppended(
            "assistant",
            "",
            tool_calls=[
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city":"Paris"}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Rome"}'},
                },
            ],
            reasoning="Two calls.",
        ),
        MessageAppended("tool", "sunny", tool_call_id="c1"),
        MessageAppended("tool", [{"type": "text", "text": "rain"}], tool_call_id="c2"),
    ]


def test_a_call_after_an_assistant_message_joins_it() -> None:
    (user, assistant) = input_events(
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Let me look."},
            {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
        ]
    )
    assert assistant.content == "Let me look." and assistant.tool_calls is not None
    assert [call["id"] for call in assistant.tool_calls] == ["c1"]


@pytest.mark.parametrize(
    ("value", "param"),
    [
        (3, "input"),
        ([], "input"),
        (["Hi"], "input[0]"),
        ([{"role": "robot", "content": "Hi"}], "input[0].role"),
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input[0].content[0]"),
        ([{"role": "user", "content": [{"type": "input_text"}]}], "input[0].content[0]"),
        ([{"role": "user", "content": [{"type": {}, "text": "x"}]}], "input[0].content[0].type"),  # was a 500
        ([{"role": "user", "content": [{"type": ["input_text"]}]}], "input[0].content[0].type"),
        ([{"role": "user", "content": ["x"]}], "input[0].content[0].type"),
        ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id"),
        ([{"type": "function_call_output", "call_id": "c", "output": 3}], "input[0].output"),
        ([{"type": "item_reference", "id": "msg_1"}], "input[0]"),
        ([{"type": "web_search_call"}], "input[0].type"),
    ],
)
def test_bad_input_names_the_item(value: Any, param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        input_events(value)
    assert caught.value.param == param


# -- output -----------------------------------------------------------------------------------

USAGE = Usage(prompt_tokens=10, completion_tokens=7, cached_tokens=0)
CALL_TURN = [
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


def logged(events: list[Any], token_ids: list[list[int]] | None = None) -> list[Any]:
    log = ChoiceLog()
    for position, event in enumerate(events):
        if token_ids is not None:
            log.add_token_ids(token_ids[position])
        log.add(event)
    return log.events()


def test_output_items_group_runs_of_one_channel_and_each_call() -> None:
    items = output_items(logged(CALL_TURN), "k")
    assert [(item["type"], item["id"]) for item in items] == [
        ("reasoning", "rs_k_0"),
        ("message", "msg_k_1"),
        ("function_call", "fc_k_2"),
        ("message", "msg_k_3"),
    ]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "think more"}]
    assert items[1]["content"][0]["text"] == "Let me check."
    assert items[2] | {} == {
        "id": "fc_k_2",
        "type": "function_call",
        "call_id": "call_a",
        "name": "weather",
        "arguments": '{"city": "Paris"}',
        "status": "completed",
    }


def test_an_empty_output_is_one_empty_message_and_length_marks_it_incomplete() -> None:
    (item,) = output_items([Finished("length")], "k")
    assert item["type"] == "message" and item["content"][0]["text"] == ""
    assert item["status"] == "incomplete"


def _stream(events: list[Any]) -> tuple[list[dict[str, Any]], ResponseStreamRenderer]:
    renderer = ResponseStreamRenderer("k")
    out = [renderer.lifecycle("response.created", {})]
    for event in events:
        out += renderer.on_event(event)
    return out, renderer


def test_stream_sequence_for_reasoning_text_and_a_call() -> None:
    out, renderer = _stream(CALL_TURN)
    assert [e["type"] for e in out] == [
        "response.created",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    added = out[1]["item"]
    assert added["status"] == "in_progress" and added["content"] == []
    done = next(e for e in out if e["type"] == "response.function_call_arguments.done")
    assert (
        done["arguments"] == '{"city": "Paris"}' and done["name"] == "weather" and done["output_index"] == 2
    )
    assert renderer.items == output_items(logged(CALL_TURN), "k")  # streamed == stored


@pytest.mark.parametrize(
    "events",
    [
        [TextDelta(0, "Hel"), TextDelta(0, ""), TextDelta(0, "lo"), Finish(0, "stop", USAGE)],
        [TextDelta(0, "cut"), Finish(0, "length", USAGE)],
        [Finish(0, "stop", USAGE)],
        [Finish(0, "length", USAGE)],
        [ToolCallStart(0, 0, "c", "f"), ToolCallEnd(0, 0), Finish(0, "length", USAGE)],
        CALL_TURN,
    ],
)
def test_streamed_items_equal_the_stored_ones(events: list[Any]) -> None:
    _, renderer = _stream(events)
    assert renderer.items == output_items(logged(events), "k")


def lp(token_id: int, token_bytes: bytes, text: str) -> TokenLogprobs:
    chosen = TokenCandidate(token_id, token_bytes.decode("utf-8", "replace"), token_bytes, -0.25)
    return TokenLogprobs(chosen, text, [chosen, TokenCandidate(9, "x", b"x", float("-inf"))])


def test_output_text_logprobs_stream_with_their_delta_and_are_stored_alike() -> None:
    think, he, eos = lp(1, b"<think>", "<think>"), lp(2, b"He", "He"), lp(3, b"<|im_end|>", "")
    half, euro = lp(4, b"\xe2\x82", ""), lp(5, b"\xac", "\u20ac")  # a character in two tokens
    events = [
        LogprobsDelta(0, [think]),
        ReasoningDelta(0, "hm"),
        LogprobsDelta(0, [he, half]),
        TextDelta(0, "He"),
        LogprobsDelta(0, [euro]),
        TextDelta(0, "\u20ac"),
        LogprobsDelta(0, [eos]),
        Finish(0, "stop", USAGE),
    ]
    out, renderer = _stream(events)
    deltas = [e["logprobs"] for e in out if e["type"] == "response.output_text.delta"]
    assert [[entry["token"] for entry in delta] for delta in deltas] == [["He", "\ufffd"], ["\ufffd"]]
    (done,) = [e for e in out if e["type"] == "response.output_text.done"]
    assert done["logprobs"] == deltas[0] + deltas[1]  # the reasoning's and the EOS's left out
    assert (
        bytes(b for entry in done["logprobs"] for b in entry["bytes"]).decode() == done["text"] == "He\u20ac"
    )
    assert done["logprobs"][0] == {
        "token": "He",
        "logprob": -0.25,
        "bytes": [72, 101],
        "top_logprobs": [
            {"token": "He", "logprob": -0.25, "bytes": [72, 101]},
            {"token": "x", "logprob": -9999.0, "bytes": [120]},  # -inf, as chat reports it
        ],
    }
    log = ChoiceLog(keeps_logprobs=True)
    for event in events:
        log.add(event)
    assert renderer.items == output_items(log.events(), "k")  # streamed == stored
    assert renderer.items[1]["content"][0]["logprobs"] == done["logprobs"]
    assert output_items(logged(events), "k")[1]["content"][0]["logprobs"] == []  # not kept: none


def test_conversation_items_name_earlier_outputs_by_their_response() -> None:
    stored = [
        StoredEvent(1, 0.0, MessageAppended("user", "Hi"), "a"),
        StoredEvent(2, 0.0, SpanGenerated("text", "Hello", [1, 2]), "a"),
        StoredEvent(3, 0.0, Finished("stop"), "a"),
        StoredEvent(4, 0.0, MessageAppended("user", "Call f"), "b"),
        StoredEvent(5, 0.0, SpanGenerated("tool_call", "{}", [3]), "b"),
        StoredEvent(6, 0.0, ToolUsed("c1", "f", "{}"), "b"),
        StoredEvent(7, 0.0, Finished("tool_calls"), "b"),
        StoredEvent(8, 0.0, MessageAppended("tool", "42", tool_call_id="c1"), "c"),
    ]
    items = conversation_items(stored)
    assert [(item["type"], item["id"]) for item in items] == [
        ("message", "msg_a_i1"),
        ("message", "msg_a_0"),
        ("message", "msg_b_i4"),
        ("function_call", "fc_b_0"),
        ("function_call_output", "fco_c_i8"),
    ]
    assert items[0]["content"] == [{"type": "input_text", "text": "Hi"}]
    assert items[4]["call_id"] == "c1" and items[4]["output"] == "42"
