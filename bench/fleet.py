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

--sim, seeded discrete events. A node's KV pool holds KV_BLOCKS blocks of 16 tokens (192 MiB
default = 8,730 SmolLM2 tokens); freed blocks stay cached until reused, least recently freed
first (engine/block_manager.py); a request reserves prompt + max_tokens blocks when admitted (no
preemption). A step runs every running request: one token per decode, prefill chunks up to 1,024
tokens, in STEP_A + STEP_B x decodes + PREFILL_S x prefill tokens, calibrated from this project's
measured figures (2-core x86, bench/engine.py): single stream 100 tok/s, 1,000-token prefill 700
tok/s, 16 concurrent 450 tok/s. The head sees node cache summaries refreshed every 0.5 s
(client.STATS_EVERY_S) and counts its own in-flight requests. Trace: 40 tenants, system prompts
of 300-1,500 random tokens; sessions (Poisson starts) of 2-8 turns, each appending the previous
answer (50-300 tokens) and user text (20-200), sent a think time (exp., mean 10 s) after the
previous answer, with the session id as affinity key; tenant popularity uniform and Zipf(1).
--load: offered work with no prefix reuse over the fleet's capacity (0.8 keeps the baselines'
nodes ~80% busy). Markdown tables on stdout, JSON in bench/results/fleet-<time>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import json
import os
import random
import signal
import statistics
import sys
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

from compare import machine_line  # noqa: E402

from argosy.fleet.placement import LOAD_BOUND, NodeView, Placer, prompt_block_keys  # noqa: E402

# -- calibration (measured on this project's 2-core machine) ---------------------------------
DECODE_1_TOK_S, PREFILL_TOK_S, AGG_16_TOK_S = 100.0, 700.0, 450.0
STEP_B = (16 / AGG_16_TOK_S - 1 / DECODE_1_TOK_S) / 15  # s per decoding request in a step
STEP_A = 1 / DECODE_1_TOK_S - STEP_B  # s per step
PREFILL_S = (1000 / PREFILL_TOK_S - STEP_A) / 1000  # s per prefilled token
CALIBRATION = {"step_a_ms": 1000 * STEP_A, "step_b_ms": 1000 * STEP_B, "prefill_ms": 1000 * PREFILL_S}
BLOCK, KV_BLOCKS, MAX_SEQS, STEP_TOKENS, SUMMARY_EVERY_S = 16, 545, 64, 1024, 0.5
CHAINS = {  # Argosy's Placer as it is (locality bounded by load), and the chain without the bound
    "affinity+prefix": "affinity,prefix,least-loaded",
    "prefix": "prefix,least-loaded",
    "round-robin": "round-robin",
    "least-loaded": "least-loaded",
    "affinity+prefix, unbounded": "affinity,prefix,least-loaded",
}


@dataclass(frozen=True)
class TraceConfig:
    nodes: int = 16
    tenants: int = 40
    duration_s: float = 600.0  # session starts over this span
    warmup_s: float = 60.0  # turns arriving earlier are not measured
    load: float = 0.8
    skew: float = 0.0  # Zipf exponent of tenant popularity (0: uniform)
    think_s: float = 10.0
    seed: int = 0


@dataclass
class Session:
    id: str
    start: float
    tokens: list[int]  # system prompt + every turn's user text and answer
    chain: list[bytes]  # block keys over `tokens`
    turns: list[tuple[int, int, float]]  # (prompt length, answer length, think time before it)


@dataclass(eq=False)
class Req:
    session: Session
    turn: int
    arrival: float
    prompt_len: int
    out_len: int
    computed: int = 0
    outputs: int = 0
    registered: int = 0
    hit_tokens: int = 0
    ttft: float | None = None
    held: list[bytes | None] = field(default_factory=list)


def nocache_work_s(prompt_len: int, out_len: int) -> float:
    """Node-seconds a turn costs prefilled in full, decoding in batches of 8."""
    return STEP_A + PREFILL_S * prompt_len + out_len * (STEP_A + 8 * STEP_B) / 8


