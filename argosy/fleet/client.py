"""FleetEngineClient: the EngineClient (core/engine_client.py) of a model served by a fleet's
nodes — the core, the dialects, the chat layer and sessions see one engine.

Each request is placed (placement.py) on a live node and streamed back from it. Every request
option crosses as it is: token ids, SamplingParams (penalties, ignore_eos, logprobs, seed,
batch_invariant, stop), the QoS class and the GuideSpec (grammars as plain specs, compiled on
the node), so a seeded request gives the tokens a local engine of the same model and mode
gives. A monitor task polls every node's stats and cache summary; a node whose process died
is marked down (Ray restarts it: it is up again once it answers). A request whose node died
before its first output is placed again on another; one under way ends with an error (the
dialect frames it), never a silently truncated stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from argosy import errors as error_types
from argosy.core.engine_client import NodeReport
from argosy.engine.arrivals import Arrival
from argosy.engine.llm_engine import validate_request
from argosy.engine.outputs import EngineStats, ModelDescription, RequestOutput
from argosy.errors import ArgosyError, EngineDeadError, InvalidRequestError
from argosy.fleet.node import NodeError, NodeStats
from argosy.fleet.placement import NodeView, NoNodeError, Placer, leading_hits, prompt_block_keys
from argosy.runner.structured import GrammarSpec, GuideSpec
from argosy.sampling_params import SamplingParams

log = logging.getLogger("argosy.fleet")

STATS_EVERY_S = 0.5  # how often the head reads each node's stats and cache summary


def _no_stats() -> EngineStats:
    return EngineStats(0, 0, 0, 0, 0, 0, 0)


class NodeLostError(EngineDeadError):
    """The node running a request died under it."""


@dataclass(slots=True)
class FleetNode:
    """One node as the head holds it: its actor handle and what it last reported."""

    name: str
    actor: Any  # a Ray ActorHandle of EngineNode
    view: NodeView
    stats: EngineStats = field(default_factory=_no_stats)
    pid: int | None = None
    restarts: int = 0  # times it came back after being seen down
    placements: Counter[str] = field(default_factory=Counter)  # policy -> requests placed here


def retyped(error: NodeError) -> ArgosyError:
    """A node's error as the ArgosyError it was there (same class, message, param, code)."""
    cls = getattr(error_types, error.kind, None)
    if not (isinstance(cls, type) and issubclass(cls, ArgosyError)):
        cls = ArgosyError
    exc = cls.__new__(cls)
    ArgosyError.__init__(exc, error.message, error.param, error.code)
    if not hasattr(exc, "retry_after_s") and isinstance(exc, error_types.OverloadedError):
        exc.retry_after_s = 1
    return exc


def _is_node_death(exc: BaseException) -> bool:
    import ray.exceptions

    return isinstance(exc, ray.exceptions.RayActorError | ray.exceptions.ActorUnavailableError)


