"""Every JSON shape the OpenAI routes emit validates against OpenAI's published OpenAPI spec.

Driven through raw HTTP (the openai client would parse, and so forgive, a missing field),
each body and each streamed frame is checked with tests/openai_schema.py against the
component schema the spec names for that route. Each case also checks that the feature it
exercises appears in the output (a tool call, logprobs, two choices...), so the shape that
is validated is the one under test. Requests are short and greedy.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from tests.e2e.server import ServerProcess
from tests.openai_schema import validate

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "smollm2-test"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}]
FORCED = {"type": "function", "function": {"name": "get_weather"}}
RESPONSE_TOOLS = [{"type": "function", "name": "get_weather", "parameters": CITY}]


def post(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post(path, json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    payload: dict[str, Any] = response.json()
    return payload


def sse(response: httpx.Response) -> list[tuple[str | None, str]]:
    """(event name, data) of each SSE frame."""
    assert response.status_code == 200, response.read()
    frames: list[tuple[str | None, str]] = []
    name: str | None = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line.removeprefix("event: ")
        elif line.startswith("data: "):
            frames.append((name, line.removeprefix("data: ")))
            name = None
    return frames


def stream(http: httpx.Client, path: str, body: dict[str, Any]) -> list[tuple[str | None, str]]:
    with http.stream("POST", path, json={"model": MODEL, **body, "stream": True}) as response:
        return sse(response)


def chunks_of(frames: list[tuple[str | None, str]]) -> list[dict[str, Any]]:
    """The JSON chunks of a chat/completions stream, which ends with `data: [DONE]`."""
    assert frames[-1] == (None, "[DONE]")
    return [json.loads(data) for _, data in frames[:-1]]


# -- chat completions ----------------------------------------------------------------------------


def has_tool_call(body: dict[str, Any]) -> bool:
    return body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def has_top_logprobs(body: dict[str, Any]) -> bool:
    content = body["choices"][0]["logprobs"]["content"]
    return len(content) == 3 and all(len(entry["top_logprobs"]) == 2 for entry in content)


CHAT_CASES: dict[str, tuple[dict[str, Any], Any]] = {
    "plain": ({"max_tokens": 3}, lambda b: b["choices"][0]["message"]["content"]),
    "forced_tool_call": ({"tools": CHAT_TOOLS, "tool_choice": FORCED, "max_tokens": 40}, has_tool_call),
    "logprobs": ({"max_tokens": 3, "logprobs": True, "top_logprobs": 2}, has_top_logprobs),
    "n2": ({"max_tokens": 2, "n": 2}, lambda b: [c["index"] for c in b["choices"]] == [0, 1]),
}


@pytest.mark.parametrize("case", CHAT_CASES)
def test_chat_completion(http: httpx.Client, case: str) -> None:
    request, exercised = CHAT_CASES[case]
    body = post(http, CHAT, {"messages": ASK, "temperature": 0, **request})
    validate("CreateChatCompletionResponse", body)
    assert exercised(body)
    assert body["usage"]["total_tokens"] > 0


CHAT_STREAM_CASES: dict[str, tuple[dict[str, Any], Any]] = {
    "include_usage": (
        {"max_tokens": 3, "stream_options": {"include_usage": True}},
        lambda chunks: chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3,
    ),
    "continuous_usage": (
        {"max_tokens": 2, "stream_options": {"continuous_usage_stats": True}},
        lambda chunks: all(chunk["usage"]["prompt_tokens"] > 0 for chunk in chunks),
    ),
    "forced_tool_call": (
        {"tools": CHAT_TOOLS, "tool_choice": FORCED, "max_tokens": 40},
        lambda chunks: any(
            call.get("function", {}).get("name") == "get_weather"
            for chunk in chunks
            for choice in chunk["choices"]
            for call in choice["delta"].get("tool_calls") or []
        ),
    ),
    "logprobs": (
        {"max_tokens": 3, "logprobs": True, "top_logprobs": 2},
        lambda chunks: (
            sum(len((c["choices"][0]["logprobs"] or {}).get("content") or []) for c in chunks) == 3
        ),
    ),
    "n2": (
        {"max_tokens": 2, "n": 2},
        lambda chunks: (
            {c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]} == {0, 1}
        ),
    ),
}


@pytest.mark.parametrize("case", CHAT_STREAM_CASES)
def test_chat_completion_chunks(http: httpx.Client, case: str) -> None:
    request, exercised = CHAT_STREAM_CASES[case]
    chunks = chunks_of(stream(http, CHAT, {"messages": ASK, "temperature": 0, **request}))
    for chunk in chunks:
        validate("CreateChatCompletionStreamResponse", chunk)
    assert exercised(chunks)


# -- completions ----------------------------------------------------------------------------------


def echoes_with_logprobs(body: dict[str, Any]) -> bool:
    choice = body["choices"][0]
    return choice["text"].startswith("The sky is") and choice["logprobs"]["token_logprobs"][0] is None


COMPLETION_CASES: dict[str, tuple[dict[str, Any], Any]] = {
    "plain": ({"prompt": "The sky is", "max_tokens": 3}, lambda b: b["choices"][0]["text"]),
    "echo_logprobs": (
        {"prompt": "The sky is", "max_tokens": 3, "echo": True, "logprobs": 2},
        echoes_with_logprobs,
    ),
    "prompts": (
        {"prompt": ["The sky is", "Water is"], "max_tokens": 2},
        lambda b: [c["index"] for c in b["choices"]] == [0, 1],
    ),
}


def without_first_echoed_token(body: dict[str, Any]) -> dict[str, Any]:
    """`body` less its first logprobs entry, which is null: nothing precedes the first prompt
    token, so it has no logprob (OpenAI sends null there too; its spec says a number)."""
    (choice,) = body["choices"]
    logprobs = choice["logprobs"]
    assert (logprobs["token_logprobs"][0], logprobs["top_logprobs"][0]) == (None, None)
    rest = {key: entries[1:] for key, entries in logprobs.items()}
    return {**body, "choices": [{**choice, "logprobs": rest}]}


@pytest.mark.parametrize("case", COMPLETION_CASES)
def test_completion(http: httpx.Client, case: str) -> None:
    request, exercised = COMPLETION_CASES[case]
    body = post(http, COMPLETIONS, {"temperature": 0, **request})
    validate("CreateCompletionResponse", without_first_echoed_token(body) if request.get("echo") else body)
    assert exercised(body)


def test_completion_chunks(http: httpx.Client) -> None:
    """The spec: "both the streamed and non-streamed response objects share the same shape".
    But a choice's chunks before its last have no finish_reason yet: null, as OpenAI streams
    them, where the completion object's is never null. Each is validated as if it were set."""
    request = {"prompt": "The sky is", "max_tokens": 3, "temperature": 0, "logprobs": 1}
    chunks = chunks_of(stream(http, COMPLETIONS, {**request, "stream_options": {"include_usage": True}}))
    *texts, usage = chunks
    reasons = [chunk["choices"][0]["finish_reason"] for chunk in texts]
    assert reasons == [None] * (len(texts) - 1) + ["length"]
    for chunk in texts:
        (choice,) = chunk["choices"]
        validate("CreateCompletionResponse", {**chunk, "choices": [{**choice, "finish_reason": "length"}]})
    assert any(chunk["choices"][0]["logprobs"] for chunk in texts)
    validate("CreateCompletionResponse", usage)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3


