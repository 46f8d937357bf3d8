"""The Anthropic Messages dialect without a model: wire -> ChatInput, events -> blocks and
stream events, and its refusals in Anthropic's envelope and statuses (before any model)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from argosy.api.anthropic import messages, render
from argosy.api.anthropic.messages import CountTokensRequest, MessagesRequest
from argosy.api.anthropic.render import MessageStream, message_json, thinking_signature
from argosy.api.anthropic.wire import chat_input_from_wire
from argosy.api.app import build_app
from argosy.chat.collector import ChannelCollector
from argosy.chat.events import (
    Finish,
    LogprobsDelta,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    Usage,
)
from argosy.chat.messages import Message, ToolCallRecord
from argosy.config import ModelSpec, ServerConfig
from argosy.core.registry import ModelRegistry
from argosy.errors import InvalidRequestError, ModelLoadError

# -- wire -> ChatInput ------------------------------------------------------------------------


def test_system_blocks_and_a_tool_round_trip_become_neutral_messages() -> None:
    chat = chat_input_from_wire(
        [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief.", "cache_control": {}}],
        [
            ("user", "Weather in Paris?"),
            (
                "assistant",
                [
                    {"type": "thinking", "thinking": "Use the tool.", "signature": "x"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_abc", "name": "weather", "input": {"city": "Paris"}},
                ],
            ),
            (
                "user",
                [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_abc",
                        "content": [{"type": "text", "text": "9C"}],
                    },
                    {"type": "tool_result", "tool_use_id": "toolu_def", "content": "down", "is_error": True},
                    {"type": "text", "text": "And "},
                    {"type": "text", "text": "tomorrow?"},
                ],
            ),
        ],
        tools=[{"name": "weather", "description": "Weather.", "input_schema": {"type": "object"}}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    assert chat.messages == [
        Message(role="system", content="Be brief."),
        Message(role="user", content="Weather in Paris?"),
        Message(
            role="assistant",
            content="Let me look.",
            reasoning="Use the tool.",
            tool_calls=[ToolCallRecord("weather", '{"city": "Paris"}', "abc")],
        ),
        Message(role="tool", content="9C", tool_call_id="abc"),
        Message(role="tool", content="Error: down", tool_call_id="def"),
        Message(role="user", content="And tomorrow?"),
    ]
    assert [(t.name, t.description, t.parameters) for t in chat.tools] == [
        ("weather", "Weather.", {"type": "object"})
    ]
    assert (chat.tool_choice.mode, chat.parallel_tool_calls) == ("required", False)


@pytest.mark.parametrize(
    ("wire", "mode", "name"),
    [(None, "auto", None), ({"type": "auto"}, "auto", None), ({"type": "none"}, "none", None)]
    + [({"type": "tool", "name": "weather"}, "named", "weather"), ({"type": "any"}, "required", None)],
)
def test_tool_choice(wire: Any, mode: str, name: str | None) -> None:
    chat = chat_input_from_wire(None, [("user", "hi")], tool_choice=wire)
    assert (chat.tool_choice.mode, chat.tool_choice.name, chat.parallel_tool_calls) == (mode, name, True)


def test_output_config_format_is_a_strict_json_schema() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = chat_input_from_wire(
        None, [("user", "hi")], output_format={"type": "json_schema", "schema": schema}
    )
    assert chat.output_format is not None
    assert (chat.output_format.kind, chat.output_format.schema, chat.output_format.strict) == (
        "json_schema",
        schema,
        True,
    )


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([("user", ["hi"])], "messages[0].content[0].type"),
        (
            [("user", [{"type": "text", "text": "x"}, {"type": "image", "source": {"type": "base64"}}])],
            "messages[0].content[1]",
        ),
        ([("user", [{"type": "document", "source": {}}])], "messages[0].content[0]"),
        ([("user", [{"type": "text"}])], "messages[0].content[0].text"),
        ([("user", [{"type": "tool_result", "content": "x"}])], "messages[0].content[0].tool_use_id"),
        (
            [("user", [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}])],
            "messages[0].content[0].content[0]",
        ),
        (
            [("assistant", [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}])],
            "messages[0].content[0].input",
        ),
        ([("assistant", [{"type": "server_tool_use"}])], "messages[0].content[0].type"),
        ([("user", 7)], "messages[0].content"),
    ],
)
def test_malformed_content_is_a_400_naming_the_block(messages: Any, param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        chat_input_from_wire(None, messages)
    assert caught.value.param == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"system": [{"type": "image"}]}, "system[0]"),
        ({"tools": [{"name": "bad name"}]}, "tools[0].name"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"name": "f", "input_schema": []}]}, "tools[0].input_schema"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"output_format": {"type": "json_object"}}, "output_config.format.type"),
        ({"output_format": {"type": "json_schema"}}, "output_config.format.schema"),
    ],
)
def test_malformed_options_are_a_400_naming_the_field(fields: dict[str, Any], param: str) -> None:
    system = fields.pop("system", None)
    with pytest.raises(InvalidRequestError) as caught:
        chat_input_from_wire(system, [("user", "hi")], **fields)
    assert caught.value.param == param


def body(**fields: Any) -> MessagesRequest:
    return MessagesRequest.model_validate(
        {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def test_thinking_and_effort_switch_the_template() -> None:
    enabled = body(thinking={"type": "enabled", "budget_tokens": 2048}, output_config={"effort": "low"})
    assert enabled.chat_input().template_kwargs == {"enable_thinking": True, "reasoning_effort": "low"}
    assert body(thinking={"type": "disabled"}).chat_input().template_kwargs == {"enable_thinking": False}
    assert body(thinking={"type": "adaptive"}).chat_input().template_kwargs == {}
    between = body(thinking={"type": "between_tools"})
    assert between.chat_input().template_kwargs == {"enable_thinking": False}  # thinking off
    assert between.degraded_fields() == ["thinking.between_tools"]  # progress text comes back as text
    for bad, param in [
        ({"thinking": {"type": "on"}}, "thinking.type"),
        ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
        ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
    ]:
        with pytest.raises(InvalidRequestError) as caught:
            body(**bad).check()
        assert caught.value.param == param


class Profile:
    """What model_degraded reads of a ChatProfile."""

    def __init__(self, has_reasoning: bool, variables: set[str]) -> None:
        self.has_reasoning = has_reasoning
        self.variables = variables

    def reads(self, variable: str) -> bool:
        return variable in self.variables


def test_degraded_fields() -> None:
    request = body(
        service_tier="standard_only",
        speed="fast",
        cache_control={"type": "ephemeral"},
        metadata={"user_id": "u"},
        frobnicate=1,
        **{"bad name": 2},
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}],
    )
    assert request.degraded_fields() == [  # a prefill is continued: not named
        "cache_control",
        "speed",
        "frobnicate",
        "1 more unknown fields",
    ]
    assert body(service_tier="auto").degraded_fields() == ["service_tier"]
    thinking = body(thinking={"type": "enabled", "budget_tokens": 1024}, output_config={"effort": "high"})
    plain, reasoner = Profile(False, set()), Profile(True, {"enable_thinking", "reasoning_effort"})
    assert thinking.model_degraded(plain, ["response_format"]) == [  # type: ignore[arg-type]
        "output_config.format",
        "thinking",
        "output_config.effort",
    ]
    assert thinking.model_degraded(reasoner, []) == []  # type: ignore[arg-type]
    # the chat layer names a budget its guide cannot hold to, in its own word
    assert thinking.model_degraded(reasoner, ["reasoning_budget"]) == ["thinking.budget_tokens"]  # type: ignore[arg-type]
    disabled = body(thinking={"type": "disabled"})
    assert disabled.model_degraded(Profile(True, set()), []) == ["thinking"]  # type: ignore[arg-type]
    assert disabled.model_degraded(reasoner, []) == []  # type: ignore[arg-type]
    assert disabled.model_degraded(plain, []) == []  # type: ignore[arg-type]


def test_count_tokens_needs_no_max_tokens_and_messages_does() -> None:
    CountTokensRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(ValueError, match="max_tokens"):
        MessagesRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})


# -- events -> blocks -------------------------------------------------------------------------

USAGE = Usage(prompt_tokens=20, completion_tokens=7, cached_tokens=16)
CALL_EVENTS = [
    ReasoningDelta(0, "Need "),
    ReasoningDelta(0, "weather."),
    TextDelta(0, "Checking."),
    LogprobsDelta(0, []),
    ToolCallStart(0, 0, "call_xyz", "weather"),
    ToolCallArgsDelta(0, 0, '{"city": '),
    ToolCallArgsDelta(0, 0, '"Paris"}'),
    ToolCallEnd(0, 0),
]


def test_a_whole_message_lists_thinking_text_and_tool_use_blocks() -> None:
    collector = ChannelCollector()
    collector.add(e for e in CALL_EVENTS if not isinstance(e, LogprobsDelta))
    message = message_json(
        response_id="msg_1",
        model_id="m",
        parsed=collector.result(),
        finish_reason="tool_calls",
        stop_reason=None,
        stop_sequences=None,
        usage=USAGE,
    )
    assert message == {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [
            {
                "type": "thinking",
                "thinking": "Need weather.",
                "signature": thinking_signature("Need weather."),
            },
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_xyz", "name": "weather", "input": {"city": "Paris"}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 4,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 16,
            "output_tokens": 7,
        },
    }


@pytest.mark.parametrize(
    ("reason", "matched", "expected"),
    [
        ("stop", None, ("end_turn", None)),
        ("stop", 2, ("end_turn", None)),  # the EOS token
        ("stop", "###", ("stop_sequence", "###")),
        ("stop", "<|im_end|>", ("end_turn", None)),  # a model's own stop string, not the client's
        ("length", None, ("max_tokens", None)),
        ("tool_calls", None, ("tool_use", None)),
    ],
)
def test_stop_reasons(reason: str, matched: Any, expected: tuple[str, str | None]) -> None:
    message = message_json(
        response_id="msg_1",
        model_id="m",
        parsed=ChannelCollector().result(),
        finish_reason=reason,
        stop_reason=matched,
        stop_sequences=["###"],
        usage=Usage(),
    )
    assert (message["stop_reason"], message["stop_sequence"]) == expected
    assert message["content"] == []


def test_the_stream_opens_and_closes_one_block_per_channel_run() -> None:
    writer = MessageStream("msg_1", "m", ["###"])
    frames = writer.start(Usage(prompt_tokens=20))
    for event in CALL_EVENTS + [TextDelta(0, "")]:
        frames += writer.on_event(event)
    frames += writer.finish(Finish(0, "tool_calls", USAGE), USAGE)
    assert [f["type"] for f in frames] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",  # signature_delta
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = frames[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] == 20
    assert [f["index"] for f in frames[1:13]] == [0] * 5 + [1] * 3 + [2] * 4
    assert frames[1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert frames[4]["delta"] == {"type": "signature_delta", "signature": thinking_signature("Need weather.")}
    assert frames[9]["content_block"] == {
        "type": "tool_use",
        "id": "toolu_xyz",
        "name": "weather",
        "input": {},
    }
    pieces = [f["delta"]["partial_json"] for f in frames[10:12]]
    assert json.loads("".join(pieces)) == {"city": "Paris"}
    assert frames[13]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert frames[13]["usage"]["output_tokens"] == 7 and frames[13]["usage"]["cache_read_input_tokens"] == 16


def test_a_stream_ended_by_a_stop_sequence_closes_its_text_block() -> None:
    writer = MessageStream("msg_1", "m", ["###"])
    frames = writer.on_event(TextDelta(0, "a")) + writer.on_event(TextDelta(0, "b"))
    frames += writer.finish(Finish(0, "stop", Usage(), "###"), Usage())
    assert [f["type"] for f in frames] == [
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert frames[4]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "###"}


class SlowStream:
    """What _stream_events reads of a CoreStream: two text deltas with a wait between them
    (until `release` is set), then the finish."""

    def __init__(self) -> None:
        self.usage = Usage(prompt_tokens=5)
        self.release = asyncio.Event()
        self.log: list[str] = []

    async def __aenter__(self) -> SlowStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.log.append("stream exited")  # where the real one aborts its engine requests

    async def with_heartbeats(self, every_s: float) -> AsyncIterator[Any]:
        """CoreStream's contract: a None whenever nothing came for `every_s` seconds."""
        try:
            yield TextDelta(0, "Red")
            while not self.release.is_set():
                try:
                    async with asyncio.timeout(every_s):
                        await self.release.wait()
                except TimeoutError:
                    yield None
            yield TextDelta(0, ", blue")
            yield Finish(0, "stop", self.usage)
        finally:
            self.log.append("events closed")


