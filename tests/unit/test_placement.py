"""Fleet placement (argosy/fleet/placement.py): the policies one by one and chained, on plain
node views — no Ray."""

from __future__ import annotations

import pytest

from argosy.engine.block_manager import BlockManager, block_key
from argosy.errors import InvalidRequestError
from argosy.fleet.placement import (
    NodeView,
    NoNodeError,
    Placer,
    leading_hits,
    parse_placement,
    prompt_block_keys,
    summary_of,
)

BS = 4


def prompt(length: int, start: int = 0) -> list[int]:
    return list(range(start, start + length))


def cached(*prompts: list[int]) -> frozenset[bytes]:
    """A node's summary after it ran these prompts: every full block of each cached."""
    keys: list[bytes] = []
    for p in prompts:
        keys += prompt_block_keys([*p, -1], BS)  # (a lookup leaves the last token out)
    return frozenset(keys)


def test_prompt_keys_are_the_block_managers_own() -> None:
    manager = BlockManager(num_blocks=8, block_size=BS)
    tokens = prompt(13)
    parent = None
    for i in range(3):  # what the manager would file for the first three full blocks
        parent = block_key(parent, tokens[i * BS : (i + 1) * BS])
        manager.cached[parent] = i
    summary = summary_of(manager.cached)
    keys = prompt_block_keys(tokens, BS)
    assert len(keys) == 3 and leading_hits(keys, summary) == 3
    assert manager.probe_cached_prefix(tokens) == 3 * BS  # the same count the node would find
    assert leading_hits(prompt_block_keys(prompt(13, start=1), BS), summary) == 0


def test_affinity_first_while_its_node_is_up() -> None:
    placer = Placer(["affinity", "least-loaded"], block_size=BS)
    a, b = NodeView("a", in_flight=2), NodeView("b")
    placer.remember("session-1", "a")
    assert placer.place([a, b], prompt(8), ["session-1"]).policy == "affinity"
    assert placer.place([a, b], prompt(8), ["session-1"]).node == "a"
    assert placer.place([a, b], prompt(8), ["session-2"]).node == "b"  # unknown: least loaded
    a.alive = False
    decision = placer.place([a, b], prompt(8), ["session-1"])
    assert (decision.node, decision.policy) == ("b", "least-loaded")


def test_prefix_goes_where_the_longest_prefix_is_cached() -> None:
    placer = Placer(["prefix", "least-loaded"], block_size=BS)
    system = prompt(12)  # three blocks shared by the conversations
    a = NodeView("a", in_flight=3, cached=cached(system[:8]))  # two of them
    b = NodeView("b", in_flight=5, cached=cached(system))  # all three
    c = NodeView("c", in_flight=0)
    decision = placer.place([a, b, c], [*system, 99, 98, 97, 96, 95])
    assert (decision.node, decision.policy, decision.prefix_blocks) == ("b", "prefix", 3)
    # a tie on the prefix goes to the less loaded of the tied
    a.cached = b.cached
    assert placer.place([a, b, c], [*system, 1, 2, 3, 4, 5]).node == "a"
    # nothing cached anywhere: the next policy decides
    cold = placer.place([a, b, c], prompt(20, start=500))
    assert (cold.node, cold.policy) == ("c", "least-loaded")


def test_least_loaded_spreads_ties_in_turn_and_round_robin_ignores_load() -> None:
    placer = Placer(["least-loaded"], block_size=BS)
    nodes = [NodeView("a"), NodeView("b"), NodeView("c", in_flight=1)]
    assert [placer.place(nodes, prompt(4)).node for _ in range(4)] == ["a", "b", "a", "b"]
    robin = Placer(["round-robin"], block_size=BS)
    assert [robin.place(nodes, prompt(4)).node for _ in range(4)] == ["a", "b", "c", "a"]


def test_every_node_down_is_a_503_and_bad_names_a_400() -> None:
    with pytest.raises(NoNodeError) as caught:
        Placer().place([NodeView("a", alive=False)], prompt(4))
    assert caught.value.retry_after_s == 2 and caught.value.code == "no_node"
    with pytest.raises(InvalidRequestError, match="'nearest'"):
        parse_placement("affinity,nearest")
    with pytest.raises(InvalidRequestError):
        parse_placement(" , ")
    assert parse_placement("prefix, round-robin") == ("prefix", "round-robin")


def test_remembered_sessions_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import argosy.fleet.placement as placement

    monkeypatch.setattr(placement, "MAX_AFFINITIES", 3)
    placer = Placer(block_size=BS)
    for index in range(5):
        placer.remember(f"s{index}", "a")
    assert list(placer._affinity) == ["s2", "s3", "s4"]


def test_locality_is_bounded_by_load_and_a_prefix_everyone_holds_tells_nothing() -> None:
    placer = Placer(["affinity", "prefix", "least-loaded"], block_size=BS)
    system = prompt(12)
    hot = NodeView("hot", in_flight=8, cached=cached(system))  # mean 3: bound 1.5 * 3 + 1 = 5.5
    cold = [NodeView("a", in_flight=1), NodeView("b", in_flight=0)]
    placer.remember("s", "hot")
    decision = placer.place([hot, *cold], [*system, 1, 2, 3], ["s"])
    assert (decision.node, decision.policy) == ("b", "least-loaded")  # neither affinity nor prefix
    hot.in_flight = 3  # within the bound again (1.5 * 4 / 3 + 1 = 3): both locality policies choose it
    assert placer.place([hot, *cold], [*system, 1, 2, 3], ["s"]).policy == "affinity"
    assert placer.place([hot, *cold], [*system, 1, 2, 3]).policy == "prefix"
    # the same template opening cached on every node: no information, the load decides
    for node in cold:
        node.cached = hot.cached
    assert placer.place([hot, *cold], [*system, 1, 2, 3]).policy == "least-loaded"
    assert (
        Placer(["prefix"], block_size=BS, load_bound=None).place([hot], [*system, 1]).policy == "least-loaded"
    )


def test_a_one_block_prefix_does_not_stack_a_burst_on_its_node() -> None:
    """Four streams sharing only a template's first block, two idle nodes, one holding that
    block: least-loaded spreads them (the prefix policy needs a gain of two blocks)."""
    placer = Placer(block_size=BS)
    template = prompt(BS)
    a = NodeView("a", in_flight=0, cached=cached(template))
    b = NodeView("b", in_flight=0)
    placed = []
    for i in range(4):
        decision = placer.place([a, b], [*template, *prompt(8, start=100 * (i + 1))])
        placed.append((decision.node, decision.policy))
        (a if decision.node == "a" else b).in_flight += 1
    assert sorted(node for node, _ in placed) == ["a", "a", "b", "b"]
    assert {policy for _, policy in placed} == {"least-loaded"}
    two_blocks = cached(prompt(2 * BS))
    a.cached, a.in_flight, b.in_flight = two_blocks, 0, 0
    assert placer.place([a, b], [*prompt(2 * BS), 7, 7, 7]).policy == "prefix"
