"""The core over a real (tiny, random-weight) Llama engine: n > 1 fan-out, usage, echo with
prompt logprobs, checks before the engine, and abort when the stream is left early."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from argosy.chat.events import Finish, PromptEcho, TextDelta
from argosy.core.service import ModelService, ServiceOptions, _offset_seed
from argosy.core.stream import CoreRequest, collect
from argosy.engine.async_engine import AsyncEngine
from argosy.errors import ContextLengthExceededError, InvalidRequestError
from argosy.sampling_params import RequestSampling

PROMPT = [5, 17, 42, 8, 99, 3, 250, 11]


@pytest.fixture
def core(tiny) -> Iterator[ModelService]:  # type: ignore[no-untyped-def]
    engine = AsyncEngine(tiny.engine(max_model_len=128))
    core = ModelService("tiny", engine, ServiceOptions())
    try:
        yield core
    finally:
        engine.shutdown()


on_tiny_llama = pytest.mark.parametrize("tiny", ["llama"], indirect=True)


def test_seed_offsets_stay_in_torch_range() -> None:
    assert _offset_seed(7, 1) == 8
    assert _offset_seed(2**64 - 1, 1) == 0
    assert _offset_seed(-1, 1) == 0
    assert _offset_seed(-5, 2) == -3


@on_tiny_llama
def test_n_choices_and_usage(core: ModelService) -> None:
    sampling = RequestSampling(temperature=1.0, seed=3, max_tokens=5, ignore_eos=True, logprobs=1)
    stream = core.start(CoreRequest(prompts=[PROMPT, PROMPT[:5]], sampling=sampling, n=2))
    assert [c.params.seed for c in stream.choices] == [3, 4, 3, 4]

    async def run() -> list[object]:
        async with stream:
            return [event async for event in stream]

    events = asyncio.run(run())
    finishes = [e for e in events if isinstance(e, Finish)]
    assert sorted(f.index for f in finishes) == [0, 1, 2, 3]
    assert all(f.reason == "length" and f.usage.completion_tokens == 5 for f in finishes)
    usage = stream.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPT) + 5, 20)
    entries = [e for e in events if isinstance(e, TextDelta) for _ in e.logprobs or []]
    assert len(entries) == 20


@on_tiny_llama
def test_collect_and_echo_with_prompt_logprobs(core: ModelService) -> None:
    sampling = RequestSampling(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    stream = core.start(CoreRequest(prompts=[PROMPT], sampling=sampling, echo=True))

    async def run():  # type: ignore[no-untyped-def]
        async with stream:
            return await collect(stream)

    (result,) = asyncio.run(run())
    assert isinstance(result.echo, PromptEcho)
    assert result.echo.logprobs is not None and len(result.echo.logprobs) == len(PROMPT)
    assert result.echo.logprobs[0].chosen.logprob is None
    assert all(e.chosen.logprob is not None for e in result.echo.logprobs[1:])
    assert [e.chosen.token_id for e in result.echo.logprobs] == PROMPT
    assert result.logprobs is not None and len(result.logprobs) == 3
    assert result.finish_reason == "length"


@on_tiny_llama
def test_refusals_happen_before_the_engine(core: ModelService) -> None:
    llm = core.require_engine().engine  # type: ignore[attr-defined]
    with pytest.raises(ContextLengthExceededError) as caught:
        core.start(
            CoreRequest(prompts=[PROMPT], sampling=RequestSampling(max_tokens=1000), prompt_param="messages")
        )
    assert caught.value.param == "max_tokens"
    with pytest.raises(ContextLengthExceededError) as caught:
        core.start(CoreRequest(prompts=[[1] * 200], sampling=RequestSampling(), prompt_param="messages"))
    assert caught.value.param == "messages"
    with pytest.raises(InvalidRequestError) as caught:
        core.start(CoreRequest(prompts=[PROMPT, [1, 10**6]], sampling=RequestSampling(max_tokens=2)))
    assert caught.value.param == "prompt[1]"
    assert not llm.has_unfinished()


@on_tiny_llama
def test_leaving_the_stream_aborts_the_engine_requests(core: ModelService) -> None:
    sampling = RequestSampling(temperature=0.0, max_tokens=100, ignore_eos=True)
    stream = core.start(CoreRequest(prompts=[PROMPT], sampling=sampling, n=2))
    engine = core.require_engine()

    async def read_a_little() -> None:
        async with stream:
            count = 0
            async for _ in stream:
                count += 1
                if count == 3:
                    break
        deadline = time.monotonic() + 2.0
        while engine.num_in_flight() or engine.engine.has_unfinished():
            assert time.monotonic() < deadline, "the engine still runs the abandoned requests"
            await asyncio.sleep(0.01)

    asyncio.run(read_a_little())
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_slow_reader_is_cut_after_its_buffer_and_the_engine_request_stops(tiny) -> None:  # type: ignore[no-untyped-def]
    engine = AsyncEngine(tiny.engine(max_model_len=128))
    core = ModelService("tiny", engine, ServiceOptions(max_stream_buffer=4))
    try:
        sampling = RequestSampling(max_tokens=60, temperature=0.0, ignore_eos=True)
        stream = core.start(CoreRequest(prompts=[PROMPT], sampling=sampling))

        async def read_late() -> list[object]:
            async with stream:
                deadline = time.monotonic() + 10
                while stream._queue.qsize() < 5 and time.monotonic() < deadline:  # the reader sleeps
                    await asyncio.sleep(0.01)
                return [event async for event in stream]

        events = asyncio.run(read_late())
        finish = events[-1]
        assert isinstance(finish, Finish) and finish.reason == "length"
        assert stream.degraded == ["slow_reader"]
        assert 4 <= stream.usage.completion_tokens < 60  # what was buffered, not the whole budget
        deadline = time.monotonic() + 5.0
        while engine.num_in_flight() or engine.engine.has_unfinished():
            assert time.monotonic() < deadline, "the engine still runs the slow reader's request"
            time.sleep(0.01)
    finally:
        engine.shutdown()


class HeldEngine:
    """The real engine, but each request starts only once `release` is set."""

    def __init__(self, engine: object) -> None:
        self._engine = engine
        self.release = asyncio.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)

    async def generate(self, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
        await self.release.wait()
        async for out in self._engine.generate(*args, **kwargs):  # type: ignore[attr-defined]
            yield out


@on_tiny_llama
def test_heartbeats_come_while_no_output_waits_and_change_nothing_else(core: ModelService) -> None:
    sampling = RequestSampling(temperature=0.0, max_tokens=6, ignore_eos=True)

    async def run(every_s: float | None) -> list[object]:
        stream = core.start(CoreRequest(prompts=[PROMPT], sampling=sampling))
        held = HeldEngine(stream._engine)
        stream._engine = held  # type: ignore[assignment]
        events: list[object] = []
        async with stream:
            source = stream.with_heartbeats(every_s) if every_s is not None else aiter(stream)
            if every_s is None:
                held.release.set()
            async for event in source:
                events.append(event)
                if event is None and events.count(None) == 2:
                    held.release.set()  # two beats while the engine is held: let it run
        return events

    beaten = asyncio.run(run(0.01))
    plain = asyncio.run(run(None))
    assert beaten[:2] == [None, None]
    assert [e for e in beaten if e is not None] == plain  # the same events, only beats added
    assert isinstance(plain[-1], Finish) and plain[-1].usage.completion_tokens == 6
