"""Fleet benchmark: `argosy fleet` against `argosy serve` on this machine, and a simulated 16-node
fleet comparing placement chains (the real Placer of argosy/fleet/placement.py) on a multi-tenant trace.

    python bench/fleet.py --sim [--quick]     # simulation only: pure Python, no Ray, a minute
    unshare --net --pid --fork --mount-proc --kill-child -- env RAY_USAGE_STATS_ENABLED=0 \\
      RAY_AUTH_MODE=disabled sh -c 'ip link set lo up && exec "$@"' _ python bench/fleet.py --real --quick

--real starts Ray, so it refuses to run unless /proc/self/net/dev lists only `lo` (the namespace
above). Aggregate output tok/s at 8 streams x 128 tokens (greedy, ignore_eos) of `serve` (--threads
= cores), `fleet --nodes 1` and `fleet --nodes 2` (--threads cores/nodes: a fleet's default),
default numerics (--quick: --compile off); head overhead per token: single-stream inter-token
latency of fleet --nodes 1 against serve (the same engine, one more hop through Ray).

The simulation (--sim) is bench/fleet_sim.py; its model of a node and its trace are described there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

from fleet_sim import (  # noqa: E402
    AGG_16_TOK_S,
    BLOCK,
    CALIBRATION,
    DECODE_1_TOK_S,
    KV_BLOCKS,
    PREFILL_TOK_S,
    run_sim,
    table,
)
from host import machine_line  # noqa: E402


# -- real servers ------------------------------------------------------------------------------
def interfaces() -> list[str]:
    lines = Path("/proc/self/net/dev").read_text().splitlines()[2:]
    return [line.split(":")[0].strip() for line in lines]


async def stream_one(base_url: str, prompt: str, max_tokens: int) -> tuple[float, float, float, int]:
    """(sent, first token, last token) times and the completion tokens of one stream."""
    import httpx

    body = {"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    sent = time.perf_counter()
    first = last = sent
    tokens = chunks = 0
    async with (
        httpx.AsyncClient(timeout=600) as client,
        client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response,
    ):
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
            if any(c.get("delta", {}).get("content") for c in data.get("choices", [])):
                last = time.perf_counter()
                first = first if chunks else last
                chunks += 1
    return sent, first, last, tokens or chunks


async def measure(base_url: str, args: argparse.Namespace) -> dict[str, float]:
    prompts = [f"Request {i}: tell me a long story about a lighthouse keeper." for i in range(64)]
    await asyncio.gather(*(stream_one(base_url, p, 8) for p in prompts[:8]))  # warm every node
    figures: dict[str, list[float]] = {"aggregate_tok_s": [], "itl_ms": [], "ttft_ms": []}
    for rep in range(args.repeats):
        sent, first, last, tokens = await stream_one(base_url, prompts[8 + rep], args.tokens)
        figures["itl_ms"].append(1000 * (last - first) / max(tokens - 1, 1))
        figures["ttft_ms"].append(1000 * (first - sent))
        batch = prompts[16 + 8 * rep : 16 + 8 * rep + args.concurrency]
        started = time.perf_counter()
        outs = await asyncio.gather(*(stream_one(base_url, p, args.tokens) for p in batch))
        figures["aggregate_tok_s"].append(sum(o[3] for o in outs) / (time.perf_counter() - started))
    return {key: statistics.median(values) for key, values in figures.items()}


def run_real(args: argparse.Namespace) -> dict[str, Any]:
    from proc_stats import ProcessTreeSampler

    from tests.e2e.server import ServerProcess, wait_compiled

    total = args.threads or os.cpu_count() or 1  # threads in all, split among a fleet's nodes
    systems: list[tuple[str, str, list[str], int]] = [("serve", "serve", [], total)] + [
        (f"fleet --nodes {n}", "fleet", ["--nodes", str(n)], max(1, total // n)) for n in (1, 2)
    ]
    compile_flag = "off" if args.quick else None
    rows: dict[str, Any] = {}
    for label, command, flags, threads in systems:
        load_before = os.getloadavg()
        server = ServerProcess(command=command, threads=threads, quantization=None, compile=compile_flag)
        server.extra_flags, server.startup_timeout_s = flags, 900.0
        started = time.monotonic()
        server.start()
        assert server.process is not None
        sampler = ProcessTreeSampler(server.process.pid)
        sampler.mark_serving()
        print(f"[{label}] healthy after {time.monotonic() - started:.0f} s: {' '.join(server.flags())}")
        try:
            if compile_flag is None:
                wait_compiled(server.base_url, "smollm2")
            figures = asyncio.run(measure(server.base_url, args))
        finally:
            sampler.stop()
            server.stop()
            for pid in sampler.cpu_ticks_by_pid:  # Ray processes the head left behind: ours
                if pid != os.getpid() and Path(f"/proc/{pid}").exists():
                    print(f"[{label}] killing left-over pid {pid}")
                    os.kill(pid, signal.SIGKILL)
        threads_text = f"{threads}" + (f" per node × {flags[1]}" if flags else "")
        rows[label] = dict(figures, threads=threads_text, other_cpu_pct=sampler.other_cpu_percent(),
                           load_before=load_before, load_after=os.getloadavg())  # fmt: skip
        print(f"[{label}] {figures}", flush=True)
    serve, one = rows["serve"], rows["fleet --nodes 1"]
    print(
        f"\n### Real servers on this machine ({args.concurrency} streams × {args.tokens} tokens, greedy, "
        f"ignore_eos; compile {compile_flag or 'default'}; default numerics; median of {args.repeats})\n"
    )
    columns = ["System", "threads", "aggregate tok/s ↑", "÷ serve", "single-stream ms/token ↓", "÷ serve"]
    columns += ["single-stream TTFT (ms)", "noise: other CPU %", "load avg before → after"]
    print(table(columns, [[label, str(r["threads"]), f"{r['aggregate_tok_s']:.1f}",
        f"{r['aggregate_tok_s'] / serve['aggregate_tok_s']:.2f}×", f"{r['itl_ms']:.2f}",
        f"{r['itl_ms'] / serve['itl_ms']:.2f}×", f"{r['ttft_ms']:.0f}", f"{r['other_cpu_pct'] or 0:.0f}",
        f"{r['load_before'][0]:.2f} → {r['load_after'][0]:.2f}"] for label, r in rows.items()]))  # fmt: skip
    overhead = one["itl_ms"] - serve["itl_ms"]
    print(
        f"\nHead overhead (fleet --nodes 1 − serve, single stream): {overhead:+.2f} ms/token "
        f"({one['itl_ms'] / serve['itl_ms']:.2f}×)"
    )
    return {"systems": rows, "head_overhead_ms_per_token": overhead}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--real", action="store_true", help="real servers (in a loopback-only netns)")
    parser.add_argument("--sim", action="store_true", help="the 16-node simulation")
    parser.add_argument("--quick", action="store_true", help="shorter trace; --compile off, 1 repetition")
    parser.add_argument("--load", type=float, default=0.8, help="offered no-reuse work / fleet capacity")
    parser.add_argument("--skews", default="0,1", help="tenant popularity Zipf exponents, one trace each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, help="--real: threads in all (default: cores)")
    parser.add_argument("--out", type=Path, help="JSON file (default bench/results/fleet-<time>.json)")
    args = parser.parse_args(argv)
    args.skews = [float(s) for s in args.skews.split(",")]
    args.repeats = 1 if args.quick else 3
    if not (args.real or args.sim):
        args.real = args.sim = True
    if args.real and interfaces() != ["lo"]:
        print(f"--real starts Ray: run it in a loopback-only network namespace (found {interfaces()}):")
        print(
            "  unshare --net --pid --fork --mount-proc --kill-child -- env RAY_USAGE_STATS_ENABLED=0 "
            "RAY_AUTH_MODE=disabled sh -c 'ip link set lo up && exec \"$@\"' _ python bench/fleet.py --real"
        )
        return 2
    os.environ["HF_HUB_OFFLINE"] = "1"
    print(
        f"# bench/fleet.py — {time.strftime('%Y-%m-%d %H:%M')}; CPU: {machine_line()}; threads {os.cpu_count()}; "
        f"load average {'/'.join(f'{x:.2f}' for x in os.getloadavg())}\n# sim calibration (from {DECODE_1_TOK_S:.0f} "
        f"tok/s single stream, {PREFILL_TOK_S:.0f} tok/s prefill, {AGG_16_TOK_S:.0f} tok/s at 16): step = "
        f"{CALIBRATION['step_a_ms']:.2f} ms + {CALIBRATION['step_b_ms']:.2f} ms × decodes + "
        f"{CALIBRATION['prefill_ms']:.3f} ms × prefill tokens; KV {KV_BLOCKS} blocks of {BLOCK}/node",
        flush=True,
    )
    result: dict[str, Any] = {
        "started_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpu": machine_line(),
        "command": "python bench/fleet.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "calibration": CALIBRATION,
        "load_before": os.getloadavg(),
    }
    if args.sim:
        result["sim"] = run_sim(args)
    if args.real:
        result["real"] = run_real(args)
    result["load_after"] = os.getloadavg()
    out = args.out or BENCH_DIR / "results" / f"fleet-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"\n(written to {out})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
