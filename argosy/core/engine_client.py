"""EngineClient: the only thing the core talks to when it generates.

Plain data crosses it both ways — token ids, SamplingParams, a QoS class name, a GuideSpec
(grammars are compiled where the engine runs, with the compile cache there), RequestOutputs,
EngineStats, a ModelDescription — so an engine in another process (a fleet node) can
implement it as well as the local AsyncEngine (argosy/engine/async_engine.py) does.

Arrivals: `arriving()` counts a request on its way (its prompt still being rendered), and the
core hands the returned Arrival to `generate(arrival=...)`, which marks it done once queued,
so an idle engine can wait for a burst's stragglers before its first step.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from argosy.engine.arrivals import Arrival
from argosy.engine.outputs import EngineStats, ModelDescription, RequestOutput
from argosy.engine.sequence import ImagePlacement
from argosy.runner.structured import GrammarSpec, GuideSpec
from argosy.sampling_params import SamplingParams


@runtime_checkable
class EngineClient(Protocol):
    description: ModelDescription
    dead_error: BaseException | None  # why the engine stopped, once it has

    @property
    def is_alive(self) -> bool: ...

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        *,
        qos: str = "interactive",
        guide: GuideSpec | None = None,
        arrival: Arrival | None = None,
        affinity: tuple[str, ...] = (),
        images: list[ImagePlacement] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come; leaving the iteration early aborts it.
        `affinity`: the session it continues (a fleet places it where that session ran);
        `images`: a VLM prompt's images (core/vision.py)."""
        ...

    def abort(self, request_id: str) -> None: ...

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, qos: str = "interactive") -> None:
        """Every check that needs no engine state; raises typed errors."""
        ...

    async def compile_grammar(self, spec: GrammarSpec, param: str | None = None) -> None:
        """Compile `spec` where the engine runs; InvalidRequestError naming `param` if it cannot be."""
        ...

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """How many leading tokens of `token_ids` the prefix cache holds now."""
        ...

    def arriving(self) -> Arrival: ...

    def stats(self) -> EngineStats: ...

    def num_in_flight(self) -> int: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class PoolingEngineClient(Protocol):
    """An EngineClient that also pools hidden states (embeddings from a chat model): the
    local AsyncEngine does; a fleet's client does not (yet)."""

    async def embed(
        self,
        inputs: list[list[int]],
        *,
        pooling: str = "mean",
        qos: str = "interactive",
        arrival: Arrival | None = None,
    ) -> list[RequestOutput]:
        """One finished output per input, in order, each with its `embedding`."""
        ...


@dataclass(frozen=True, slots=True)
class NodeReport:
    """One engine node of a fleet's model, as /health and /metrics show it."""

    name: str
    up: bool
    in_flight: int  # this head's requests on it now
    restarts: int  # times it came back after being seen down
    placements: dict[str, int]  # placement policy -> requests it placed there
    pid: int | None


@runtime_checkable
class NodeReporting(Protocol):
    """An EngineClient whose engine is several nodes (argosy/fleet/client.py)."""

    def report(self) -> list[NodeReport]: ...
