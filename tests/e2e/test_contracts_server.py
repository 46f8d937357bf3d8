"""Issue 38's contracts on a real server (SmolLM2), through the official openai client.

Keep-alive needs a server of its own (`--sse-keepalive-s 0.2`, no prefix cache, so every
long prompt is prefilled in full: a real slow prefill, not a sleep); everything else runs on
the session's server (`smollm2-test`).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.server import FULL_CONTEXT_KV, ServerProcess

MODEL = "smollm2-test"
KEEPALIVE = b": keep-alive"


@pytest.fixture(scope="module")
def slow_server() -> Iterator[ServerProcess]:
    process = ServerProcess(
        served_model_name=MODEL,
        kv_cache_memory=FULL_CONTEXT_KV,
        extra_flags=["--sse-keepalive-s", "0.2", "--no-prefix-cache"],
    ).start()
    try:
        yield process
    finally:
        process.stop()


def long_prompt() -> str:
    """About 1,500 tokens: a prefill of a second or more on one thread."""
    words = " ".join(f"item{i} is {i * 7 % 13}" for i in range(250))
    return f"Here is a list. {words}. Repeat the first item:"


def raw_stream(server: ServerProcess, path: str, body: dict[str, Any]) -> list[bytes]:
    """The stream's SSE blocks (frames and comments) as the server sent them."""
    with httpx.stream("POST", f"{server.base_url}{path}", json=body, timeout=300) as response:
        assert response.status_code == 200, response.read()
        raw = b"".join(response.iter_bytes())
    return [block for block in raw.split(b"\n\n") if block]


def first_index(blocks: list[bytes], is_token: Any) -> int:
    return next(i for i, block in enumerate(blocks) if is_token(block))


def _data(block: bytes) -> dict[str, Any]:
    line = next(line for line in block.split(b"\n") if line.startswith(b"data: "))
    parsed: dict[str, Any] = json.loads(line[len(b"data: ") :])
    return parsed


def _chat_token(block: bytes) -> bool:
    if not block.startswith(b"data: {"):
        return False
    choices = _data(block)["choices"]
    return bool(choices and choices[0]["delta"].get("content"))


def _completion_token(block: bytes) -> bool:
    return block.startswith(b"data: {") and bool(_data(block)["choices"][0]["text"])


def _responses_token(block: bytes) -> bool:
    return block.startswith(b"event: response.output_text.delta")


@pytest.mark.parametrize(
    ("path", "body", "is_token"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "{prompt}"}]}, _chat_token),
        ("/v1/completions", {"prompt": "{prompt}"}, _completion_token),
        ("/v1/responses", {"input": "{prompt}", "store": False}, _responses_token),
    ],
)
def test_every_openai_stream_sends_keepalives_while_the_prefill_runs(
    slow_server: ServerProcess, path: str, body: dict[str, Any], is_token: Any
) -> None:
    prompt = f"{uuid.uuid4().hex} {long_prompt()}"
    filled = json.loads(json.dumps(body).replace("{prompt}", prompt))
    tokens = {"max_output_tokens" if path == "/v1/responses" else "max_tokens": 4}
    blocks = raw_stream(
        slow_server, path, {"model": MODEL, "stream": True, "temperature": 0, **filled, **tokens}
    )
    first_token = first_index(blocks, is_token)
    keepalives = [i for i, block in enumerate(blocks) if block == KEEPALIVE]
    assert keepalives and keepalives[0] < first_token, blocks[: first_token + 1]
    if path != "/v1/responses":
        assert blocks[-1] == b"data: [DONE]"


def test_the_openai_sdk_stream_skips_the_keepalives(slow_server: ServerProcess) -> None:
    client = openai.OpenAI(
        base_url=f"{slow_server.base_url}/v1", api_key="unused", max_retries=0, timeout=300
    )
    prompt = long_prompt()
    messages = [{"role": "user", "content": prompt}]
    sampling: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_tokens": 6}
    blocks = raw_stream(
        slow_server, "/v1/chat/completions", {**sampling, "messages": messages, "stream": True}
    )
    assert KEEPALIVE in blocks  # the same prompt, prefilled afresh (no prefix cache): keep-alives again
    raw_text = "".join(
        _data(b)["choices"][0]["delta"].get("content") or ""
        for b in blocks
        if b.startswith(b"data: {") and _data(b)["choices"]
    )
    streamed = client.chat.completions.create(messages=messages, stream=True, **sampling)  # type: ignore[call-overload]
    sdk_text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert sdk_text == raw_text and sdk_text
    events = client.responses.create(
        model=MODEL, input=prompt, max_output_tokens=6, temperature=0, stream=True
    )
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta")


