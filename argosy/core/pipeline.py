"""The one request skeleton every model route runs, dialect-free:

    read body -> parse and cheap checks -> policy hook -> QoS -> resolve the model (registry)
    -> acquire it (load on request) -> prepare -> admit -> start -> render -> request events

The HTTP edge (argosy/api/route.py) does the reading and rendering; this module holds the
steps between and the two hooks: `policy` (called with the request and the model it names,
before any load: API keys plug in here; raise a typed error to refuse) and `on_event`
(started / finished / rejected, with status and duration). Both are no-ops by default.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from argosy.core.registry import ArrivalGroup, Lease, ModelRegistry
from argosy.engine.arrivals import Arrival

log = logging.getLogger("argosy.api")


@dataclass(slots=True)
class RequestContext:
    """One HTTP request as the core sees it."""

    request_id: str
    route: str  # e.g. "POST /v1/chat/completions"
    headers: dict[str, str] = field(default_factory=dict)
    client: str | None = None  # the peer's address
    arrivals: ArrivalGroup | None = None  # counted at the engines until its model is known
    model_id: str | None = None  # once resolved
    started: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True, slots=True)
class RequestEvent:
    kind: str  # started | finished | rejected
    request_id: str
    route: str
    model_id: str | None
    status: int | None = None  # HTTP status, when known
    duration_s: float = 0.0
    error: str | None = None


PolicyHook = Callable[[RequestContext, str | None], None]
EventHook = Callable[[RequestEvent], None]


def _no_policy(ctx: RequestContext, model_name: str | None) -> None:
    return None


def _no_events(event: RequestEvent) -> None:
    return None


class Pipeline:
    def __init__(
        self,
        registry: ModelRegistry,
        policy: PolicyHook | None = None,
        on_event: EventHook | None = None,
    ) -> None:
        self.registry = registry
        self.policy = policy or _no_policy
        self.on_event = on_event or _no_events

    async def acquire(self, ctx: RequestContext, model_name: str | None, kind: str | None) -> Lease:
        """Policy, then resolve (404 / wrong kind: no load), then a lease on the loaded model."""
        self.policy(ctx, model_name)
        entry = self.registry.resolve(model_name, kind)
        ctx.model_id = entry.spec.id
        self.emit(ctx, "started")
        return await self.registry.acquire(entry)

    def arrival(self, ctx: RequestContext) -> Arrival | None:
        """The request's arrival count at its own model's engine (the others' end here)."""
        if ctx.arrivals is None or ctx.model_id is None:
            return None
        return ctx.arrivals.keep(ctx.model_id)

    def emit(
        self, ctx: RequestContext, kind: str, status: int | None = None, error: str | None = None
    ) -> None:
        event = RequestEvent(
            kind=kind,
            request_id=ctx.request_id,
            route=ctx.route,
            model_id=ctx.model_id,
            status=status,
            duration_s=time.perf_counter() - ctx.started,
            error=error,
        )
        try:
            self.on_event(event)
        except Exception:  # an observer must never fail a request
            log.exception("request event hook failed")
