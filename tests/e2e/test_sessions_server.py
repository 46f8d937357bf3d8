"""Sessions, the Responses API, admission and QoS, through a real `argosy serve` (smollm2)
and the official openai client.

Most tests share the session-wide server of conftest.py; admission, QoS preemption, the
request timeout and crash recovery each start their own (flags of their own, or a kill -9).
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.server import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "smollm2-test"
BLOCK_SIZE = 16
# SmolLM2-135M echoes this word back when asked three turns later, greedy (probed).
SECRET_TURNS = ["The secret word is banana.", "Hi!", "Thanks.", "What is the secret word?"]
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


def create(client: openai.OpenAI, text: Any, previous: str | None = None, **options: Any) -> Any:
    options.setdefault("max_output_tokens", 24)
    return client.responses.create(
        model=MODEL, input=text, previous_response_id=previous, temperature=0, **options
    )


def prompt_of(http: httpx.Client, response_id: str) -> dict[str, Any]:
    response = http.get(f"/v1/argosy/responses/{response_id}/prompt")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def client_for(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


# -- the Responses API -------------------------------------------------------------------------


def test_chained_turns_see_the_conversation_and_reuse_its_cache(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    responses = []
    previous = None
    for text in SECRET_TURNS:
        response = create(client, text, previous)
        assert response.status in ("completed", "incomplete")
        assert response.previous_response_id == previous
        responses.append(response)
        previous = response.id
    # Each turn's prompt extends the previous prompt + output token for token, so the prefix
    # cache serves all of it but the last partial block (and the one token always computed).
    for before, after in zip(responses, responses[1:], strict=False):
        reused = before.usage.input_tokens + before.usage.output_tokens - 1
        assert after.usage.input_tokens_details.cached_tokens >= reused // BLOCK_SIZE * BLOCK_SIZE
        assert (
            after.usage.input_tokens_details.cached_tokens > before.usage.input_tokens_details.cached_tokens
        )
        assert prompt_of(http, after.id)["prompt_source"] == "continued"
    last = prompt_of(http, responses[-1].id)
    assert SECRET_TURNS[0] in last["prompt"] and SECRET_TURNS[-1] in last["prompt"]
    assert responses[0].output_text in last["prompt"]  # the model's own turn, as it said it
    assert last["prompt"].count("<|im_start|>user") == 4
    assert "banana" in responses[-1].output_text.lower()
    # retrieve gives back what create returned
    again = client.responses.retrieve(responses[-1].id)
    assert again.output_text == responses[-1].output_text
    assert again.usage is not None and again.usage.input_tokens == responses[-1].usage.input_tokens
    # the input items are the whole conversation that led to it, newest first by default
    items = client.responses.input_items.list(responses[-1].id, order="asc").data
    assert [item.type for item in items] == ["message"] * 7
    assert [getattr(item, "role", None) for item in items] == ["user", "assistant"] * 3 + ["user"]
    assert items[1].id == responses[0].output[0].id


def test_two_children_fork_one_response(client: openai.OpenAI, http: httpx.Client) -> None:
    parent = create(client, "The secret word is banana.")
    left = create(client, "Hi!", parent.id)
    right = create(client, "What is the secret word?", parent.id)
    assert len({parent.id, left.id, right.id}) == 3
    left_prompt, right_prompt = prompt_of(http, left.id)["prompt"], prompt_of(http, right.id)["prompt"]
    for prompt in (left_prompt, right_prompt):
        assert "The secret word is banana." in prompt and parent.output_text in prompt
    assert "Hi!" in left_prompt and "Hi!" not in right_prompt
    assert "What is the secret word?" in right_prompt and "What is the secret word?" not in left_prompt
    for child in (left, right):
        assert child.usage.input_tokens_details.cached_tokens >= (
            (parent.usage.input_tokens + parent.usage.output_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
        )
    # each branch continues on its own
    grandchild = create(client, "Thanks.", left.id)
    grand_prompt = prompt_of(http, grandchild.id)["prompt"]
    assert "Hi!" in grand_prompt and "What is the secret word?" not in grand_prompt


def test_store_false_is_not_retrievable(client: openai.OpenAI) -> None:
    response = create(client, "Hi!", store=False)
    assert response.store is False and response.output_text
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve(response.id)
    assert caught.value.body["message"] == f"Response with id '{response.id}' not found."  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        create(client, "Thanks.", response.id)


def test_delete_then_404_while_forks_keep_their_history(client: openai.OpenAI, http: httpx.Client) -> None:
    parent = create(client, "The secret word is banana.")
    child = create(client, "Hi!", parent.id)
    client.responses.delete(parent.id)
    for call in (
        lambda: client.responses.retrieve(parent.id),
        lambda: client.responses.delete(parent.id),
        lambda: client.responses.input_items.list(parent.id),
        lambda: create(client, "Thanks.", parent.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert "The secret word is banana." in prompt_of(http, child.id)["prompt"]
    assert create(client, "Thanks.", child.id).output_text
    error = http.get("/v1/responses/resp_nope").json()["error"]
    assert error == {
        "message": "Response with id 'resp_nope' not found.",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }


def test_stream_parses_with_the_sdk_helper(client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL, input="Hi!", temperature=0, max_output_tokens=48) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "response.output_text.delta" in kinds
    assert final.status == "completed" and final.output_text
    assert final.usage is not None and final.usage.output_tokens > 0
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_stream_sequence_numbers_and_incomplete_end(http: httpx.Client) -> None:
    body = {"model": MODEL, "input": "Hi!", "stream": True, "max_output_tokens": 3, "temperature": 0}
    with http.stream("POST", "/v1/responses", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line.removeprefix("data: ")) for line in lines]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["response"]["usage"]["output_tokens"] == 3


def test_function_call_output_is_fed_back(client: openai.OpenAI, http: httpx.Client) -> None:
    items = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city":"Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "It is sunny and 25 degrees."},
    ]
    response = create(client, items, tools=TOOLS, max_output_tokens=32)
    prompt = prompt_of(http, response.id)["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nIt is sunny and 25 degrees.\n</tool_response>" in prompt
    assert "25" in response.output_text or "sunny" in response.output_text.lower()
    kinds = [item.type for item in client.responses.input_items.list(response.id, order="asc").data]
    assert kinds == ["message", "function_call", "function_call_output"]


def test_a_forced_call_then_its_output_continues_the_conversation(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    asked = create(
        client,
        "What is the weather in Paris?",
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=64,
    )
    (call,) = asked.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert isinstance(json.loads(call.arguments), dict)
    assert asked.status == "completed"
    output = {
        "type": "function_call_output",
        "call_id": call.call_id,
        "output": "It is sunny and 25 degrees.",
    }
    answer = create(client, [output], asked.id, tools=TOOLS, max_output_tokens=32)
    prompt = prompt_of(http, answer.id)
    # Our tool prompt writes the call back as JSON of its own, so the previous prompt (not its
    # output) is what the new one extends.
    assert prompt["prompt_source"] == "extended"
    assert "What is the weather in Paris?" in prompt["prompt"] and "get_weather" in prompt["prompt"]
    assert "<tool_response>\nIt is sunny and 25 degrees.\n</tool_response>" in prompt["prompt"]
    reused = (asked.usage.input_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert answer.usage.input_tokens_details.cached_tokens >= reused
    # the same call, streamed: function-call argument events, parsed by the SDK helper
    with client.responses.stream(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=64,
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    (streamed,) = final.output
    assert streamed.type == "function_call" and streamed.arguments == call.arguments
    assert client.responses.retrieve(final.id).output[0].arguments == call.arguments  # type: ignore[union-attr]


def test_responses_refusals(http: httpx.Client) -> None:
    def post(body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
        return http.post("/v1/responses", json={"model": MODEL, **body}, headers=headers)

    media = {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}
    cases = [
        ({}, "input"),
        ({"input": [media]}, "input[0].content[0]"),
        ({"input": "Hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"input": "Hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
        ({"input": "Hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"input": "Hi", "priority": "urgent"}, "priority"),
    ]
    for body, param in cases:
        response = post(body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param
    response = post({"input": "Hi"}, headers={"x-argosy-qos": "urgent"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "x-argosy-qos"
    degraded = post({"input": "Hi", "max_output_tokens": 2, "include": ["file_search_call.results"]})
    assert degraded.status_code == 200 and degraded.headers["x-argosy-degraded"] == "include"


def test_qos_and_batch_invariant_fields_on_chat_and_completions(http: httpx.Client) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 4}
    completion = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        ok = http.post(path, json={**body, "priority": "background", "batch_invariant": True})
        assert ok.status_code == 200, ok.text
        assert http.post(path, json=body, headers={"x-argosy-qos": "inline"}).status_code == 200
        bad = http.post(path, json={**body, "priority": 3})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
        bad = http.post(path, json=body, headers={"x-argosy-qos": "realtime"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-argosy-qos"


# -- admission, QoS, time limit (servers of their own) ---------------------------------------


@pytest.fixture
def own_server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    server = ServerProcess(served_model_name=MODEL, **request.param).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize(
    "own_server", [{"max_num_seqs": 1, "extra_flags": ["--max-queued-requests", "1"]}], indirect=True
)
def test_a_full_queue_answers_503_with_retry_after(own_server: ServerProcess) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 24,
        "ignore_eos": True,
    }

    def post(_: int) -> httpx.Response:
        return httpx.post(f"{own_server.base_url}/v1/chat/completions", json=body, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(post, range(8)))
    refused = [r for r in responses if r.status_code == 503]
    accepted = [r for r in responses if r.status_code == 200]
    assert refused and accepted and len(refused) + len(accepted) == 8
    for response in refused:
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["type"] == "server_error"
    for response in accepted:
        assert response.json()["usage"]["completion_tokens"] == 24
    stats = httpx.get(f"{own_server.base_url}/v1/argosy/engine").json()
    assert stats["num_queued"] == 0


@pytest.mark.parametrize("own_server", [{"kv_cache_memory": "4M"}], indirect=True)
def test_background_is_preempted_by_interactive_and_still_completes(own_server: ServerProcess) -> None:
    url = own_server.base_url
    blocks = httpx.get(f"{url}/v1/argosy/engine").json()["num_total_blocks"]
    tokens = blocks * BLOCK_SIZE

    def chat(priority: str, max_tokens: int) -> httpx.Response:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "priority": priority,
        }
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        background = pool.submit(chat, "background", tokens - 64)
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/v1/argosy/engine").json()["num_running"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # it runs alone first; interactive ones join, grow, and need its blocks
        interactive = [pool.submit(chat, "interactive", tokens // 4) for _ in range(3)]
        for future in [background, *interactive]:
            response = future.result()
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["finish_reason"] == "length"
    stats = httpx.get(f"{url}/v1/argosy/engine").json()
    assert stats["num_preemptions"] >= 1
    assert background.result().json()["usage"]["completion_tokens"] == tokens - 64


@pytest.mark.parametrize("own_server", [{"extra_flags": ["--request-timeout", "1"]}], indirect=True)
def test_request_timeout_ends_with_length_and_says_so(own_server: ServerProcess) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 4000,
        "ignore_eos": True,
    }
    response = httpx.post(f"{own_server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200
    assert response.json()["choices"][0]["finish_reason"] == "length"
    assert response.headers["x-argosy-degraded"] == "request_timeout"
    assert 0 < response.json()["usage"]["completion_tokens"] < 4000
    with httpx.stream(
        "POST", f"{own_server.base_url}/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as streamed:
        lines = list(streamed.iter_lines())
    assert ": x-argosy-degraded: request_timeout" in lines
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"


# -- crash safety ------------------------------------------------------------------------------


def test_kill_9_keeps_committed_turns_and_the_conversation_continues(tmp_path: Any) -> None:
    server = ServerProcess(served_model_name=MODEL, data_dir=tmp_path).start()
    try:
        client = client_for(server)
        first = create(client, SECRET_TURNS[0])
        second = create(client, SECRET_TURNS[1], first.id)
        # a generation under way when the server dies: its input is committed, its output not
        body = {
            "model": MODEL,
            "input": "Tell me a long story.",
            "previous_response_id": second.id,
            "max_output_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{server.base_url}/v1/responses", json=body, timeout=60) as streamed:
            lines = streamed.iter_lines()
            created = next(line for line in lines if line.startswith("data: "))
            next(line for line in lines if "output_text.delta" in line)
            server.kill()
        interrupted_id = json.loads(created.removeprefix("data: "))["response"]["id"]
    finally:
        server.kill()
    server.port = 0
    server.start()
    try:
        client = client_for(server)
        assert client.responses.retrieve(first.id).output_text == first.output_text
        again = client.responses.retrieve(second.id)
        assert again.output_text == second.output_text and again.previous_response_id == first.id
        interrupted = client.responses.retrieve(interrupted_id)
        assert interrupted.status == "failed" and interrupted.output == []
        # both continue: the stored one, and the interrupted one (its turn has no answer)
        with httpx.Client(base_url=server.base_url) as http:
            for previous in (second.id, interrupted_id):
                follow = create(client, SECRET_TURNS[3], previous)
                prompt = prompt_of(http, follow.id)["prompt"]
                assert SECRET_TURNS[0] in prompt and first.output_text in prompt
            assert "Tell me a long story." in prompt
    finally:
        server.stop()
