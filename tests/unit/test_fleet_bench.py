"""bench/fleet_sim.py (bench/fleet.py --sim): a node's block accounting, and a small seeded fleet run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "fleet_sim.py"


@pytest.fixture(scope="module")
def fleet() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_fleet", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_fleet"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def session(fleet: ModuleType, tokens: list[int], turns: list[tuple[int, int, float]]) -> object:
    chain = fleet.prompt_block_keys([*tokens, 0], fleet.BLOCK)
    return fleet.Session("s0", 0.0, tokens, chain, turns)


def test_a_turn_reuses_the_blocks_its_previous_turn_left_cached(fleet: ModuleType) -> None:
    tokens = list(range(1000, 1000 + 200))
    s = session(fleet, tokens, [(100, 50, 0.0), (180, 20, 1.0)])
    node = fleet.Node()
    first = fleet.Req(s, 0, 0.0, 100, 50)
    node.waiting.append(first)
    node.admit()
    assert first.hit_tokens == 0 and node.private == -(-150 // 16)
    first.computed = 100
    node.register(first, 100)
    assert len(node.ref) == 100 // 16
    node.free(first)  # its prompt and answer blocks stay cached, free
    assert not node.ref and node.private == 0 and len(node.lru) == (150 - 1) // 16
    second = fleet.Req(s, 1, 1.0, 180, 20)
    node.waiting.append(second)
    node.admit()
    assert second.hit_tokens == 144 and second.computed == 144  # 9 whole blocks of the 150 tokens
    node.free(second)
    assert not node.ref and node.private == 0


def test_the_seeded_simulation_is_repeatable_and_affinity_keeps_prefixes(fleet: ModuleType) -> None:
    cfg = fleet.TraceConfig(nodes=4, tenants=8, duration_s=40.0, warmup_s=0.0, load=0.8, seed=3)
    sessions, _ = fleet.make_trace(cfg)
    ours = fleet.simulate(sessions, cfg, "affinity,prefix,least-loaded", True)
    again = fleet.simulate(sessions, cfg, "affinity,prefix,least-loaded", True)
    baseline = fleet.simulate(sessions, cfg, "round-robin", False)
    assert ours == again
    assert ours["requests"] == baseline["requests"] == sum(len(s.turns) for s in sessions)
    assert 0 <= baseline["hit_rate"] < ours["hit_rate"] <= 1
