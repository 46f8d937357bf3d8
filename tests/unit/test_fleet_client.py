"""The head's FleetEngineClient (argosy/fleet/client.py) over fake node actors — the shapes of
Ray's handles without Ray's processes: placement and in-flight counts, a node's typed error
raised again as itself, a request re-placed when its node dies before its first output, an
error (not a cut stream) when it dies after, 503 before anything is sent while every node is
down, and the nodes' stats and summaries read by refresh()."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import pytest

from argosy.engine.outputs import EngineStats, RequestOutput
from argosy.errors import ContextLengthExceededError, OverloadedError
from argosy.fleet.client import FleetEngineClient, FleetNode, NodeLostError, retyped
from argosy.fleet.node import NodeError, NodeStats, node_error
from argosy.fleet.placement import NodeView, NoNodeError, Placer, prompt_block_keys
from argosy.sampling_params import SamplingParams

ray = pytest.importorskip("ray")  # the fleet extra (make install installs it)


class Description:
    vocab_size = 1000
    context_length = 256


def output(request_id: str, token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[token],
        num_prompt_tokens=4,
        num_cached_tokens=0,
        num_output_tokens=1,
        finished=finished,
        finish_reason="length" if finished else None,
    )


async def ready(value: Any) -> Any:
    return value


class Method:
    def __init__(self, call: Any) -> None:
        self.call = call

    def options(self, **_: Any) -> Method:
        return self

    def remote(self, *args: Any) -> Any:
        return self.call(*args)


class FakeActor:
    """`batches`: what generate streams (lists of outputs / a NodeError), or an exception
    raised after `die_after` items (the node's process died)."""

    def __init__(self, batches: list[list[Any]] | None = None, die_after: int | None = None) -> None:
        self.batches = batches or []
        self.die_after = die_after
        self.calls: list[str] = []
        self.aborted: list[str] = []
        self.summary: frozenset[bytes] = frozenset()
        self.dead = False
        self.generate = Method(self._generate)
        self.abort = Method(self.aborted.append)
        self.stats = Method(self._stats)

    def _generate(self, prompt: list[int], params: SamplingParams, request_id: str, *_: Any) -> Any:
        self.calls.append(request_id)

        async def stream() -> AsyncIterator[Awaitable[Any]]:
            for index, batch in enumerate(self.batches):
                if self.die_after is not None and index >= self.die_after:
                    raise ray.exceptions.ActorDiedError()
                yield ready(batch)
            if self.die_after is not None and self.die_after >= len(self.batches):
                raise ray.exceptions.ActorDiedError()

        return stream()

    def _stats(self) -> Awaitable[NodeStats]:
        if self.dead:
            raise ray.exceptions.ActorDiedError()
        return ready(NodeStats(EngineStats(1, 2, 3, 10, 0, 5, 4), 0, self.summary, 4242))


def fleet(*actors: FakeActor, placement: tuple[str, ...] = ("least-loaded",)) -> FleetEngineClient:
    nodes = [FleetNode(f"node{i}", actor, NodeView(f"node{i}")) for i, actor in enumerate(actors)]
    client = FleetEngineClient(nodes, Description(), 4, Placer(placement, 4))  # type: ignore[arg-type]
    client._ensure_monitor = lambda: None  # type: ignore[method-assign]  # refresh() is called by hand
    return client


async def drain(client: FleetEngineClient, request_id: str, **kwargs: Any) -> list[RequestOutput]:
    return [out async for out in client.generate([1, 2, 3, 4], SamplingParams(), request_id, **kwargs)]


def test_outputs_stream_back_in_batches_and_the_count_goes_back_to_zero() -> None:
    actor = FakeActor([[output("r", 5)], [output("r", 6), output("r", 7, finished=True)]])
    client = fleet(actor, FakeActor())
    outs = asyncio.run(drain(client, "r"))
    assert [o.new_token_ids[0] for o in outs] == [5, 6, 7] and outs[-1].finished
    assert actor.calls == ["r"] and client.num_in_flight() == 0
    assert [n.view.in_flight for n in client.nodes] == [0, 0]
    assert client.nodes[0].placements == {"least-loaded": 1} and actor.aborted == []


def test_a_nodes_error_is_raised_as_its_own_type() -> None:
    error = node_error(ContextLengthExceededError("too long", param="max_tokens"))
    client = fleet(FakeActor([[error]]))
    with pytest.raises(ContextLengthExceededError) as caught:
        asyncio.run(drain(client, "r"))
    assert caught.value.param == "max_tokens" and caught.value.code == "context_length_exceeded"
    busy = retyped(NodeError("OverloadedError", "queue full"))
    assert isinstance(busy, OverloadedError) and busy.retry_after_s == 1
    assert type(retyped(NodeError("NoSuchError", "x"))).__name__ == "ArgosyError"


def test_a_node_that_dies_before_the_first_output_hands_the_request_to_another() -> None:
    dying = FakeActor([[output("r", 5)]], die_after=0)
    healthy = FakeActor([[output("r", 9, finished=True)]])
    client = fleet(dying, healthy)
    outs = asyncio.run(drain(client, "r"))
    assert [o.new_token_ids[0] for o in outs] == [9]
    assert dying.calls == ["r"] and healthy.calls == ["r"]
    assert [n.view.alive for n in client.nodes] == [False, True]


def test_a_node_that_dies_mid_stream_ends_it_with_an_error_and_the_others_serve() -> None:
    dying = FakeActor([[output("r", 5)], [output("r", 6)]], die_after=1)
    client = fleet(dying, FakeActor([[output("s", 1, finished=True)]]))

    async def run() -> list[int]:
        seen: list[int] = []
        with pytest.raises(NodeLostError, match="node0 .* died"):
            async for out in client.generate([1, 2, 3, 4], SamplingParams(), "r"):
                seen += out.new_token_ids
        return seen

    assert asyncio.run(run()) == [5]  # what came before the death, then the error
    assert dying.aborted == ["r"]
    assert [o.finished for o in asyncio.run(drain(client, "s"))] == [True]  # placed on node1


def test_every_node_down_is_refused_before_anything_is_sent() -> None:
    client = fleet(FakeActor(), FakeActor())
    client.validate([1, 2, 3], SamplingParams())
    for node in client.nodes:
        node.view.alive = False
    with pytest.raises(NoNodeError):
        client.validate([1, 2, 3], SamplingParams())
    with pytest.raises(ContextLengthExceededError):
        client.validate([1] * 300, SamplingParams())


def test_refresh_reads_stats_and_summaries_and_sees_nodes_go_and_come_back() -> None:
    first, second = FakeActor(), FakeActor()
    prompt = list(range(13))
    first.summary = frozenset(prompt_block_keys(prompt, 4)[:2])
    client = fleet(first, second, placement=("prefix", "least-loaded"))
    asyncio.run(client.refresh())
    assert client.cached_prefix_tokens(prompt) == 8
    assert client.stats().num_running == 2 and client.stats().prefix_cache_hits == 8
    second.dead = True
    asyncio.run(client.refresh())
    assert [r.up for r in client.report()] == [True, False]
    second.dead = False
    asyncio.run(client.refresh())
    assert [(r.up, r.restarts, r.pid) for r in client.report()] == [(True, 0, 4242), (True, 1, 4242)]
    assert client.placer.place([n.view for n in client.nodes], prompt).node == "node0"  # its prefix
