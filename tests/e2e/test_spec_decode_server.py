"""`argosy serve --speculative ngram` on the default model, through the openai client.

A greedy request that copies a given passage must produce the same text as the server
without speculation (both run batch-invariant: alone, no cached prefix), with
usage.speculative showing accepted drafts; streaming delivers the same text; stop strings
cut it the same way; the access log line carries spec=accepted/proposed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.e2e.server import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "smollm2-test"
SOLO = {"batch_invariant": True}
PASSAGE = (
    "The lighthouse at Cape Ellery was built in 1871, after three ships ran aground on the reef "
    "in a single winter. Its tower is made of local granite, cut from a quarry two miles inland "
    "and carried to the coast on ox carts. The first keeper, Thomas Hale, lived in the small "
    "cottage at the foot of the tower with his wife and four children. Every evening he climbed "
    "the one hundred and twelve steps to light the lamp."
)
REPEAT = [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{PASSAGE}"}]


@pytest.fixture(scope="module")
def spec_server() -> Iterator[ServerProcess]:
    server = ServerProcess(served_model_name=MODEL, extra_flags=["--speculative", "ngram"]).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def spec_client(spec_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{spec_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def repeat(client: openai.OpenAI, **options: object) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(  # type: ignore[call-overload, no-any-return]
        model=MODEL, messages=REPEAT, temperature=0, max_tokens=96, extra_body=SOLO, **options
    )


def test_greedy_text_equals_the_plain_server_and_drafts_are_accepted(
    client: openai.OpenAI, spec_client: openai.OpenAI
) -> None:
    plain = repeat(client)
    spec = repeat(spec_client)
    text = spec.choices[0].message.content or ""
    assert "granite" in text  # it does copy the passage
    assert text == plain.choices[0].message.content
    assert spec.choices[0].finish_reason == plain.choices[0].finish_reason
    assert spec.usage is not None and plain.usage is not None
    assert spec.usage.completion_tokens == plain.usage.completion_tokens
    extension = spec.usage.model_dump()["speculative"]
    assert 0 < extension["accepted_tokens"] <= extension["proposed_tokens"]
    assert extension["accepted_tokens"] >= spec.usage.completion_tokens // 3  # it is worth it here
    assert "speculative" not in plain.usage.model_dump()  # only when speculation is on


def test_streaming_delivers_the_same_text_and_usage(spec_client: openai.OpenAI) -> None:
    whole = repeat(spec_client)
    chunks = list(repeat(spec_client, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(deltas) == whole.choices[0].message.content
    assert len(deltas) > 5  # tokens arriving several per step still stream
    usage = chunks[-1].usage
    assert usage is not None and whole.usage is not None
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.model_dump()["speculative"]["accepted_tokens"] > 0


def test_stop_strings_cut_like_the_plain_server(client: openai.OpenAI, spec_client: openai.OpenAI) -> None:
    plain = repeat(client, stop=["granite"])
    spec = repeat(spec_client, stop=["granite"])
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert "granite" not in (spec.choices[0].message.content or "")
    assert spec.choices[0].finish_reason == "stop"
    assert spec.usage is not None and plain.usage is not None
    assert spec.usage.completion_tokens == plain.usage.completion_tokens
    streamed = repeat(spec_client, stop=["granite"], stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == plain.choices[0].message.content


def test_access_log_models_and_engine_counters(spec_server: ServerProcess) -> None:
    with httpx.Client(base_url=spec_server.base_url, timeout=120) as http:
        body = {"model": MODEL, "messages": REPEAT, "max_tokens": 40, "temperature": 0}
        response = http.post("/v1/chat/completions", json=body, headers={"x-request-id": "spec-probe"})
        assert response.status_code == 200
        spec = response.json()["usage"]["speculative"]
        deadline = time.monotonic() + 5
        lines: list[str] = []
        while time.monotonic() < deadline and not lines:
            lines = [ln for ln in spec_server.log_text().splitlines() if "request_id=spec-probe" in ln]
            time.sleep(0.1)
        assert len(lines) == 1
        assert f" spec={spec['accepted_tokens']}/{spec['proposed_tokens']} " in lines[0]
        model = http.get(f"/v1/models/{MODEL}").json()
        assert model["capabilities"]["speculative_decoding"] == "ngram"
        stats = http.get("/v1/argosy/engine").json()
        assert stats["spec_accepted_tokens"] >= spec["accepted_tokens"] > 0
        assert stats["spec_proposed_tokens"] >= spec["proposed_tokens"]
