"""OpenAI `GET /v1/models` and `GET /v1/models/{id}`, with a capabilities descriptor.

The descriptor says what a client may ask of the model: context length (`max_model_len`, and
`n_ctx` as the reference and llama.cpp name it), modalities (`modality_support`: true, or why a
part of that medium is refused, in the refusal's words), whether it has a chat template /
thinking (`reasoning_effort`: the levels where its template reads one) / tool-call dialect, its
weights' format, and the sampling values a request that sets nothing runs with (SPEC §3
rule 7: sending them back changes nothing). Every configured model is listed with its state (`loaded`, `loading`, `unloaded`,
`unloading`, `failed`); what is not known until it loads is null.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse

from argosy.api.openapi import takes
from argosy.api.transport import read_model
from argosy.api.wire import WireModel
from argosy.chat.modalities import modality_support
from argosy.core.registry import ModelEntry, ModelRegistry
from argosy.core.service import ModelInfo
from argosy.errors import NotFoundError

router = APIRouter()
# the audio model kinds and the tasks each serves (a multilingual recogniser also translates)
AUDIO_KINDS = {"transcription": ("transcribe",), "speech": ("speech",), "music": ("music",)}


def model_json(info: ModelInfo) -> dict[str, Any]:
    capabilities: dict[str, Any] = {
        "kind": info.kind,
        "state": info.state,
        "loaded": info.is_loaded,
        "aliases": list(info.aliases),
        "context_length": info.context_length,
        "modalities": ["text"],
        # per modality: true, or why the model refuses a part of it (the 400's own words)
        "modality_support": modality_support(),
        "architecture": info.architecture,
        "dtype": info.dtype,
        "memory_bytes": info.memory_bytes,
        "error": info.error,
    }
    if info.kind == "embedding":
        capabilities |= {
            "embeddings": True,
            "dimensions": info.dimensions,
            "embedding_dimensions": info.dimensions,
            "pooling": info.pooling,
        }
    elif info.kind == "rerank":
        capabilities |= {"tasks": ["rerank", "score"]}
    elif info.kind in AUDIO_KINDS:
        capabilities |= {
            "modalities": ["audio", "text"],
            "modality_support": modality_support("audio"),
            "tasks": list(info.tasks or AUDIO_KINDS[info.kind]),
            "languages": None if info.languages is None else list(info.languages),
            "voices": None if info.voices is None else list(info.voices),
            "description": info.description,
            "quantization": info.quantization,
        }
    elif info.kind == "image":
        capabilities |= {
            "modalities": ["text", "image"],
            "modality_support": modality_support("image"),
            "tasks": ["generate"],
            "description": info.description,
        }
    else:
        if info.accepts_images:  # a vision-language model reads image parts
            capabilities |= {"modalities": ["text", "image"], "modality_support": modality_support("image")}
        capabilities |= {
            "chat_template": info.has_chat_template,
            "chat_template_source": info.chat_template_source,
            "thinking": info.has_thinking,
            # the values a request's reasoning_effort may take where the template reads it, else null
            "reasoning_effort": (
                None if info.reasoning_effort_levels is None else list(info.reasoning_effort_levels)
            ),
            "tools": info.has_tools,
            "fill_in_the_middle": info.has_fim,
            "quantization": info.quantization,
            "sampling_defaults": info.sampling_defaults,
            # a request without max_tokens: this default, or None: to the end of the context
            "default_max_tokens": info.sampling_defaults.get("max_tokens"),
            "speculative_decoding": info.speculative,
            "weights": info.weights,
            "tensor_formats": info.tensor_formats,
            "compiled_decode": info.compiled_decode,
            "compile": info.compile_status,
            "compiled_graphs": info.compiled_graphs,
            "kernels": info.kernels,
            "deterministic": info.deterministic,
            "kv_cache": info.kv_cache,
            # /v1/embeddings of a chat model: its last hidden states, mean-pooled (null: unloaded)
            "embeddings": info.pooling is not None,
            "embedding_dimensions": info.dimensions,
            "pooling": info.pooling,
        }
    return {
        "id": info.id,
        "object": "model",
        "created": info.created,
        "owned_by": "argosy",
        "max_model_len": info.context_length,
        "n_ctx": info.context_length,  # the reference's name (llama.cpp's) for the same length
        # K and V bytes of one token (--kv-cache-dtype int8: 0.53x fp16's); null: not loaded
        "kv_bytes_per_token": None if info.kv_cache is None else info.kv_cache["bytes_per_token"],
        "capabilities": capabilities,
    }


def adapter_json(base: dict[str, Any], name: str, path: str) -> dict[str, Any]:
    """A LoRA adapter as a model of its own, its base as `parent` and its file as `root` (as
    vLLM lists them); the rest is its base's."""
    capabilities = {**base["capabilities"], "lora_adapter": True}
    return {**base, "id": name, "parent": base["id"], "root": path, "capabilities": capabilities}


