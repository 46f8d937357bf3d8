"""Health and engine introspection: `GET /health`, `GET /v1/argosy/engine`.

/health never needs a key: 200 {"status": "ok"} once the model serves, 503 with
{"status": "loading"} before, {"status": "failed"} if it could not load, {"status": "dead"}
if the engine loop stopped.
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse

from argosy.core.service import Core

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    core: Core = request.app.state.core
    state = core.state
    body = {"status": "ok" if state == "ready" else state}
    return JSONResponse(body, status_code=200 if state == "ready" else 503)


@router.get("/v1/argosy/engine")
async def engine_stats(request: Request) -> JSONResponse:
    core: Core = request.app.state.core
    stats, num_in_flight = core.engine_stats()
    return JSONResponse(
        {
            "model": core.model_id,
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "num_in_flight": num_in_flight,
            "num_queued": core.admission.num_waiting,  # admitted, not started (--max-queued-requests)
            "num_free_blocks": stats.num_free_blocks,
            "num_total_blocks": stats.num_total_blocks,
            "kv_cache_usage": stats.kv_cache_usage,
            "num_preemptions": stats.num_preemptions,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "spec_proposed_tokens": stats.spec_proposed_tokens,
            "spec_accepted_tokens": stats.spec_accepted_tokens,
            "spec_steps": stats.spec_steps,
        }
    )
