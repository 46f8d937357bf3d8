"""The graceful stop (argosy/core/drain.py): the drain's states, the abort of live generations
(CoreStream.abort over a tiny real engine), and the HTTP edge while draining (503s in each
dialect's envelope, /health)."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from starlette.testclient import TestClient

from argosy.api.app import build_app
from argosy.api.errors import anthropic_status_of, ollama_status_of, status_of
from argosy.api.server import DrainingServer
from argosy.chat.events import TextDelta
from argosy.config import ModelSpec, ServerConfig
from argosy.core.drain import Drain
from argosy.core.registry import ModelRegistry
from argosy.core.service import ModelService, ServiceOptions
from argosy.core.stream import CoreRequest
from argosy.engine.async_engine import AsyncEngine
from argosy.errors import ArgosyError, ServerDrainingError
from argosy.sampling_params import RequestSampling
from tests.unit.blocked_load import BlockedLoad

# -- the state machine ----------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_begin_starts_the_grace_once_and_force_ends_it() -> None:
    clock = FakeClock()
    drain = Drain(30.0, clock=clock)
    assert drain.state == "serving" and drain.is_serving
    assert drain.grace_left_s() == 30.0
    assert drain.begin() is True
    assert drain.state == "draining" and not drain.is_serving
    clock.now += 12.2
    assert drain.grace_left_s() == pytest.approx(17.8)
    assert drain.retry_after_s() == 18  # until this process is gone at the latest
    assert drain.begin() is False  # a second begin changes nothing
    assert drain.grace_left_s() == pytest.approx(17.8)
    drain.force()
    assert drain.grace_left_s() == 0.0
    assert drain.retry_after_s() == 1  # never 0


def test_force_before_begin_begins_with_no_grace() -> None:
    drain = Drain(30.0, clock=FakeClock())
    drain.force()
    assert drain.state == "draining" and drain.grace_left_s() == 0.0


def test_a_negative_grace_is_refused() -> None:
    with pytest.raises(ValueError):
        Drain(-1.0)


def test_the_refusal_and_the_abort_are_503s_in_every_dialect() -> None:
    drain = Drain(30.0, clock=FakeClock())
    drain.begin()
    refusal, abort = drain.refusal(), drain.abort_error()
    for error in (refusal, abort):
        assert isinstance(error, ServerDrainingError)
        assert error.kind == "draining" and error.code == "server_draining"
        assert status_of(error) == anthropic_status_of(error) == ollama_status_of(error) == 503
    assert refusal.retry_after_s == 30
    assert "shutting down" in refusal.message and "30 s" in abort.message


class Work:
    """Live generations a drain waits for: `abort` stops `abortable` of them at once."""

    def __init__(self, num_live: int, abortable: bool = True) -> None:
        self.num_live = num_live
        self.abortable = abortable
        self.aborts: list[ArgosyError] = []

    def live(self) -> int:
        return self.num_live

    def abort(self, error: ArgosyError) -> int:
        self.aborts.append(error)
        stopped = self.num_live if self.abortable else 0
        self.num_live -= stopped
        return stopped


def test_an_idle_server_stops_at_once() -> None:
    drain = Drain(30.0)
    started = time.monotonic()
    asyncio.run(drain.run())
    assert drain.state == "stopped"
    assert time.monotonic() - started < 0.5
    assert drain.num_aborted == 0


def test_requests_that_finish_within_the_grace_are_waited_for_not_aborted() -> None:
    drain = Drain(5.0)
    work = Work(num_live=1)
    drain.request_started()
    drain.request_started()
    states: list[str] = []

    async def scenario() -> None:
        running = asyncio.create_task(drain.run(work.live, work.abort))
        await asyncio.sleep(0.2)
        states.append(drain.state)
        drain.request_finished()
        work.num_live = 0  # the background generation ends on its own
        await asyncio.sleep(0.2)
        states.append(drain.state)
        drain.request_finished()
        await asyncio.wait_for(running, 1.0)

    started = time.monotonic()
    asyncio.run(scenario())
    assert states == ["draining", "draining"]
    assert drain.state == "stopped"
    assert work.aborts == [] and drain.num_aborted == 0
    assert time.monotonic() - started < 2.0


def test_work_past_the_grace_is_aborted_then_waited_for() -> None:
    drain = Drain(0.3)
    work = Work(num_live=3)
    drain.request_started()  # a streaming request: it ends once its generation is aborted

    def abort(error: ArgosyError) -> int:
        stopped = work.abort(error)
        if stopped:
            asyncio.get_running_loop().call_later(0.1, drain.request_finished)
        return stopped

    started = time.monotonic()
    asyncio.run(drain.run(work.live, abort))
    elapsed = time.monotonic() - started
    assert drain.state == "stopped"
    assert 0.3 <= elapsed < 1.5
    assert drain.num_aborted == 3
    assert isinstance(work.aborts[0], ServerDrainingError)
    assert drain.num_requests == 0


def test_a_second_signal_aborts_at_once() -> None:
    drain = Drain(30.0)
    work = Work(num_live=2)

    async def scenario() -> None:
        running = asyncio.create_task(drain.run(work.live, work.abort))
        await asyncio.sleep(0.1)
        assert drain.state == "draining" and not work.aborts
        drain.force()
        await asyncio.wait_for(running, 2.0)

    asyncio.run(scenario())
    assert drain.state == "stopped" and drain.num_aborted == 2
    assert drain.is_forced and "second signal" in work.aborts[0].message


def test_work_that_will_not_end_is_given_up_after_the_abort_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("argosy.core.drain.ABORT_WAIT_S", 0.3)
    drain = Drain(0.1)
    work = Work(num_live=1, abortable=False)  # e.g. a client that stopped reading
    started = time.monotonic()
    asyncio.run(drain.run(work.live, work.abort))
    assert drain.state == "stopped"
    assert 0.4 <= time.monotonic() - started < 1.5
    assert len(work.aborts) > 1  # tried again on every poll


# -- aborting live generations (CoreStream.abort) -------------------------------------------------

PROMPT = [5, 17, 42, 8, 99, 3, 250, 11]
on_tiny_llama = pytest.mark.parametrize("tiny", ["llama"], indirect=True)


@pytest.fixture
def service(tiny) -> Iterator[ModelService]:  # type: ignore[no-untyped-def]
    engine = AsyncEngine(tiny.engine(max_model_len=256))
    service = ModelService("tiny", engine, ServiceOptions())
    try:
        yield service
    finally:
        engine.shutdown()


@on_tiny_llama
def test_abort_ends_every_live_stream_with_the_error_and_stops_the_engine(service: ModelService) -> None:
    sampling = RequestSampling(temperature=0.0, max_tokens=200, ignore_eos=True)
    streams = [service.start(CoreRequest(prompts=[PROMPT], sampling=sampling, n=2)) for _ in range(3)]
    assert len(service.live_streams) == 3
    engine = service.require_engine()
    error = ServerDrainingError("shutting down")

    async def read(stream: Any) -> tuple[int, BaseException | None]:
        num_deltas = 0
        try:
            async with stream:
                async for event in stream:
                    num_deltas += isinstance(event, TextDelta)
                    if stream.usage.completion_tokens >= 3 and stream is streams[0] and not stream.is_aborted:
                        assert service.abort_streams(error) == 3
                        assert service.abort_streams(error) == 0  # once each
                    # the readers take turns: under load the events queue up, and a reader that
                    # never yields could read a whole stream before the first one aborts
                    await asyncio.sleep(0)
        except ArgosyError as exc:
            return num_deltas, exc
        return num_deltas, None

    async def scenario() -> list[tuple[int, BaseException | None]]:
        results = await asyncio.gather(*(read(stream) for stream in streams))
        deadline = time.monotonic() + 5.0
        while engine.num_in_flight() or engine.engine.has_unfinished():
            assert time.monotonic() < deadline, "the engine still runs the aborted requests"
            await asyncio.sleep(0.01)
        return results

    results = asyncio.run(scenario())
    for _, raised in results:
        assert isinstance(raised, ServerDrainingError), results
        assert raised is not error and raised.message == error.message  # each reader its own
    assert all(stream.usage.completion_tokens < 400 for stream in streams)  # 2 choices x 200
    assert all(stream.is_aborted for stream in streams)
    assert len(service.live_streams) == 0  # closed streams leave the set


@on_tiny_llama
def test_the_registry_counts_and_aborts_the_live_streams_of_its_models(service: ModelService) -> None:
    registry = ModelRegistry([ModelSpec("tiny", "tiny")], lambda spec: service)
    entry = registry.entries[0]
    entry.service, entry.state = service, "loaded"
    sampling = RequestSampling(temperature=0.0, max_tokens=50, ignore_eos=True)
    stream = service.start(CoreRequest(prompts=[PROMPT], sampling=sampling))
    assert registry.num_live_streams() == 1
    assert registry.abort_streams(ServerDrainingError("bye")) == 1

    async def read() -> None:
        async with stream:
            async for _ in stream:
                pass

    with pytest.raises(ServerDrainingError):
        asyncio.run(read())
    assert registry.num_live_streams() == 0


# -- the HTTP edge while draining ----------------------------------------------------------------


@pytest.fixture
def draining_client() -> Iterator[tuple[TestClient, Drain]]:
    load = BlockedLoad()
    registry = ModelRegistry([ModelSpec("smollm2", "smollm2")], load, load_timeout_s=0.3)
    app = build_app(registry, ServerConfig(shutdown_grace=20.0))
    try:
        with TestClient(app, raise_server_exceptions=False) as client:
            yield client, app.state.drain
    finally:
        load.released.set()


CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}


def test_new_requests_get_503_in_their_dialect_and_health_says_draining(
    draining_client: tuple[TestClient, Drain],
) -> None:
    client, drain = draining_client
    assert client.get("/health").json()["status"] in ("loading", "failed")
    assert drain.begin()

    openai = client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "drain-1"})
    assert openai.status_code == 503
    assert 19 <= int(openai.headers["retry-after"]) <= 20
    assert openai.headers["connection"] == "close"
    assert openai.headers["x-request-id"] == "drain-1"
    error = openai.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "server_error" and error["code"] == "server_draining"
    assert "shutting down" in error["message"]

    anthropic = client.post("/v1/messages", json={**CHAT, "max_tokens": 8})
    assert anthropic.status_code == 503 and "retry-after" in anthropic.headers
    assert anthropic.json()["type"] == "error"
    assert anthropic.json()["error"]["type"] == "overloaded_error"

    ollama = client.post("/api/chat", json=CHAT)
    assert ollama.status_code == 503 and "retry-after" in ollama.headers
    assert set(ollama.json()) == {"error"} and "shutting down" in ollama.json()["error"]

    assert client.get("/v1/models").status_code == 503  # every route but /health

    health = client.get("/health")
    assert health.status_code == 503
    body = health.json()
    assert body["status"] == "draining" and body["num_in_flight"] == 0
    assert 0 < body["grace_left_s"] <= 20.0
    assert set(body["models"]) == {"smollm2"}
    assert drain.num_requests == 0  # refusals are not in flight


def test_requests_in_flight_are_counted_until_they_end(draining_client: tuple[TestClient, Drain]) -> None:
    client, drain = draining_client
    seen: list[int] = []
    original = drain.request_finished

    def finished() -> None:
        seen.append(drain.num_requests)
        original()

    drain.request_finished = finished  # type: ignore[method-assign]
    client.get("/v1/models")
    client.get("/health")  # not counted
    assert seen == [1] and drain.num_requests == 0


# -- the signals (DrainingServer) -----------------------------------------------------------------


def test_signals_drain_then_cut_the_grace_then_force_the_exit() -> None:
    drain = Drain(30.0)
    work = Work(num_live=1)
    server = DrainingServer(uvicorn.Config(app=None), drain, live=work.live, abort=work.abort)
    server.handle_exit(signal.SIGTERM, None)  # before start-up: nothing to drain
    assert server.should_exit and drain.is_serving
    server.should_exit = False

    async def scenario() -> None:
        server._loop = asyncio.get_running_loop()
        server.handle_exit(signal.SIGTERM, None)  # as the signal handler does: via the loop
        await asyncio.sleep(0.1)
        assert drain.state == "draining" and not server.should_exit and not work.aborts
        server.handle_exit(signal.SIGINT, None)
        for _ in range(40):
            if server.should_exit:
                break
            await asyncio.sleep(0.05)
        assert drain.state == "stopped" and server.should_exit and not server.force_exit
        assert len(work.aborts) == 1
        server.handle_exit(signal.SIGINT, None)  # a third: uvicorn stops waiting for connections
        await asyncio.sleep(0.05)
        assert server.force_exit

    asyncio.run(scenario())
    assert server._captured_signals == []  # none re-raised at exit: a drained server exits 0
