"""Which node of a fleet runs a request: a chain of policies (`--placement`, in order), each
either choosing a node or passing to the next.

- `affinity`: a request that continues a session goes to the node that ran the session's last
  turn (its KV prefix lives there), while that node is up.
- `prefix`: the node whose prefix cache holds the most leading blocks of the prompt, from the
  compact summaries nodes publish (the first 8 bytes of each cached block's key: the same
  chained key the block manager computes, engine/block_manager.py); ties go to the less loaded.
  A prefix every live node holds alike (a chat template's opening) tells nothing: it passes.

Both locality policies are bounded: they choose only among nodes whose load is at most
LOAD_BOUND × the mean + 1 ("consistent hashing with bounded loads"), so a popular tenant's
system prompt cannot pile every session onto one node — past the bound its sessions go to
the next policy, and the prompt gets cached on a second node too. (bench/fleet.py's
simulation: with Zipf-popular tenants, unbounded prefix placement had a p99 TTFT 16× least-
loaded's; bounded, below it, at a higher hit rate.)
- `least-loaded`: the node with the fewest of this head's requests on it (running or
  waiting there); ties in turn, so an idle fleet spreads a burst.
- `round-robin`: in turn, whatever the load (the baseline the bench compares with).

A chain that passes every policy ends in least-loaded. Plain data in, a Decision out: no Ray
here, so the policies are unit-tested on their own and reused by the bench's simulation.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from argosy.engine.block_manager import block_key
from argosy.errors import InvalidRequestError, OverloadedError

POLICIES = ("affinity", "prefix", "least-loaded", "round-robin")
DEFAULT_PLACEMENT = ("affinity", "prefix", "least-loaded")
SUMMARY_KEY_BYTES = 8  # of a block key, in a node's published summary
LOAD_BOUND = 1.5  # a locality policy skips nodes with in-flight > LOAD_BOUND × mean + 1
# the prefix policy decides only when a node holds at least this many more of the prompt's
# leading blocks than the node holding fewest: one block (a chat template's opening, 16
# tokens) saves too little prefill to stack a burst on its node (the bound's "+1" lets a
# handful through at low load: seen in the fleet's kill test, four streams on one node)
MIN_PREFIX_GAIN = 2
MAX_AFFINITIES = 100_000  # sessions remembered (least recently placed dropped first)


class NoNodeError(OverloadedError):
    """Every node of the fleet is down (HTTP 503 + Retry-After: a node is restarted)."""

    def __init__(self, message: str, retry_after_s: int = 2) -> None:
        super().__init__(message, retry_after_s)
        self.code = "no_node"


@dataclass(slots=True)
class NodeView:
    """One node as the head sees it now."""

    name: str
    alive: bool = True
    in_flight: int = 0  # this head's requests on it (running or waiting there)
    cached: frozenset[bytes] = field(default_factory=frozenset)  # its summary of cached blocks


@dataclass(frozen=True, slots=True)
class Decision:
    node: str
    policy: str  # the policy that chose it
    prefix_blocks: int = 0  # leading prompt blocks cached on it (by its last summary)


def parse_placement(text: str | Sequence[str]) -> tuple[str, ...]:
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        raise InvalidRequestError(
            f"unknown placement policy {unknown[0]!r}; use a list of {', '.join(POLICIES)}"
            if unknown
            else f"placement needs at least one of {', '.join(POLICIES)}",
            "placement",
        )
    return tuple(names)


def prompt_block_keys(token_ids: list[int], block_size: int) -> list[bytes]:
    """The short keys of the prompt's full blocks, as a node's summary holds them (the last
    token excluded, as the block manager's cache lookup does)."""
    keys: list[bytes] = []
    parent: bytes | None = None
    for i in range((len(token_ids) - 1) // block_size):
        parent = block_key(parent, token_ids[i * block_size : (i + 1) * block_size])
        keys.append(parent[:SUMMARY_KEY_BYTES])
    return keys


def summary_of(keys: Iterable[bytes]) -> frozenset[bytes]:
    """A node's summary from its block manager's cached keys."""
    return frozenset(key[:SUMMARY_KEY_BYTES] for key in keys)


def leading_hits(keys: list[bytes], cached: frozenset[bytes]) -> int:
    count = 0
    for key in keys:
        if key not in cached:
            break
        count += 1
    return count


class Placer:
    def __init__(
        self,
        policies: Sequence[str] = DEFAULT_PLACEMENT,
        block_size: int = 16,
        load_bound: float | None = LOAD_BOUND,
    ) -> None:
        self.policies = parse_placement(policies)
        self.block_size = block_size
        self.load_bound = load_bound  # None: locality policies ignore load (the bench compares)
        self._affinity: OrderedDict[str, str] = OrderedDict()
        self._turn = itertools.count()

    def place(
        self, nodes: Sequence[NodeView], prompt_ids: list[int], affinity: Sequence[str] = ()
    ) -> Decision:
        """`affinity`: the sessions the request belongs with (the one it continues first)."""
        live = [n for n in nodes if n.alive]
        if not live:
            raise NoNodeError("Every node of the fleet is down; try again shortly.")
        keys: list[bytes] | None = None
        near = self._within_bound(live)
        for policy in self.policies:
            if policy == "affinity":
                homes = [self._affinity[key] for key in affinity if key in self._affinity]
                chosen = next((n for n in near if homes and n.name == homes[0]), None)
                if chosen is not None:
                    return Decision(chosen.name, "affinity")
            elif policy == "prefix":
                keys = keys if keys is not None else prompt_block_keys(prompt_ids, self.block_size)
                hits = {n.name: leading_hits(keys, n.cached) for n in live}
                best = max((hits[n.name] for n in near), default=0)
                if best - min(hits.values()) >= MIN_PREFIX_GAIN:  # more than every node holds alike
                    chosen = self._least_loaded([n for n in near if hits[n.name] == best])
                    return Decision(chosen.name, "prefix", best)
            elif policy == "round-robin":
                return Decision(live[next(self._turn) % len(live)].name, "round-robin")
            else:
                break  # least-loaded: below
        return Decision(self._least_loaded(live).name, "least-loaded")

    def _within_bound(self, live: list[NodeView]) -> list[NodeView]:
        if self.load_bound is None:
            return live
        limit = self.load_bound * sum(n.in_flight for n in live) / len(live) + 1
        return [n for n in live if n.in_flight <= limit]

    def _least_loaded(self, nodes: list[NodeView]) -> NodeView:
        fewest = min(n.in_flight for n in nodes)
        idle = [n for n in nodes if n.in_flight == fewest]
        return idle[next(self._turn) % len(idle)]

    def remember(self, session: str, node: str) -> None:
        """`session` ran on `node`: its next turn goes there too."""
        self._affinity[session] = node
        self._affinity.move_to_end(session)
        while len(self._affinity) > MAX_AFFINITIES:
            self._affinity.popitem(last=False)