def session_shape(rng: random.Random, sys_lens: list[int], weights: list[float]) -> tuple[int, list[Any]]:
    tenant = rng.choices(range(len(sys_lens)), weights)[0]
    length, turns = sys_lens[tenant], []
    for _ in range(rng.randint(2, 8)):
        user, answer = rng.randint(20, 200), rng.randint(50, 300)
        turns.append((length + user, answer, user))
        length += user + answer
    return tenant, turns


def make_trace(cfg: TraceConfig) -> tuple[list[Session], float]:
    rng = random.Random(cfg.seed)
    systems = [[rng.randrange(100, 49000) for _ in range(rng.randint(300, 1500))] for _ in range(cfg.tenants)]
    sys_lens = [len(s) for s in systems]
    weights = [1 / (i + 1) ** cfg.skew for i in range(cfg.tenants)]
    pilot = random.Random(cfg.seed + 1)
    shapes = [session_shape(pilot, sys_lens, weights)[1] for _ in range(2000)]
    work = statistics.fmean(sum(nocache_work_s(p, a) for p, a, _ in s) for s in shapes)
    rate = cfg.load * cfg.nodes / work  # sessions per second
    sessions: list[Session] = []
    now = 0.0
    while (now := now + rng.expovariate(rate)) < cfg.duration_s:
        tenant, shape = session_shape(rng, sys_lens, weights)
        tokens = list(systems[tenant])
        turns = []
        for prompt_len, answer, user in shape:
            tokens += [rng.randrange(100, 49000) for _ in range(user)]
            turns.append((prompt_len, answer, rng.expovariate(1 / cfg.think_s)))
            tokens += [rng.randrange(100, 49000) for _ in range(answer)]
        chain = prompt_block_keys([*tokens, 0], BLOCK)
        sessions.append(Session(f"s{len(sessions)}", now, tokens, chain, turns))
    return sessions, rate


