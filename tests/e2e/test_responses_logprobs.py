"""Responses API logprobs (`include: ["message.output_text.logprobs"]` with `top_logprobs`)
through the openai client against a real server: created, streamed and retrieved alike, each
body and event checked against OpenAI's spec (tests/openai_schema.py). Short and greedy."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.openai_schema import validate

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "smollm2-test"
LOGPROBS = "message.output_text.logprobs"
REQUEST: dict[str, Any] = dict(
    model=MODEL,
    input="Say hi.",
    temperature=0,
    max_output_tokens=8,
    include=[LOGPROBS],
    top_logprobs=2,
    extra_body={"batch_invariant": True},  # the same tokens streamed or not
)


def text_part(response: dict[str, Any]) -> dict[str, Any]:
    (message,) = [item for item in response["output"] if item["type"] == "message"]
    (part,) = message["content"]
    assert part["type"] == "output_text"
    return part  # type: ignore[no-any-return]


def check_logprobs(logprobs: list[dict[str, Any]], text: str) -> None:
    """One entry per token of `text`, each with 2 alternatives, joining to the text."""
    assert logprobs and text
    for entry in logprobs:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
    assert bytes(b for entry in logprobs for b in entry["bytes"]).decode() == text
    tokens = [entry["token"] for entry in logprobs]
    if not any("\ufffd" in token for token in tokens):  # no character split across tokens
        assert "".join(tokens) == text


def test_a_response_lists_its_tokens_logprobs_and_keeps_them(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    raw = client.responses.with_raw_response.create(**REQUEST)
    assert "include" not in raw.headers.get("x-argosy-degraded", "")
    body = raw.http_response.json()
    validate("Response", body)
    part = text_part(body)
    check_logprobs(part["logprobs"], part["text"])
    # every output token but the end-of-sequence one (a completed answer ends with it)
    assert len(part["logprobs"]) == body["usage"]["output_tokens"] - (body["status"] == "completed")
    assert body["top_logprobs"] == 2
    parsed = raw.parse()  # the SDK reads them too
    assert [lp.token for lp in parsed.output[0].content[0].logprobs or []] == [  # type: ignore[union-attr]
        entry["token"] for entry in part["logprobs"]
    ]
    retrieved = http.get(f"/v1/responses/{body['id']}").json()
    validate("Response", retrieved)
    assert retrieved["output"] == body["output"]


def test_a_streamed_response_carries_logprobs_on_its_text_deltas(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    events = [event.to_dict() for event in client.responses.create(stream=True, **REQUEST)]
    for event in events:
        validate("ResponseStreamEvent", event)
    deltas = [event for event in events if event["type"] == "response.output_text.delta"]
    streamed = [entry for delta in deltas for entry in delta["logprobs"]]
    check_logprobs(streamed, "".join(delta["delta"] for delta in deltas))
    (done,) = [event for event in events if event["type"] == "response.output_text.done"]
    assert done["logprobs"] == streamed
    completed = events[-1]["response"]
    assert text_part(completed)["logprobs"] == streamed
    retrieved = http.get(f"/v1/responses/{completed['id']}").json()
    assert text_part(retrieved)["logprobs"] == streamed
    whole = client.responses.create(**REQUEST).to_dict()
    assert [entry["token"] for entry in text_part(whole)["logprobs"]] == [
        entry["token"] for entry in streamed
    ]


def test_include_values_other_than_logprobs(http: httpx.Client) -> None:
    def post(body: dict[str, Any]) -> httpx.Response:
        return http.post(
            "/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2, **body}
        )

    unknown = post({"include": ["message.output_text.bogus"]})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "include"
    for body, degraded in (
        ({"include": ["file_search_call.results"]}, "include"),  # asks for what no tool here returns
        ({"top_logprobs": 2}, None),  # without the include: no logprobs, as on OpenAI
    ):
        response = post(body)
        assert response.status_code == 200, response.text
        assert response.headers.get("x-argosy-degraded") == degraded
        validate("Response", response.json())
        assert text_part(response.json())["logprobs"] == []