def test_the_stream_pings_after_message_start_and_while_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(messages, "PING_EVERY_S", 0.01)

    async def main() -> list[dict[str, Any]]:
        stream = SlowStream()
        frames: list[dict[str, Any]] = []
        async for frame in messages._stream_events(body(), stream, "m", 1024):  # type: ignore[arg-type]
            frames.append(frame)
            if frame["type"] == "ping" and len(frames) > 2:
                stream.release.set()  # one ping while waiting: let the next delta come
        return frames

    frames = asyncio.run(main())
    assert [f["type"] for f in frames] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "ping",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert frames[1] == {"type": "ping"}
    assert "".join(f["delta"]["text"] for f in frames if f["type"] == "content_block_delta") == "Red, blue"


def test_a_client_gone_mid_wait_ends_the_wait_before_the_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(messages, "PING_EVERY_S", 0.01)

    async def main() -> SlowStream:
        stream = SlowStream()
        frames = messages._stream_events(body(), stream, "m", 1024)  # type: ignore[arg-type]
        seen = [(await anext(frames))["type"] for _ in range(5)]
        assert seen == ["message_start", "ping", "content_block_start", "content_block_delta", "ping"]
        await frames.aclose()  # type: ignore[attr-defined]
        return stream

    assert asyncio.run(main()).log == ["events closed", "stream exited"]