# -- on the session's server ---------------------------------------------------------------------


def degraded(response: Any) -> list[str]:
    header = response.headers.get("x-argosy-degraded", "")
    return [name.strip() for name in header.split(",") if name.strip()]


def test_unknown_fields_are_named_and_top_level_enable_thinking_is_read(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        extra_body={"fim_mode": "psm", "frobnicate": True, "enable_thinking": False},
    )
    # SmolLM2's template reads no enable_thinking: named, as reasoning_effort is
    assert degraded(raw) == ["fim_mode", "frobnicate", "enable_thinking"]
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="Hi", max_tokens=2, extra_body={"frobnicate": 1}
    )
    assert "frobnicate" in degraded(raw)
    plain = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert degraded(plain) == []


def test_repeat_penalty_0_is_off(client: openai.OpenAI) -> None:
    for name in ("repeat_penalty", "repetition_penalty"):
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_body={name: 0}
        )
        assert json.loads(raw.headers["x-argosy-sampling"])["repetition_penalty"] == 1.0


def test_tool_choice_shorthand_forces_the_named_call(client: openai.OpenAI) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=tools,  # type: ignore[arg-type]
        tool_choice={"name": "get_weather"},  # type: ignore[arg-type]
        max_tokens=40,
        temperature=0,
    )
    calls = completion.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"  # type: ignore[union-attr]


def test_an_inline_json_schema_constrains_the_output(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is Paris in France? Answer as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", **schema}},  # type: ignore[typeddict-unknown-key]
        max_tokens=24,
        temperature=0,
    )
    text = completion.choices[0].message.content or ""
    assert completion.choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text)["ok"], bool) and set(json.loads(text)) == {"ok"}


def test_a_stored_chat_completion_names_its_session(client: openai.OpenAI, http: httpx.Client) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        store=True,
        metadata={"project": "x"},
    )
    session_id = raw.headers["x-argosy-session-id"]
    completion = raw.parse()
    assert completion.metadata == {"project": "x", "argosy_session_id": session_id}  # type: ignore[attr-defined]
    session = http.get(f"/v1/argosy/sessions/{session_id}").json()
    assert session["metadata"]["kind"] == "chat.completion"
    streamed = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, store=True, stream=True
    )
    stream_session = streamed.headers["x-argosy-session-id"]
    assert "".join(c.choices[0].delta.content or "" for c in streamed.parse() if c.choices)
    assert http.get(f"/v1/argosy/sessions/{stream_session}").status_code == 200
    unstored = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    )
    assert "x-argosy-session-id" not in unstored.headers
    assert getattr(unstored.parse(), "metadata", None) is None


def test_a_continued_response_inherits_its_parents_qos(client: openai.OpenAI, http: httpx.Client) -> None:
    def qos_of(response_id: str) -> str:
        key = response_id.removeprefix("resp_")
        qos: str = http.get(f"/v1/argosy/sessions/{key}").json()["metadata"]["qos"]
        return qos

    parent = client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=2, extra_headers={"x-argosy-qos": "background"}
    )
    assert qos_of(parent.id) == "background"
    child = client.responses.create(
        model=MODEL, input="More", max_output_tokens=2, previous_response_id=parent.id
    )
    assert qos_of(child.id) == "background"
    named = client.responses.create(
        model=MODEL,
        input="More",
        max_output_tokens=2,
        previous_response_id=parent.id,
        extra_headers={"x-argosy-qos": "interactive"},
    )
    assert qos_of(named.id) == "interactive"


def test_an_invalid_reasoning_summary_is_a_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model=MODEL,
            input="Hi",
            max_output_tokens=2,
            reasoning={"summary": "verbose"},  # type: ignore[typeddict-item]
        )
    assert caught.value.body["param"] == "reasoning.summary"  # type: ignore[index]
    response = client.responses.with_raw_response.create(
        model=MODEL, input="Hi", max_output_tokens=2, reasoning={"summary": "auto"}
    )
    assert response.parse().reasoning.summary == "auto"  # type: ignore[union-attr]
    assert "reasoning.summary" in degraded(response)
