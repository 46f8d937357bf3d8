"""Health and engine introspection: `GET /health`, `GET /v1/argosy/engine`.

/health never needs a key and stays cheap: 200 {"status": "ok", "models": {id: state}} once
the models loaded at start-up serve; 503 with {"status": "loading"} before, {"status":
"failed"} if one of them could not load, {"status": "dead"} if a loaded model's engine loop
stopped. Models loaded on request do not hold /health back. Once the server is shutting down
(SIGTERM / SIGINT, argosy/core/drain.py) it answers 503 {"status": "draining", "models",
"num_in_flight", "grace_left_s"} with Retry-After, whatever the models' state. A fleet
(argosy fleet) adds its models' nodes ("nodes": up, in flight, restarts), and answers 503
{"status": "no_nodes"} + Retry-After while a model has every node down.
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse

from argosy.api.openapi import query
from argosy.core.drain import Drain
from argosy.core.engine_client import NodeReport
from argosy.core.registry import ModelRegistry
from argosy.core.service import ModelService
from argosy.errors import InvalidRequestError

router = APIRouter()


def server_state(registry: ModelRegistry, preloaded: list[str]) -> str:
    """ok | loading | failed | dead. A start-up model unloaded since (a keep-alive, a request
    asking it) is not waited for again: the next request loads it."""
    entries = {e.spec.id: e for e in registry.entries}
    if any(e.state == "loaded" and not e.service.is_alive for e in registry.entries):
        return "dead"
    if any(entries[model_id].state == "failed" for model_id in preloaded):
        return "failed"
    if any(entries[model_id].state != "loaded" and not entries[model_id].num_loads for model_id in preloaded):
        return "loading"
    return "ok"


@router.get(
    "/health",
    responses={
        503: {
            "description": "Not ready: models loading, failed or dead; or draining",
            "content": {"application/json": {}},
        }
    },
)
async def health(request: Request) -> JSONResponse:
    registry: ModelRegistry = request.app.state.registry
    models = {e.spec.id: e.state for e in registry.entries}
    drain: Drain | None = getattr(request.app.state, "drain", None)
    if drain is not None and not drain.is_serving:
        body = {
            "status": "draining",
            "models": models,
            "num_in_flight": drain.num_requests,
            "grace_left_s": round(drain.grace_left_s(), 1),
        }
        return JSONResponse(body, status_code=503, headers={"retry-after": str(drain.retry_after_s())})
    state = server_state(registry, request.app.state.preloaded)
    answer: dict[str, object] = {"status": state, "models": models}
    fleet = fleet_nodes(registry)
    if fleet:
        answer["nodes"] = {
            model_id: [
                {"name": n.name, "up": n.up, "in_flight": n.in_flight, "restarts": n.restarts, "pid": n.pid}
                for n in nodes
            ]
            for model_id, nodes in fleet.items()
        }
        if state == "ok" and any(not any(n.up for n in nodes) for nodes in fleet.values()):
            # a fleet model with every node down: take this head out of rotation until one is back
            return JSONResponse(
                {**answer, "status": "no_nodes"}, status_code=503, headers={"retry-after": "2"}
            )
    return JSONResponse(answer, status_code=200 if state == "ok" else 503)


def fleet_nodes(registry: ModelRegistry) -> dict[str, list[NodeReport]]:
    """Per loaded fleet model, its nodes (a local model has none)."""
    found = {}
    for entry in registry.loaded():
        if isinstance(entry.service, ModelService) and (nodes := entry.service.nodes()) is not None:
            found[entry.spec.id] = nodes
    return found


@router.get(
    "/v1/argosy/engine",
    openapi_extra={
        "parameters": [query("model", {"type": "string"}, "A loaded chat model (default: the first).")]
    },
)
async def engine_stats(request: Request) -> JSONResponse:
    """A loaded chat model's engine counters (`?model=`; default the first chat model)."""
    registry: ModelRegistry = request.app.state.registry
    entry = registry.resolve(request.query_params.get("model"), "chat")
    if entry.state != "loaded":
        raise InvalidRequestError(f"Model {entry.spec.id!r} is {entry.state}, not loaded.", "model")
    service: ModelService = entry.service
    stats, num_in_flight = service.engine_stats()
    return JSONResponse(
        {
            "model": service.model_id,
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "num_in_flight": num_in_flight,
            "num_queued": service.admission.num_waiting,  # admitted, not started (--max-queued-requests)
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