# -- models ---------------------------------------------------------------------------------------


def test_models(http: httpx.Client) -> None:
    listed = http.get("/v1/models").json()
    validate("ListModelsResponse", listed)
    assert [model["id"] for model in listed["data"]] == [MODEL]
    validate("Model", http.get(f"/v1/models/{MODEL}").json())


@pytest.fixture(scope="module")
def embeddings_url() -> Iterator[str]:
    """An embeddings server (the session's serves only the chat model); it starts in seconds."""
    process = ServerProcess(model="minilm", quantization=None, compile=None).start()
    try:
        yield f"{process.base_url}/v1/embeddings"
    finally:
        process.stop()


def test_embeddings(embeddings_url: str) -> None:
    request = {"model": "minilm", "input": ["The cat sits.", "Paris"]}
    floats = httpx.post(embeddings_url, json=request, timeout=60).json()
    validate("CreateEmbeddingResponse", floats)
    assert [item["index"] for item in floats["data"]] == [0, 1] and len(floats["data"][0]["embedding"]) == 384
    # base64 is the float32 bytes of the same vectors; the spec models only the list of floats
    encoded = httpx.post(embeddings_url, json={**request, "encoding_format": "base64"}, timeout=60).json()
    for item in encoded["data"]:
        item["embedding"] = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4").tolist()
    validate("CreateEmbeddingResponse", encoded)
    assert np.allclose(encoded["data"][1]["embedding"], floats["data"][1]["embedding"], atol=1e-6)


# -- responses ------------------------------------------------------------------------------------


def test_response(http: httpx.Client) -> None:
    body = post(
        http, RESPONSES, {"input": "Say hi.", "temperature": 0, "max_output_tokens": 4, "user": "u-1"}
    )
    validate("Response", body)
    assert body["status"] in ("completed", "incomplete") and body["output"][0]["type"] == "message"
    retrieved = http.get(f"{RESPONSES}/{body['id']}").json()
    validate("Response", retrieved)
    assert retrieved["output"] == body["output"]
    items = http.get(f"{RESPONSES}/{body['id']}/input_items").json()
    validate("ResponseItemList", items)
    assert items["data"][0]["content"] == [{"type": "input_text", "text": "Say hi."}]


