"""Ollama's /api/* dialect on the real server (SmolLM2 + all-MiniLM-L6-v2), through the
official `ollama` client: list, show, ps, version, chat and generate (streamed and not),
`format` held to a JSON schema over 20 seeds, tools (a round trip, a forced call), embed,
logprobs, errors in Ollama's shape, fields not honoured named, `keep_alive: 0` unloading a
model (seen in /api/ps), and the same greedy answer and token counts as OpenAI chat and
Anthropic messages give.

Seeded requests run concurrently; max tokens stay small so the file takes about a minute.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import anthropic
import httpx
import jsonschema
import numpy as np
import ollama
import openai
import pytest

from tests.e2e.server import SMOLLM2_AND_MINILM_TOML, ServerProcess, models_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SEEDS = range(20)
ASK = [{"role": "user", "content": "Name three colors."}]
STORY = [{"role": "user", "content": "Tell me a long story about a dragon."}]
PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
T = TypeVar("T")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with models_server(tmp_path_factory.mktemp("ollama"), SMOLLM2_AND_MINILM_TOML) as started:
        yield started


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> ollama.Client:
    return ollama.Client(host=server.base_url, timeout=300)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=300) as session:
        yield session


def over_seeds(call: Callable[[int], T]) -> list[T]:
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(call, SEEDS))


def ndjson(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in response.text.splitlines() if line]


def test_version_list_show_and_ps(client: ollama.Client, http: httpx.Client) -> None:
    assert http.get("/api/version").json()["version"]
    assert http.head("/").status_code == 200  # the CLI's heartbeat
    listed = {model.model: model for model in client.list().models}
    assert set(listed) == {"smollm2:latest", "minilm:latest"}
    smollm2 = listed["smollm2:latest"]
    assert smollm2.size and smollm2.size > 50_000_000 and smollm2.digest and len(smollm2.digest) == 64
    assert smollm2.details is not None and smollm2.details.format == "gguf"
    assert smollm2.details.quantization_level == "Q4_1"

    shown = client.show("smollm2")  # a bare name means `:latest`
    assert shown.capabilities == ["completion", "tools"]
    assert shown.template is not None and "<|im_start|>" in shown.template
    assert shown.modelinfo is not None
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] == 1024
    assert shown.parameters is not None and '"<|im_end|>"' in shown.parameters
    assert shown.modelfile is not None and shown.modelfile.startswith("FROM smollm2")

    loaded = {model.model: model for model in client.ps().models}
    assert "smollm2:latest" in loaded
    assert loaded["smollm2:latest"].context_length == 1024
    assert loaded["smollm2:latest"].size and loaded["smollm2:latest"].size > 0


def test_chat_plain_and_streamed(client: ollama.Client) -> None:
    options = {"temperature": 0, "num_predict": 12}
    client.chat(model="smollm2", messages=STORY, options=options)  # the prompt is cached from here on
    reply = client.chat(model="smollm2", messages=STORY, options=options)
    assert reply.done and reply.done_reason == "length" and reply.eval_count == 12
    assert reply.message.role == "assistant" and reply.message.content
    assert reply.prompt_eval_count and reply.prompt_eval_count > 10
    assert reply.total_duration and reply.eval_duration and reply.prompt_eval_duration is not None
    assert reply.total_duration >= reply.eval_duration

    parts = list(client.chat(model="smollm2", messages=STORY, options=options, stream=True))
    assert all(not part.done for part in parts[:-1]) and parts[-1].done
    assert "".join(part.message.content or "" for part in parts) == reply.message.content
    assert parts[-1].eval_count == 12 and parts[-1].prompt_eval_count == reply.prompt_eval_count


def test_generate_templated_raw_and_context(client: ollama.Client) -> None:
    options = {"temperature": 0, "num_predict": 10}
    client.generate(model="smollm2", prompt=STORY[0]["content"], options=options)
    first = client.generate(model="smollm2", prompt=STORY[0]["content"], options=options)
    assert first.response and first.done_reason == "length" and first.eval_count == 10
    assert first.context is not None and len(first.context) == first.prompt_eval_count + 10  # type: ignore[operator]
    chunks = list(client.generate(model="smollm2", prompt=STORY[0]["content"], options=options, stream=True))
    assert "".join(chunk.response or "" for chunk in chunks) == first.response
    assert chunks[-1].context == first.context

    # the returned context goes before the next prompt
    follow = client.generate(model="smollm2", prompt="And two more.", context=first.context, options=options)
    alone = client.generate(model="smollm2", prompt="And two more.", options=options)
    assert follow.prompt_eval_count == len(first.context) + alone.prompt_eval_count  # type: ignore[arg-type, operator]

    raw = client.generate(model="smollm2", prompt="The sky is", raw=True, options=options)
    assert raw.response and raw.prompt_eval_count is not None and raw.prompt_eval_count < 6


def test_generate_with_its_own_template(client: ollama.Client, http: httpx.Client) -> None:
    options = {"temperature": 0, "num_predict": 8}
    template = "{{ if .System }}{{ .System }}\n{{ end }}Question: {{ .Prompt }}\nAnswer:{{ .Response }} (end)"
    templated = client.generate(
        model="smollm2", prompt="What is 2+2?", system="Be brief.", template=template, options=options
    )
    raw = client.generate(
        model="smollm2", prompt="Be brief.\nQuestion: What is 2+2?\nAnswer:", raw=True, options=options
    )
    assert templated.response == raw.response and templated.prompt_eval_count == raw.prompt_eval_count

    refused = http.post(
        "/api/generate",
        json={
            "model": "smollm2",
            "prompt": "x",
            "template": "{{ range .Messages }}{{ end }}",
            "stream": False,
        },
    )
    assert refused.status_code == 400 and "template" in refused.json()["error"]


def test_format_schema_holds_over_seeds(client: ollama.Client) -> None:
    def person(seed: int) -> tuple[str, str | None]:
        reply = client.chat(
            model="smollm2",
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            format=PERSON_SCHEMA,
            options={"seed": seed, "temperature": 1.0, "num_predict": 200},
        )
        return reply.message.content or "", reply.done_reason

    replies = over_seeds(person)
    # every document the model finished holds to the schema; a sampled one may ramble in a
    # string past the budget (cut: "length"), rarely (the seeds run batched, so their texts
    # depend on the batch in this bf16 mode)
    for text, reason in replies:
        if reason == "stop":
            jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    assert sum(reason == "stop" for _, reason in replies) >= len(replies) - 2

    def fruits(seed: int) -> tuple[str, str | None]:
        reply = client.generate(
            model="smollm2",
            prompt="List two fruits as JSON.",
            format="json",
            options={"seed": seed, "num_predict": 160},
        )
        return reply.response or "", reply.done_reason

    # any JSON: every reply the model finished is one object (a 135M model's sampled text can
    # ramble in a string past the budget, so no one seed is sure to finish)
    documents = over_seeds(fruits)
    for text, reason in documents:
        if reason == "stop":
            assert isinstance(json.loads(text), dict), text
    assert any(reason == "stop" for _, reason in documents)


def test_tools_round_trip_and_a_forced_call(client: ollama.Client, http: httpx.Client) -> None:
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "18 degrees and sunny", "tool_name": "get_weather"},
    ]
    answer = client.chat(
        model="smollm2", messages=history, tools=[WEATHER_TOOL], options={"temperature": 0, "num_predict": 24}
    )
    assert answer.message.content and not answer.message.tool_calls
    # the tool's result is in the prompt: it is longer than the same history without it
    shorter = client.chat(
        model="smollm2",
        messages=history[:1],
        tools=[WEATHER_TOOL],
        options={"temperature": 0, "num_predict": 1},
    )
    assert answer.prompt_eval_count > shorter.prompt_eval_count  # type: ignore[operator]

    schema = WEATHER_TOOL["function"]["parameters"]

    def forced(seed: int) -> tuple[str, list[dict[str, Any]]]:
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": "Weather in Rome?"}],
            "tools": [WEATHER_TOOL],
            "tool_choice": "required",  # an Argosy extension; Ollama leaves the choice to the model
            "options": {"seed": seed, "num_predict": 160},
            "stream": seed % 2 == 0,
        }
        response = http.post("/api/chat", json=body)
        assert response.status_code == 200, response.text
        lines = ndjson(response) if body["stream"] else [response.json()]
        assert lines[-1]["done"] and lines[-1]["done_reason"] in ("stop", "length")
        return lines[-1]["done_reason"], [
            call for line in lines for call in line["message"].get("tool_calls") or []
        ]

    results = over_seeds(forced)
    # parallel calls are allowed, and SmolLM2 sometimes goes on calling (3 of 20 seeds call
    # without end here, batched): those end at the budget, their complete calls still held to
    # the schema; most end by themselves (the grammar lets a call list close)
    assert sum(reason == "stop" for reason, _ in results) >= len(results) // 2
    for reason, calls in results:
        assert calls, "a forced call was not made"
        for index, call in enumerate(calls):  # parallel calls are allowed
            assert call["function"]["name"] == "get_weather" and call["function"]["index"] == index
            if reason == "stop" or index < len(calls) - 1:  # a cut reply's last call may be cut too
                jsonschema.validate(call["function"]["arguments"], schema)


def test_logprobs(client: ollama.Client) -> None:
    reply = client.chat(
        model="smollm2",
        messages=ASK,
        options={"temperature": 0, "num_predict": 6},
        logprobs=True,
        top_logprobs=3,
    )
    assert reply.logprobs is not None and len(reply.logprobs) == reply.eval_count == 6
    assert "".join(entry.token for entry in reply.logprobs) == reply.message.content
    for entry in reply.logprobs:
        assert entry.top_logprobs is not None and len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the top one

    streamed = list(
        client.generate(
            model="smollm2",
            prompt="Hi",
            options={"temperature": 0, "num_predict": 5},
            logprobs=True,
            stream=True,
        )
    )
    entries = [entry for chunk in streamed for entry in chunk.logprobs or []]
    assert len(entries) == 5


def test_embed(client: ollama.Client, server: ServerProcess) -> None:
    texts = ["The cat sat on the mat.", "A dog barked."]
    embedded = client.embed(model="minilm", input=texts)
    assert len(embedded.embeddings) == 2 and len(embedded.embeddings[0]) == 384
    reference = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="-").embeddings.create(
        model="minilm", input=texts, encoding_format="float"
    )
    for ours, theirs in zip(embedded.embeddings, reference.data, strict=True):
        assert np.allclose(ours, theirs.embedding, atol=1e-6)

    short = client.embed(model="minilm", input=texts[0], dimensions=64)
    assert len(short.embeddings[0]) == 64
    assert np.linalg.norm(short.embeddings[0]) == pytest.approx(1.0, abs=1e-5)

    older = client.embeddings(model="minilm", prompt=texts[1])
    assert np.allclose(older.embedding, reference.data[1].embedding, atol=1e-6)

    long_text = "word " * 600
    assert len(client.embed(model="minilm", input=long_text).embeddings) == 1  # truncated by default
    with pytest.raises(ollama.ResponseError) as refused:
        client.embed(model="minilm", input=long_text, truncate=False)
    assert refused.value.status_code == 400


def test_errors_in_ollamas_shape(client: ollama.Client, http: httpx.Client) -> None:
    with pytest.raises(ollama.ResponseError) as unknown:
        client.chat(model="nope", messages=ASK)
    assert unknown.value.status_code == 404 and 'model "nope" not found' in unknown.value.error

    refusals = [
        (
            "/api/chat",
            {"model": "smollm2", "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
        ),
        ("/api/generate", {"model": "smollm2", "prompt": "def f(", "suffix": "return 1"}),
        ("/api/generate", {"model": "smollm2", "prompt": "a cat", "width": 512}),
        ("/api/chat", {"model": "smollm2", "messages": ASK, "think": True}),
        ("/api/chat", {"model": "smollm2", "messages": ASK, "options": {"temperature": "hot"}}),
        ("/api/chat", {"model": "smollm2", "messages": ASK, "keep_alive": "soon"}),
        ("/api/chat", {"messages": ASK}),
        # a chat model embeds (mean-pooled hidden states), but not past its context untruncated
        ("/api/embed", {"model": "smollm2", "input": "x " * 9000, "truncate": False}),
    ]
    for path, body in refusals:
        response = http.post(path, json=body)
        assert response.status_code == 400, (body, response.text)
        assert isinstance(response.json()["error"], str)
    assert "options.temperature" in http.post("/api/chat", json=refusals[4][1]).json()["error"]

    malformed = http.post("/api/chat", content=b"{not json", headers={"content-type": "application/json"})
    assert malformed.status_code == 400 and isinstance(malformed.json()["error"], str)
    missing = http.get("/api/nothing-here")
    assert missing.status_code == 404 and isinstance(missing.json()["error"], str)

    assert client.pull("smollm2").status == "success"  # served: it is here already
    with pytest.raises(ollama.ResponseError) as refused:
        client.pull("llama3")  # not one of the packaged models: nothing to pull it from
    assert refused.value.status_code == 400 and "cannot be pulled" in refused.value.error
    with pytest.raises(ollama.ResponseError) as refused:
        client.delete("smollm2")
    assert refused.value.status_code == 400 and "configured locally" in refused.value.error


def test_fields_not_honoured_are_named(http: httpx.Client) -> None:
    body = {
        "model": "smollm2",
        "messages": ASK,
        "stream": False,
        "options": {"num_predict": 2, "num_thread": 4, "mirostat": 2, "num_ctx": 8192, "colour": "blue"},
        "frobnicate": True,
    }
    response = http.post("/api/chat", json=body)
    assert response.status_code == 200
    degraded = response.headers["x-argosy-degraded"].split(", ")
    assert degraded == [
        "options.num_thread",
        "options.mirostat",
        "options.num_ctx",
        "options.colour",
        "frobnicate",
    ]
    body["options"] = {"num_predict": 2, "num_ctx": 1024, "repeat_last_n": -1}
    del body["frobnicate"]
    assert "x-argosy-degraded" not in http.post("/api/chat", json=body).headers


def test_same_greedy_answer_as_openai_and_anthropic(server: ServerProcess, client: ollama.Client) -> None:
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="-")
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="-")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat.chat.completions.create(model="smollm2", messages=messages, max_tokens=1, temperature=0)  # type: ignore[arg-type]
    # every request below reads the same prompt blocks from the cache, so they decode alike
    openai_answer = chat.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=16, temperature=0
    )  # type: ignore[arg-type]
    message = claude.messages.create(
        model="smollm2",
        messages=messages,
        max_tokens=16,
        extra_body={"temperature": 0},  # type: ignore[arg-type]
    )
    reply = client.chat(model="smollm2", messages=messages, options={"temperature": 0, "num_predict": 16})

    text = openai_answer.choices[0].message.content
    assert text and reply.message.content == text
    assert message.content[0].type == "text" and message.content[0].text == text
    usage = openai_answer.usage
    assert usage is not None
    anthropic_prompt = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    assert reply.prompt_eval_count == usage.prompt_tokens == anthropic_prompt
    assert reply.eval_count == usage.completion_tokens == message.usage.output_tokens


def wait_unloaded(client: ollama.Client, name: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while name in {model.model for model in client.ps().models}:
        assert time.monotonic() < deadline, f"{name} still loaded"
        time.sleep(0.2)


def test_keep_alive_zero_unloads(client: ollama.Client, http: httpx.Client) -> None:
    """Last in the file: it unloads both models (the next request would load them again)."""
    client.embed(model="minilm", input="load me", keep_alive="5m")
    assert "minilm:latest" in {model.model for model in client.ps().models}
    client.embed(model="minilm", input="and now go", keep_alive=0)
    wait_unloaded(client, "minilm:latest")

    unloaded = client.generate(model="smollm2", prompt="", keep_alive=0)
    assert unloaded.done and unloaded.done_reason == "unload"
    wait_unloaded(client, "smollm2:latest")
    assert http.get("/health").status_code == 200  # a start-up model unloaded on request is not "loading"

    loaded = client.chat(model="smollm2", messages=[], keep_alive=-1)  # empty: loads it, nothing more
    assert loaded.done_reason == "load"
    (ps,) = [model for model in client.ps().models if model.model == "smollm2:latest"]
    assert ps.expires_at is not None and ps.expires_at.year > 2100  # -1: kept loaded
