"""Background responses through the openai client: queued -> in_progress -> completed, polled
with GET; cancel; a stream that can be resumed with starting_after; the refusals; and a
background response running when the server dies reads back `failed`, never `in_progress`."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.server import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "smollm2-test"
LONG = {"max_output_tokens": 4000, "extra_body": {"ignore_eos": True}}


def wait_for(client: openai.OpenAI, response_id: str, statuses: set[str], limit_s: float = 120) -> Any:
    deadline = time.monotonic() + limit_s  # a bound on the test, not a speed claim
    while True:
        response = client.responses.retrieve(response_id)
        if response.status in statuses or time.monotonic() > deadline:
            return response
        time.sleep(0.1)


def sse_events(response: httpx.Response) -> list[dict[str, Any]]:
    return [
        json.loads(line.removeprefix("data: ")) for line in response.iter_lines() if line.startswith("data: ")
    ]


def test_a_background_response_is_queued_then_completes_with_the_foreground_text(
    client: openai.OpenAI,
) -> None:
    options: dict[str, Any] = {
        "model": MODEL,
        "input": "Name three colors.",
        "temperature": 0,
        "max_output_tokens": 16,
    }
    # Both compared runs are prefix-cache hits on the same cached blocks: a miss and a hit can
    # still resolve a greedy near-tie differently (the determinism issue, not this one's).
    client.responses.create(**options)
    foreground = client.responses.create(**options)
    created = client.responses.create(background=True, **options)
    assert created.status in ("queued", "in_progress") and created.background is True
    done = wait_for(client, created.id, {"completed", "incomplete", "failed"})
    assert done.status in ("completed", "incomplete") and done.background is True
    assert done.output_text == foreground.output_text
    assert done.usage is not None and done.usage.output_tokens == foreground.usage.output_tokens  # type: ignore[union-attr]


def test_cancel_stops_the_generation_and_keeps_what_it_made(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    created = client.responses.create(model=MODEL, input="Tell me a long story.", background=True, **LONG)
    with http.stream("GET", f"/v1/responses/{created.id}", params={"stream": "true"}) as followed:
        lines = followed.iter_lines()
        next(line for line in lines if "output_text.delta" in line)  # it has generated something
    assert client.responses.retrieve(created.id).status == "in_progress"
    cancelled = client.responses.cancel(created.id)
    assert cancelled.status == "cancelled"
    again = client.responses.retrieve(created.id)
    assert again.status == "cancelled" and again.usage is not None
    assert 0 < again.usage.output_tokens < 4000
    assert client.responses.cancel(created.id).status == "cancelled"  # cancelling again changes nothing
    engine = http.get("/v1/argosy/engine").json()
    assert engine["num_running"] == 0 or engine["num_in_flight"] == 0


def test_a_background_stream_resumes_with_starting_after(client: openai.OpenAI, http: httpx.Client) -> None:
    body = {"model": MODEL, "input": "Count to five.", "temperature": 0, "max_output_tokens": 24}
    with http.stream("POST", "/v1/responses", json={**body, "background": True, "stream": True}) as response:
        assert response.status_code == 200
        first = sse_events(response)
    numbers = [event["sequence_number"] for event in first]
    assert numbers == list(range(len(first)))
    assert first[-1]["type"] in ("response.completed", "response.incomplete")
    response_id = first[0]["response"]["id"]
    with http.stream(
        "GET", f"/v1/responses/{response_id}", params={"stream": "true", "starting_after": 3}
    ) as again:
        resumed = sse_events(again)
    assert resumed == first[4:]
    assert client.responses.retrieve(response_id).output_text == "".join(
        e["delta"] for e in first if e["type"] == "response.output_text.delta"
    )


def test_background_refusals(http: httpx.Client, client: openai.OpenAI) -> None:
    unstored = http.post(
        "/v1/responses", json={"model": MODEL, "input": "x", "background": True, "store": False}
    )
    assert unstored.status_code == 400 and unstored.json()["error"]["param"] == "background"
    encrypted = http.post(
        "/v1/responses", json={"model": MODEL, "input": "x", "include": ["reasoning.encrypted_content"]}
    )
    assert encrypted.status_code == 400 and encrypted.json()["error"]["param"] == "include"
    foreground = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    refused = http.post(f"/v1/responses/{foreground.id}/cancel")
    assert refused.status_code == 400
    no_replay = http.get(f"/v1/responses/{foreground.id}", params={"stream": "true"})
    assert no_replay.status_code == 400 and no_replay.json()["error"]["param"] == "stream"
    assert http.post("/v1/responses/resp_" + "0" * 32 + "/cancel").status_code == 404


def test_a_background_response_running_when_the_server_dies_reads_back_failed(tmp_path: Any) -> None:
    server = ServerProcess(served_model_name=MODEL, data_dir=tmp_path).start()
    try:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        created = client.responses.create(model=MODEL, input="Tell me a long story.", background=True, **LONG)
        assert wait_for(client, created.id, {"in_progress"}).status == "in_progress"
        server.kill()
        server.port = 0
        server.start()
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        after = client.responses.retrieve(created.id)
        assert after.status == "failed" and after.error is not None
        assert "server stopped" in after.error.message
    finally:
        server.stop()