def _with_adapters(registry: ModelRegistry, entry: ModelEntry) -> list[dict[str, Any]]:
    base = model_json(registry.info(entry))
    return [base, *(adapter_json(base, name, path) for name, path in entry.spec.adapters)]


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    registry: ModelRegistry = request.app.state.registry
    data = [model for e in registry.entries for model in _with_adapters(registry, e)]
    return JSONResponse({"object": "list", "data": data})


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> JSONResponse:
    registry: ModelRegistry = request.app.state.registry
    try:
        entry = registry.resolve(model_id)
    except NotFoundError as exc:
        exc.param = None  # a path segment, not a body field
        raise
    listed = {model["id"]: model for model in _with_adapters(registry, entry)}
    return JSONResponse(listed.get(model_id, listed[entry.spec.id]))


@router.get("/v1/audio/models")
async def list_audio_models(request: Request) -> JSONResponse:
    """The configured audio models (transcription and speech), each with its tasks and voices."""
    registry: ModelRegistry = request.app.state.registry
    entries = [e for e in registry.entries if e.spec.kind in AUDIO_KINDS]
    return JSONResponse({"object": "list", "data": [model_json(registry.info(e)) for e in entries]})


def _audio_entry(registry: ModelRegistry, model_id: str, param: str | None = None) -> ModelEntry:
    """The configured audio model `model_id` names (404 for an unknown or a non-audio one)."""
    try:
        entry = registry.resolve(model_id)
    except NotFoundError as exc:
        exc.param = param
        raise
    if entry.spec.kind not in AUDIO_KINDS:
        raise NotFoundError(
            f"'{model_id}' is a {entry.spec.kind} model, not an audio model.", param, code="not_audio_model"
        )
    return entry


@router.get("/v1/audio/models/{model_id:path}")
async def retrieve_audio_model(request: Request, model_id: str) -> JSONResponse:
    registry: ModelRegistry = request.app.state.registry
    return JSONResponse(model_json(registry.info(_audio_entry(registry, model_id))))


class AudioModelLoad(WireModel):
    model: str = Field(min_length=1)  # a configured audio model's id or alias


@router.post("/v1/audio/models")
@takes(AudioModelLoad)
async def load_audio_model(request: Request) -> JSONResponse:
    """Load a configured audio model now (the reference server's path; the same as
    POST /v1/argosy/models/{id}/load for an audio model); answers once it serves."""
    registry: ModelRegistry = request.app.state.registry
    body = await read_model(request, AudioModelLoad)
    entry = _audio_entry(registry, body.model, "model")
    (await registry.acquire(entry)).release()
    return JSONResponse(model_json(registry.info(entry)))


@router.delete("/v1/audio/models/{model_id:path}")
async def unload_audio_model(request: Request, model_id: str) -> JSONResponse:
    """Unload an audio model once its in-flight requests are done (the reference server's
    path; as POST /v1/argosy/models/{id}/unload). Its configuration stays: the next request
    loads it again."""
    registry: ModelRegistry = request.app.state.registry
    return await _unload(registry, _audio_entry(registry, model_id))


def _entry(request: Request, model_id: str) -> Any:
    registry: ModelRegistry = request.app.state.registry
    try:
        return registry.resolve(model_id)
    except NotFoundError as exc:
        exc.param = None  # a path segment, not a body field
        raise


@router.post("/v1/argosy/models/{model_id:path}/load")
async def load_model(request: Request, model_id: str) -> JSONResponse:
    """Load a configured model now (any kind); answers once it serves, with its description."""
    registry: ModelRegistry = request.app.state.registry
    entry = _entry(request, model_id)
    lease = await registry.acquire(entry)
    lease.release()
    return JSONResponse(model_json(registry.info(entry)))


@router.post("/v1/argosy/models/{model_id:path}/unload")
async def unload_model(request: Request, model_id: str) -> JSONResponse:
    """Unload a model once its in-flight requests are done (the next request loads it again)."""
    registry: ModelRegistry = request.app.state.registry
    return await _unload(registry, _entry(request, model_id))


async def _unload(registry: ModelRegistry, entry: ModelEntry) -> JSONResponse:
    was_loaded = entry.state == "loaded"
    await registry.unload(entry, reason="asked over HTTP")
    return JSONResponse(
        {"id": entry.spec.id, "object": "model", "unloaded": was_loaded, "state": entry.state}
    )
