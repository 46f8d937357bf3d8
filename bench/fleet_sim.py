"""The simulated 16-node fleet of bench/fleet.py --sim: placement chains (the real Placer of
argosy/fleet/placement.py) on a multi-tenant trace, in seeded discrete events.

A node's KV pool holds KV_BLOCKS blocks of 16 tokens (192 MiB
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
nodes ~80% busy).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import statistics
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from argosy.fleet.placement import LOAD_BOUND, NodeView, Placer, prompt_block_keys

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
