"""Golden tests for markerless tool calls (argosy/chat/bare_call.py, call_check.py).

Hermes-syntax models (Qwen2.5) may write a call without `<tool_call>` markers where the answer
starts: a JSON object, a list of them, several in a row, or any of these in a ```json fence.
Such an answer is calls only when every call names a declared tool and its arguments are
valid for the tool's schema and grounded in the conversation; anything else is text (with a
ToolParseFailure when it was a call attempt). Every case runs at every 2- and 3-piece cut
and one character at a time (tests/unit/test_chat_parsing.py's harness).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from argosy.chat.bare_call import MAX_HELD_CHARS
from argosy.chat.call_check import BareCallCheck
from argosy.chat.events import ToolParseFailure
from argosy.chat.families import hermes
from argosy.chat.messages import ChatInput, Message, OutputFormat, ToolChoice, ToolDefinition
from argosy.chat.parsing import ChannelCollector, ParserOptions, make_channel_parser, parse_text
from argosy.core.constraints import plan_constraints
from tests.unit.test_chat_parsing import (
    Case,
    F,
    R,
    T,
    _check_stream_shape,
    _ids,
    _merge,
    _splits,
    _stream,
    call,
)

WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
TIME_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"timezone": {"type": "string"}},
    "required": ["timezone"],
}
SCHEMAS: dict[str, dict[str, Any] | None] = {
    "get_weather": WEATHER_SCHEMA,
    "get_time": TIME_SCHEMA,
    "run": None,
}
CHECK = BareCallCheck(SCHEMAS, ("What is the weather in Paris?", "And the time in Tokyo?"))
AUTO: dict[str, object] = {"bare_calls": CHECK}

PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TOKYO = '{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}'
LONDON = '{"name": "get_weather", "arguments": {"city": "London", "unit": "celsius"}}'


def text_case(case_id: str, text: str, reason: str | None = None, **options: object) -> Case:
    """A case whose whole text stays text (a failure with `reason` when it was a call)."""
    expected = [T(text), *([F(text, reason)] if reason else [])]
    return Case(case_id, "hermes", text, expected, {**AUTO, **options})


CASES = [
    # ---- calls
    Case("object", "hermes", PARIS, call(0, "get_weather", '{"city": "Paris"}'), AUTO),
    Case(
        "leading-whitespace-and-text-after",
        "hermes",
        f"\n {PARIS}\n\nChecking now.",
        [*call(0, "get_weather", '{"city": "Paris"}'), T("Checking now.")],
        AUTO,
    ),
    Case(
        "list",
        "hermes",
        f"[{PARIS},\n {TOKYO}]",
        [*call(0, "get_weather", '{"city": "Paris"}'), *call(1, "get_time", '{"timezone": "Asia/Tokyo"}')],
        AUTO,
    ),
    Case(
        "objects-in-a-row",
        "hermes",
        f"{PARIS}\n{TOKYO}",
        [*call(0, "get_weather", '{"city": "Paris"}'), *call(1, "get_time", '{"timezone": "Asia/Tokyo"}')],
        AUTO,
    ),
    Case(
        "fenced-pretty",
        "hermes",
        '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
        call(0, "get_weather", '{\n    "city": "Paris"\n  }'),
        AUTO,
    ),
    Case(
        "fenced-then-text",
        "hermes",
        f"```\n{PARIS}\n```\nDone.",
        [*call(0, "get_weather", '{"city": "Paris"}'), T("Done.")],
        AUTO,
    ),
    Case(
        "fence-never-closed",
        "hermes",
        f"```json\n{PARIS}\n",
        call(0, "get_weather", '{"city": "Paris"}'),
        AUTO,
    ),
    Case(
        "arguments-as-a-json-string",
        "hermes",
        '{"name": "get_time", "arguments": "{\\"timezone\\": \\"Asia/Tokyo\\"}"}',
        call(0, "get_time", '{"timezone": "Asia/Tokyo"}'),
        AUTO,
    ),
    Case("no-arguments-any-schema", "hermes", '{"name": "run"}', call(0, "run", "{}"), AUTO),
    Case(
        "braces-and-markers-inside-strings",
        "hermes",
        '{"name": "run", "arguments": {"code": "if (a) { b(\\"}\\"); } </tool_call> Paris"}}',
        call(0, "run", '{"code": "if (a) { b(\\"}\\"); } </tool_call> Paris"}'),
        AUTO,
    ),
    Case(
        "a-marker-call-after-a-bare-one",
        "hermes",
        f"{PARIS}\n<tool_call>\n{LONDON}\n</tool_call>",
        [
            *call(0, "get_weather", '{"city": "Paris"}'),
            *call(1, "get_weather", '{"city": "London", "unit": "celsius"}'),
        ],
        AUTO,
    ),
    Case(  # markers are the model's own word: no grounding asked of them
        "marker-call-is-not-checked",
        "hermes",
        f"<tool_call>\n{LONDON}\n</tool_call>",
        call(0, "get_weather", '{"city": "London", "unit": "celsius"}'),
        AUTO,
    ),
    Case(
        "after-reasoning",
        "qwen3",
        f"hm</think>\n\n{PARIS}",
        [R("hm"), *call(0, "get_weather", '{"city": "Paris"}')],
        {**AUTO, "is_reasoning_open": True},
    ),
    Case(
        "parallel-off-keeps-the-first",
        "hermes",
        f"[{PARIS}, {TOKYO}]",
        [*call(0, "get_weather", '{"city": "Paris"}'), F(TOKYO, "extra_call")],
        {**AUTO, "can_call_in_parallel": False},
    ),
    # ---- call attempts that stay text
    text_case("undeclared-tool", '{"name": "get_news", "arguments": {"query": "Paris"}}', "unknown_tool"),
    text_case(
        "missing-required", '{"name": "get_weather", "arguments": {"town": "Paris"}}', "invalid_arguments"
    ),
    text_case(
        "not-in-the-enum",
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}}',
        "invalid_arguments",
    ),
    text_case("arguments-not-an-object", '{"name": "get_weather", "arguments": ["Paris"]}', "bad_arguments"),
    text_case("ungrounded", LONDON, "ungrounded_arguments"),
    text_case(  # "celsius" restates the schema's enum: no evidence
        "enum-value-is-no-evidence",
        LONDON,
        "ungrounded_arguments",
        bare_calls=BareCallCheck(SCHEMAS, ("What is the boiling point of water in Celsius?",)),
    ),
    text_case("one-bad-call-in-a-list", f'[{PARIS}, {{"name": "nope", "arguments": {{}}}}]', "unknown_tool"),
    text_case("broken-json", '{"name": "get_weather", "arguments": {"city": "Paris"}', "invalid_json"),
    text_case("cut-off", '{"name": "get_weather", "arguments": {"ci', "invalid_json"),
    # ---- never call attempts: text, no failure
    text_case("json-answer", '{"answer": 4}'),
    Case(  # let go after its first key: the marker in it is read whatever the cuts
        "json-answer-holding-a-marker",
        "hermes",
        '{"answer": 1, <tool_call>{"name": "run"}</tool_call>}',
        [T('{"answer": 1,'), *call(0, "run", "{}"), T(" }")],
        AUTO,
    ),
    text_case("name-but-not-a-call", '{"name": "Ann", "age": 3}'),
    text_case("prose-in-braces", "{Hello} world"),
    text_case("numbered-list", "[1] See the docs."),
    text_case("empty-object", "{} is empty"),
    text_case("other-fence", "```python\nprint(1)\n```"),
    text_case("fenced-json-not-a-call", '```json\n{"a": 1}\n```'),
    text_case("not-at-the-start", f"Here: {PARIS}"),
    text_case("tool-choice-none", PARIS, has_tool_calls=False),
    text_case("no-check-json-answer-or-forced", PARIS, bare_calls=None),
    Case(  # a later value that is not a call ends the unit: the calls before it stand
        "call-then-json",
        "hermes",
        f'{PARIS}\n{{"note": 1}}',
        [*call(0, "get_weather", '{"city": "Paris"}'), T('{"note": 1}')],
        AUTO,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_golden_events_at_every_split(case: Case) -> None:
    assert _merge(_stream(case, [case.text])) == case.expected
    for pieces in _splits(case.text):
        events = _stream(case, pieces)
        _check_stream_shape(events)
        assert _merge(events) == case.expected, pieces


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_streamed_arguments_join_to_the_non_streamed(case: Case) -> None:
    parsed = parse_text(make_channel_parser(case.family, _options(case), new_call_id=_ids()), case.text)
    collector = ChannelCollector()
    collector.add(_stream(case, list(case.text)))
    assert collector.result() == parsed


def _options(case: Case) -> ParserOptions:
    values: dict[str, Any] = {"tool_names": frozenset(SCHEMAS), **case.options}
    return ParserOptions(**values)


FRAGMENTS = [
    PARIS,
    TOKYO,
    LONDON,
    "```json\n",
    "```",
    "\n",
    " ",
    "[",
    "]",
    ", ",
    "{",
    '"name": "run"',
    "}",
    "Hi ",
    "<tool_call>",
    "</tool_call>",
    '{"answer": 1}',
    '{"a": "<tool_call>{\\"name\\": \\"run\\"}</tool_call>"}',
]


def test_random_texts_do_not_depend_on_the_cuts() -> None:
    rng = random.Random(36)
    for _ in range(400):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 7)))
        for options in (AUTO, {**AUTO, "can_call_in_parallel": False}):
            case = Case("random", "hermes", text, [], options)
            whole = _merge(_stream(case, [text]))
            cuts = sorted(rng.sample(range(1, len(text) + 1), k=min(len(text), rng.randint(0, 6))))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            events = _stream(case, pieces)
            _check_stream_shape(events)
            assert _merge(events) == whole, (text, pieces)
            assert _merge(_stream(case, list(text))) == whole, text


# ---- holdback: bounded, and let go at once for what cannot be a call


def _feed(parser_options: dict[str, object], pieces: list[str]) -> list[list[str]]:
    """The text each feed sends, for the given pieces."""
    parser = make_channel_parser("hermes", ParserOptions(**parser_options), new_call_id=_ids())  # type: ignore[arg-type]
    return [[getattr(event, "text", "") for event in parser.feed(piece)] for piece in pieces]


def test_a_call_is_held_until_it_can_be_judged() -> None:
    pieces = ['{"name": "get_weather", ', '"arguments": {"city": "Paris"}}']
    assert _feed(AUTO, pieces) == [[], []]  # the object closed, but another value may follow


def test_what_cannot_be_a_call_is_let_go_at_once() -> None:
    assert _feed(AUTO, ['{"answer": ', "4}"]) == [['{"answer":'], [" 4}"]]
    assert _feed(AUTO, ["``", "`py"]) == [[], ["```py"]]
    assert _feed(AUTO, ["{Hel", "lo}"]) == [["{Hel"], ["lo}"]]


def test_holdback_is_bounded() -> None:
    text = '{"name": "run", "arguments": {"s": "' + "x" * MAX_HELD_CHARS + '"}}'
    held = text[:MAX_HELD_CHARS]  # let go as text; the rest follows as text
    expected = [T(held), F(held, "call_too_long"), T(text[MAX_HELD_CHARS:])]
    for size in (len(text), 1000, 4093):
        case = Case("long", "hermes", text, [], AUTO)
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        assert _merge(_stream(case, pieces)) == expected


# ---- the request's options decide the check


def _chat(**fields: Any) -> ChatInput:
    weather = ToolDefinition("get_weather", None, WEATHER_SCHEMA)
    messages = [Message("system", "Be brief."), Message("user", "Weather in Paris?")]
    return ChatInput(messages=messages, tools=[weather], **fields)


def test_auto_checks_bare_calls_against_the_tools_and_the_conversation() -> None:
    check = plan_constraints(_chat(), hermes.CALL_SYNTAX).parser_options.bare_calls
    assert check == BareCallCheck({"get_weather": WEATHER_SCHEMA}, ("Be brief.", "Weather in Paris?"))


@pytest.mark.parametrize(
    "fields",
    [{"tool_choice": ToolChoice("none")}, {"tool_choice": ToolChoice("required")}],
    ids=["none", "required"],
)
def test_no_bare_call_check_where_nothing_is_left_to_judge(fields: dict[str, Any]) -> None:
    assert plan_constraints(_chat(**fields), hermes.CALL_SYNTAX).parser_options.bare_calls is None


def test_a_json_answer_asked_for_is_never_read_as_calls() -> None:
    plan = plan_constraints(_chat(output_format=OutputFormat("json_object")), hermes.CALL_SYNTAX)
    options = plan.parser_options
    assert options.bare_calls is None and not options.has_tool_calls
    assert plan.degraded == ["tools"]


@pytest.mark.parametrize(
    ("reason", "call_index", "is_left_as_text"),
    [
        ("unknown_tool", None, True),
        ("invalid_arguments", None, True),
        ("ungrounded_arguments", None, True),
        ("invalid_json", None, True),
        ("invalid_json", 0, False),  # kept as a call
        ("extra_call", None, False),  # left out, not text
        ("unexpected_text", None, False),  # text beside a call that stands
    ],
)
def test_which_failures_are_calls_left_as_text(
    reason: str, call_index: int | None, is_left_as_text: bool
) -> None:
    assert ToolParseFailure(0, "x", reason, call_index).is_call_left_as_text is is_left_as_text
