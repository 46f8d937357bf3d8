"""OpenAI `GET /v1/models` and `GET /v1/models/{id}`, with a capabilities descriptor.

The descriptor says what a client may ask of the model: context length, modalities, whether
it has a chat template / thinking / tool-call dialect, its weights' format, and the sampling
values a request that sets nothing runs with (SPEC §3 rule 7: sending them back changes
nothing). While the model loads, what is not known yet is null.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse

from argosy.core.service import Core, ModelInfo
from argosy.errors import NotFoundError

router = APIRouter()


def model_json(info: ModelInfo) -> dict[str, Any]:
    return {
        "id": info.id,
        "object": "model",
        "created": info.created,
        "owned_by": "argosy",
        "max_model_len": info.context_length,
        "capabilities": {
            "loaded": info.is_loaded,
            "context_length": info.context_length,
            "modalities": ["text"],
            "chat_template": info.has_chat_template,
            "thinking": info.has_thinking,
            "tools": info.has_tools,
            "fill_in_the_middle": False,
            "architecture": info.architecture,
            "quantization": info.quantization,
            "dtype": info.dtype,
            "sampling_defaults": info.sampling_defaults,
            "speculative_decoding": info.speculative,
            "weights": info.weights,
            "compiled_decode": info.compiled_decode,
        },
    }


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    core: Core = request.app.state.core
    return JSONResponse({"object": "list", "data": [model_json(core.model_info())]})


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> JSONResponse:
    core: Core = request.app.state.core
    try:
        core.resolve_model(model_id)
    except NotFoundError as exc:
        exc.param = None  # a path segment, not a body field
        raise
    return JSONResponse(model_json(core.model_info()))
