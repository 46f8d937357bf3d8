"""LoRA adapters at run time, in the shapes vLLM's and llama.cpp's servers take:

- `POST /v1/load_lora_adapter` `{"lora_name", "lora_path", "model"?}` (vLLM's; `model`: the
  chat model it adapts, default the first): read, checked against the base and served as model
  `lora_name` from now on. Admin keys only (`--admin-key`, or `admin = true` in --api-keys).
- `POST /v1/unload_lora_adapter` `{"lora_name"}`: no longer served (409 while requests run
  with it). Admin keys only.
- `GET /lora-adapters?model=` (llama.cpp's): `[{id, path, scale, name, rank, format}]`, the
  ids a request's `lora: [{id, scale}]` names.

An adapter is a model id of its own (`GET /v1/models` lists it with its base as `parent`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse

from argosy.api.errors import APIError
from argosy.api.gate import Gate
from argosy.api.openapi import query, takes
from argosy.api.transport import read_model, request_record
from argosy.api.wire import WireModel
from argosy.core.registry import ModelEntry, ModelRegistry
from argosy.errors import InvalidRequestError

router = APIRouter()


class LoadLoraAdapter(WireModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)
    model: str | None = None  # the chat model it adapts (default: the first)


class UnloadLoraAdapter(WireModel):
    lora_name: str = Field(min_length=1, max_length=256)
    model: str | None = None  # accepted for symmetry; the adapter's name says its base


def require_admin(request: Request) -> None:
    """403 unless the request came with an admin key; none configured: nobody may."""
    gate: Gate = request.app.state.gate
    admins = [policy for policy in gate.keys.policies if policy.admin]
    if not admins:
        raise APIError(
            "permission_denied",
            "Loading and unloading adapters needs an admin key; start the server with --admin-key KEY "
            "(or admin = true on a key of --api-keys).",
            code="admin_key_required",
        )
    record = request_record(request.scope)
    name = record.key_name if record is not None else None
    if not any(policy.name == name for policy in admins):
        raise APIError("permission_denied", "This route needs an admin key.", code="admin_key_required")


def _engine_of(entry: ModelEntry) -> Any:
    engine = entry.service.require_engine()
    if not hasattr(engine, "load_adapter"):
        raise InvalidRequestError(
            f"Model {entry.spec.id!r} runs on a fleet; its adapters are set at start-up (--lora).", "model"
        )
    return engine


@router.post("/v1/load_lora_adapter")
@takes(LoadLoraAdapter)
async def load_lora_adapter(request: Request) -> JSONResponse:
    require_admin(request)
    body = await read_model(request, LoadLoraAdapter)
    registry: ModelRegistry = request.app.state.registry
    entry = registry.resolve(body.model, "chat")
    if registry.adapters.base_of(body.lora_name) is not None or body.lora_name in {
        n for e in registry.entries for n in e.spec.names
    }:
        raise APIError(
            "conflict", f"The name {body.lora_name!r} is already a served model or adapter.", "lora_name"
        )
    lease = await registry.acquire(entry)
    try:
        described = await _engine_of(entry).load_adapter(body.lora_name, body.lora_path)
    finally:
        lease.release()
    registry.adapters.add(entry, body.lora_name, body.lora_path)
    return JSONResponse({"status": "loaded", "model": entry.spec.id, **described})


@router.post("/v1/unload_lora_adapter")
@takes(UnloadLoraAdapter)
async def unload_lora_adapter(request: Request) -> JSONResponse:
    require_admin(request)
    body = await read_model(request, UnloadLoraAdapter)
    registry: ModelRegistry = request.app.state.registry
    entry = registry.adapters.base_of(body.lora_name)
    if entry is None:
        raise APIError("not_found", f"No LoRA adapter named {body.lora_name!r} is served.", "lora_name")
    if entry.state == "loaded":
        await _engine_of(entry).unload_adapter(body.lora_name)
    registry.adapters.remove(body.lora_name)
    return JSONResponse({"status": "unloaded", "lora_name": body.lora_name, "model": entry.spec.id})


@router.get(
    "/lora-adapters",
    openapi_extra={"parameters": [query("model", {"type": "string"}, "A chat model (default: the first).")]},
)
async def list_lora_adapters(request: Request) -> JSONResponse:
    registry: ModelRegistry = request.app.state.registry
    entry = registry.resolve(request.query_params.get("model"), "chat")
    if entry.state == "loaded" and hasattr(entry.service.require_engine(), "adapters"):
        listed = entry.service.require_engine().adapters()
    else:  # not loaded: the configured ones, in the order they will take their ids
        listed = [{"name": n, "id": i, "path": p} for i, (n, p) in enumerate(entry.spec.adapters)]
    return JSONResponse([{**adapter, "scale": 1.0} for adapter in listed])
