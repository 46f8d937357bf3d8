"""The gate on a real server: keys through the official clients (Bearer for openai and ollama,
x-api-key for anthropic), per-key requests / tokens per minute and concurrency, the
per-address bucket (clients told apart by X-Forwarded-For from a trusted proxy; loopback
itself exempt), body limits per route, CORS, and every request in the events log.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.e2e.server import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KEYS = """
[[key]]
name = "alice"
key = "sk-alice"

[[key]]
name = "few"
key = "sk-few"
requests_per_minute = 3

[[key]]
name = "thrifty"
key = "sk-thrifty"
tokens_per_minute = 40

[[key]]
name = "single"
key = "sk-single"
max_concurrent = 1

[[key]]
name = "elsewhere"
key = "sk-elsewhere"
models = ["minilm"]
"""
ASK = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("gate")
    (directory / "keys.toml").write_text(KEYS)
    started = ServerProcess(
        extra_flags=[
            "--api-keys",
            str(directory / "keys.toml"),
            "--rate-limit-per-minute",
            "2",
            "--burst",
            "2",
            "--trusted-proxies",
            "127.0.0.1",
            "--max-small-body-bytes",
            "1K",
            "--allowed-origins",
            "https://console.example",
            "--events-log",
            str(directory / "events.jsonl"),
        ],
    )
    started.start()
    try:
        yield started
    finally:
        started.stop()


def events(server: ServerProcess) -> list[dict[str, object]]:
    assert server.data_dir is not None
    path = Path(str(server.flags()[server.flags().index("--events-log") + 1]))
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_keys_through_every_client(server: ServerProcess) -> None:
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # open
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="sk-wrong").models.list()
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="sk-alice")
    assert (
        chat.chat.completions.create(model="smollm2", messages=ASK, max_tokens=4).choices[0].message.content
    )  # type: ignore[arg-type]

    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.base_url, api_key="sk-wrong").messages.create(
            model="smollm2",
            max_tokens=4,
            messages=ASK,  # type: ignore[arg-type]
        )
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="sk-alice")
    assert claude.messages.create(model="smollm2", max_tokens=4, messages=ASK).content  # type: ignore[arg-type]

    with pytest.raises(ollama.ResponseError) as refused:
        ollama.Client(host=server.base_url).list()
    assert refused.value.status_code == 401
    llama = ollama.Client(host=server.base_url, headers={"Authorization": "Bearer sk-alice"})
    assert {m.model for m in llama.list().models} == {"smollm2:latest"}

    with pytest.raises(openai.PermissionDeniedError):  # its key may use minilm only
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="sk-elsewhere").chat.completions.create(
            model="smollm2",
            messages=ASK,
            max_tokens=4,  # type: ignore[arg-type]
        )


def test_requests_per_minute(server: ServerProcess) -> None:
    headers = {"authorization": "Bearer sk-few"}
    statuses = [httpx.get(f"{server.base_url}/v1/models", headers=headers).status_code for _ in range(4)]
    assert statuses == [200, 200, 200, 429]
    refused = httpx.get(f"{server.base_url}/v1/models", headers=headers)
    assert refused.status_code == 429 and 1 <= int(refused.headers["retry-after"]) <= 20
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"


def test_tokens_per_minute(server: ServerProcess) -> None:
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="sk-thrifty", max_retries=0)
    # ignore_eos: the answer's length must not depend on where the model chooses to stop
    first = chat.chat.completions.create(
        model="smollm2",
        messages=ASK,  # type: ignore[arg-type]
        max_tokens=16,
        extra_body={"ignore_eos": True},
    )
    assert first.usage is not None and first.usage.total_tokens > 40  # the minute's 40 tokens, and more
    with pytest.raises(openai.RateLimitError) as limited:
        chat.chat.completions.create(model="smollm2", messages=ASK, max_tokens=16)  # type: ignore[arg-type]
    wait = int(limited.value.response.headers["retry-after"])
    assert 1 <= wait <= 60 * (first.usage.total_tokens - 40) / 40 + 1


def test_concurrent_requests(server: ServerProcess) -> None:
    body = {"model": "smollm2", "messages": ASK, "max_tokens": 64, "stream": True, "ignore_eos": True}
    headers = {"authorization": "Bearer sk-single"}
    started = threading.Event()
    lines: list[str] = []

    def hold() -> None:
        with httpx.stream(
            "POST", f"{server.base_url}/v1/chat/completions", json=body, headers=headers
        ) as stream:
            for line in stream.iter_lines():
                started.set()
                lines.append(line)

    holder = threading.Thread(target=hold)
    holder.start()
    assert started.wait(60)
    second = httpx.get(f"{server.base_url}/v1/models", headers=headers)
    holder.join(60)
    assert second.status_code == 429 and "max_concurrent" in second.json()["error"]["message"]
    assert [line for line in lines if line][-1] == "data: [DONE]"  # the first one was not disturbed
    assert httpx.get(f"{server.base_url}/v1/models", headers=headers).status_code == 200  # its slot is back


def test_per_address_bucket_behind_a_trusted_proxy(server: ServerProcess) -> None:
    def get(client: str | None) -> httpx.Response:
        headers = {"x-api-key": "sk-alice"} | ({"x-forwarded-for": client} if client else {})
        return httpx.get(f"{server.base_url}/api/tags", headers=headers)

    assert [get("203.0.113.7").status_code for _ in range(3)] == [200, 200, 429]
    limited = get("203.0.113.7")
    assert limited.status_code == 429 and limited.json()["error"].startswith(
        "Too many requests from 203.0.113.7"
    )
    assert int(limited.headers["retry-after"]) >= 1
    assert get("198.51.100.9").status_code == 200  # another client has its own bucket
    assert all(get(None).status_code == 200 for _ in range(4))  # loopback itself is exempt


def test_body_limits_per_route(server: ServerProcess) -> None:
    headers = {"x-api-key": "sk-alice"}
    padding = "x" * 2000
    small = httpx.post(
        f"{server.base_url}/api/show", json={"model": "smollm2", "pad": padding}, headers=headers
    )
    assert small.status_code == 413 and isinstance(small.json()["error"], str)
    messages = httpx.post(
        f"{server.base_url}/v1/messages/count_tokens",
        json={"model": "smollm2", "messages": [{"role": "user", "content": padding}]},
        headers=headers,
    )
    assert messages.status_code == 200  # a model route takes up to --max-body-bytes
    show = httpx.post(f"{server.base_url}/api/show", json={"model": "smollm2"}, headers=headers)
    assert show.status_code == 200


def test_cors_and_the_events_log(server: ServerProcess) -> None:
    preflight = httpx.options(
        f"{server.base_url}/v1/chat/completions",
        headers={"origin": "https://console.example", "access-control-request-method": "POST"},
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "https://console.example"
    time.sleep(0.2)
    logged = events(server)
    finished = [e for e in logged if e["kind"] == "finished"]
    assert len(finished) == sum(1 for e in logged if e["kind"] == "started")
    assert {e["status"] for e in finished} >= {200, 401, 403, 413, 429}
    unauthorized = [e for e in finished if e["status"] == 401]
    assert unauthorized and all(
        e["error_kind"] == "unauthorized" and "key_name" not in e for e in unauthorized
    )
    named = {e.get("key_name") for e in finished}
    assert {"alice", "few", "thrifty", "single", "elsewhere"} <= named
    generated = [e for e in finished if e.get("completion_tokens")]
    assert generated and all(e["dialect"] in ("openai", "anthropic", "ollama") for e in generated)
    assert "sk-" not in Path(str(server.flags()[server.flags().index("--events-log") + 1])).read_text()
