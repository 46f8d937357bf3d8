"""The Anthropic Messages dialect on the real server (SmolLM2 as `smollm2-test`), through the
official `anthropic` SDK: create, stream (a ping after message_start), a forced tool call
streamed, structured output, count_tokens, stop sequences, errors, the same greedy answer as
OpenAI chat gives, and a prefill continued (as OpenAI chat's continue_final_message does).

Seeded requests (`seed`, an Argosy extension sent in `extra_body`) run concurrently; every
max_tokens is small so the file stays well under a minute.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.e2e.server import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "smollm2-test"
SEEDS = range(20)  # the issue asks each seeded check over 20 seeds
# A system prompt of this file's own: its KV blocks are not shared with other files' checks.
SYSTEM = "You are a concise assistant for the Anthropic dialect tests."
ASK = [{"role": "user", "content": "Name three colors."}]
WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER_TOOL: dict[str, Any] = {
    "name": "weather",
    "description": "Weather in a city",
    "input_schema": WEATHER_SCHEMA,
}
ANSWER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}},
    "required": ["answer"],
    "additionalProperties": False,
}

# SDK 2.x has no sampling arguments any more (Anthropic's newest models take none); the server
# still honours temperature / top_p / top_k, sent as extra body fields
GREEDY = {"temperature": 0}

T = TypeVar("T")


def for_seeds(make: Callable[[int], T]) -> list[T]:
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(make, SEEDS))


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120) as sdk:
        yield sdk


def whole_prompt(usage: Any) -> int:
    """Anthropic counts cache reads apart from input_tokens; the prompt is their sum."""
    return int(
        usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
    )


def test_create_answers_with_a_text_block_and_usage(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(
        model=MODEL, system=SYSTEM, messages=ASK, max_tokens=8, extra_body=GREEDY, metadata={"user_id": "u1"}
    )
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_")
    (block,) = message.content
    assert block.type == "text" and block.text
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    if message.stop_reason == "max_tokens":
        assert message.usage.output_tokens == 8
    assert 0 < message.usage.output_tokens <= 8
    assert message.usage.cache_creation_input_tokens == 0
    count = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK)  # type: ignore[arg-type]
    assert count.input_tokens == whole_prompt(message.usage) > 10


def test_stream_text_and_its_final_message(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(
        model=MODEL, system=SYSTEM, messages=ASK, max_tokens=16, extra_body=GREEDY
    ) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == final.content[0].text != ""  # type: ignore[union-attr]
    assert len(final.content) == 1 and final.stop_reason in ("end_turn", "max_tokens")
    assert 0 < final.usage.output_tokens <= 16 and whole_prompt(final.usage) > 10


def test_stream_events_in_the_order_the_sdk_parses(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "system": SYSTEM,
        "messages": ASK,
        "max_tokens": 4,
        "stream": True,
        "temperature": 0,
    }
    with http.stream(
        "POST", "/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"}
    ) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    events = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    payloads = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert [p["type"] for p in payloads] == events
    assert events[:2] == ["message_start", "ping"] and events[-2:] == ["message_delta", "message_stop"]
    assert payloads[1] == {"type": "ping"}
    assert events[2:-2] == ["content_block_start"] + ["content_block_delta"] * (len(events) - 6) + [
        "content_block_stop"
    ]
    assert "data: [DONE]" not in lines  # Anthropic's stream ends with message_stop
    assert (
        payloads[-2]["usage"]["output_tokens"] == 4 and payloads[-2]["delta"]["stop_reason"] == "max_tokens"
    )


def test_a_tool_result_round_trip(claude: anthropic.Anthropic) -> None:
    """The model's tool_use handed back with its tool_result: the answer is text, and the
    result is in the prompt (counted, and longer than the same history without it)."""
    call = claude.messages.create(
        model=MODEL,
        max_tokens=48,
        system=SYSTEM,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "weather"},
        extra_body=GREEDY,
    )
    (tool_use,) = [block for block in call.content if block.type == "tool_use"]
    history: list[Any] = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": [block.model_dump() for block in call.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": tool_use.id, "content": "18 degrees and sunny"}
            ],
        },
    ]
    answer = claude.messages.create(
        model=MODEL,
        max_tokens=24,
        system=SYSTEM,
        messages=history,
        tools=[WEATHER_TOOL],
        extra_body=GREEDY,  # type: ignore[list-item]
    )
    assert answer.content and answer.content[0].type == "text" and answer.content[0].text
    counted = claude.messages.count_tokens(model=MODEL, system=SYSTEM, messages=history, tools=[WEATHER_TOOL])  # type: ignore[list-item]
    assert counted.input_tokens == answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0)
    without = claude.messages.count_tokens(
        model=MODEL,
        system=SYSTEM,
        messages=history[:2] + [{"role": "user", "content": "Thanks."}],
        tools=[WEATHER_TOOL],
    )  # type: ignore[list-item]
    assert counted.input_tokens > without.input_tokens


def test_a_forced_tool_call_streams_json_valid_for_its_schema(claude: anthropic.Anthropic) -> None:
    def ask(seed: int) -> tuple[Any, str]:
        with claude.messages.stream(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[WEATHER_TOOL],
            tool_choice={"type": "tool", "name": "weather"},
            max_tokens=32,
            extra_body={"seed": seed, "temperature": 0.7},
        ) as stream:
            pieces = [event.partial_json for event in stream if event.type == "input_json"]
            return stream.get_final_message(), "".join(pieces)

    finished = 0
    for final, joined in for_seeds(ask):
        blocks = [block for block in final.content if block.type == "tool_use"]
        assert len(blocks) == 1 and blocks[0].name == "weather" and blocks[0].id.startswith("toolu_")
        if final.stop_reason == "max_tokens":  # cut inside the call at this temperature: nothing to check
            continue
        assert final.stop_reason == "tool_use"
        jsonschema.validate(json.loads(joined), WEATHER_SCHEMA)
        assert blocks[0].input == json.loads(joined)
        finished += 1
    assert finished


def test_output_config_json_schema_holds_the_answer(claude: anthropic.Anthropic) -> None:
    def ask(seed: int) -> Any:
        return claude.messages.create(
            model=MODEL,
            system=SYSTEM,
            messages=[{"role": "user", "content": "How many legs has a cat? Answer in JSON."}],
            max_tokens=32,
            output_config={"format": {"type": "json_schema", "schema": ANSWER_SCHEMA}},
            extra_body={"seed": seed, "temperature": 0.7},
        )

    finished = 0
    for message in for_seeds(ask):
        if message.stop_reason == "max_tokens":
            continue
        assert message.stop_reason == "end_turn"
        jsonschema.validate(json.loads(message.content[0].text), ANSWER_SCHEMA)
        finished += 1
    assert finished


def test_a_stop_sequence_ends_the_text_before_it(claude: anthropic.Anthropic) -> None:
    def ask(max_tokens: int = 24, **fields: Any) -> Any:
        return claude.messages.create(
            model=MODEL, system=SYSTEM, messages=ASK, max_tokens=max_tokens, extra_body=GREEDY, **fields
        )

    ask(max_tokens=1)  # the prompt's blocks cached first: the two answers below start alike
    free = ask().content[0].text
    words = free.split()
    assert len(words) >= 3, free
    stop = words[2]
    stopped = ask(stop_sequences=[stop, "never-generated-sequence"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    text = stopped.content[0].text if stopped.content else ""
    assert free.startswith(text) and stop not in text


def test_refusals_raise_the_sdks_errors(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as not_found:
        claude.messages.create(model="claude-nope", messages=ASK, max_tokens=4)  # type: ignore[arg-type]
    assert not_found.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.post("/v1/messages", cast_to=object, body={"model": MODEL, "messages": ASK})
    assert "max_tokens" in bad.value.message
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(
            model=MODEL,
            messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}],
            max_tokens=4,
        )
    assert "messages[0].content[1]" in refused.value.message


def test_greedy_answers_match_openai_chat(claude: anthropic.Anthropic, client: openai.OpenAI) -> None:
    question = "Why is the sky blue?"
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    client.chat.completions.create(model=MODEL, messages=chat, max_tokens=1, temperature=0)  # type: ignore[arg-type]
    # both requests below read the prompt from the cache (K/V with the bits a recompute gives)
    openai_answer = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=16, temperature=0)  # type: ignore[arg-type]
    message = claude.messages.create(
        model=MODEL,
        system=SYSTEM,
        messages=[{"role": "user", "content": question}],
        max_tokens=16,
        extra_body=GREEDY,
    )
    assert message.content[0].text == openai_answer.choices[0].message.content  # type: ignore[union-attr]
    usage = openai_answer.usage
    assert usage is not None
    assert message.usage.output_tokens == usage.completion_tokens
    assert whole_prompt(message.usage) == usage.prompt_tokens
    # the warm-up published the prompt's whole blocks; the OpenAI answer's 16 tokens filled the
    # block holding the prompt's end, so the Messages call reads all of the prompt but its last token
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    assert cached is not None and cached >= min(usage.prompt_tokens - 1, usage.prompt_tokens // 16 * 16)
    assert message.usage.cache_read_input_tokens == usage.prompt_tokens - 1


def test_fields_not_honoured_are_named(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [*ASK, {"role": "assistant", "content": "Red,"}],
        "thinking": {"type": "enabled", "budget_tokens": 1024},  # SmolLM2 does not reason
        "service_tier": "standard_only",
        "frobnicate": True,
        "top_k": 5,
    }
    response = http.post("/v1/messages", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["x-argosy-degraded"].split(", ") == ["frobnicate", "thinking"]


PREFILL = [
    {"role": "user", "content": "Name three colors."},
    {"role": "assistant", "content": "The first color is"},
]


def test_a_prefill_is_continued(
    claude: anthropic.Anthropic, client: openai.OpenAI, http: httpx.Client
) -> None:
    # the prompt's blocks cached first: every request below reads them alike, so decodes alike
    claude.messages.create(model=MODEL, messages=PREFILL, max_tokens=1, extra_body=GREEDY)  # type: ignore[arg-type]
    continued = claude.messages.create(model=MODEL, messages=PREFILL, max_tokens=12, extra_body=GREEDY)  # type: ignore[arg-type]
    text = continued.content[0].text  # type: ignore[union-attr]
    assert text and not text.startswith("The first color is")  # only what follows the prefill
    count = claude.messages.count_tokens(model=MODEL, messages=PREFILL)  # type: ignore[arg-type]
    assert whole_prompt(continued.usage) == count.input_tokens
    # a new turn's prompt is longer by the end-of-turn and the generation prompt
    asked = claude.messages.count_tokens(model=MODEL, messages=PREFILL[:1])  # type: ignore[arg-type]
    assert count.input_tokens > asked.input_tokens
    # OpenAI chat continues it alike (vLLM's fields), and the prompt is the same
    chat = client.chat.completions.create(
        model=MODEL,
        messages=PREFILL,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    assert chat.choices[0].message.content == text
    assert chat.usage is not None and chat.usage.prompt_tokens == count.input_tokens
    # streamed, the same text; and nothing is named as not honoured
    with claude.messages.stream(model=MODEL, messages=PREFILL, max_tokens=12, extra_body=GREEDY) as stream:  # type: ignore[arg-type]
        assert "".join(stream.text_stream) == text
    response = http.post("/v1/messages", json={"model": MODEL, "messages": PREFILL, "max_tokens": 2})
    assert response.status_code == 200 and "x-argosy-degraded" not in response.headers


def test_openai_continue_final_message_refusals(client: openai.OpenAI) -> None:
    for extra, words in [
        ({"continue_final_message": True}, "cannot both be true"),
        ({"continue_final_message": True, "add_generation_prompt": False}, "ends with a 'user' message"),
    ]:
        messages = PREFILL if "add_generation_prompt" not in extra else PREFILL[:1]
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body=extra)  # type: ignore[arg-type]
        assert words in caught.value.message
        assert caught.value.body["param"] == "continue_final_message"  # type: ignore[index]
