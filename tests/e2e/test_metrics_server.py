"""GET /metrics on a real server: it parses as Prometheus' text format; its counters move by
exactly the requests and tokens sent (read from each response's own usage); and 1,000
requests naming distinct bogus models, or carrying distinct bogus keys, add no series (only
counter values move), so a client cannot grow the server's metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.server import ServerProcess

MODEL = "smollm2-test"  # conftest's server
OPENAI = {"model": MODEL, "dialect": "openai", "key_name": "none"}
NUM_BOGUS = 1000
KEY = "sk-metrics-test-key"

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(http: httpx.Client, path: str = "/metrics", **headers: str) -> Series:
    response = http.get(path, headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(series: Series, name: str, **labels: str) -> float:
    return series.get((name, tuple(sorted(labels.items()))), 0.0)


def chat(http: httpx.Client, text: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens}
    response = http.post("/v1/chat/completions", json=body | {"temperature": 0})
    assert response.status_code == 200, response.text
    return dict(response.json())


def completion(http: httpx.Client, text: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": text, "max_tokens": max_tokens, "temperature": 0}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_metrics_counters_move_by_the_requests_and_tokens_sent(http: httpx.Client) -> None:
    before = scrape(http)
    assert value(before, "argosy:model_loads_total", model=MODEL) == 1
    assert value(before, "argosy:num_models_loaded") == 1
    answers = [
        chat(http, "Name a colour.", 4),
        chat(http, "Count from one to ten, in words, separated by commas.", 12),
        chat(http, "Say hi.", 1),
        completion(http, "The capital of France is", 6),
        completion(http, "1, 2, 3,", 3),
    ]
    after = scrape(http, "/v1/metrics")

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    prompt_tokens = sum(a["usage"]["prompt_tokens"] for a in answers)
    generation_tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    assert delta("argosy:prompt_tokens_total", **OPENAI) == prompt_tokens
    assert delta("argosy:generation_tokens_total", **OPENAI) == generation_tokens
    assert delta("argosy:http_requests_total", **OPENAI, status="200") == len(answers)
    finishes: dict[str, int] = {}
    for answer in answers:
        reason = answer["choices"][0]["finish_reason"]
        finishes[reason] = finishes.get(reason, 0) + 1
    for reason, count in finishes.items():
        assert delta("argosy:request_success_total", **OPENAI, finished_reason=reason) == count
    assert delta("argosy:time_to_first_token_seconds_count", **OPENAI) == len(answers)
    assert delta("argosy:e2e_request_latency_seconds_count", **OPENAI) == len(answers)
    # every generation waited in the engine's queue for some time, less than until its first token
    assert delta("argosy:request_queue_time_seconds_count", **OPENAI) == len(answers)
    queued_s = delta("argosy:request_queue_time_seconds_sum", **OPENAI)
    assert 0 < queued_s < delta("argosy:time_to_first_token_seconds_sum", **OPENAI)
    # one observation per token after each request's first (no speculation in this server)
    assert delta("argosy:inter_token_latency_seconds_count", **OPENAI) == generation_tokens - len(answers)
    # each prompt is looked up in the prefix cache once, token by token
    assert delta("argosy:prefix_cache_queries_total", model=MODEL) == prompt_tokens
    assert delta("argosy:prefix_cache_hits_total", model=MODEL) >= 0
    assert value(after, "argosy:num_requests_running", model=MODEL) == 0
    assert value(after, "argosy:num_requests_waiting", model=MODEL) == 0
    assert 0 <= value(after, "argosy:kv_cache_usage_perc", model=MODEL) <= 1
    # the first scrape was counted as a request too (its own finish comes after its body)
    assert (
        delta("argosy:http_requests_total", model="none", dialect="argosy", key_name="none", status="200")
        >= 1
    )


async def send_bogus(base_url: str, num: int, keyed: bool) -> list[int]:
    limits = httpx.Limits(max_connections=16)
    async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:
        gate = asyncio.Semaphore(16)

        async def one(index: int) -> int:
            body = {"model": f"bogus-model-{index}", "messages": [{"role": "user", "content": "hi"}]}
            headers = {"x-api-key": f"sk-bogus-{index}"}
            if keyed and index % 2:
                headers = {"authorization": f"Bearer sk-bogus-{index}"}
            async with gate:
                response = await client.post("/v1/chat/completions", json=body, headers=headers)
            return response.status_code

        return list(await asyncio.gather(*(one(index) for index in range(num))))


def names_and_labels(series: Series) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    return set(series)


def test_bogus_models_and_keys_add_no_series(server: ServerProcess, http: httpx.Client) -> None:
    # the series a refusal and a scrape make exist from here on
    asyncio.run(send_bogus(server.base_url, 1, keyed=False))
    scrape(http)
    before = scrape(http)
    statuses = asyncio.run(send_bogus(server.base_url, NUM_BOGUS, keyed=False))
    assert statuses == [404] * NUM_BOGUS
    after = scrape(http)
    assert names_and_labels(after) == names_and_labels(before)
    refused = {"model": "none", "dialect": "openai", "key_name": "none"}
    assert (
        value(after, "argosy:http_requests_total", **refused, status="404")
        - value(before, "argosy:http_requests_total", **refused, status="404")
        == NUM_BOGUS
    )
    assert (
        value(after, "argosy:requests_rejected_total", **refused, reason="not_found")
        - value(before, "argosy:requests_rejected_total", **refused, reason="not_found")
        == NUM_BOGUS
    )


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[ServerProcess]:
    process = ServerProcess(served_model_name=MODEL, extra_flags=["--api-key", KEY]).start()
    try:
        yield process
    finally:
        process.stop()


def test_with_keys_the_key_name_labels_and_bogus_keys_add_no_series(keyed_server: ServerProcess) -> None:
    auth = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=keyed_server.base_url, timeout=120, headers=auth) as http:
        answer = chat(http, "Say hi.", 2)
        asyncio.run(send_bogus(keyed_server.base_url, 1, keyed=True))
        scrape(http)
        before = scrape(http)
        statuses = asyncio.run(send_bogus(keyed_server.base_url, NUM_BOGUS, keyed=True))
        assert statuses == [401] * NUM_BOGUS
        after = scrape(http)
    assert names_and_labels(after) == names_and_labels(before)
    named = {"model": MODEL, "dialect": "openai", "key_name": "key-1"}
    assert value(after, "argosy:prompt_tokens_total", **named) == answer["usage"]["prompt_tokens"]
    assert value(after, "argosy:generation_tokens_total", **named) == answer["usage"]["completion_tokens"]
    keys = {dict(labels).get("key_name") for _, labels in after} - {None}
    assert keys == {"key-1", "none"}
    refused = {"model": "none", "dialect": "openai", "key_name": "none"}
    assert value(after, "argosy:http_requests_total", **refused, status="401") == NUM_BOGUS + 1
