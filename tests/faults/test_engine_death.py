"""Engine death: the engine thread raises. Every open stream ends with a framed error event
(no [DONE]), /health turns 503 "dead" at once, and the server does not hang: the next request
reloads the model (the registry discards the dead engine) and is answered."""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from argosy.engine.async_engine import AsyncEngine
from tests.faults.live import MODEL, LiveServer

QUESTION = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture
def live() -> Iterator[LiveServer]:
    server = LiveServer().start()
    try:
        yield server
    finally:
        server.stop()


def engine_of(live: LiveServer) -> AsyncEngine:
    assert live.registry is not None
    engine = live.registry.resolve(MODEL).service.client
    assert isinstance(engine, AsyncEngine)
    return engine


def test_open_streams_get_an_error_frame_and_the_next_request_reloads(live: LiveServer) -> None:
    engine = engine_of(live)
    started = concurrent.futures.ThreadPoolExecutor(3)
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 500, "ignore_eos": True, "stream": True}
    first_chunk = [threading.Event() for _ in range(3)]

    def stream(index: int) -> list[str]:
        with httpx.stream("POST", f"{live.base_url}/v1/chat/completions", json=body, timeout=60) as response:
            lines = []
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                    first_chunk[index].set()
            return lines

    futures = [started.submit(stream, i) for i in range(3)]
    for event in first_chunk:
        assert event.wait(60)

    def broken_step() -> list[object]:
        raise RuntimeError("injected engine fault")

    engine.engine.step = broken_step  # type: ignore[method-assign]
    streams = [future.result(timeout=60) for future in futures]
    for lines in streams:
        assert lines[-1].startswith("data: ") and lines[-2] == "event: error"
        error = json.loads(lines[-1].removeprefix("data: "))["error"]
        assert "injected engine fault" in error["message"]
        assert "data: [DONE]" not in lines
    health = httpx.get(f"{live.base_url}/health")
    assert health.status_code == 503 and health.json()["status"] == "dead"
    answer = httpx.post(
        f"{live.base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": QUESTION, "max_tokens": 4, "temperature": 0},
        timeout=120,
    )
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
    assert engine_of(live) is not engine and not engine.is_alive
    assert httpx.get(f"{live.base_url}/health").json()["status"] == "ok"