def test_prefill_and_a_budget_reach_the_chat_input() -> None:
    prefill = body(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}])
    chat_input = prefill.chat_input()
    assert chat_input.continue_final_message and not chat_input.add_generation_prompt
    assert chat_input.messages[-1] == Message("assistant", "Sure,")
    answered = body().chat_input()
    assert answered.add_generation_prompt and not answered.continue_final_message
    assert answered.reasoning_budget is None
    thinking = body(thinking={"type": "enabled", "budget_tokens": 1024}).chat_input()
    assert thinking.reasoning_budget == 1024
    assert body(thinking={"type": "adaptive"}).chat_input().reasoning_budget is None
    tool_use = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
    with pytest.raises(InvalidRequestError) as caught:
        body(
            messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": [tool_use]}]
        ).check()
    assert caught.value.param == "messages" and "tool calls" in caught.value.message


# -- the HTTP edge: Anthropic's envelope, before any model -------------------------------------

LIMIT = 4096
GOOD = {"model": "smollm2", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def client() -> Iterator[TestClient]:
    released = threading.Event()
    calls: list[str] = []

    def load(spec: ModelSpec) -> Any:  # never finishes loading: every good request is 529
        calls.append(spec.id)
        released.wait(10)
        raise ModelLoadError("no such file")

    registry = ModelRegistry([ModelSpec("smollm2", "smollm2")], load, load_timeout_s=0.3)
    app = build_app(registry, ServerConfig(max_body_bytes=LIMIT))
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client
    released.set()


def assert_anthropic_error(response: Any, status: int, error_type: str) -> str:
    assert response.status_code == status, response.text
    payload = response.json()
    assert set(payload) == {"type", "error"} and payload["type"] == "error"
    assert set(payload["error"]) == {"type", "message"} and payload["error"]["type"] == error_type
    message: str = payload["error"]["message"]
    assert message
    return message


def test_refusals_are_in_anthropics_envelope(client: TestClient) -> None:
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "anything", "x-api-key": "k"}
    missing = {key: value for key, value in GOOD.items() if key != "max_tokens"}
    assert "max_tokens" in assert_anthropic_error(
        client.post("/v1/messages", json=missing, headers=headers), 400, "invalid_request_error"
    )
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    with_image = {**GOOD, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, image]}]}
    assert "messages[0].content[1]" in assert_anthropic_error(
        client.post("/v1/messages", json=with_image), 400, "invalid_request_error"
    )
    assert "claude-9" in assert_anthropic_error(
        client.post("/v1/messages", json={**GOOD, "model": "claude-9"}), 404, "not_found_error"
    )
    assert_anthropic_error(
        client.post("/v1/messages", content=b'{"max_tokens": ', headers={"content-type": "application/json"}),
        400,
        "invalid_request_error",
    )
    assert_anthropic_error(client.post("/v1/messages", content=b"x" * (LIMIT + 1)), 413, "request_too_large")
    count = dict(missing)
    assert_anthropic_error(
        client.post("/v1/messages/count_tokens", json={**count, "tools": 3}), 400, "invalid_request_error"
    )
    # a good request finds the model still loading: 529, as Anthropic says overloaded
    response = client.post("/v1/messages", json=GOOD)
    assert_anthropic_error(response, 529, "overloaded_error")
    assert response.headers["retry-after"] == "1"
    assert_anthropic_error(client.post("/v1/messages/count_tokens", json=count), 529, "overloaded_error")
    # the OpenAI routes keep their own envelope
    assert set(client.post("/v1/chat/completions", json={"messages": []}).json()) == {"error"}


