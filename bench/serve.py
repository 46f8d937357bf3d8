"""Serving benchmark: N concurrent streaming chat clients against `argosy serve`.

    python bench/serve.py                      # starts its own server (smollm2)
    python bench/serve.py --url http://127.0.0.1:8000 --concurrency 1,4,16

For each concurrency level every client sends `--requests-per-client` streaming requests
one after another (seeded prompts, `ignore_eos` so each runs exactly `--max-tokens`), after
one warm-up request. Prints one line per figure: TTFT p50/p95 (request sent -> first
content chunk), inter-token latency p50/p95 (gaps between content chunks, first excluded)
and aggregate output tok/s (completion tokens / wall time of the level).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import TOPICS  # noqa: E402  (the seeded prompt topics compare.py uses too)

from tests.e2e.server import ServerProcess  # noqa: E402


@dataclass
class RequestResult:
    ttft_s: float
    gaps_s: list[float] = field(default_factory=list)
    num_tokens: int = 0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


async def one_request(
    http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, seed: int
) -> RequestResult:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.7,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first: float | None = None
    last = sent
    result = RequestResult(ttft_s=0.0)
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("usage"):
                result.num_tokens = chunk["usage"]["completion_tokens"]
            if not chunk["choices"] or not chunk["choices"][0]["delta"].get("content"):
                continue
            now = time.perf_counter()
            if first is None:
                first = now
                result.ttft_s = now - sent
            else:
                result.gaps_s.append(now - last)
            last = now
    return result


async def run_level(
    url: str, model: str, concurrency: int, requests_per_client: int, max_tokens: int, seed: int
) -> None:
    rng = random.Random(seed * 1000 + concurrency)
    prompts = [
        f"Write a short paragraph about {rng.choice(TOPICS)}."
        for _ in range(concurrency * requests_per_client)
    ]
    limits = httpx.Limits(max_connections=concurrency + 1)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        await one_request(http, model, "Say hello.", 4, seed)  # warm-up

        async def client(index: int) -> list[RequestResult]:
            results = []
            for j in range(requests_per_client):
                slot = index * requests_per_client + j
                results.append(await one_request(http, model, prompts[slot], max_tokens, seed + slot))
            return results

        started = time.perf_counter()
        per_client = await asyncio.gather(*(client(i) for i in range(concurrency)))
        wall_s = time.perf_counter() - started
    results = [r for rs in per_client for r in rs]
    ttfts_ms = [r.ttft_s * 1000 for r in results]
    gaps_ms = [g * 1000 for r in results for g in r.gaps_s]
    num_tokens = sum(r.num_tokens for r in results)
    label = f"argosy serve c={concurrency}"
    print(f"{label} ttft_p50 {percentile(ttfts_ms, 50):.1f} ms", flush=True)
    print(f"{label} ttft_p95 {percentile(ttfts_ms, 95):.1f} ms", flush=True)
    print(f"{label} itl_p50 {percentile(gaps_ms, 50):.1f} ms", flush=True)
    print(f"{label} itl_p95 {percentile(gaps_ms, 95):.1f} ms", flush=True)
    print(f"{label} output_throughput {num_tokens / wall_s:.1f} tok/s", flush=True)
    if gaps_ms:
        print(f"{label} itl_mean {statistics.fmean(gaps_ms):.1f} ms", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start one)")
    parser.add_argument("--model", default=None, help="model id to request (default: the server's first)")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-flags", default="", help="extra flags for the server this script starts")
    args = parser.parse_args()

    server = None
    url = args.url
    if url is None:
        server = ServerProcess(extra_flags=args.server_flags.split()).start()
        url = server.base_url
    try:
        model = args.model or httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            asyncio.run(
                run_level(url, model, concurrency, args.requests_per_client, args.max_tokens, args.seed)
            )
    finally:
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
