"""The one request skeleton every model route runs, dialect-free:

    read body -> parse and cheap checks -> QoS -> resolve the model (registry) -> policy hook
    -> acquire it (load on request) -> prepare -> admit -> start -> render

The HTTP edge (argosy/api/route.py) does the reading and rendering; this module holds the
steps between and the `policy` hook (called with the request and the configured model it
resolved to, before any load: per-key policy plugs in here — raise a typed error to refuse,
or lower `ctx.qos`; a no-op by default).
What happens to each request is told by its RequestRecord's events (argosy/core/events.py):
the pipeline notes the model it resolved there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from argosy.config import ModelSpec
from argosy.core.events import RequestRecord
from argosy.core.registry import ArrivalGroup, Lease, ModelRegistry
from argosy.engine.arrivals import Arrival


@dataclass(slots=True)
class RequestContext:
    """One HTTP request as the core sees it."""

    request_id: str
    route: str  # e.g. "POST /v1/chat/completions"
    headers: dict[str, str] = field(default_factory=dict)
    client: str | None = None  # the peer's address
    arrivals: ArrivalGroup | None = None  # counted at the engines until its model is known
    model_id: str | None = None  # once resolved
    adapter: str | None = None  # the LoRA adapter its model name named (model_id: its base)
    key_name: str | None = None  # the API key's name, once the gate authenticated it
    qos: str | None = None  # the QoS class it runs with (the policy may lower it)
    qos_is_explicit: bool = False  # the request named its class (else the default)
    record: RequestRecord | None = None  # what its events tell (None: nobody listens)
    started: float = field(default_factory=time.perf_counter)


PolicyHook = Callable[[RequestContext, ModelSpec], None]


def _no_policy(ctx: RequestContext, spec: ModelSpec) -> None:
    return None


class Pipeline:
    def __init__(self, registry: ModelRegistry, policy: PolicyHook | None = None) -> None:
        self.registry = registry
        self.policy = policy or _no_policy

    async def acquire(
        self, ctx: RequestContext, model_name: str | None, kind: str | tuple[str, ...] | None
    ) -> Lease:
        """Resolve (404 / wrong kind: no load), the policy, then a lease on the loaded model."""
        entry = self.registry.resolve(model_name, kind)
        self.policy(ctx, entry.spec)
        ctx.model_id = entry.spec.id
        ctx.adapter = model_name if self.registry.adapters.base_of(model_name) is entry else None
        if ctx.record is not None:
            ctx.record.model_id = entry.spec.id
        return await self.registry.acquire(entry)

    def arrival(self, ctx: RequestContext) -> Arrival | None:
        """The request's arrival count at its own model's engine (the others' end here)."""
        if ctx.arrivals is None or ctx.model_id is None:
            return None
        return ctx.arrivals.keep(ctx.model_id)