class FleetEngineClient:
    def __init__(
        self,
        nodes: list[FleetNode],
        description: ModelDescription,
        block_size: int,
        placer: Placer,
    ) -> None:
        self.nodes = nodes
        self.description = description
        self.block_size = block_size
        self.placer = placer
        self.dead_error: BaseException | None = None
        self._where: dict[str, FleetNode] = {}  # request id -> its node
        self._monitor: asyncio.Task[None] | None = None

    # -- EngineClient ------------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self.dead_error is None  # nodes come back (Ray restarts them); none up: 503s

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, qos: str = "interactive") -> None:
        """The engine's own checks, and a 503 + Retry-After (before any byte is sent) while
        every node is down."""
        d = self.description
        validate_request(prompt_token_ids, params, qos, d.vocab_size, d.context_length)
        if not any(node.view.alive for node in self.nodes):
            raise NoNodeError("Every node of the fleet is down; try again shortly.")

    async def compile_grammar(self, spec: GrammarSpec, param: str | None = None) -> None:
        """Checked on one live node (each node compiles it again into its own cache when a
        request needs it)."""
        node = next((n for n in self.nodes if n.view.alive), None)
        if node is None:
            return  # placement answers 503 next
        error = await node.actor.compile_grammar.remote(spec, param)
        if error is not None:
            raise retyped(error)

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        keys = prompt_block_keys(token_ids, self.block_size)
        return max((leading_hits(keys, n.view.cached) for n in self.nodes if n.view.alive), default=0) * (
            self.block_size
        )

    def arriving(self) -> Arrival:
        return Arrival()

    def stats(self) -> EngineStats:
        total = _no_stats()
        for node in self.nodes:
            if node.view.alive:
                total = EngineStats(
                    **{
                        f.name: getattr(total, f.name) + getattr(node.stats, f.name)
                        for f in dataclasses.fields(EngineStats)
                        if f.name not in ("compile_status",)
                    },
                    compile_status=node.stats.compile_status,
                )
        return total

    def num_in_flight(self) -> int:
        return len(self._where)

    def abort(self, request_id: str) -> None:
        node = self._where.get(request_id)
        if node is not None:
            node.actor.abort.remote(request_id)

    def shutdown(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        import ray

        for node in self.nodes:
            with contextlib.suppress(Exception):
                ray.kill(node.actor, no_restart=True)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        qos: str = "interactive",
        guide: GuideSpec | None = None,
        arrival: Arrival | None = None,
        affinity: tuple[str, ...] = (),
        images: list[Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        if images:  # never reached: a fleet's vision_info is None, so the core refuses images
            raise InvalidRequestError("A fleet's models read text only (yet).", param="messages")
        self._ensure_monitor()
        request_id = request_id or f"fleet-{time.monotonic_ns()}"
        if arrival is not None:
            arrival.done()
        tried: set[str] = set()
        while True:
            node = self._place(request_id, prompt_token_ids, affinity, tried)
            started = finished = False
            node.view.in_flight += 1
            self._where[request_id] = node
            try:
                stream = node.actor.generate.options(num_returns="streaming").remote(
                    prompt_token_ids, params, request_id, qos, guide
                )
                async for ref in stream:
                    for item in await ref:
                        if isinstance(item, NodeError):
                            raise retyped(item)
                        started = True
                        finished = item.finished
                        yield item
                return
            except BaseException as exc:
                if not _is_node_death(exc):
                    raise
                self._mark_down(node, exc)
                if started:
                    raise NodeLostError(
                        f"The fleet node {node.name} running this request died; the other nodes serve on."
                    ) from None
                tried.add(node.name)  # not started: placed again, on another node if one is up
            finally:
                node.view.in_flight -= 1
                self._where.pop(request_id, None)
                if started and not finished:
                    with contextlib.suppress(Exception):
                        node.actor.abort.remote(request_id)

    # -- placement and node states -----------------------------------------------------------
    def _place(
        self, request_id: str, prompt_token_ids: list[int], affinity: tuple[str, ...], tried: set[str]
    ) -> FleetNode:
        views = [n.view for n in self.nodes if n.name not in tried] or [n.view for n in self.nodes]
        decision = self.placer.place(views, prompt_token_ids, affinity)
        node = next(n for n in self.nodes if n.name == decision.node)
        node.placements[decision.policy] += 1
        for key in affinity:
            self.placer.remember(key, node.name)
        log.info(
            "%s placed on %s by %s (%d of the prompt's blocks cached there)",
            request_id,
            node.name,
            decision.policy,
            decision.prefix_blocks,
        )
        return node

    def _mark_down(self, node: FleetNode, exc: BaseException) -> None:
        if node.view.alive:
            log.warning("fleet node %s is down (%s); Ray restarts it", node.name, type(exc).__name__)
        node.view.alive = False

    def _ensure_monitor(self) -> None:
        if self._monitor is None or self._monitor.done():
            self._monitor = asyncio.get_running_loop().create_task(self._watch(), name="fleet-monitor")

    async def refresh(self) -> None:
        """Read every node's stats once (the monitor does every STATS_EVERY_S)."""
        await asyncio.gather(*(self._refresh(node) for node in self.nodes))

    async def _refresh(self, node: FleetNode) -> None:
        try:
            report: NodeStats = await asyncio.wait_for(node.actor.stats.remote(), timeout=5.0)
        except Exception as exc:  # noqa: BLE001 - dead, restarting or wedged: down until it answers
            self._mark_down(node, exc)
            return
        if not node.view.alive:
            node.restarts += 1
            log.info("fleet node %s is up again (pid %d)", node.name, report.pid)
        node.view.alive = True
        node.view.cached = report.cached
        node.stats = report.engine
        node.pid = report.pid

    async def _watch(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                await self.refresh()
            await asyncio.sleep(STATS_EVERY_S)

    def report(self) -> list[NodeReport]:
        return [
            NodeReport(n.name, n.view.alive, n.view.in_flight, n.restarts, dict(n.placements), n.pid)
            for n in self.nodes
        ]