class Node:
    def __init__(self) -> None:
        self.ref: dict[bytes, int] = {}  # cached blocks in use -> requests holding them
        self.lru: OrderedDict[bytes, None] = OrderedDict()  # cached free blocks, next evicted first
        self.private = 0  # blocks in use without a key (not yet computed, or duplicates)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.stepping = False
        self.busy_s = 0.0

    def cached(self, key: bytes) -> bool:
        return key in self.ref or key in self.lru

    def admit(self) -> None:
        while self.waiting and len(self.running) < MAX_SEQS:
            req = self.waiting[0]
            keys = req.session.chain[: (req.prompt_len - 1) // BLOCK]
            hits = next((i for i, k in enumerate(keys) if not self.cached(k)), len(keys))
            revived = sum(1 for k in keys[:hits] if k in self.lru)
            new = -(-(req.prompt_len + req.out_len) // BLOCK) - hits
            if len(self.ref) + self.private + revived + new > KV_BLOCKS:
                return
            self.waiting.popleft()
            for key in keys[:hits]:
                self.lru.pop(key, None)
                self.ref[key] = self.ref.get(key, 0) + 1
            req.held = [*keys[:hits], *([None] * new)]
            self.private += new
            while self.lru and len(self.lru) > KV_BLOCKS - len(self.ref) - self.private:
                self.lru.popitem(last=False)
            req.computed = hits * BLOCK
            req.registered, req.hit_tokens = hits, min(hits * BLOCK, req.prompt_len)
            self.running.append(req)

    def register(self, req: Req, computed: int) -> None:
        """Publish the keys of blocks that became full of computed tokens."""
        for i in range(req.registered, computed // BLOCK):
            key = req.session.chain[i]
            if req.held[i] is None and not self.cached(key):
                self.ref[key], req.held[i] = 1, key
                self.private -= 1
        req.registered = max(req.registered, computed // BLOCK)

    def free(self, req: Req) -> None:
        self.register(req, req.prompt_len + req.out_len - 1)
        for key in reversed(req.held):  # deepest first: evicted before the shared root
            if key is None:
                self.private -= 1
            else:
                self.ref[key] -= 1
                if not self.ref[key]:
                    del self.ref[key]
                    self.lru[key] = None
        self.running.remove(req)


def simulate(sessions: list[Session], cfg: TraceConfig, chain: str, bounded: bool) -> dict[str, Any]:
    placer = Placer(chain.split(","), BLOCK, load_bound=LOAD_BOUND if bounded else None)
    nodes = [Node() for _ in range(cfg.nodes)]
    names = [f"node{i}" for i in range(cfg.nodes)]
    in_flight, summaries = [0] * cfg.nodes, [frozenset[bytes]()] * cfg.nodes
    events: list[tuple[float, int, str, Any]] = []
    seq = itertools.count()
    done: list[Req] = []
    placed_by: Counter[str] = Counter()
    imbalance: list[float] = []
    open_sessions = len(sessions)

    def push(at: float, kind: str, payload: Any) -> None:
        heapq.heappush(events, (at, next(seq), kind, payload))

    def step(i: int, now: float) -> None:
        node = nodes[i]
        node.admit()
        node.stepping = bool(node.running)
        if not node.running:
            return
        decodes = [r for r in node.running if r.computed >= r.prompt_len]
        budget, chunks = STEP_TOKENS - len(decodes), []
        for r in node.running:
            if r.computed < r.prompt_len and budget > 0:
                take = min(r.prompt_len - r.computed, budget)
                chunks.append((r, take))
                budget -= take
        dt = STEP_A + STEP_B * len(decodes) + PREFILL_S * sum(t for _, t in chunks)
        node.busy_s += dt
        push(now + dt, "step", (i, decodes, chunks))

    for s in sessions:
        push(s.start, "arrive", Req(s, 0, s.start, s.turns[0][0], s.turns[0][1]))
    push(0.0, "refresh", None)
    now = 0.0
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "refresh":
            summaries = [frozenset(n.ref.keys() | n.lru.keys()) for n in nodes]
            if sum(in_flight):
                imbalance.append(max(in_flight) / statistics.fmean(in_flight))
            if open_sessions:
                push(now + SUMMARY_EVERY_S, "refresh", None)
        elif kind == "arrive":
            req: Req = payload
            session = req.session
            views = [NodeView(n, True, in_flight[i], summaries[i]) for i, n in enumerate(names)]
            decision = placer.place(views, session.tokens[: req.prompt_len], (session.id,))
            placer.remember(session.id, decision.node)
            placed_by[decision.policy] += 1
            i = names.index(decision.node)
            in_flight[i] += 1
            nodes[i].waiting.append(req)
            if not nodes[i].stepping:
                step(i, now)
        else:
            i, decodes, chunks = payload
            node = nodes[i]
            for r in decodes:
                r.outputs += 1
            for r, take in chunks:
                r.computed += take
                node.register(r, r.computed)
                if r.computed == r.prompt_len:
                    r.outputs, r.ttft = 1, now - r.arrival
            for r in [r for r in node.running if r.outputs >= r.out_len]:
                node.free(r)
                in_flight[i] -= 1
                done.append(r)
                if r.turn + 1 < len(r.session.turns):
                    prompt_len, out_len, think = r.session.turns[r.turn + 1]
                    push(now + think, "arrive", Req(r.session, r.turn + 1, now + think, prompt_len, out_len))
                else:
                    open_sessions -= 1
            step(i, now)
    measured = [r for r in done if r.arrival >= cfg.warmup_s]
    ttfts = sorted(r.ttft or 0.0 for r in measured)
    busy = [n.busy_s for n in nodes]
    return {
        "requests": len(measured),
        "hit_rate": sum(r.hit_tokens for r in measured) / sum(r.prompt_len for r in measured),
        "ttft_p50_ms": 1000 * percentile(ttfts, 50),
        "ttft_p99_ms": 1000 * percentile(ttfts, 99),
        "in_flight_max_over_mean": statistics.fmean(imbalance) if imbalance else 1.0,
        "busy_max_over_mean": max(busy) / statistics.fmean(busy),
        "busy_pct": 100 * sum(busy) / (cfg.nodes * now),
        "placed_by": dict(placed_by),
    }


SIM_COLUMNS = ["Placement", "requests", "prefix hit rate ↑", "TTFT p50 (ms) ↓", "TTFT p99 (ms) ↓"]
SIM_COLUMNS += ["in-flight max/mean ↓", "node busy max/mean ↓", "node busy %", "placed by"]


def sim_row(name: str, r: dict[str, Any]) -> list[str]:
    by = ", ".join(f"{k} {v / sum(r['placed_by'].values()):.0%}" for k, v in sorted(r["placed_by"].items()))
    return [f"{name} (`{CHAINS[name]}`)", str(r["requests"]), f"{r['hit_rate']:.1%}", f"{r['ttft_p50_ms']:,.0f}"] + [
        f"{r['ttft_p99_ms']:,.0f}", f"{r['in_flight_max_over_mean']:.2f}", f"{r['busy_max_over_mean']:.2f}",
        f"{r['busy_pct']:.0f}", by]  # fmt: skip


def table(columns: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def percentile(values: list[float], pct: float) -> float:
    return values[min(len(values) - 1, round(pct / 100 * (len(values) - 1)))] if values else 0.0


def run_sim(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for skew in args.skews:
        duration, warmup = (200.0, 30.0) if args.quick else (600.0, 60.0)
        cfg = TraceConfig(duration_s=duration, warmup_s=warmup, load=args.load, skew=skew, seed=args.seed)
        started = time.monotonic()
        sessions, rate = make_trace(cfg)
        rows = {
            name: simulate(sessions, cfg, chain, not name.endswith("unbounded"))
            for name, chain in CHAINS.items()
        }
        ours, rr, ll = rows["affinity+prefix"], rows["round-robin"], rows["least-loaded"]
        hit_ratio = ours["hit_rate"] / max(rr["hit_rate"], 1e-9)
        p99_ratio = ours["ttft_p99_ms"] / ll["ttft_p99_ms"]
        label = "uniform tenants" if skew == 0 else f"Zipf({skew:g}) tenants"
        results[label] = dict(config=cfg.__dict__, sessions=len(sessions), session_rate_per_s=rate, policies=rows,
            hit_rate_vs_round_robin=hit_ratio, p99_ttft_vs_least_loaded=p99_ratio,
            passed=hit_ratio >= 2 and p99_ratio <= 1)  # fmt: skip
        print(f"\n### Simulated {cfg.nodes}-node fleet, {label}")
        print(
            f"{len(sessions)} sessions ({rate:.2f}/s over {cfg.duration_s:.0f} s, {cfg.tenants} tenants), "
            f"offered no-reuse load {cfg.load:.0%}; turns arriving after {cfg.warmup_s:.0f} s measured; "
            f"seed {cfg.seed}; simulated in {time.monotonic() - started:.1f} s\n"
        )
        print(table(SIM_COLUMNS, [sim_row(name, r) for name, r in rows.items()]))
        print(
            f"\n- hit rate, affinity+prefix ÷ round-robin: **{hit_ratio:.2f}×** (target ≥ 2×: "
            f"{'PASS' if hit_ratio >= 2 else 'FAIL'})\n- TTFT p99, affinity+prefix ÷ least-loaded: "
            f"**{p99_ratio:.2f}×** (target ≤ 1×: {'PASS' if p99_ratio <= 1 else 'FAIL'})\n- Argosy's locality "
            f"policies choose among nodes with in-flight ≤ {LOAD_BOUND:g} × mean + 1; the unbounded row is "
            "the same chain without that bound"
        )
    return results


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
