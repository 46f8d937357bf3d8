"""The core over a tiny random Llama: every generation recorded in a session (n samples as
forks of one conversation), the admission bound, the wall-clock limit, batch_invariant."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from argosy.chat.events import Finish
from argosy.config import ModelSpec, ServerConfig
from argosy.core.recording import SessionRecorder, SessionSpec
from argosy.core.service import ModelService, ServiceOptions
from argosy.core.stream import CoreRequest, CoreStream
from argosy.engine.async_engine import AsyncEngine
from argosy.errors import OverloadedError
from argosy.sampling_params import RequestSampling
from argosy.sessions import Finished, MessageAppended, SpanGenerated, SqliteSessionStore

PROMPT = [5, 17, 42, 8, 99, 3, 250, 11]
on_tiny_llama = pytest.mark.parametrize("tiny", ["llama"], indirect=True)


def make_core(tiny, tmp_path: Path, **server: object) -> Iterator[ModelService]:  # type: ignore[no-untyped-def]
    engine = AsyncEngine(tiny.engine(max_model_len=128))
    options = ServiceOptions.of(ModelSpec("tiny", "tiny"), ServerConfig(**server), "none")  # type: ignore[arg-type]
    sessions = SessionRecorder(SqliteSessionStore(tmp_path / "sessions.sqlite3"))
    core = ModelService("tiny", engine, options, sessions=sessions)
    try:
        yield core
    finally:
        engine.shutdown()
        sessions.close()


@pytest.fixture
def core(tiny, tmp_path: Path) -> Iterator[ModelService]:  # type: ignore[no-untyped-def]
    yield from make_core(tiny, tmp_path)


def run(stream: CoreStream) -> list[object]:
    async def drain() -> list[object]:
        async with stream:
            events = [event async for event in stream]
        assert stream.record is not None and stream.record.committed is not None
        await asyncio.wrap_future(stream.record.committed)
        return events

    return asyncio.run(drain())


def sampling(max_tokens: int) -> RequestSampling:
    return RequestSampling(temperature=1.0, seed=1, max_tokens=max_tokens, ignore_eos=True)


@on_tiny_llama
def test_n_samples_are_forks_of_one_recorded_conversation(core: ModelService) -> None:
    spec = SessionSpec(
        inputs=[[MessageAppended("user", "hi")]], metadata={"kind": "test"}, is_ephemeral=False
    )
    stream = core.start(CoreRequest(prompts=[PROMPT], sampling=sampling(5), n=2, session=spec))
    run(stream)
    assert stream.record is not None and stream.record.committed is not None
    base, fork = stream.record.committed.result()
    assert core.sessions is not None
    store = core.sessions.store
    for session_id in (base, fork):
        events = [stored.event for stored in store.read(session_id)]
        assert events[0] == MessageAppended("user", "hi")
        spans = [e for e in events if isinstance(e, SpanGenerated)]
        assert sum(len(span.token_ids) for span in spans) == 5  # every generated id, once
        assert events[-1] == Finished(
            "length", {"prompt_tokens": len(PROMPT), "completion_tokens": 5, "cached_tokens": 0}
        )
    session = store.get(fork)
    assert session is not None and session.parent is not None
    assert (session.parent.session_id, session.parent.at_event) == (base, 1)


@on_tiny_llama
def test_a_request_without_a_spec_records_its_prompt_ids(core: ModelService) -> None:
    stream = core.start(CoreRequest(prompts=[PROMPT], sampling=sampling(2), route="POST /test"))
    run(stream)
    assert stream.record is not None and stream.record.committed is not None
    (session_id,) = stream.record.committed.result()
    assert core.sessions is not None
    session = core.sessions.store.get(session_id)
    assert session is not None and session.is_ephemeral and session.metadata["route"] == "POST /test"
    first = core.sessions.store.read(session_id)[0].event
    assert first == MessageAppended("prompt", [{"type": "token_ids", "token_ids": PROMPT}])


@on_tiny_llama
def test_batch_invariant_reaches_the_sampling_params(core: ModelService) -> None:
    stream = core.start(CoreRequest(prompts=[PROMPT], sampling=sampling(2), batch_invariant=True))
    assert all(choice.params.batch_invariant for choice in stream.choices)
    run(stream)


@pytest.mark.parametrize("tiny", ["llama"], indirect=True)
def test_admission_bound_counts_requests_not_yet_started(tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    for core in make_core(tiny, tmp_path, max_queued_requests=1):
        waiting = core.start(CoreRequest(prompts=[PROMPT], sampling=sampling(2), n=3))
        with pytest.raises(OverloadedError):
            core.start(CoreRequest(prompts=[PROMPT], sampling=sampling(2)))
        run(waiting)
        assert core.admission.num_waiting == 0
        run(core.start(CoreRequest(prompts=[PROMPT], sampling=sampling(2))))


@pytest.mark.parametrize("tiny", ["llama"], indirect=True)
def test_the_time_limit_finishes_with_length_and_stops_the_engine(tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    for core in make_core(tiny, tmp_path, request_timeout=0.001):
        stream = core.start(CoreRequest(prompts=[PROMPT], sampling=sampling(100), n=2))
        time.sleep(0.01)  # the deadline counts from arrival
        events = run(stream)
        finishes = [e for e in events if isinstance(e, Finish)]
        assert sorted(f.index for f in finishes) == [0, 1]
        assert all(f.reason == "length" for f in finishes)
        assert stream.degraded == ["request_timeout"]
        engine = core.require_engine()
        deadline = time.monotonic() + 2.0
        while engine.num_in_flight() or engine.engine.has_unfinished():
            assert time.monotonic() < deadline, "the engine still runs the timed-out requests"
            time.sleep(0.01)
        assert stream.record is not None
        last = [output[-1] for output in stream.record.outputs]
        assert all(isinstance(event, Finished) and event.reason == "length" for event in last)


@on_tiny_llama
def test_a_store_that_fails_never_breaks_the_generation(core: ModelService) -> None:
    assert core.sessions is not None
    core.sessions.close()  # every write now fails: the writer is shut down

    async def drain(stream: CoreStream) -> list[object]:
        async with stream:
            return [event async for event in stream]

    stream = core.start(CoreRequest(prompts=[PROMPT], sampling=sampling(3)))
    events = asyncio.run(drain(stream))
    assert [e.reason for e in events if isinstance(e, Finish)] == ["length"]
    assert stream.record is not None and stream.record.committed is None
