"""A chat request -> what the core runs: the OpenAI wire checked field by field, tool_choice /
response_format -> grammar and parser options, prepare_chat on SmolLM2's tokenizer (prompt,
compiled grammar, refusals naming the field), and the per-choice channel stage."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from argosy.api.errors import status_of
from argosy.api.openai.chat import ChatCompletionRequest
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
    ToolParseFailure,
    Usage,
)
from argosy.chat.families import get_family, hermes
from argosy.chat.markers import SpecialTextFilter
from argosy.chat.messages import (
    ChatInput,
    Message,
    OutputFormat,
    ToolCallRecord,
    ToolChoice,
    ToolDefinition,
)
from argosy.chat.profile import ChatProfile
from argosy.chat.template import ChatTemplate
from argosy.core.channels import ChannelSpec, ChoiceChannels
from argosy.core.chat_request import PreparedChat, prepare_chat
from argosy.core.constraints import guide_spec, plan_constraints
from argosy.core.service import ServiceOptions
from argosy.engine.grammar_service import GrammarService
from argosy.errors import InvalidRequestError
from argosy.runner.structured import (
    DelayedGuide,
    GrammarSpec,
    GuideSpec,
    OptionalReasoningGuide,
    TokenGuide,
    bitmask_words,
    build_guide,
    unpack_bitmask,
)
from argosy.sampling_params import RequestSampling

USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "description": "Time now"}},
]


def refusal(body: dict[str, Any]) -> InvalidRequestError:
    request = ChatCompletionRequest.model_validate({"messages": USER, **body})
    with pytest.raises(InvalidRequestError) as caught:
        request.check()
    assert status_of(caught.value) == 400
    return caught.value


# -- the OpenAI wire -> ChatInput ------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tool_choice": "required"}, "tool_choice", "no tools were given"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "no tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope', which is not among the declared tools (get_weather, get_time)",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "expected"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "expected"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "repeated: get_weather"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", ""),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "only 'function'"),
        ({"tools": [{"type": "function"}]}, "tools[0].function", "Missing"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
            "tools[0].function.parameters",
            "",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "'yaml'"),
        ({"response_format": "json"}, "response_format", "expected an object"),
    ],
)
def test_refusals_name_the_field(body: dict[str, Any], param: str, words: str) -> None:
    error = refusal(body)
    assert error.param == param
    assert words in error.message


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "assistant", "tool_calls": "x"}, "messages[1].tool_calls"),
        ({"role": "assistant", "tool_calls": [{"type": "function"}]}, "messages[1].tool_calls[0].function"),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]},
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": ""}}]},
            "messages[1].tool_calls[0].function.name",
        ),
        ({"role": "assistant", "content": "x", "reasoning_content": 5}, "messages[1].reasoning_content"),
        ({"role": "tool", "content": "21"}, "messages[1].tool_call_id"),
    ],
)
def test_malformed_history_names_the_field(message: dict[str, Any], param: str) -> None:
    request = ChatCompletionRequest.model_validate({"messages": [USER[0], message]})
    with pytest.raises(InvalidRequestError) as caught:
        request.check()
    assert caught.value.param == param


def test_wire_history_becomes_neutral_messages() -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "developer", "content": "Be brief."},
                *USER,
                {"role": "assistant", "content": None, "reasoning": "use the tool", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
            ],
            "tools": TOOLS,
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "w", "schema": {}, "strict": True},
            },
            "reasoning_effort": "low",
            "chat_template_kwargs": {"enable_thinking": False},
        }
    )
    chat = body.chat_input()
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assistant = chat.messages[2]
    assert assistant.reasoning == "use the tool"
    assert assistant.tool_calls[0].call_id == "call_1"
    assert assistant.tool_calls[0].arguments_value() == {"city": "Paris"}
    assert chat.messages[3].tool_call_id == "call_1"
    assert [t.name for t in chat.tools] == ["get_weather", "get_time"]
    assert chat.tools[1].parameters is None and chat.tools[1].description == "Time now"
    assert not chat.parallel_tool_calls
    assert chat.output_format == OutputFormat("json_schema", {}, "w", strict=True)
    assert chat.template_kwargs == {"enable_thinking": False, "reasoning_effort": "low"}


def test_only_never_honoured_fields_are_degraded_up_front() -> None:
    body = ChatCompletionRequest.model_validate(
        {"messages": USER, "tools": TOOLS, "response_format": {"type": "json_object"}, "prediction": {}}
    )
    assert body.degraded_fields() == ["prediction"]


# -- tool_choice / response_format -> grammar and parser options ------------------------------

WEATHER = ToolDefinition("get_weather", None, WEATHER_SCHEMA)
TIME = ToolDefinition("get_time")
HERMES = hermes.CALL_SYNTAX


def chat(**fields: Any) -> ChatInput:
    return ChatInput(messages=[Message("user", "hi")], **fields)


def test_auto_offers_the_tools_and_forces_nothing() -> None:
    plan = plan_constraints(chat(tools=[WEATHER, TIME]), HERMES)
    assert plan.grammar is None and plan.prompt_tools == [WEATHER, TIME]
    options = plan.parser_options
    assert options.has_tool_calls and not options.is_call_forced and options.can_call_in_parallel
    assert options.tool_names == frozenset({"get_weather", "get_time"})


def test_none_leaves_the_tools_out() -> None:
    plan = plan_constraints(chat(tools=[WEATHER], tool_choice=ToolChoice("none")), HERMES)
    assert plan.prompt_tools == [] and plan.grammar is None
    assert not plan.parser_options.has_tool_calls


@pytest.mark.parametrize("parallel", [True, False])
def test_required_forces_a_call_of_any_tool(parallel: bool) -> None:
    plan = plan_constraints(
        chat(tools=[WEATHER, TIME], tool_choice=ToolChoice("required"), parallel_tool_calls=parallel), HERMES
    )
    assert plan.grammar is not None and plan.grammar.kind == "tool_call"
    grammar = plan.grammar.payload
    assert [t.name for t in grammar.tools] == ["get_weather", "get_time"]
    assert grammar.tools[0].parameters == WEATHER_SCHEMA
    assert (
        grammar.parallel is parallel and grammar.begin == "<tool_call>\n" and grammar.end == "\n</tool_call>"
    )
    assert plan.parser_options.is_call_forced and plan.parser_options.can_call_in_parallel is parallel
    assert plan.grammar_param == "tools"


def test_named_forces_exactly_one_call_of_that_tool() -> None:
    plan = plan_constraints(chat(tools=[WEATHER, TIME], tool_choice=ToolChoice("named", "get_time")), HERMES)
    assert plan.grammar is not None
    assert [t.name for t in plan.grammar.payload.tools] == ["get_time"]
    assert plan.grammar.payload.parallel is False
    assert not plan.parser_options.can_call_in_parallel


def test_llama_calls_are_forced_as_bare_json_with_parameters() -> None:
    syntax = get_family("llama3_json").call_syntax
    plan = plan_constraints(chat(tools=[WEATHER], tool_choice=ToolChoice("required")), syntax)
    assert plan.grammar is not None
    grammar = plan.grammar.payload
    assert (grammar.begin, grammar.end, grammar.arguments_key) == ("", "", "parameters")


def test_response_formats() -> None:
    json_object = plan_constraints(chat(output_format=OutputFormat("json_object")), HERMES)
    assert json_object.grammar is not None and json_object.grammar.kind == "json_object"
    assert json_object.grammar_param == "response_format"
    for strict in (True, False):
        plan = plan_constraints(
            chat(output_format=OutputFormat("json_schema", WEATHER_SCHEMA, strict=strict)), HERMES
        )
        assert plan.grammar is not None and plan.grammar.kind == "json_schema"
        assert plan.grammar.payload == WEATHER_SCHEMA and plan.grammar.strict is strict
    assert plan_constraints(chat(output_format=OutputFormat("text")), HERMES).grammar is None


def test_what_cannot_be_honoured_together_is_named() -> None:
    json_answer = OutputFormat("json_object")
    forced = plan_constraints(
        chat(tools=[WEATHER], tool_choice=ToolChoice("required"), output_format=json_answer), HERMES
    )
    assert forced.grammar is not None and forced.grammar.kind == "tool_call"
    assert forced.degraded == ["response_format"]
    offered = plan_constraints(chat(tools=[WEATHER], output_format=json_answer), HERMES)
    assert offered.grammar is not None and offered.grammar.kind == "json_object"
    assert offered.degraded == ["tools"]


# -- prepare_chat on SmolLM2's tokenizer -----------------------------------------------------


@dataclass
class ChatCore:
    """What prepare_chat asks of the core: the model's chat profile, grammars compiled where
    its engine runs (here: a GrammarService of our own), and its options (the repair budget)."""

    profile: ChatProfile
    grammar: GrammarService
    options: ServiceOptions = field(default_factory=ServiceOptions)

    def chat_profile(self) -> ChatProfile:
        return self.profile

    async def compile_grammar(self, spec: GrammarSpec, param: str | None) -> None:
        await self.grammar.compile(spec, param)

    def guide(self, spec: GuideSpec) -> TokenGuide:
        """The guide the engine would build for `spec`."""
        if spec.grammar is None:
            return build_guide(spec, None)
        compiled = asyncio.run(self.grammar.compile(spec.grammar))
        return build_guide(spec, self.grammar.guide(compiled))


@pytest.fixture(scope="module")
def smollm2_core() -> ChatCore:
    from argosy.models.loader import resolve_model

    source = resolve_model("smollm2")
    assert source.chat_template is not None
    template = ChatTemplate(source.chat_template, bos_token=source.bos_token, eos_token=source.eos_token)
    return ChatCore(
        ChatProfile(template, source.tokenizer),
        GrammarService(source.tokenizer, source.vocab_size, source.eos_token_ids),
    )


def prepare(core: ChatCore, chat_input: ChatInput) -> PreparedChat:
    return asyncio.run(prepare_chat(core, chat_input))  # type: ignore[arg-type]


def test_prepare_a_forced_call(smollm2_core: ChatCore) -> None:
    prepared = prepare(smollm2_core, chat(tools=[WEATHER], tool_choice=ToolChoice("named", "get_weather")))
    assert "<tools>" in prepared.prompt_text and prepared.prompt_text.endswith("<|im_start|>assistant\n")
    assert prepared.prompt_ids == smollm2_core.profile.tokenize(prepared.prompt_text)
    assert prepared.channels.family is hermes.FAMILY and prepared.channels.options.is_call_forced
    assert prepared.guide is not None
    guide = smollm2_core.guide(prepared.guide)
    vocab_size = smollm2_core.profile._tokenizer.get_vocab_size()
    mask = torch.zeros(1, bitmask_words(vocab_size), dtype=torch.int32)
    guide.fill_bitmask(mask, 0)
    allowed = unpack_bitmask(mask, vocab_size)[0].nonzero().flatten().tolist()
    tokenizer = smollm2_core.profile._tokenizer
    assert all("<tool_call>".startswith(tokenizer.decode([t])) for t in allowed)
    request = prepared.core_request(RequestSampling(max_tokens=5), n=2, route="test")
    assert request.prompts == [prepared.prompt_ids] and request.n == 2 and request.prompt_param == "messages"
    assert request.channels is prepared.channels and request.guide is prepared.guide
    assert request.sampling.skip_special_tokens is None  # SmolLM2's markers are plain text


@pytest.mark.parametrize(
    ("server_budget", "request_budget", "budget"), [(1, None, 1), (0, None, 0), (1, 0, 0), (0, 2, 2)]
)
def test_the_request_repair_budget_wins_over_the_server_one(
    smollm2_core: ChatCore, server_budget: int, request_budget: int | None, budget: int
) -> None:
    core = ChatCore(
        smollm2_core.profile, smollm2_core.grammar, ServiceOptions(tool_repair_budget=server_budget)
    )
    prepared = prepare(core, chat(tools=[WEATHER], tool_repair_budget=request_budget))
    assert prepared.channels.repair_budget == budget
    assert prepared.channels.options.can_repair_calls is (budget > 0)
    assert prepared.channels.options.call_schemas == {"get_weather": WEATHER.parameters}
    forced = prepare(core, chat(tools=[WEATHER], tool_choice=ToolChoice("required"), tool_repair_budget=1))
    assert not forced.channels.options.can_repair_calls  # a forced call is the grammar's


def test_prepare_plain_chat_has_channels_and_no_grammar(smollm2_core: ChatCore) -> None:
    prepared = prepare(smollm2_core, chat())
    assert prepared.guide is None and "<tools>" not in prepared.prompt_text
    assert not prepared.channels.options.has_tool_calls


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        (
            {"output_format": OutputFormat("json_schema", {"type": "foo"})},
            "response_format",
            "Unsupported type",
        ),
        (
            {"tools": [ToolDefinition("f", None, {"type": "foo"})], "tool_choice": ToolChoice("required")},
            "tools",
            "Invalid tool parameters schema",
        ),
    ],
)
def test_uncompilable_schemas_are_400_naming_why(
    smollm2_core: ChatCore, fields: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        prepare(smollm2_core, chat(**fields))
    assert caught.value.param == param and words in caught.value.message


def test_compiled_grammars_are_cached(smollm2_core: ChatCore) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    spec = plan_constraints(chat(output_format=OutputFormat("json_schema", schema)), HERMES).grammar
    assert spec is not None
    first = asyncio.run(smollm2_core.grammar.compile(spec))
    again = asyncio.run(smollm2_core.grammar.compile(spec))
    assert again is first


# -- the channel stage -----------------------------------------------------------------------


def entry(text: str) -> TokenLogprobs:
    return TokenLogprobs(TokenCandidate(1, text, text.encode(), -0.5), text)


def run_channels(texts: list[str], reason: str, options: Any = None) -> list[Any]:
    from argosy.chat.parser_options import ParserOptions

    channels = ChoiceChannels(ChannelSpec(hermes.FAMILY, options or ParserOptions()), 0)
    events: list[Any] = []
    for text in texts:
        events += channels.process([TextDelta(0, text, [entry(text)])])
    events += channels.process([Finish(0, reason, Usage())])
    return events


def test_calls_finish_with_tool_calls_and_logprobs_travel_apart() -> None:
    texts = ["Sure.", "<tool_call>\n", '{"name": "f", "arguments": {"a": 1}}', "\n</tool_call>"]
    events = run_channels(texts, "stop")
    assert [e for e in events if isinstance(e, LogprobsDelta)] == [
        LogprobsDelta(0, [entry(text)]) for text in texts
    ]
    kinds = [type(e) for e in events if not isinstance(e, LogprobsDelta)]
    assert kinds == [TextDelta, ToolCallStart, ToolCallArgsDelta, ToolCallEnd, Finish]
    assert events[-1].reason == "tool_calls"
    args = "".join(e.fragment for e in events if isinstance(e, ToolCallArgsDelta))
    assert json.loads(args) == {"a": 1}


def test_a_call_cut_off_finishes_with_length() -> None:
    events = run_channels(['<tool_call>\n{"name": "f", "arguments": {"a": '], "stop")
    failure = next(e for e in events if isinstance(e, ToolParseFailure))
    assert failure.is_unterminated and failure.call_index == 0
    assert events[-1].reason == "length"


def test_text_only_keeps_the_engines_reason() -> None:
    assert run_channels(["Hello"], "stop")[-1].reason == "stop"
    assert run_channels(["Hello"], "length")[-1].reason == "length"


def test_special_token_text_is_removed_before_parsing() -> None:
    from argosy.chat.parser_options import ParserOptions

    family = get_family("llama3_json")
    channels = ChoiceChannels(ChannelSpec(family, ParserOptions(), ("<|eot_id|>",)), 0)
    events = channels.process([TextDelta(0, '<|python_tag|>{"name": "f", "parameters": {}}<|eo')])
    events += channels.process([TextDelta(0, "t_id|>"), Finish(0, "stop", Usage())])
    assert [e.name for e in events if isinstance(e, ToolCallStart)] == ["f"]
    assert not [e for e in events if isinstance(e, TextDelta)]
    assert events[-1].reason == "tool_calls"


def test_special_text_filter_holds_only_a_possible_start() -> None:
    text_filter = SpecialTextFilter(["<|eot_id|>", "<|end|>"])
    assert text_filter.feed("a<|eot_id|>b<|") == "ab"
    assert text_filter.feed("end|>c<") == "c"
    assert text_filter.feed("x") == "<x"
    assert text_filter.feed("<|e") == ""
    assert text_filter.flush() == "<|e"
    assert SpecialTextFilter([]).feed("<|eot_id|>") == "<|eot_id|>"


# -- a final assistant message continued ------------------------------------------------------

PREFILL = [Message("user", "Name three colors."), Message("assistant", "The first color is")]


def test_prepare_continues_a_final_assistant_message(smollm2_core: ChatCore) -> None:
    continued = prepare(
        smollm2_core, ChatInput(PREFILL, add_generation_prompt=False, continue_final_message=True)
    )
    assert continued.prompt_text.endswith(
        "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\nThe first color is"
    )
    assert continued.prompt_ids == smollm2_core.profile.tokenize(continued.prompt_text)
    assert not continued.channels.options.is_reasoning_open
    answered = prepare(smollm2_core, ChatInput(PREFILL))  # a new turn after it, as before
    assert answered.prompt_text == continued.prompt_text + "<|im_end|>\n<|im_start|>assistant\n"
    closed = prepare(smollm2_core, ChatInput(PREFILL, add_generation_prompt=False))
    assert closed.prompt_text == continued.prompt_text + "<|im_end|>\n"


def test_our_tool_prompt_still_comes_with_a_continued_message(smollm2_core: ChatCore) -> None:
    chat_input = ChatInput(
        [Message("user", "Weather in Paris?"), Message("assistant", "Let me check")],
        tools=[WEATHER],
        add_generation_prompt=False,
        continue_final_message=True,
    )
    prepared = prepare(smollm2_core, chat_input)
    assert "<tools>" in prepared.prompt_text and '"name": "get_weather"' in prepared.prompt_text
    assert prepared.prompt_text.endswith("<|im_start|>assistant\nLet me check")
    assert prepared.channels.options.has_tool_calls


@pytest.mark.parametrize(
    ("chat_input", "param", "words"),
    [
        (ChatInput(PREFILL, continue_final_message=True), "continue_final_message", "cannot both be true"),
        (
            ChatInput(PREFILL[:1], add_generation_prompt=False, continue_final_message=True),
            "continue_final_message",
            "ends with a 'user' message",
        ),
        (
            ChatInput(
                [PREFILL[0], Message("assistant", None, tool_calls=[ToolCallRecord("f", "{}", "call_1")])],
                add_generation_prompt=False,
                continue_final_message=True,
            ),
            "messages",
            "made tool calls",
        ),
    ],
)
def test_what_cannot_be_continued_is_a_400(
    smollm2_core: ChatCore, chat_input: ChatInput, param: str, words: str
) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        prepare(smollm2_core, chat_input)
    assert caught.value.param == param and words in caught.value.message


def test_openai_chat_takes_vllms_continuation_fields() -> None:
    prefill = [USER[0], {"role": "assistant", "content": "It is"}]
    request = ChatCompletionRequest.model_validate(
        {"messages": prefill, "continue_final_message": True, "add_generation_prompt": False}
    )
    request.check()
    chat_input = request.chat_input()
    assert chat_input.continue_final_message and not chat_input.add_generation_prompt
    plain = ChatCompletionRequest.model_validate({"messages": prefill})
    assert plain.chat_input().add_generation_prompt and not plain.chat_input().continue_final_message
    for body, words in [
        ({"messages": prefill, "continue_final_message": True}, "cannot both be true"),
        (
            {"continue_final_message": True, "add_generation_prompt": False},
            "ends with a 'user' message",
        ),
    ]:
        error = refusal(body)
        assert error.param == "continue_final_message" and words in error.message
    error = refusal({"chat_template_kwargs": {"continue_final_message": True}})
    assert error.param == "chat_template_kwargs"


# -- grammars after reasoning ----------------------------------------------------------------


class FirstTokenGuide:
    """Allows only token 3 at first, then anything; records what it was given."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row].fill_(0)
        if not self.accepted:
            bitmask[row, 0] = 1 << 3
        else:
            bitmask[row].fill_(-1)

    def accept_token(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return True

    def is_terminated(self) -> bool:
        return False


def allowed(guide: Any, vocab_size: int = 64) -> list[int]:
    mask = torch.zeros(1, bitmask_words(vocab_size), dtype=torch.int32)
    guide.fill_bitmask(mask, 0)
    return unpack_bitmask(mask, vocab_size)[0].nonzero().flatten().tolist()


def test_optional_reasoning_guide_with_and_without_reasoning() -> None:
    inner = FirstTokenGuide()
    guide = OptionalReasoningGuide(inner, start_token_id=40, end_token_ids=[41])
    assert allowed(guide) == [3, 40]  # the grammar's first token or the reasoning marker
    guide.accept_token(40)
    assert len(allowed(guide)) == 64 and not guide.is_terminated()
    for token_id in (7, 8, 41):
        guide.accept_token(token_id)
    assert inner.accepted == [] and allowed(guide) == [3]  # the grammar starts after </think>
    direct = FirstTokenGuide()
    guide = OptionalReasoningGuide(direct, start_token_id=63, end_token_ids=[41])
    assert allowed(guide) == [3, 63]  # bit 31 of a word (the sign bit) works too
    guide.accept_token(3)
    assert direct.accepted == [3]


def test_guide_spec_picks_the_guide() -> None:
    def make(**kwargs: Any) -> Any:
        options = {"start_ids": [40], "end_ids": [41], "is_reasoning_open": False, "may_reason": True}
        spec = guide_spec(GrammarSpec("json_object"), **{**options, **kwargs})
        return build_guide(spec, FirstTokenGuide())

    assert isinstance(make(is_reasoning_open=True), DelayedGuide)
    assert isinstance(make(), OptionalReasoningGuide)
    assert isinstance(make(may_reason=False), FirstTokenGuide)
    assert isinstance(make(start_ids=[40, 42]), FirstTokenGuide)  # a marker of several tokens
    assert isinstance(make(start_ids=[], end_ids=[]), FirstTokenGuide)


def test_a_thinking_models_json_answer_follows_its_reasoning() -> None:
    from argosy.chat.parser_options import ParserOptions

    channels = ChoiceChannels(ChannelSpec(get_family("qwen3"), ParserOptions(has_tool_calls=False)), 0)
    events = channels.process(
        [TextDelta(0, "<think>\nThe user wants JSON.\n</think>\n\n"), TextDelta(0, '{"a": 1}')]
    )
    events += channels.process([Finish(0, "stop", Usage())])
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert reasoning == "The user wants JSON." and json.loads(content) == {"a": 1}
    assert events[-1].reason == "stop"


def test_strict_is_honoured(smollm2_core: ChatCore) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tokenizer = smollm2_core.profile._tokenizer

    def accepts(strict: bool, text: str) -> bool:
        spec = plan_constraints(
            chat(output_format=OutputFormat("json_schema", schema, strict=strict)), HERMES
        )
        assert spec.grammar is not None
        guide = smollm2_core.grammar.guide(asyncio.run(smollm2_core.grammar.compile(spec.grammar)))
        return all(guide.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False).ids)

    assert accepts(True, '{"a": 1}') and accepts(False, '{"a": 1}')
    assert not accepts(True, '{"a": 1, "b": 2}')  # strict: only what the schema names
    assert accepts(False, '{"a": 1, "b": 2}')  # not strict: JSON Schema's defaults
