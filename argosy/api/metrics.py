"""Prometheus scrape: `GET /metrics` and `GET /v1/metrics`, in the text exposition format.

What they hold and how their labels stay bounded: argosy/core/metrics.py (the figures name
configured models and key names only, never a prompt or a string a client sent).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response

from argosy.core.metrics import ServerMetrics

router = APIRouter()

_TEXT: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "Prometheus text exposition",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
}


@router.get("/metrics", response_class=Response, responses=_TEXT)
@router.get("/v1/metrics", response_class=Response, responses=_TEXT)
async def metrics(request: Request) -> Response:
    """The server's metrics (requests, tokens, latencies, engine state), for Prometheus."""
    server_metrics: ServerMetrics = request.app.state.metrics
    return Response(server_metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
