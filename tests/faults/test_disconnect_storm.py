"""Disconnect storm: 200 streaming clients that hang up at random points (before the first
byte, after a few chunks, mid-generation). Once they are gone, every KV block is free again
and no request is left running or waiting in the engine."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.faults.live import MODEL, LiveServer

NUM_CLIENTS = 200
SETTLE_S = 5.0  # a bound on the test (cancellation reaches the engine within one step)


@pytest.fixture
def live() -> Iterator[LiveServer]:
    server = LiveServer(server_options={"max_queued_requests": NUM_CLIENTS}).start()
    try:
        yield server
    finally:
        server.stop()


async def client(base_url: str, index: int, rng: random.Random) -> str:
    """One client: hangs up after a random number of chunks (0: right after sending)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Story number {index}, please."}],
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
    }
    read_chunks = rng.choice([0, 0, 1, 2, 5, 10, 20])
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        if read_chunks == 0:
            try:
                await asyncio.wait_for(http.post("/v1/chat/completions", json=body), rng.uniform(0.01, 0.5))
            except TimeoutError:
                return "hung up before the first byte"
            return "finished before the hang-up"
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            seen = 0
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen >= read_chunks:
                        return f"hung up after {seen} chunks"
    return "stream ended"


def test_every_block_is_free_after_the_storm(live: LiveServer) -> None:
    rng = random.Random(7)

    async def storm() -> list[str]:
        return await asyncio.gather(*(client(live.base_url, i, rng) for i in range(NUM_CLIENTS)))

    outcomes = asyncio.run(storm())
    assert sum(o.startswith("hung up") for o in outcomes) > NUM_CLIENTS // 2
    deadline = time.monotonic() + SETTLE_S
    while True:
        stats = httpx.get(f"{live.base_url}/v1/argosy/engine").json()
        settled = (
            stats["num_free_blocks"] == stats["num_total_blocks"]
            and stats["num_running"] == stats["num_waiting"] == stats["num_in_flight"] == 0
            and stats["num_queued"] == 0
        )
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert settled, stats
    answer = httpx.post(
        f"{live.base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        timeout=60,
    )
    assert answer.status_code == 200  # and the server still serves
