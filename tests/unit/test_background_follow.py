"""BackgroundJob.follow: replay after a sequence number, then the live events, then the end.

Found by fuzzing: `starting_after` of -131073 made the replay index negative, and the follower
replayed the job's events forever (a busy loop writing to a socket long closed)."""

from __future__ import annotations

import asyncio
from typing import Any

from argosy.api.openai.responses.background import BackgroundJob


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
