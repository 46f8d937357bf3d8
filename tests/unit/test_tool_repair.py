"""The tool-call guardrail: a call that parsed but fails its tool's schema (argosy/chat/
call_guard.py, call_check.py) and its one constrained retry (argosy/core/tool_repair.py).

Classification, pinned at every 2- and 3-piece cut: valid (a call), invalid (a declared tool,
arguments a JSON object its schema refuses: text with "invalid_arguments", or a ToolCallInvalid
handed to the core when it may repair) and unparsed (anything else left as text). The core's
half runs on a scripted engine that plays back the output and the repair's text: what is
pinned there is the plumbing (the repair's prompt and grammar, the budget, call numbers,
finish reasons, usage, the degraded names), not a model's behaviour (tests/e2e/
test_qwen_tools.py repairs a real call).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any, cast

import pytest

from argosy.chat.call_check import BareCallCheck, fits_schema
from argosy.chat.events import (
    ChannelEvent,
    Event,
    Finish,
    TextDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallInvalid,
    ToolCallStart,
    ToolParseFailure,
)
from argosy.chat.families import hermes
from argosy.chat.messages import ChatInput, Message, ToolChoice, ToolDefinition
from argosy.chat.parsing import ParserOptions, make_channel_parser
from argosy.config import ServerConfig
from argosy.core.channels import ChannelSpec, ChoiceChannels
from argosy.core.choice import ChoiceState
from argosy.core.constraints import plan_constraints
from argosy.core.stream import CoreRequest, CoreStream, collect
from argosy.core.tool_repair import ToolCallRepairs
from argosy.engine.outputs import RequestOutput
from argosy.errors import InvalidRequestError
from argosy.runner.structured import GrammarSpec
from argosy.sampling_params import RequestSampling, SamplingParams
from tests.unit.test_chat_parsing import F, T, _merge, _splits, call

THERMOSTAT: dict[str, Any] = {
    "type": "object",
    "properties": {"room": {"type": "string"}, "degrees": {"type": "integer", "minimum": 50, "maximum": 90}},
    "required": ["room", "degrees"],
}
SCHEMAS: dict[str, dict[str, Any] | None] = {"set_thermostat": THERMOSTAT, "run": None}
CONVERSATION = ("Set the living room thermostat to 20 degrees.",)
GOOD_ARGS = '{"room": "living room", "degrees": 70}'
BAD_ARGS = '{"room": "living room", "degrees": 20}'
GOOD = f'{{"name": "set_thermostat", "arguments": {GOOD_ARGS}}}'
BAD = f'{{"name": "set_thermostat", "arguments": {BAD_ARGS}}}'
MARKED_GOOD = f"<tool_call>\n{GOOD}\n</tool_call>"
MARKED_BAD = f"<tool_call>\n{BAD}\n</tool_call>"
MARKED_OPENING = '<tool_call>\n{"name": "set_thermostat", "arguments": '
BARE_OPENING = '{"name": "set_thermostat", "arguments": '
AUTO: dict[str, Any] = {
    "tool_names": frozenset(SCHEMAS),
    "bare_calls": BareCallCheck(SCHEMAS, CONVERSATION),
    "call_schemas": SCHEMAS,
}
REPAIR: dict[str, Any] = {**AUTO, "can_repair_calls": True}


def invalid(call_index: int, text: str, prefix: str, opening: str = MARKED_OPENING) -> ToolCallInvalid:
    return ToolCallInvalid(0, call_index, "set_thermostat", BAD_ARGS, text, prefix, opening)


def _ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"id{next(counter)}"


def _parse(pieces: list[str], options: dict[str, Any]) -> list[ChannelEvent]:
    parser = make_channel_parser("hermes", ParserOptions(**options), new_call_id=_ids())
    events = [event for piece in pieces for event in parser.feed(piece)]
    return _merge(events + parser.finish())


# (id, text, parser options, events): valid / invalid-schema / unparsed, markers or none
CASES: list[tuple[str, str, dict[str, Any], list[ChannelEvent]]] = [
    ("marked-valid", MARKED_GOOD, AUTO, call(0, "set_thermostat", GOOD_ARGS)),
    ("marked-invalid-text", MARKED_BAD, AUTO, [T(MARKED_BAD), F(MARKED_BAD, "invalid_arguments")]),
    (
        "marked-invalid-then-valid-is-call-0",
        f"Sure. {MARKED_BAD} {MARKED_GOOD}",
        AUTO,
        [T(f"Sure. {MARKED_BAD}"), F(MARKED_BAD, "invalid_arguments"), *call(0, "set_thermostat", GOOD_ARGS)],
    ),
    ("marked-invalid-for-repair", MARKED_BAD, REPAIR, [invalid(0, MARKED_BAD, "")]),
    (
        "marked-invalid-for-repair-keeps-its-number",
        f"Sure. {MARKED_BAD} {MARKED_GOOD}",
        REPAIR,
        [  # the held call took no id: the call after it has the first
            T("Sure."),
            invalid(0, MARKED_BAD, "Sure. "),
            ToolCallStart(0, 1, "id0", "set_thermostat"),
            *call(1, "set_thermostat", GOOD_ARGS)[1:],
        ],
    ),
    (  # broken JSON after a known name: still a call, as before (unparsed, kept as a call)
        "marked-broken-json-stays-a-call",
        '<tool_call>\n{"name": "set_thermostat", "arguments": {"room": }}\n</tool_call>',
        REPAIR,
        [
            *call(0, "set_thermostat", '{"room": }'),
            F(
                '<tool_call>\n{"name": "set_thermostat", "arguments": {"room": }}\n</tool_call>',
                "invalid_json",
                0,
            ),
        ],
    ),
    (
        "marked-undeclared-is-unparsed",
        '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
        REPAIR,
        [
            T('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'),
            F('<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>', "unknown_tool"),
        ],
    ),
    (
        "marked-no-schema-is-not-held",
        '<tool_call>{"name": "run", "arguments": {"x": 1}}</tool_call>',
        REPAIR,
        call(0, "run", '{"x": 1}'),
    ),
    ("bare-valid", GOOD, AUTO, call(0, "set_thermostat", GOOD_ARGS)),
    ("bare-invalid-text", BAD, AUTO, [T(BAD), F(BAD, "invalid_arguments")]),
    ("bare-invalid-for-repair", BAD, REPAIR, [invalid(0, BAD, "", BARE_OPENING)]),
    (
        "bare-fenced-invalid-for-repair",
        f"```json\n{BAD}\n```",
        REPAIR,
        [invalid(0, f"```json\n{BAD}\n```", "", BARE_OPENING)],
    ),
    (  # a made-up call (no word of it in the conversation) is never repaired into a call
        "bare-ungrounded-invalid-is-unparsed",
        '{"name": "set_thermostat", "arguments": {"room": "garage", "degrees": 5}}',
        REPAIR,
        [
            T('{"name": "set_thermostat", "arguments": {"room": "garage", "degrees": 5}}'),
            F(
                '{"name": "set_thermostat", "arguments": {"room": "garage", "degrees": 5}}',
                "ungrounded_arguments",
            ),
        ],
    ),
    (  # several calls, one failing its schema: all text, named invalid, not repaired
        "bare-list-with-an-invalid-call",
        f"[{GOOD}, {BAD}]",
        REPAIR,
        [T(f"[{GOOD}, {BAD}]"), F(f"[{GOOD}, {BAD}]", "invalid_arguments")],
    ),
    (  # a forced call is the grammar's: nothing held or checked
        "forced-is-not-checked",
        MARKED_BAD,
        {**REPAIR, "bare_calls": None, "is_call_forced": True},
        call(0, "set_thermostat", BAD_ARGS),
    ),
]


@pytest.mark.parametrize(("text", "options", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_classification_at_every_split(
    text: str, options: dict[str, Any], expected: list[ChannelEvent]
) -> None:
    for pieces in _splits(text):
        assert _parse(pieces, options) == expected, pieces


def test_random_texts_do_not_depend_on_the_cuts() -> None:
    fragments = [MARKED_BAD, MARKED_GOOD, BAD, GOOD, "Hi ", "\n", "<tool_call>", "</tool_call>", "{", "}"]
    rng = random.Random(38)
    for _ in range(200):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(1, 5)))
        cuts = sorted(rng.sample(range(1, len(text) + 1), k=min(len(text), rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        for options in (AUTO, REPAIR, {**REPAIR, "can_call_in_parallel": False}):
            whole = _parse([text], options)
            assert _parse(pieces, options) == whole, (text, pieces)
            assert _parse(list(text), options) == whole, text


def test_a_checked_call_is_held_until_its_arguments_close() -> None:
    parser = make_channel_parser("hermes", ParserOptions(**AUTO), new_call_id=_ids())
    head, tail = MARKED_GOOD[:-15], MARKED_GOOD[-15:]  # cut inside the arguments
    assert parser.feed(head) == []
    assert _merge(parser.feed(tail) + parser.finish()) == call(0, "set_thermostat", GOOD_ARGS)


def test_a_held_call_the_output_ends_inside_is_still_a_call() -> None:
    text = MARKED_BAD[:-25]  # inside the arguments
    for options in (AUTO, REPAIR):
        assert _parse([text], options) == [
            *call(0, "set_thermostat", text[len(MARKED_OPENING) :])[:2],
            ToolCallEnd(0, 0),
            F(text, "unterminated", 0, is_unterminated=True),
        ]


def test_which_failures_name_tool_call_invalid() -> None:
    assert ToolParseFailure(0, "x", "invalid_arguments").is_invalid_call
    for reason, call_index in [("invalid_arguments", 0), ("unknown_tool", None), ("bad_arguments", None)]:
        assert not ToolParseFailure(0, "x", reason, call_index).is_invalid_call
    assert fits_schema(GOOD_ARGS, THERMOSTAT) and not fits_schema(BAD_ARGS, THERMOSTAT)
    assert not fits_schema("[1]", None) and fits_schema("{}", None)


def test_auto_checks_calls_against_the_schemas_forced_and_none_do_not() -> None:
    tool = ToolDefinition("set_thermostat", None, THERMOSTAT)
    messages = [Message("user", CONVERSATION[0])]
    for choice, schemas in [("auto", {"set_thermostat": THERMOSTAT}), ("required", None), ("none", None)]:
        chat = ChatInput(messages=messages, tools=[tool], tool_choice=ToolChoice(choice))  # type: ignore[arg-type]
        assert plan_constraints(chat, hermes.CALL_SYNTAX).parser_options.call_schemas == schemas


def test_the_server_budget_defaults_to_one_and_refuses_a_negative_one() -> None:
    assert ServerConfig().tool_repair_budget == 1
    with pytest.raises(InvalidRequestError, match="tool_repair_budget"):
        ServerConfig(tool_repair_budget=-1)


# ---- the core: a scripted engine plays back the output, then each repair's text


class _Ids(list[int]):
    @property
    def ids(self) -> list[int]:
        return list(self)


class _CharTokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> _Ids:
        return _Ids(ord(ch) for ch in text)


class ScriptedEngine:
    """Each generate plays back the next (text, finish reason), one token a character."""

    def __init__(self, texts: list[tuple[str, str]], context_length: int = 4096) -> None:
        self.description = SimpleNamespace(tokenizer=_CharTokenizer(), context_length=context_length)
        self.texts = list(texts)
        self.requests: list[tuple[list[int], SamplingParams, Any]] = []
        self.grammars: list[GrammarSpec] = []

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, qos: str = "interactive") -> None:
        pass

    async def compile_grammar(self, spec: GrammarSpec, param: str | None = None) -> None:
        self.grammars.append(spec)

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None, **_: Any
    ) -> AsyncIterator[RequestOutput]:
        self.requests.append((prompt_token_ids, params, _.get("guide")))
        text, finish = self.texts.pop(0)
        yield RequestOutput(
            request_id or "r",
            [0] * len(text),
            len(prompt_token_ids),
            num_output_tokens=len(text),
            text_delta=text,
            finished=True,
            finish_reason=finish,
        )


PROMPT = [1, 2, 3]


def _spec(budget: int, **options: Any) -> ChannelSpec:
    values = {**(REPAIR if budget else AUTO), **options}
    return ChannelSpec(hermes.FAMILY, ParserOptions(**values), repair_budget=budget)


def _choice(spec: ChannelSpec, max_tokens: int = 100) -> ChoiceState:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=["STOP"])
    tokenizer = cast(Any, _CharTokenizer())
    return ChoiceState(
        index=0,
        prompt_index=0,
        prompt_ids=PROMPT,
        params=params,
        echo=False,
        tokenizer=tokenizer,
        token_texts=cast(Any, None),
        channels=ChoiceChannels(spec, 0),
    )


def _run(engine: ScriptedEngine, spec: ChannelSpec) -> tuple[list[Event], ChoiceState]:
    """The output's events through the choice's channels, then the repairs."""
    text, finish = engine.texts.pop(0)
    choice = _choice(spec)
    out = RequestOutput("r", [0] * len(text), 3, num_output_tokens=len(text), text_delta=text, finished=True)
    out.finish_reason = finish
    repairs = ToolCallRepairs(cast(Any, engine), spec, stream_id="gen", qos="interactive", deadline=None)
    events = asyncio.run(repairs.process(choice, choice.on_output(out)))
    return events, choice


def _calls(events: list[Event]) -> list[tuple[int, str, str]]:
    starts = {e.call_index: e.name for e in events if isinstance(e, ToolCallStart)}
    args = {e.call_index: e.fragment for e in events if isinstance(e, ToolCallArgsDelta)}
    ends = [e.call_index for e in events if isinstance(e, ToolCallEnd)]
    assert sorted(starts) == ends == list(range(len(starts)))
    return [(index, starts[index], args[index]) for index in ends]


def test_a_repaired_call_is_the_call_written_again_under_its_schema() -> None:
    engine = ScriptedEngine([(f"Sure. {MARKED_BAD}", "stop"), (GOOD_ARGS, "stop")])
    events, choice = _run(engine, _spec(1))
    assert _calls(events) == [(0, "set_thermostat", GOOD_ARGS)]
    assert [e.text for e in events if isinstance(e, TextDelta)] == ["Sure."]
    (finish,) = [e for e in events if isinstance(e, Finish)]
    repair_tokens = len(GOOD_ARGS)
    assert finish.reason == "tool_calls" and choice.finish_reason == "tool_calls"
    assert finish.usage.completion_tokens == len(f"Sure. {MARKED_BAD}") + repair_tokens
    assert choice.usage.completion_tokens == finish.usage.completion_tokens
    prompt, params, guide = engine.requests[0]
    assert prompt == PROMPT + [ord(ch) for ch in "Sure. " + MARKED_OPENING]  # prompt, prefix, opening
    assert guide.grammar == GrammarSpec("json_schema", THERMOSTAT, strict=True)
    assert params.stop == [] and params.logprobs is None and params.max_tokens == 100
    assert engine.grammars == [guide.grammar]


def test_the_budget_is_per_request_and_later_calls_are_numbered_down() -> None:
    text = f"{MARKED_BAD}\n{MARKED_BAD}\n{MARKED_GOOD}"
    engine = ScriptedEngine([(text, "stop"), (GOOD_ARGS, "stop")])
    events, _ = _run(engine, _spec(1))
    assert _calls(events) == [(0, "set_thermostat", GOOD_ARGS), (1, "set_thermostat", GOOD_ARGS)]
    failures = [e for e in events if isinstance(e, ToolParseFailure)]
    assert failures == [ToolParseFailure(0, MARKED_BAD, "invalid_arguments")]  # the second: no budget
    assert [e.text for e in events if isinstance(e, TextDelta)] == [MARKED_BAD]
    assert len(engine.requests) == 1


@pytest.mark.parametrize(
    "repair", [(BAD_ARGS, "stop"), ('{"room": "living room", "degrees": 5', "length")], ids=["invalid", "cut"]
)
def test_a_repair_that_fails_leaves_the_text(repair: tuple[str, str]) -> None:
    engine = ScriptedEngine([(BAD, "stop"), repair])
    events, choice = _run(engine, _spec(1))
    assert not _calls(events)
    assert events == [
        TextDelta(0, BAD),
        ToolParseFailure(0, BAD, "invalid_arguments"),
        Finish(0, "stop", dataclasses.replace(choice.usage)),
    ]
    assert choice.usage.completion_tokens == len(BAD) + len(repair[0])  # the attempt is counted


def test_no_repair_past_the_context() -> None:
    engine = ScriptedEngine([(BAD, "stop")], context_length=len(PROMPT) + len(BARE_OPENING))
    events, _ = _run(engine, _spec(1))
    assert ToolParseFailure(0, BAD, "invalid_arguments") in events and not engine.requests


def _stream(engine: ScriptedEngine, spec: ChannelSpec, *, is_streamed: bool) -> tuple[list[Any], list[str]]:
    request = CoreRequest(prompts=[PROMPT], sampling=RequestSampling(), channels=spec)
    stream = CoreStream(cast(Any, engine), request, [_choice(spec)], "m", "gen")

    async def run() -> list[Any]:
        async with stream:
            if is_streamed:
                return [event async for event in stream]
            return await collect(stream)

    return asyncio.run(run()), stream.degraded


@pytest.mark.parametrize("is_streamed", [True, False], ids=["streamed", "collected"])
def test_the_stream_repairs_or_names_tool_call_invalid(is_streamed: bool) -> None:
    events, degraded = _stream(
        ScriptedEngine([(BAD, "stop"), (GOOD_ARGS, "stop")]), _spec(1), is_streamed=is_streamed
    )
    assert degraded == []
    if is_streamed:
        assert not any(isinstance(e, ToolCallInvalid) for e in events)
        assert _calls(events) == [(0, "set_thermostat", GOOD_ARGS)]
    else:
        (result,) = events
        assert result.finish_reason == "tool_calls"
        assert [(c.name, c.arguments) for c in result.channels.result().tool_calls] == [
            ("set_thermostat", GOOD_ARGS)
        ]
    for budget in (0, 1):  # no budget; a budget spent on a repair that fails
        engine = ScriptedEngine([(BAD, "stop"), (BAD_ARGS, "stop")])
        events, degraded = _stream(engine, _spec(budget), is_streamed=is_streamed)
        assert degraded == ["tool_call_invalid"]
        assert len(engine.requests) == 1 + budget  # the output, then the repair


def test_an_unparsed_call_still_names_tool_call_unparsed() -> None:
    text = '{"name": "nope", "arguments": {}}'
    _, degraded = _stream(ScriptedEngine([(text, "stop")]), _spec(1), is_streamed=True)
    assert degraded == ["tool_call_unparsed"]
