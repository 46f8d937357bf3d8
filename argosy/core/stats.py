"""The server's own figures over time, for the console's charts: a snapshot (per loaded chat
model its engine's running / waiting requests, KV-cache usage and prefix-cache hit rate; over
the recent finished requests, TTFT and inter-token latency percentiles and tokens per second),
and StatsHistory, which takes one every `interval_s` and keeps the last hour, so a console
opened now draws the hour before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from argosy.core.events import RequestEvent
from argosy.core.registry import ModelRegistry
from argosy.core.service import ModelService

log = logging.getLogger("argosy.stats")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def model_gauges(registry: ModelRegistry) -> dict[str, dict[str, Any]]:
    """Per loaded chat model: its engine's running / waiting requests, in-flight generations,
    KV-cache usage and prefix-cache hit rate (None before its first lookup)."""
    models = {}
    for entry in registry.loaded():
        service = entry.service
        if isinstance(service, ModelService) and service.is_alive:
            engine, in_flight = service.engine_stats()
            hits, queries = engine.prefix_cache_hits, engine.prefix_cache_queries
            models[entry.spec.id] = {
                "running": engine.num_running,
                "waiting": engine.num_waiting,
                "in_flight": in_flight,
                "kv_cache_usage": engine.kv_cache_usage,
                "prefix_cache_hit_rate": hits / queries if queries else None,
            }
    return models


def snapshot(registry: ModelRegistry, finished: list[RequestEvent], window_s: float) -> dict[str, Any]:
    """The figures now: the gauges, and over the requests that finished in the last `window_s`."""
    now = time.time()
    recent = [e for e in finished if e.timestamp >= now - window_s]
    ttft = [e.ttft_s for e in recent if e.ttft_s is not None]
    itl = [e.decode_s / e.decode_tokens for e in recent if e.decode_s and e.decode_tokens]
    tokens = sum(e.completion_tokens or 0 for e in recent)
    return {
        "time": now,
        "window_s": window_s,
        "requests": len(recent),
        "refused": sum(1 for e in recent if (e.status or 0) >= 400),
        "tokens_per_s": tokens / window_s if window_s > 0 else None,
        "ttft_s": {"p50": percentile(ttft, 0.5), "p95": percentile(ttft, 0.95)},
        "itl_s": {"p50": percentile(itl, 0.5), "p95": percentile(itl, 0.95)},
        "models": model_gauges(registry),
    }


class StatsHistory:
    """A snapshot every `interval_s` (over the last `window_s` of requests), the last `keep_s`
    of them kept; a Service of the server's lifespan (start / stop)."""

    def __init__(
        self,
        take: Callable[[float], dict[str, Any]],
        interval_s: float = 5.0,
        window_s: float = 60.0,
        keep_s: float = 3600.0,
    ) -> None:
        self.take = take
        self.interval_s = interval_s
        self.window_s = window_s
        self.points: deque[dict[str, Any]] = deque(maxlen=max(1, int(keep_s / interval_s)))
        self._task: asyncio.Task[None] | None = None

    def record(self) -> dict[str, Any]:
        point = self.take(self.window_s)
        self.points.append(point)
        return point

    def since(self, after: float | None) -> list[dict[str, Any]]:
        return [p for p in self.points if after is None or p["time"] > after]

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="stats-history")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            try:
                self.record()
            except Exception:  # noqa: BLE001 - a figure that cannot be read is skipped, not fatal
                log.exception("stats sample failed")
            await asyncio.sleep(self.interval_s)
