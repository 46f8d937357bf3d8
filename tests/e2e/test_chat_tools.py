"""Tools, tool_choice and structured outputs on the default model (SmolLM2, whose template
knows no tools: it gets our Hermes tool prompt), through the official openai client.

Seeded requests run concurrently (the engine batches them; a seeded request's tokens do not
depend on what else is in the batch), so 20 seeds cost about one request's time.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.unit.test_structured import check_schema

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "smollm2-test"
CHAT = "/v1/chat/completions"
SEEDS = range(20)
WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"timezone": {"type": "string"}},
    "required": ["timezone"],
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER_SCHEMA},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME_SCHEMA},
    },
]
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
# The same tools with every string bounded and no other properties: one call is then at most
# ~250 tokens (a token holds at least one byte; a string character takes at most 6, `\uXXXX`;
# a whitespace run at most 8), whatever is sampled.
BOUNDED_SCHEMAS: dict[str, dict[str, Any]] = {
    "get_weather": {
        **WEATHER_SCHEMA,
        "properties": {**WEATHER_SCHEMA["properties"], "city": {"type": "string", "maxLength": 12}},
    },
    "get_time": {
        **TIME_SCHEMA,
        "properties": {"timezone": {"type": "string", "maxLength": 12}},
        "additionalProperties": False,
    },
}
BOUNDED_TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {**tool["function"], "parameters": BOUNDED_SCHEMAS[tool["function"]["name"]]},
    }
    for tool in TOOLS
]
EOS = 2  # SmolLM2's <|im_end|>, its only stop token
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# Requests without tools bring their own system message: SmolLM2's default one would share
# its first KV block with other files' greedy checks, and in bf16 a prompt whose prefix comes
# from the cache can tip a near-tie (test_openai_server's "capital of France" answer does).
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
NAMED = {"type": "function", "function": {"name": "get_weather"}}

T = TypeVar("T")


def for_seeds(make: Callable[[int], T], seeds: range = SEEDS) -> list[T]:
    with ThreadPoolExecutor(len(seeds)) as pool:
        return list(pool.map(make, seeds))


def check_call(name: str, arguments: str, schemas: dict[str, dict[str, Any]] = SCHEMAS) -> None:
    assert name in schemas, name
    check_schema(json.loads(arguments), schemas[name])


def finished_or_cut(response: Any, finished: str, max_tokens: int) -> bool:
    """True when the choice finished as `finished`; else it must have been cut at max_tokens.

    At temperature > 0 which of the two happens depends on the sampled tokens, and those on
    the CPU (its bf16 rounding), so a test must accept both and check what each implies."""
    reason = response.choices[0].finish_reason
    if reason == finished:
        return True
    assert reason == "length" and response.usage.completion_tokens == max_tokens, response
    return False


def test_required_always_makes_a_valid_call(client: openai.OpenAI) -> None:
    def ask(seed: int) -> Any:
        return client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0.7,
            seed=seed,
            max_tokens=80,
        )

    for response in for_seeds(ask):
        choice = response.choices[0]
        assert choice.message.content is None
        (call,) = choice.message.tool_calls or []  # a cut one too: the grammar starts with it
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in SCHEMAS
        if finished_or_cut(response, "tool_calls", 80):
            check_call(call.function.name, call.function.arguments)


def test_a_named_tool_is_always_called_validly(client: openai.OpenAI) -> None:
    def ask(seed: int) -> Any:
        return client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice=NAMED,
            temperature=0.7,
            seed=seed,
            max_tokens=80,
        )

    for response in for_seeds(ask):
        (call,) = response.choices[0].message.tool_calls or []
        assert call.function.name == "get_weather"
        if finished_or_cut(response, "tool_calls", 80):
            check_call(call.function.name, call.function.arguments)


def test_parallel_calls_get_consecutive_indexes_and_length_when_cut(client: openai.OpenAI) -> None:
    # EOS banned: after each call the grammar allows only the next one, so every sample runs
    # to max_tokens; 400 tokens hold a whole bounded call plus the start of a second one, so
    # each response has two calls or more whatever is sampled (not only when the model
    # happens to choose a second call). Where the cut lands is sampled: inside a call's
    # arguments (that call keeps what was written) or inside the head of the next one, before
    # its name (that text becomes content: a call the output ended inside is a failure).
    request: dict[str, Any] = dict(
        model=MODEL,
        messages=ASK,
        tools=BOUNDED_TOOLS,
        tool_choice="required",
        temperature=0.7,
        max_tokens=400,
        logit_bias={str(EOS): -100},
    )

    # three 400-token requests at once, twice: on a CPU without bf16 compute (float32 weights,
    # one thread) under a busy CI that is minutes, past the suite client's 120 s
    patient = client.with_options(timeout=600)

    def ask(seed: int) -> tuple[Any, tuple[list[dict[str, Any]], str | None]]:
        whole = patient.chat.completions.create(seed=seed, **request)
        streamed = streamed_calls(patient, is_content_allowed=True, seed=seed, **request)
        return whole, streamed  # streamed_calls asserts the indexes are 0, 1, ...

    for response, (streamed, finish) in for_seeds(ask, range(3)):
        calls = response.choices[0].message.tool_calls or []
        assert not finished_or_cut(response, "tool_calls", 400)
        assert len(calls) >= 2 and len(streamed) >= 2 and finish == "length"
        assert len({call.id for call in calls}) == len(calls)
        for call in calls[:-1]:  # the last one may be cut inside its arguments
            check_call(call.function.name, call.function.arguments, BOUNDED_SCHEMAS)
        assert calls[-1].function.name in BOUNDED_SCHEMAS


def streamed_calls(
    client: openai.OpenAI, is_content_allowed: bool = False, **request: Any
) -> tuple[list[dict[str, Any]], str | None]:
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **request):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        assert is_content_allowed or not delta.content
        for fragment in delta.tool_calls or []:
            if fragment.index not in calls:  # the first fragment: id, type and name, once
                assert fragment.id and fragment.type == "function" and fragment.function.name
                calls[fragment.index] = {"id": fragment.id, "name": fragment.function.name, "arguments": ""}
            else:
                assert fragment.id is None and fragment.function.name is None
            calls[fragment.index]["arguments"] += fragment.function.arguments or ""
    assert sorted(calls) == list(range(len(calls)))
    return [calls[i] for i in sorted(calls)], finish


def test_streamed_arguments_join_to_the_non_streamed_ones(client: openai.OpenAI) -> None:
    def both(seed: int) -> tuple[Any, tuple[list[dict[str, Any]], str | None]]:
        request = dict(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            temperature=0.7,
            seed=seed,
            max_tokens=80,
            extra_body={"batch_invariant": True},  # the same tokens whatever else runs
        )
        whole = client.chat.completions.create(**request)  # type: ignore[call-overload]
        return whole, streamed_calls(client, **request)

    for whole, (calls, finish) in for_seeds(both, range(4)):
        choice = whole.choices[0]
        assert finish == choice.finish_reason
        expected = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        assert [(c["name"], c["arguments"]) for c in calls] == expected
        if finish == "tool_calls":  # else cut at max_tokens, maybe inside the arguments
            json.loads(calls[0]["arguments"])


def test_tool_call_logprobs_cover_every_token(client: openai.OpenAI) -> None:
    request: dict[str, Any] = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice=NAMED,
        seed=3,
        temperature=0.7,
        max_tokens=80,
        extra_body={"batch_invariant": True},
    )
    whole = client.chat.completions.create(logprobs=True, top_logprobs=2, **request)
    entries = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert entries is not None and len(entries) == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert all(len(e.top_logprobs) == 2 for e in entries)
    text = bytes(b for e in entries for b in e.bytes or []).decode()
    assert (
        text.startswith("<tool_call>") and whole.choices[0].message.tool_calls[0].function.arguments in text
    )
    streamed = [
        e
        for chunk in client.chat.completions.create(stream=True, logprobs=True, top_logprobs=2, **request)
        if chunk.choices and chunk.choices[0].logprobs
        for e in chunk.choices[0].logprobs.content or []
    ]
    assert [e.token for e in streamed] == [e.token for e in entries]


class City(BaseModel):
    # Bounded, so that a sample rarely runs past max_tokens inside a string (a 135M model at
    # temperature 0.7 sometimes rambles). The bound does not fit in max_tokens in the worst
    # case (strings of `\uXXXX` escapes, whitespace runs), so a cut answer is accepted: `parse`
    # then rightly raises LengthFinishReasonError.
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population: int = Field(ge=0, le=100_000_000)


def test_parse_with_a_pydantic_model_succeeds_unless_cut(client: openai.OpenAI) -> None:
    messages = [
        SYSTEM,
        {
            "role": "user",
            "content": "Give me the capital of France as JSON with name, country and population.",
        },
    ]

    def ask(seed: int) -> Any:
        try:
            return client.chat.completions.parse(
                model=MODEL,
                messages=messages,
                response_format=City,
                temperature=0.7,
                seed=seed,
                max_tokens=100,
            )
        except openai.LengthFinishReasonError as cut:
            return cut.completion

    for response in for_seeds(ask):
        if finished_or_cut(response, "stop", 100):
            message = response.choices[0].message
            assert isinstance(message.parsed, City)
            assert message.parsed == City.model_validate_json(message.content or "")


def test_json_object_parses_unless_cut(client: openai.OpenAI) -> None:
    messages = [
        SYSTEM,
        {"role": "user", "content": "Describe Paris as a JSON object with two keys: name and country."},
    ]

    def ask(seed: int) -> Any:
        return client.chat.completions.create(
            model=MODEL,
            messages=messages,
            response_format={"type": "json_object"},
            temperature=0.7,
            seed=seed,
            max_tokens=100,
        )

    for response in for_seeds(ask):
        if finished_or_cut(response, "stop", 100):  # a JSON object has no length bound
            assert isinstance(json.loads(response.choices[0].message.content or ""), dict)


def test_tool_choice_none_leaves_the_tools_out_of_the_prompt(client: openai.OpenAI) -> None:
    def prompt_tokens(**fields: Any) -> int:
        response = client.chat.completions.create(
            model=MODEL, messages=[SYSTEM, *ASK], max_tokens=1, **fields
        )
        assert response.usage is not None
        return response.usage.prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(tools=TOOLS, tool_choice="none") == plain
    assert prompt_tokens(tools=TOOLS) > plain + 100  # our tool prompt lists both schemas


def test_a_tool_loop_history_renders_and_answers(client: openai.OpenAI) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages: list[Any] = [
        SYSTEM,
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "unit": "celsius"}'},
    ]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=12
    )
    choice = response.choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason in ("stop", "length")


BAD_REQUESTS: list[tuple[dict[str, Any], str, str]] = [
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"tool_choice": NAMED}, "tool_choice", "no tools"),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice",
        "'nope'",
    ),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "expected"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
        "response_format",
        'Unsupported type "foo"',
    ),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}],
            "tool_choice": "required",
        },
        "tools",
        "Invalid tool parameters schema",
    ),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name", ""),
    (
        {"messages": [*ASK, {"role": "tool", "content": "21"}]},
        "messages[1].tool_call_id",
        "Missing required parameter",
    ),
    (
        {
            "messages": [
                {"role": "system", "content": "hi"},
                {"role": "user", "content": "hi"},
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image_url",
                            "image_url": {
                                "url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGPk5ORkYGBgYmBgYGBgAAABbgAfXn6dLgAAAABJRU5ErkJggg=="
                            },
                        }
                    ],
                },
            ]
        },
        "messages[2].content[0]",
        "does not accept images",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}],
                }
            ]
        },
        "messages[0].content[0]",
        "does not accept audio",
    ),
]


@pytest.mark.parametrize(("fields", "param", "words"), BAD_REQUESTS)
def test_refusals(http: httpx.Client, fields: dict[str, Any], param: str, words: str) -> None:
    response = http.post(CHAT, json={"model": MODEL, "messages": ASK, "max_tokens": 4, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"]


def test_a_forced_call_overrides_response_format_and_says_so(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": NAMED,
        "response_format": {"type": "json_object"},
        "seed": 1,
        "max_tokens": 80,
    }
    response = http.post(CHAT, json=body)
    assert response.status_code == 200
    assert response.headers["x-argosy-degraded"] == "response_format"
    assert response.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
