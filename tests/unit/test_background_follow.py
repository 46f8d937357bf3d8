"""BackgroundJob.follow: replay after a sequence number, then the live events, then the end.

Found by fuzzing: `starting_after` of -131073 made the replay index negative, and the follower
replayed the job's events forever (a busy loop writing to a socket long closed)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from types import SimpleNamespace
from typing import Any

from argosy.api.openai.responses.background import BackgroundJob
from argosy.api.openai.responses.route import _stream_events


async def _finished_job(num_events: int) -> BackgroundJob:
    job = BackgroundJob("k", stream=None)  # type: ignore[arg-type]  # follow() never touches it

    async def events() -> Any:
        for i in range(num_events):
            yield {"type": "response.output_text.delta", "sequence_number": i}

    job.run(events())
    assert job.task is not None
    await job.task
    return job


async def _followed(job: BackgroundJob, starting_after: int | None) -> list[int]:
    """The sequence numbers followed (at most 100: a follower that never ends fails, not hangs)."""
    numbers: list[int] = []
    async for event in job.follow(starting_after):
        numbers.append(event["sequence_number"])
        assert len(numbers) <= 100, f"the follower does not end: {numbers[:12]}..."
    return numbers


def test_follow_replays_after_a_sequence_number_and_ends() -> None:
    async def scenario() -> None:
        job = await _finished_job(5)
        assert await _followed(job, None) == [0, 1, 2, 3, 4]
        assert await _followed(job, 2) == [3, 4]
        assert await _followed(job, 4) == []
        assert await _followed(job, 99) == []
        # a negative number replays everything once and ends (it used to loop forever)
        assert await _followed(job, -131073) == [0, 1, 2, 3, 4]

    asyncio.run(scenario())


class _UncommittedStream:
    """A finished generation (no events left) whose record the store has not committed yet."""

    def __init__(self) -> None:
        self.record = SimpleNamespace(committed=concurrent.futures.Future(), outputs=[])

    async def __aenter__(self) -> _UncommittedStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def __aiter__(self) -> _UncommittedStream:
        return self

    async def __anext__(self) -> Any:
        raise StopAsyncIteration

    async def aclose(self) -> None:
        return None


def test_a_response_is_in_flight_until_its_output_is_stored() -> None:
    """Found by CI: a retrieve between the generation's end and the store's commit saw the key
    out of flight and no finish stored, and read the response back as `failed`."""

    async def scenario() -> None:
        stream, flying = _UncommittedStream(), set[str]()
        events = _stream_events(stream, "k" * 32, {}, flying)  # type: ignore[arg-type]
        assert [(await anext(events))["type"] for _ in range(2)] == [
            "response.created",
            "response.in_progress",
        ]
        final = asyncio.ensure_future(anext(events))
        await asyncio.sleep(0.05)
        assert not final.done() and flying == {"k" * 32}  # waiting for the store, still in flight
        stream.record.committed.set_result([])
        assert (await final)["type"] == "response.failed"  # no Finished recorded in this fake
        assert flying == set()

    asyncio.run(scenario())
