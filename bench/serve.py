"""Serving benchmark: N concurrent streaming chat clients against `argosy serve`.

    python bench/serve.py                      # starts its own server (smollm2)
    python bench/serve.py --url http://127.0.0.1:8000 --concurrency 1,4,16

For each concurrency level every client sends `--requests-per-client` streaming requests
one after another (seeded prompts, `ignore_eos` so each runs exactly `--max-tokens`), after
one warm-up request. Prints one line per figure: TTFT p50/p95 (request sent -> first
content chunk), inter-token latency p50/p95 (gaps between content chunks, first excluded)
and aggregate output tok/s (completion tokens / wall time of the level).

    python bench/serve.py --gate-overhead      # the gate's cost: a key set vs none

--gate-overhead starts two servers in the default mode (int4, compiled decode) side by side,
one open and one with `--api-keys` (a key with generous per-key limits, so every request
passes through authentication, the policy and the limit accounting) plus a per-address
bucket, and runs the concurrency levels on each in turn, alternating for `--reps`
repetitions; it prints the median tok/s and TTFT of each and their ratio (target: the gated
server within 2% of the open one at concurrency 16).
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
    url: str,
    model: str,
    concurrency: int,
    requests_per_client: int,
    max_tokens: int,
    seed: int,
    headers: dict[str, str] | None = None,
    quiet: bool = False,
) -> tuple[float, float]:
    """(aggregate output tok/s, TTFT p50 ms) of one level."""
    rng = random.Random(seed * 1000 + concurrency)
    prompts = [
        f"Write a short paragraph about {rng.choice(TOPICS)}."
        for _ in range(concurrency * requests_per_client)
    ]
    limits = httpx.Limits(max_connections=concurrency + 1)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits, headers=headers) as http:
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
    if quiet:
        return num_tokens / wall_s, percentile(ttfts_ms, 50)
    print(f"{label} ttft_p50 {percentile(ttfts_ms, 50):.1f} ms", flush=True)
    print(f"{label} ttft_p95 {percentile(ttfts_ms, 95):.1f} ms", flush=True)
    print(f"{label} itl_p50 {percentile(gaps_ms, 50):.1f} ms", flush=True)
    print(f"{label} itl_p95 {percentile(gaps_ms, 95):.1f} ms", flush=True)
    print(f"{label} output_throughput {num_tokens / wall_s:.1f} tok/s", flush=True)
    if gaps_ms:
        print(f"{label} itl_mean {statistics.fmean(gaps_ms):.1f} ms", flush=True)
    return num_tokens / wall_s, percentile(ttfts_ms, 50)


GATE_KEYS = """
[[key]]
name = "bench"
key = "sk-bench"
models = ["smollm2*"]
requests_per_minute = 100000
tokens_per_minute = 100000000
max_concurrent = 1000
"""


def gate_cost_us(keys_toml: Path, num_requests: int = 20000) -> tuple[float, float]:
    """In-process: microseconds per request through GateMiddleware without keys and with a key
    checked (hash, policy, per-key and per-address buckets), to a trivial app."""
    from starlette.responses import JSONResponse

    from argosy.api.gate import Gate, GateMiddleware
    from argosy.core.keys import AddressLimits, key_ring

    async def app(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
        await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b""})  # type: ignore[operator]

    def render(scope: object, error: object) -> JSONResponse:
        return JSONResponse({}, status_code=401)

    async def nothing(message: object = None) -> dict:  # type: ignore[type-arg]
        return {"type": "http.request", "body": b""}

    open_gate = GateMiddleware(app, Gate(key_ring([], None, None)), render)  # type: ignore[arg-type]
    limits = AddressLimits(1e9)
    gated = GateMiddleware(
        app, Gate(key_ring([], None, str(keys_toml)), address_limits=limits, limit_loopback=True), render
    )  # type: ignore[arg-type]

    async def per_request(middleware: GateMiddleware, headers: list[tuple[bytes, bytes]]) -> float:
        started = time.perf_counter()
        for _ in range(num_requests):
            scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers,
                     "client": ("127.0.0.1", 1), "state": {}}  # fmt: skip
            await middleware(scope, nothing, nothing)  # type: ignore[arg-type]
        return (time.perf_counter() - started) / num_requests * 1e6

    async def both() -> tuple[float, float]:
        await per_request(open_gate, [])  # warm
        return await per_request(open_gate, []), await per_request(
            gated, [(b"authorization", b"Bearer sk-bench")]
        )

    return asyncio.run(both())


def gate_overhead(args: argparse.Namespace) -> int:
    """Open vs gated server, same mode, alternating repetitions; medians and ratios."""
    import tempfile

    keys = Path(tempfile.mkdtemp(prefix="argosy-gate-")) / "keys.toml"
    keys.write_text(GATE_KEYS)
    gated_flags = ["--api-keys", str(keys), "--rate-limit-per-minute", "1000000", "--rate-limit-loopback"]
    servers = {
        "open": ServerProcess(quantization=None, compile=None, threads=args.threads, startup_timeout_s=900),
        "gated": ServerProcess(
            quantization=None,
            compile=None,
            threads=args.threads,
            startup_timeout_s=900,
            extra_flags=gated_flags,
        ),
    }
    headers = {"open": {}, "gated": {"authorization": "Bearer sk-bench"}}
    levels = [int(c) for c in args.concurrency.split(",")]
    figures: dict[tuple[str, int], list[tuple[float, float]]] = {}
    try:
        for server in servers.values():
            server.start()
        for rep in range(args.reps):
            order = list(servers) if rep % 2 == 0 else list(reversed(servers))
            for name in order:
                for concurrency in levels:
                    figure = asyncio.run(
                        run_level(
                            servers[name].base_url,
                            "smollm2",
                            concurrency,
                            args.requests_per_client,
                            args.max_tokens,
                            args.seed,
                            headers[name],
                            quiet=True,
                        )
                    )
                    figures.setdefault((name, concurrency), []).append(figure)
                    print(
                        f"[rep {rep + 1}] {name:5} c={concurrency}: {figure[0]:.1f} tok/s, TTFT p50 {figure[1]:.0f} ms",
                        flush=True,
                    )
    finally:
        for server in servers.values():
            server.stop()
    print(f"\nGate overhead, {args.reps} repetitions, median (min-max); {args.max_tokens} tok per request")
    print("| c | open tok/s | gated tok/s | gated / open | open TTFT ms | gated TTFT ms |")
    print("|---|---|---|---|---|---|")
    for concurrency in levels:
        row = []
        for name in servers:
            values = figures[(name, concurrency)]
            rates = [v[0] for v in values]
            row.append(
                (statistics.median(rates), min(rates), max(rates), statistics.median(v[1] for v in values))
            )
        (open_rate, open_low, open_high, open_ttft), (gated_rate, gated_low, gated_high, gated_ttft) = row
        print(
            f"| {concurrency} | {open_rate:.1f} ({open_low:.1f}-{open_high:.1f}) | {gated_rate:.1f} "
            f"({gated_low:.1f}-{gated_high:.1f}) | {gated_rate / open_rate:.3f} | {open_ttft:.0f} | {gated_ttft:.0f} |"
        )
    open_us, gated_us = gate_cost_us(keys)
    request_s = args.max_tokens * 16 / statistics.median(v[0] for v in figures[("open", levels[-1])])
    print(
        f"\nIn-process, per request: {open_us:.1f} us through the gate without keys, {gated_us:.1f} us with a "
        f"key checked; the difference is {100 * (gated_us - open_us) / 1e6 / request_s:.4f}% of a c={levels[-1]} "
        f"request's {request_s:.2f} s (the servers' own ratio above is within their run-to-run noise)."
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start one)")
    parser.add_argument("--model", default=None, help="model id to request (default: the server's first)")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-flags", default="", help="extra flags for the server this script starts")
    parser.add_argument("--gate-overhead", action="store_true", help="an open vs a gated server (see above)")
    parser.add_argument("--reps", type=int, default=3, help="--gate-overhead repetitions")
    parser.add_argument("--threads", type=int, default=1, help="--gate-overhead: each server's --threads")
    args = parser.parse_args()
    if args.gate_overhead:
        return gate_overhead(args)

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
