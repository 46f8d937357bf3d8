"""One fleet node: a Ray actor process holding one model's engine (the same AsyncEngine a
local `argosy serve` runs), driven by the head's FleetEngineClient (client.py).

Token streams go back through a Ray streaming generator. Each item is a list: every output
the engine produced since the last item (one under light load, several when the node streams
many requests), so a busy node sends fewer, larger items. An error ends the list as a value
(NodeError), never as a Ray exception, so the head raises the engine's own typed error.

The class is plain Python; `node_actor()` makes it a Ray actor class (Ray is imported only
there: `argosy[fleet]` is an optional extra).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Any

from argosy.config import EngineConfig
from argosy.engine.outputs import EngineStats, ModelDescription, RequestOutput
from argosy.errors import ArgosyError
from argosy.fleet.placement import summary_of
from argosy.runner.structured import GrammarSpec, GuideSpec
from argosy.sampling_params import SamplingParams

_END = object()


@dataclass(frozen=True, slots=True)
class NodeError:
    """An error a node's engine raised for one request, as plain data (typed again at the head)."""

    kind: str  # the ArgosyError subclass' name
    message: str
    param: str | None = None
    code: str | None = None


@dataclass(frozen=True, slots=True)
class NodeStats:
    engine: EngineStats
    in_flight: int
    cached: frozenset[bytes]  # placement summary of its prefix cache
    pid: int


class EngineNode:
    def __init__(self, name: str, config: EngineConfig) -> None:
        from argosy.commands.serve import SWITCH_INTERVAL_S
        from argosy.engine.async_engine import AsyncEngine
        from argosy.engine.llm_engine import LLMEngine
        from argosy.process import configure_process

        configure_process(config)
        # as in `argosy serve`: the engine thread must get the GIL back quickly between kernels
        # (Ray's threads and this actor's event loop share it)
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.name = name
        self.engine = AsyncEngine(lambda: LLMEngine(config))
        self.block_size = config.block_size
        self._pumps: dict[str, asyncio.Task[None]] = {}

    def describe(self) -> tuple[ModelDescription, int]:
        return self.engine.description, os.getpid()

    def stats(self) -> NodeStats:
        return NodeStats(self.engine.stats(), len(self._pumps), self._summary(), os.getpid())

    def _summary(self) -> frozenset[bytes]:
        cached = self.engine.engine.block_manager.cached
        for _ in range(5):  # the engine thread may change it while this reads: read again
            with contextlib.suppress(RuntimeError):
                return summary_of(tuple(cached))
        return frozenset()

    async def compile_grammar(self, spec: GrammarSpec, param: str | None = None) -> NodeError | None:
        try:
            await self.engine.compile_grammar(spec, param)
        except ArgosyError as exc:
            return node_error(exc)
        return None

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        qos: str,
        guide: GuideSpec | None,
    ) -> Any:
        """Streaming: lists of RequestOutputs (a NodeError last when the engine refused or failed)."""
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def pump() -> None:
            try:
                async for out in self.engine.generate(
                    prompt_token_ids, params, request_id, qos=qos, guide=guide
                ):
                    queue.put_nowait(out)
            except ArgosyError as exc:
                queue.put_nowait(node_error(exc))
            except Exception as exc:  # noqa: BLE001 - sent to the head as the request's error
                queue.put_nowait(NodeError("EngineDeadError", f"the node's engine failed: {exc!r}"))
            finally:
                queue.put_nowait(_END)

        task = asyncio.create_task(pump())
        self._pumps[request_id] = task
        try:
            ended = False
            while not ended:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                ended = batch[-1] is _END
                items = [item for item in batch if item is not _END]
                if items:
                    yield items
        finally:
            self._pumps.pop(request_id, None)
            task.cancel()  # the head left early: leaving the engine's generator aborts the request

    def abort(self, request_id: str) -> None:
        task = self._pumps.get(request_id)
        if task is not None:
            task.cancel()

    def pid(self) -> int:
        return os.getpid()


def node_error(exc: ArgosyError) -> NodeError:
    return NodeError(type(exc).__name__, exc.message, exc.param, exc.code)


def node_actor(max_restarts: int = -1, num_cpus: float = 1) -> Any:
    """EngineNode as a Ray actor class: restarted when its process dies (`max_restarts`, -1:
    always); a call in flight when it died fails (the head re-places a request that had not
    started) and is not retried."""
    import ray

    return ray.remote(max_restarts=max_restarts, max_task_retries=0, num_cpus=num_cpus)(EngineNode)


def is_output(item: object) -> bool:
    return isinstance(item, RequestOutput)
