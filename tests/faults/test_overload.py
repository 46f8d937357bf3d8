"""Overload: a burst of 10x what the admission queue holds. The excess gets 503 with
Retry-After at once; every admitted request completes (none is lost, none runs past the
request timeout)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import httpx
import pytest

from tests.faults.live import MODEL, LiveServer

QUEUE = 4
BURST = 10 * QUEUE


@pytest.fixture
def live() -> Iterator[LiveServer]:
    options = {"max_queued_requests": QUEUE, "request_timeout": 120.0}
    server = LiveServer(server_options=options).start()
    try:
        yield server
    finally:
        server.stop()


def test_a_burst_past_the_queue_is_refused_cleanly_and_the_rest_complete(live: LiveServer) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 16}

    def post(index: int) -> httpx.Response:
        return httpx.post(f"{live.base_url}/v1/chat/completions", json=body, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(BURST) as pool:
        responses = list(pool.map(post, range(BURST)))
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 503}, statuses
    refused = [r for r in responses if r.status_code == 503]
    served = [r for r in responses if r.status_code == 200]
    assert refused and len(served) >= QUEUE
    for response in refused:
        assert int(response.headers["retry-after"]) >= 1
        assert response.json()["error"]["type"] == "server_error"
    for response in served:
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] in ("stop", "length") and choice["message"]["content"] is not None
        assert "request_timeout" not in response.headers.get("x-argosy-degraded", "")
