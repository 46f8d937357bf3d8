"""Golden tests for the channel parsers (argosy/chat/parsing.py, argosy/chat/families/).

Each case is raw model text and the exact events it must produce. Every case is also fed cut
at every position into 2 and into 3 pieces, in 1-character pieces and with empty deltas in
between: after merging adjacent deltas of one kind, the events must be the golden ones every
time, and the non-streaming result must be those events collected.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from argosy.chat.events import (
    ChannelEvent,
    ReasoningDelta,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    ToolParseFailure,
)
from argosy.chat.families import FAMILIES, detect_family, get_family
from argosy.chat.families.base import new_alphanumeric9_call_id, new_openai_call_id
from argosy.chat.parsing import (
    ChannelCollector,
    ChannelParser,
    ParsedToolCall,
    ParserOptions,
    make_channel_parser,
    parse_text,
    prompt_opens_reasoning,
)
from argosy.engine.detokenizer import IncrementalDetokenizer

WEATHER = frozenset({"get_weather", "get_time", "run"})


def T(text: str) -> TextDelta:
    return TextDelta(0, text)


def R(text: str) -> ReasoningDelta:
    return ReasoningDelta(0, text)


def S(call_index: int, name: str) -> ToolCallStart:
    return ToolCallStart(0, call_index, f"id{call_index}", name)


def A(call_index: int, fragment: str) -> ToolCallArgsDelta:
    return ToolCallArgsDelta(0, call_index, fragment)


def E(call_index: int) -> ToolCallEnd:
    return ToolCallEnd(0, call_index)


def F(
    text: str, reason: str, call_index: int | None = None, is_unterminated: bool = False
) -> ToolParseFailure:
    return ToolParseFailure(0, text, reason, call_index, is_unterminated)


def call(call_index: int, name: str, arguments: str) -> list[ChannelEvent]:
    return [S(call_index, name), A(call_index, arguments), E(call_index)]


@dataclass(frozen=True)
class Case:
    id: str
    family: str
    text: str
    expected: list[ChannelEvent]
    options: Mapping[str, object] = field(default_factory=dict)


HERMES_NESTED = (
    '{"code": "if (a) { b(\\"}\\"); }", "note": "</tool_call> and <tool_call> stay",'
    ' "nested": {"list": [1, {"k": "v"}, []], "esc": "\\\\", "quote": "\\""}}'
)

CASES = [
    # ---- ChatML / Hermes
    Case("hermes-plain-text", "hermes", "Hello, world!\n  ", [T("Hello, world!\n  ")]),
    Case(
        "hermes-lookalikes",
        "hermes",
        "a < b, <tool_cal and </tool_call> <",
        [T("a < b, <tool_cal and </tool_call> <")],
    ),
    Case("hermes-partial-marker-at-end", "hermes", "Hello <tool_ca", [T("Hello <tool_ca")]),
    Case(
        "hermes-one-call",
        "hermes",
        'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        [T("Let me check."), *call(0, "get_weather", '{"city": "Paris"}')],
    ),
    Case(  # the output ran out of tokens inside the closing marker: markup, not content
        "hermes-call-cut-inside-its-closer",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool',
        [*call(0, "get_weather", '{"city": "Paris"}')],
    ),
    Case(
        "hermes-nested-json",
        "hermes",
        '<tool_call>\n{"name": "run", "arguments": ' + HERMES_NESTED + "}\n</tool_call>",
        call(0, "run", HERMES_NESTED),
    ),
    Case(
        "hermes-parallel-and-text-after",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>\n\nBoth asked.',
        [
            *call(0, "get_weather", '{"city": "Paris"}'),
            *call(1, "get_time", '{"tz": "CET"}'),
            T("Both asked."),
        ],
    ),
    Case(
        "hermes-text-around",
        "hermes",
        'Sure. <tool_call>{"name": "get_time", "arguments": {}}</tool_call> Done.\n',
        [T("Sure."), *call(0, "get_time", "{}"), T(" Done.\n")],
    ),
    Case(
        "hermes-no-space-around",
        "hermes",
        'Sure.<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\nDone.',
        [T("Sure."), *call(0, "get_time", "{}"), T("\nDone.")],
    ),
    Case(
        "hermes-whitespace-between-calls-and-text",
        "hermes",
        'Hi<tool_call>{"name": "run"}</tool_call>\n<tool_call>{"name": "run"}</tool_call>\n bye\n'
        '<tool_call>{"name": "run"}</tool_call>{<tool_call>{"name": "run"}</tool_call>\n x',
        [
            T("Hi"),
            *call(0, "run", "{}"),
            *call(1, "run", "{}"),
            T("\nbye"),
            *call(2, "run", "{}"),
            T("\n{"),
            *call(3, "run", "{}"),
            T("\n x"),
        ],
    ),
    Case(
        "hermes-arguments-first-and-compact",
        "hermes",
        '<tool_call>{"arguments":{"a":[1,2]},"name":"run"}</tool_call>',
        call(0, "run", '{"a":[1,2]}'),
    ),
    Case(
        "hermes-no-arguments",
        "hermes",
        '<tool_call>\n{"name": "get_time"}\n</tool_call>',
        call(0, "get_time", "{}"),
    ),
    Case(
        "hermes-string-arguments",
        "hermes",
        '<tool_call>\n{"name": "run", "arguments": "{\\"a\\": \\"x\\\\\\"y\\"}"}\n</tool_call>',
        call(0, "run", '{"a": "x\\"y"}'),
    ),
    Case(
        "hermes-no-closing-marker",
        "hermes",
        'Ok <tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n',
        [T("Ok"), *call(0, "get_time", '{"tz": "UTC"}')],
    ),
    Case(
        "hermes-next-call-without-closing-marker",
        "hermes",
        '<tool_call>{"name": "get_time", "arguments": {}}<tool_call>{"name": "run", "arguments": {}}</tool_call>',
        [*call(0, "get_time", "{}"), *call(1, "run", "{}")],
    ),
    Case(
        "hermes-unterminated-in-arguments",
        "hermes",
        'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        [
            T("Hi"),
            S(0, "get_weather"),
            A(0, '{"city": "Par'),
            E(0),
            F('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "unterminated", 0, True),
        ],
    ),
    Case(
        "hermes-unterminated-before-name",
        "hermes",
        'Hi <tool_call>\n{"name": "get_wea',
        [
            T('Hi <tool_call>\n{"name": "get_wea'),
            F('<tool_call>\n{"name": "get_wea', "unterminated", None, True),
        ],
    ),
    Case(
        "hermes-unterminated-after-marker",
        "hermes",
        "Hi <tool_call>\n",
        [T("Hi <tool_call>\n"), F("<tool_call>\n", "unterminated", None, True)],
    ),
    Case(
        "hermes-invalid-json-before-name",
        "hermes",
        "<tool_call>\n{name: 'get_time'}\n</tool_call> after",
        [
            T("<tool_call>\n{name: 'get_time'}\n</tool_call>"),
            F("<tool_call>\n{name: 'get_time'}\n</tool_call>", "invalid_json"),
            T(" after"),
        ],
    ),
    Case(
        "hermes-invalid-json-after-name",
        "hermes",
        'A <tool_call>\n{"name": "run", "arguments": {"a" 1}}\n</tool_call> B',
        [
            T("A"),
            *call(0, "run", '{"a" 1}'),
            F('<tool_call>\n{"name": "run", "arguments": {"a" 1}}\n</tool_call>', "invalid_json", 0),
            T(" B"),
        ],
    ),
    Case(
        "hermes-broken-structure-after-name",
        "hermes",
        '<tool_call>\n{"name": "run", "arguments": {"a": 1}</tool_call>Next',
        [
            S(0, "run"),
            A(0, '{"a": 1}'),
            E(0),
            F('<tool_call>\n{"name": "run", "arguments": {"a": 1}</tool_call>', "invalid_json", 0),
            T("Next"),
        ],
    ),
    Case(
        "hermes-not-json",
        "hermes",
        "<tool_call>\nI would call get_time now.\n</tool_call>",
        [
            T("<tool_call>\nI would call get_time now.\n</tool_call>"),
            F("<tool_call>\nI would call get_time now.\n</tool_call>", "invalid_json"),
        ],
    ),
    Case(
        "hermes-unknown-tool",
        "hermes",
        'Try: <tool_call>\n{"name": "delete_all", "arguments": {}}\n</tool_call>',
        [
            T('Try: <tool_call>\n{"name": "delete_all", "arguments": {}}\n</tool_call>'),
            F('<tool_call>\n{"name": "delete_all", "arguments": {}}\n</tool_call>', "unknown_tool"),
        ],
    ),
    Case(
        "hermes-missing-name",
        "hermes",
        '<tool_call>{"arguments": {"a": 1}}</tool_call>',
        [
            T('<tool_call>{"arguments": {"a": 1}}</tool_call>'),
            F('<tool_call>{"arguments": {"a": 1}}</tool_call>', "missing_name"),
        ],
    ),
    Case(
        "hermes-name-not-a-string",
        "hermes",
        '<tool_call>{"name": 7, "arguments": {}}</tool_call>',
        [
            T('<tool_call>{"name": 7, "arguments": {}}</tool_call>'),
            F('<tool_call>{"name": 7, "arguments": {}}</tool_call>', "missing_name"),
        ],
    ),
    Case(
        "hermes-bad-arguments",
        "hermes",
        '<tool_call>{"name": "run", "arguments": [1, 2]}</tool_call>',
        [
            *call(0, "run", "[1, 2]"),
            F('<tool_call>{"name": "run", "arguments": [1, 2]}</tool_call>', "bad_arguments", 0),
        ],
    ),
    Case(
        "hermes-unexpected-text-before-closing-marker",
        "hermes",
        '<tool_call>{"name": "run", "arguments": {}}}\n</tool_call>',
        [*call(0, "run", "{}"), T("}"), F("}\n", "unexpected_text")],
    ),
    Case(
        "hermes-unknown-then-known",
        "hermes",
        '<tool_call>{"name": "nope"}</tool_call>\n<tool_call>{"name": "run"}</tool_call>',
        [
            T('<tool_call>{"name": "nope"}</tool_call>'),
            F('<tool_call>{"name": "nope"}</tool_call>', "unknown_tool"),
            *call(0, "run", "{}"),
        ],
    ),
    Case(
        "hermes-tool-choice-none",
        "hermes",
        'Ok <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        [T('Ok <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')],
        {"has_tool_calls": False},
    ),
    Case(
        "hermes-parallel-off",
        "hermes",
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "run", "arguments": {"a": 1}}</tool_call>\n'
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
        [
            *call(0, "get_time", "{}"),
            F('<tool_call>{"name": "run", "arguments": {"a": 1}}</tool_call>', "extra_call"),
            T('<tool_call>{"name": "nope", "arguments": {}}</tool_call>'),
            F('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "unknown_tool"),
        ],
        {"can_call_in_parallel": False},
    ),
    Case(
        "hermes-any-name-when-undeclared",
        "hermes",
        '<tool_call>{"name": "anything", "arguments": {}}</tool_call>',
        call(0, "anything", "{}"),
        {"tool_names": None},
    ),
    Case(
        "hermes-think-is-text",
        "hermes",
        "<think>\nhm\n</think>\n\nHi",
        [T("<think>\nhm\n</think>\n\nHi")],
    ),
    # ---- Qwen3: reasoning, then text and Hermes calls
    Case(
        "qwen3-prompt-opened-think",
        "qwen3",
        "Let me think.\n2 + 2 = 4.\n</think>\n\nThe answer is 4.",
        [R("Let me think.\n2 + 2 = 4."), T("The answer is 4.")],
        {"is_reasoning_open": True},
    ),
    Case(
        "qwen3-model-opened-think-with-call",
        "qwen3",
        '\n<think>\nI could use <tool_call>{"name": "get_time"}</tool_call> here.\n</think>\n\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
        [
            R('I could use <tool_call>{"name": "get_time"}</tool_call> here.'),
            *call(0, "get_time", '{"tz": "CET"}'),
        ],
    ),
    Case(
        "qwen3-empty-think",
        "qwen3",
        "<think>\n\n</think>\n\nHi there",
        [T("Hi there")],
    ),
    Case(
        "qwen3-unterminated-think",
        "qwen3",
        "<think>\nStill thinking about </thin",
        [R("Still thinking about </thin")],
    ),
    Case(
        "qwen3-think-later-is-text",
        "qwen3",
        "Use <think> tags, then </think>.",
        [T("Use <think> tags, then </think>.")],
    ),
    Case(
        "qwen3-second-think-is-text",
        "qwen3",
        "<think>a</think>b<think>c</think>",
        [R("a"), T("b<think>c</think>")],
    ),
    Case(
        "qwen3-reasoning-off",
        "qwen3",
        "<think>\nhm\n</think>\n\nHi",
        [T("<think>\nhm\n</think>\n\nHi")],
        {"has_reasoning": False},
    ),
    Case(
        "qwen3-tool-choice-none-keeps-reasoning",
        "qwen3",
        "hm</think>\n<tool_call>{}</tool_call>",
        [R("hm"), T("<tool_call>{}</tool_call>")],
        {"is_reasoning_open": True, "has_tool_calls": False},
    ),
    # ---- Llama 3.x JSON calls
    Case(
        "llama-bare-call",
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        call(0, "get_weather", '{"city": "Paris"}'),
    ),
    Case(
        "llama-python-tag-multiple",
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_time", "parameters": {}}',
        [*call(0, "get_weather", '{"city": "Paris"}'), *call(1, "get_time", "{}")],
    ),
    Case(
        "llama-bare-multiple-with-type-key",
        "llama3_json",
        '\n{"type": "function", "name": "get_time", "parameters": {"tz": "UTC"}};{"name": "run", "parameters": {"x": ";"}}',
        [*call(0, "get_time", '{"tz": "UTC"}'), *call(1, "run", '{"x": ";"}')],
    ),
    Case(
        "llama-separator-then-text",
        "llama3_json",
        '{"name": "get_time", "parameters": {}}; and that is all',
        [*call(0, "get_time", "{}"), T("and that is all")],
    ),
    Case(
        "llama-json-answer-is-text",
        "llama3_json",
        '{"city": "Paris", "temp": {"c": 21}}',
        [T('{"city": "Paris", "temp": {"c": 21}}')],
    ),
    Case(
        "llama-not-at-start-is-text",
        "llama3_json",
        'Call it as {"name": "get_time", "parameters": {}}',
        [T('Call it as {"name": "get_time", "parameters": {}}')],
    ),
    Case(
        "llama-brace-text",
        "llama3_json",
        "{this is not json}",
        [T("{this is not json}")],
    ),
    Case(
        "llama-unknown-tool",
        "llama3_json",
        '{"name": "Bob", "parameters": {}}',
        [T('{"name": "Bob", "parameters": {}}'), F('{"name": "Bob", "parameters": {}}', "unknown_tool")],
    ),
    Case(
        "llama-bare-cut-before-name",
        "llama3_json",
        '{"name": "get_ti',
        [T('{"name": "get_ti')],
    ),
    Case(
        "llama-unterminated-call",
        "llama3_json",
        '{"name": "get_time", "parameters": {"tz": ',
        [
            S(0, "get_time"),
            A(0, '{"tz": '),
            E(0),
            F('{"name": "get_time", "parameters": {"tz": ', "unterminated", 0, True),
        ],
    ),
    # ---- Mistral
    Case(
        "mistral-array",
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"tz": ["a", "]"]}}]',
        [*call(0, "get_weather", '{"city": "Paris"}'), *call(1, "get_time", '{"tz": ["a", "]"]}')],
    ),
    Case(
        "mistral-text-then-array",
        "mistral",
        'Sure. [TOOL_CALLS] [{"name": "get_time", "arguments": {}}]',
        [T("Sure."), *call(0, "get_time", "{}")],
    ),
    Case(
        "mistral-named-form",
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
        [*call(0, "get_weather", '{"city": "Paris"}'), *call(1, "get_time", "{}")],
    ),
    Case(
        "mistral-named-unknown",
        "mistral",
        '[TOOL_CALLS]nope[ARGS]{"a": 1}',
        [T('[TOOL_CALLS]nope[ARGS]{"a": 1}'), F('[TOOL_CALLS]nope[ARGS]{"a": 1}', "unknown_tool")],
    ),
    Case(
        "mistral-unterminated-second",
        "mistral",
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "run", "argu',
        [
            *call(0, "get_time", "{}"),
            S(1, "run"),
            E(1),
            F(' {"name": "run", "argu', "unterminated", 1, True),
        ],
    ),
    # ---- tool_choice required / named: bare JSON whatever the family
    Case(
        "forced-object",
        "hermes",
        '{"name": "get_time", "arguments": {"tz": "UTC"}}',
        call(0, "get_time", '{"tz": "UTC"}'),
        {"is_call_forced": True},
    ),
    Case(
        "forced-grammar-hermes-shape",
        "qwen3",
        '<think>\nok\n</think>\n\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "run", "arguments": {"a": 1}}\n</tool_call>',
        [R("ok"), *call(0, "get_time", "{}"), *call(1, "run", '{"a": 1}')],
        {"is_call_forced": True},
    ),
    Case(
        "forced-bare-objects-one-after-another",
        "llama3_json",
        '{"name": "get_time", "parameters": {}}\n{"name": "run", "parameters": {"a": 1}}',
        [*call(0, "get_time", "{}"), *call(1, "run", '{"a": 1}')],
        {"is_call_forced": True},
    ),
    Case(
        "forced-bare-unknown-name",
        "mistral",
        '{"name": "nope", "arguments": {}}',
        [T('{"name": "nope", "arguments": {}}'), F('{"name": "nope", "arguments": {}}', "unknown_tool")],
        {"is_call_forced": True},
    ),
    Case(
        "forced-array-after-reasoning",
        "qwen3",
        'plan</think>\n[{"name": "get_time", "arguments": {}}, {"name": "run", "arguments": {"a": 1}}]',
        [R("plan"), *call(0, "get_time", "{}"), *call(1, "run", '{"a": 1}')],
        {"is_call_forced": True, "is_reasoning_open": True},
    ),
]


def _ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"id{next(counter)}"


def _parser(case: Case) -> ChannelParser:
    values: dict[str, object] = {"tool_names": WEATHER}
    values.update(case.options)
    return make_channel_parser(case.family, ParserOptions(**values), new_call_id=_ids())  # type: ignore[arg-type]


def _merge(events: list[ChannelEvent]) -> list[ChannelEvent]:
    merged: list[ChannelEvent] = []
    for event in events:
        last = merged[-1] if merged else None
        if isinstance(event, TextDelta) and isinstance(last, TextDelta):
            merged[-1] = TextDelta(0, last.text + event.text)
        elif isinstance(event, ReasoningDelta) and isinstance(last, ReasoningDelta):
            merged[-1] = ReasoningDelta(0, last.text + event.text)
        elif (
            isinstance(event, ToolCallArgsDelta)
            and isinstance(last, ToolCallArgsDelta)
            and last.call_index == event.call_index
        ):
            merged[-1] = ToolCallArgsDelta(0, event.call_index, last.fragment + event.fragment)
        else:
            merged.append(event)
    return merged


def _stream(case: Case, pieces: list[str]) -> list[ChannelEvent]:
    parser = _parser(case)
    events: list[ChannelEvent] = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    return events


def _splits(text: str) -> Iterator[list[str]]:
    yield [text]
    yield list(text)
    yield ["", *itertools.chain.from_iterable((ch, "") for ch in text)]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    for i in range(1, len(text)):
        for j in range(i + 1, len(text)):
            yield [text[:i], text[i:j], text[j:]]


def _check_stream_shape(events: list[ChannelEvent]) -> None:
    """No empty deltas; per call: one start, then arguments, then one end."""
    state: dict[int, str] = {}
    for event in events:
        if isinstance(event, TextDelta | ReasoningDelta):
            assert event.text
        elif isinstance(event, ToolCallStart):
            assert event.call_index == len(state) and event.call_index not in state
            state[event.call_index] = "open"
        elif isinstance(event, ToolCallArgsDelta):
            assert event.fragment and state.get(event.call_index) == "open"
        elif isinstance(event, ToolCallEnd):
            assert state.get(event.call_index) == "open"
            state[event.call_index] = "closed"
    assert all(value == "closed" for value in state.values())


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_golden_events_at_every_split(case: Case) -> None:
    assert _merge(_stream(case, [case.text])) == case.expected
    for pieces in _splits(case.text):
        events = _stream(case, pieces)
        _check_stream_shape(events)
        assert _merge(events) == case.expected, pieces


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_non_streaming_is_the_stream_collected(case: Case) -> None:
    parsed = parse_text(_parser(case), case.text)
    collector = ChannelCollector()
    collector.add(_stream(case, list(case.text)))
    assert collector.result() == parsed
    assert parsed.content == "".join(e.text for e in case.expected if isinstance(e, TextDelta))
    assert parsed.reasoning == "".join(e.text for e in case.expected if isinstance(e, ReasoningDelta))
    assert parsed.parse_failures == [e for e in case.expected if isinstance(e, ToolParseFailure)]
    starts = [e for e in case.expected if isinstance(e, ToolCallStart)]
    assert [(c.call_index, c.call_id, c.name) for c in parsed.tool_calls] == [
        (s.call_index, s.call_id, s.name) for s in starts
    ]
    assert parsed.is_call_cut_off == any(f.is_unterminated for f in parsed.parse_failures)


def test_arguments_of_good_calls_are_valid_json() -> None:
    for case in CASES:
        parsed = parse_text(_parser(case), case.text)
        failed = {f.call_index for f in parsed.parse_failures}
        for tool_call in parsed.tool_calls:
            if tool_call.call_index not in failed:
                assert isinstance(json.loads(tool_call.arguments), dict), case.id


# ---- randomized: texts stitched from fragments, cut at random places


FRAGMENTS = {
    "hermes": [
        "Hello ",
        " ",
        "\n",
        "<",
        "<tool_call>",
        "</tool_call>",
        '{"name": "run", "arguments": {"a": "}"}}',
        '{"name": "nope"}',
        '{"arguments": {}, "name": "get_time"}',
        '{"name": "run", "arguments": {"s": "</tool_call>\\"{"}',
        "{bad",
        "}",
    ],
    "qwen3": ["<think>", "</think>", "hm ", "\n\n", "<tool_call>", "</tool_call>", '{"name": "run"}', "x"],
    "llama3_json": [
        "{",
        '"name": "run", ',
        '"parameters": {"x": [1]}',
        "}",
        ";",
        " ",
        "<|python_tag|>",
        "text",
    ],
    "mistral": [
        "[TOOL_CALLS]",
        "[",
        "]",
        ", ",
        '{"name": "run", "arguments": {}}',
        "run",
        "[ARGS]",
        '{"a": 1}',
        "hi ",
    ],
}


@pytest.mark.parametrize("family", sorted(FRAGMENTS))
def test_random_texts_do_not_depend_on_the_cuts(family: str) -> None:
    rng = random.Random(1234)
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS[family]) for _ in range(rng.randint(1, 8)))
        for options in (
            {},
            {"is_reasoning_open": True},
            {"can_call_in_parallel": False},
            {"is_call_forced": True},
        ):
            case = Case("random", family, text, [], options)
            whole = _merge(_stream(case, [text]))
            cuts = sorted(rng.sample(range(1, len(text) + 1), k=min(len(text), rng.randint(0, 6))))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            events = _stream(case, pieces)
            _check_stream_shape(events)
            assert _merge(events) == whole, (text, pieces)
            assert _merge(_stream(case, list(text))) == whole, text


# ---- through a real tokenizer and the incremental detokenizer


def test_hermes_call_through_the_detokenizer(smollm2_tokenizer_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(smollm2_tokenizer_dir / "tokenizer.json"))
    text = (
        "Let me check 🌦️.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Zürich", "note": "</tool_call>"}}\n</tool_call>'
    )
    token_ids = tokenizer.encode(text, add_special_tokens=False).ids
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    parser = make_channel_parser("hermes", ParserOptions(tool_names=WEATHER), new_call_id=_ids())
    events: list[ChannelEvent] = []
    for token_id in token_ids:
        events += parser.feed(detokenizer.feed([token_id]).text_delta)
    events += parser.feed(detokenizer.flush())
    events += parser.finish()
    assert _merge(events) == [
        T("Let me check 🌦️."),
        *call(0, "get_weather", '{"city": "Zürich", "note": "</tool_call>"}'),
    ]


# ---- parser lifecycle and options


def test_choice_index_is_carried_and_finish_is_final() -> None:
    parser = make_channel_parser(
        "qwen3", ParserOptions(is_reasoning_open=True), choice_index=3, new_call_id=_ids()
    )
    events = parser.feed('a</think>b<tool_call>{"name": "f"}</tool_call>') + parser.finish()
    assert events == [
        ReasoningDelta(3, "a"),
        TextDelta(3, "b"),
        ToolCallStart(3, 0, "id0", "f"),
        ToolCallArgsDelta(3, 0, "{}"),
        ToolCallEnd(3, 0),
    ]
    assert parser.finish() == []
    with pytest.raises(RuntimeError):
        parser.feed("more")


def test_parse_text_returns_the_message_parts() -> None:
    parser = make_channel_parser("qwen3", ParserOptions(tool_names=WEATHER), new_call_id=_ids())
    content, reasoning, tool_calls, failures = parse_text(
        parser, '<think>hm</think>Ok.<tool_call>{"name": "run", "arguments": {"a": 1}}</tool_call>'
    )
    assert (content, reasoning, failures) == ("Ok.", "hm", [])
    assert tool_calls == [ParsedToolCall(0, "id0", "run", '{"a": 1}')]


def test_default_call_ids() -> None:
    ids = {new_openai_call_id() for _ in range(50)}
    assert len(ids) == 50 and all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)
    assert re.fullmatch(r"[A-Za-z0-9]{9}", new_alphanumeric9_call_id())
    parsed = parse_text(make_channel_parser("hermes"), '<tool_call>{"name": "f"}</tool_call>')
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", parsed.tool_calls[0].call_id)
    parsed = parse_text(make_channel_parser("mistral"), '[TOOL_CALLS][{"name": "f", "arguments": {}}]')
    assert re.fullmatch(r"[A-Za-z0-9]{9}", parsed.tool_calls[0].call_id)


def test_prompt_opens_reasoning() -> None:
    qwen3, hermes = get_family("qwen3"), get_family("hermes")
    assert prompt_opens_reasoning(qwen3, "<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning(qwen3, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning(qwen3, "<|im_start|>assistant\n")
    assert not prompt_opens_reasoning(hermes, "<|im_start|>assistant\n<think>\n")


# ---- the registry and detection

QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' }}{{- '<|im_start|>assistant\\n' }}"
)
QWEN3_TEMPLATE = (
    QWEN25_TEMPLATE
    + "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
)
LLAMA31_TEMPLATE = (
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{{- '{\"name\": \"' + tool_call.name + '\", ' }}{{- '\"parameters\": ' }}"
)
MISTRAL_TEMPLATE = "{%- if message.tool_calls %}{{- '[TOOL_CALLS][' }}{%- endif %}[INST]"
SMOLLM2_TEMPLATE = "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"


@pytest.mark.parametrize(
    ("template", "vocab", "family"),
    [
        (QWEN25_TEMPLATE, (), "hermes"),
        (QWEN3_TEMPLATE, (), "qwen3"),
        (QWEN25_TEMPLATE, ("<think>", "</think>"), "qwen3"),
        (LLAMA31_TEMPLATE, (), "llama3_json"),
        ("{{ bos_token }}<|start_header_id|>", ("<|python_tag|>",), "llama3_json"),
        (MISTRAL_TEMPLATE, (), "mistral"),
        ("[INST]{{ message }}[/INST]", {"[TOOL_CALLS]": 5}, "mistral"),
        (SMOLLM2_TEMPLATE, (), "hermes"),
        (None, (), "hermes"),
    ],
)
def test_detect_family(template: str | None, vocab: object, family: str) -> None:
    assert detect_family(template, vocab).name == family  # type: ignore[arg-type]


def test_detect_family_on_smollm2(smollm2_tokenizer_dir: Path) -> None:
    config = json.loads((smollm2_tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    template = config["chat_template"]
    assert template is not None and "<|im_start|>" in template
    vocab = Tokenizer.from_file(str(smollm2_tokenizer_dir / "tokenizer.json")).get_vocab()
    assert detect_family(template, vocab).name == "hermes"


def test_registry() -> None:
    assert sorted(FAMILIES) == ["hermes", "llama3_json", "mistral", "qwen3"]
    with pytest.raises(ValueError, match="unknown chat family 'gpt9'"):
        get_family("gpt9")
    assert get_family("qwen3").marker_strings == ("<think>", "</think>", "<tool_call>", "</tool_call>")
    assert get_family("mistral").marker_strings == ("[TOOL_CALLS]", "[ARGS]")