def test_thinking_display_omitted_keeps_the_signature_only() -> None:
    collector = ChannelCollector()
    collector.add(e for e in CALL_EVENTS if not isinstance(e, LogprobsDelta))
    message = message_json(
        response_id="msg_1",
        model_id="m",
        parsed=collector.result(),
        finish_reason="tool_calls",
        stop_reason=None,
        stop_sequences=None,
        usage=USAGE,
        omit_thinking=True,
    )
    assert message["content"][0] == {
        "type": "thinking",
        "thinking": "",
        "signature": thinking_signature("Need weather."),
    }
    writer = MessageStream("msg_1", "m", None, omit_thinking=True)
    frames = writer.start(Usage())
    for event in CALL_EVENTS:
        frames += writer.on_event(event)
    deltas = [f["delta"]["type"] for f in frames if f["type"] == "content_block_delta"]
    assert "thinking_delta" not in deltas and deltas[0] == "signature_delta"
    assert body(thinking={"type": "adaptive", "display": "omitted"}).degraded_fields() == []


def test_betas_without_their_behaviour_are_named() -> None:
    from starlette.requests import Request

    headers = [
        (b"anthropic-beta", b"token-counting-2024-11-01, claude-code-20250219"),
        (b"anthropic-beta", b"context-1m-2025-08-07"),
    ]
    request = Request({"type": "http", "headers": headers})
    assert messages.beta_degraded(request) == [
        "anthropic-beta:claude-code-20250219",
        "anthropic-beta:context-1m-2025-08-07",
    ]
    assert messages.beta_degraded(Request({"type": "http", "headers": []})) == []


def test_a_full_context_is_model_context_window_exceeded() -> None:
    full = Usage(prompt_tokens=1000, completion_tokens=24)
    assert render.stop_json("length", None, None, full, 1024) == ("model_context_window_exceeded", None)
    assert render.stop_json("length", None, None, Usage(prompt_tokens=10, completion_tokens=24), 1024) == (
        "max_tokens",
        None,
    )
    writer = MessageStream("msg_1", "m", None, context_length=1024)
    frames = writer.finish(Finish(0, "length", full), full)
    assert frames[0]["delta"]["stop_reason"] == "model_context_window_exceeded"