def test_a_response_echoing_its_options(http: httpx.Client) -> None:
    answer_format = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    request = {
        "input": "Name a city.",
        "instructions": "Answer in JSON.",
        "text": {"format": answer_format},
        "metadata": {"case": "echo"},
        "reasoning": {"effort": "low"},
        "top_p": 0.5,
        "store": False,
        "max_output_tokens": 4,
    }
    body = post(http, RESPONSES, request)
    validate("Response", body)
    assert body["text"] == {"format": answer_format} and body["metadata"] == {"case": "echo"}


def test_an_incomplete_response(http: httpx.Client) -> None:
    body = post(http, RESPONSES, {"input": "Count to twenty.", "temperature": 0, "max_output_tokens": 2})
    validate("Response", body)
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_function_call_response(http: httpx.Client) -> None:
    request = {"input": "What is the weather in Paris?", "tools": RESPONSE_TOOLS, "temperature": 0}
    body = post(
        http,
        RESPONSES,
        {**request, "tool_choice": "required", "parallel_tool_calls": False, "max_output_tokens": 40},
    )
    validate("Response", body)
    assert [item["type"] for item in body["output"]] == ["function_call"]
    follow_up = {"type": "function_call_output", "call_id": body["output"][0]["call_id"], "output": "sunny"}
    answer = post(
        http,
        RESPONSES,
        {
            "input": [follow_up],
            "previous_response_id": body["id"],
            "tools": RESPONSE_TOOLS,
            "max_output_tokens": 3,
        },
    )
    validate("Response", answer)
    items = http.get(f"{RESPONSES}/{answer['id']}/input_items", params={"order": "asc"}).json()
    validate("ResponseItemList", items)
    assert [item["type"] for item in items["data"]] == ["message", "function_call", "function_call_output"]


def response_events(frames: list[tuple[str | None, str]]) -> list[dict[str, Any]]:
    """The events of a Responses stream (named frames, no [DONE]), each validated."""
    events = []
    for name, data in frames:
        event = json.loads(data)
        assert name == event["type"]
        validate("ResponseStreamEvent", event)
        events.append(event)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    return events


RESPONSE_STREAM_CASES: dict[str, tuple[dict[str, Any], str, str]] = {
    "text": (
        {"input": "Say hi.", "max_output_tokens": 48},
        "response.output_text.delta",
        "response.completed",
    ),
    "incomplete": (
        {"input": "Count to twenty.", "max_output_tokens": 2},
        "response.output_text.done",
        "response.incomplete",
    ),
    "function_call": (
        {
            "input": "What is the weather in Paris?",
            "tools": RESPONSE_TOOLS,
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 40,
        },
        "response.function_call_arguments.done",
        "response.completed",
    ),
}


@pytest.mark.parametrize("case", RESPONSE_STREAM_CASES)
def test_response_stream_events(http: httpx.Client, case: str) -> None:
    request, exercised, last = RESPONSE_STREAM_CASES[case]
    events = response_events(stream(http, RESPONSES, {"temperature": 0, **request}))
    kinds = [event["type"] for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == last
    assert exercised in kinds


def test_a_background_response(http: httpx.Client) -> None:
    queued = post(http, RESPONSES, {"input": "Say hi.", "max_output_tokens": 2, "background": True})
    validate("Response", queued)
    assert queued["status"] == "queued" and queued["background"] is True
    with http.stream("GET", f"{RESPONSES}/{queued['id']}", params={"stream": "true"}) as response:
        events = response_events(sse(response))
    assert events[-1]["type"] in ("response.completed", "response.incomplete")


# -- errors ---------------------------------------------------------------------------------------

ERRORS: list[tuple[str, str, dict[str, Any] | None, int]] = [
    ("POST", CHAT, {"model": MODEL, "messages": ASK, "temperature": 3}, 400),
    ("POST", CHAT, {"model": "no-such-model", "messages": ASK}, 404),
    ("POST", COMPLETIONS, {"model": MODEL, "prompt": "x", "suffix": "y"}, 400),
    ("POST", RESPONSES, {"model": MODEL}, 400),
    ("GET", f"{RESPONSES}/resp_nope", None, 404),
    ("GET", "/v1/models/no-such-model", None, 404),
    ("GET", "/v1/nowhere", None, 404),
    ("GET", CHAT, None, 405),
]


@pytest.mark.parametrize(("method", "path", "body", "status"), ERRORS)
def test_error_bodies(
    http: httpx.Client, method: str, path: str, body: dict[str, Any] | None, status: int
) -> None:
    response = http.request(method, path, json=body)
    assert response.status_code == status, response.text
    validate("ErrorResponse", response.json())
