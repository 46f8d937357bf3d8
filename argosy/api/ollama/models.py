"""Ollama's model routes: `GET /api/tags`, `POST /api/show`, `GET /api/ps`,
`GET /api/version`, `POST /api/embed`, `POST /api/embeddings`, and `GET|HEAD /` (the CLI's
heartbeat).

Models are those configured at start-up (`--model` / `--models`), listed as `name:latest`.
`/api/pull` is argosy/api/ollama/pull.py (the models Argosy ships in packages); `/api/push`, `/api/create`, `/api/copy` and `/api/delete`, is a 400 saying that models are
configured locally, in Ollama's `{"error": …}` shape.

`/api/show` loads the model when it is not loaded (its template and capabilities are only
known then). `size` in /api/tags is the model file's size on disk (a converted folder's
total); `digest` is a sha256 of the file's path, size and modification time (not of its
bytes, which would mean reading gigabytes on every listing). /api/ps lists loaded models
with their memory (weights and KV pool) and when the keep-alive unloads them (`expires_at`;
far in the future when it never does).

Embeddings, from an embedding model or (as Ollama gives them) a chat model's mean-pooled
last hidden states: `/api/embed` takes `input` (a string or a list), `truncate` (default true:
an over-long input is cut to the context, `options.num_ctx` when it is smaller than the
model's, keeping its leading tokens; false: a 400), and `dimensions` (the vector cut to its
first N values and L2-normalized again, as Ollama does); `/api/embeddings` the older
`prompt` → `embedding`.
"""

from __future__ import annotations

import hashlib
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import APIRouter
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from argosy import __version__
from argosy.api.errors import ollama_status_of
from argosy.api.ollama.wire import (
    OllamaRoute,
    Options,
    apply_keep_alive,
    in_seconds,
    nanoseconds,
    parse_keep_alive,
    timestamp,
    wire_model_name,
)
from argosy.api.openapi import takes
from argosy.api.route import RouteCall, run_route
from argosy.api.wire import WireModel
from argosy.core.embedding_service import embedder_of
from argosy.core.registry import ModelEntry, ModelRegistry
from argosy.core.service import ModelInfo, ModelService
from argosy.errors import ArgosyError, InvalidRequestError
from argosy.models.embedding_source import EMBEDDING_REGISTRY
from argosy.models.loader import MODEL_REGISTRY

router = APIRouter()

# The Ollama API this dialect follows (clients compare versions to enable features).
OLLAMA_API_VERSION = "0.12.0"
FOREVER = "2318-08-07T00:00:00Z"  # expires_at of a model no keep-alive unloads


class ModelRequest(WireModel):
    model: str = Field(min_length=1)


class ShowRequest(ModelRequest):
    verbose: bool = False


# -- the models ------------------------------------------------------------------------------


def _source_path(source: str) -> Path | None:
    locator = MODEL_REGISTRY.get(source) or EMBEDDING_REGISTRY.get(source)
    try:
        path = locator() if locator is not None else Path(source).expanduser()
    except ArgosyError:
        return None
    return path if path.exists() else None


def _disk_facts(source: str) -> tuple[int, str, datetime | None]:
    """(bytes on disk, digest of path + size + mtime, modified) of a model's file or folder."""
    path = _source_path(source)
    if path is None:
        return 0, hashlib.sha256(source.encode()).hexdigest(), None
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    mtime = max((p.stat().st_mtime for p in files), default=0.0)
    key = f"{path.resolve()}\0{size}\0{mtime}"
    return size, hashlib.sha256(key.encode()).hexdigest(), datetime.fromtimestamp(mtime, UTC)


def family_of(architecture: str | None) -> str:
    """Ollama's family name of an architecture: LlamaForCausalLM -> llama, BertModel -> bert."""
    name = architecture or ""
    for suffix in ("ForCausalLM", "ForConditionalGeneration", "ForMaskedLM", "Model"):
        name = name.removesuffix(suffix)
    return name.lower()


def _details(info: ModelInfo, source: str) -> dict[str, Any]:
    family = family_of(info.architecture)
    return {
        "parent_model": "",
        "format": "gguf" if source.endswith(".gguf") or source in MODEL_REGISTRY else "safetensors",
        "family": family,
        "families": [family] if family else None,
        "parameter_size": "",
        "quantization_level": info.quantization or (info.dtype or ""),
    }


def _capabilities(info: ModelInfo) -> list[str]:
    if info.kind == "embedding":
        return ["embedding"]
    if info.kind == "rerank":
        return []  # Ollama names no rerank capability; it generates nothing
    capabilities = ["completion"]
    if info.has_tools:
        capabilities.append("tools")
    if info.has_thinking:
        capabilities.append("thinking")
    return capabilities


def _tag(registry: ModelRegistry, entry: ModelEntry) -> dict[str, Any]:
    info = registry.info(entry)
    size, digest, modified = _disk_facts(entry.spec.source)
    name = wire_model_name(entry.spec.id)
    return {
        "name": name,
        "model": name,
        "modified_at": timestamp(modified),
        "size": size,
        "digest": digest,
        "details": _details(info, entry.spec.source),
    }


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def heartbeat() -> Response:
    return PlainTextResponse("Argosy is running (Ollama API)")


@router.get("/api/version")
@takes(None, errors="OllamaError")
async def version() -> JSONResponse:
    return JSONResponse({"version": OLLAMA_API_VERSION, "server": f"argosy {__version__}"})


@router.get("/api/tags")
@takes(None, errors="OllamaError")
async def tags(request: Request) -> JSONResponse:
    registry: ModelRegistry = request.app.state.registry
    return JSONResponse({"models": [_tag(registry, entry) for entry in registry.entries]})


@router.get("/api/ps")
@takes(None, errors="OllamaError")
async def ps(request: Request) -> JSONResponse:
    registry: ModelRegistry = request.app.state.registry
    now = time.monotonic()
    models = []
    for entry in registry.loaded():
        info = registry.info(entry)
        _, digest, _ = _disk_facts(entry.spec.source)
        expires = registry.expires_in(entry, now)
        name = wire_model_name(entry.spec.id)
        models.append(
            {
                "name": name,
                "model": name,
                "size": info.memory_bytes or 0,
                "digest": digest,
                "details": _details(info, entry.spec.source),
                "expires_at": FOREVER if expires is None else in_seconds(expires),
                "size_vram": 0,
                "context_length": info.context_length,
            }
        )
    return JSONResponse({"models": models})


def _parameters(info: ModelInfo, stop: list[str]) -> str:
    """The sampling a request that sets none runs with, as Modelfile PARAMETER lines."""
    lines = [f"{name:<15} {value}" for name, value in sorted(info.sampling_defaults.items())]
    lines += [f'{"stop":<15} "{text}"' for text in stop]
    return "\n".join(lines)


class ShowRoute(OllamaRoute[ShowRequest]):
    """What a model is; loads it (its template and capabilities are known once loaded)."""

    route = "POST /api/show"
    body_type = ShowRequest
    kind = None  # any kind of model

    async def serve(self, body: ShowRequest, service: Any, call: RouteCall) -> Response:
        registry: ModelRegistry = call.request.app.state.registry
        entry = registry.resolve(call.model_id)
        info = registry.info(entry)
        arch = family_of(info.architecture) or "unknown"
        model_info: dict[str, Any] = {
            "general.architecture": arch,
            f"{arch}.context_length": info.context_length,
        }
        template = ""
        stop: list[str] = []
        if isinstance(service, ModelService):
            description = service.description
            template = description.chat_template or ""
            stop = [description.eos_token] if description.eos_token else []
            model_info["general.file_type"] = info.quantization
        if info.dimensions is not None:  # a chat model's too (its hidden size), as Ollama shows it
            model_info[f"{arch}.embedding_length"] = info.dimensions
        parameters = _parameters(info, stop)
        modelfile = f"FROM {entry.spec.source}\n"
        if template:
            modelfile += f'TEMPLATE """{template}"""\n'
        modelfile += "".join(f"PARAMETER {line}\n" for line in parameters.splitlines())
        _, _, modified = _disk_facts(entry.spec.source)
        return JSONResponse(
            {
                "modelfile": modelfile,
                "parameters": parameters,
                "template": template,
                "details": _details(info, entry.spec.source),
                "model_info": model_info,
                "capabilities": _capabilities(info),
                "modified_at": timestamp(modified),
            }
        )


@router.post("/api/show")
@takes(ShowRequest, errors="OllamaError")
async def show(request: Request) -> Response:
    return await run_route(request, ShowRoute())


# -- what is configured, not pulled -----------------------------------------------------------


def _not_managed(action: str, registry: ModelRegistry) -> JSONResponse:
    served = ", ".join(wire_model_name(e.spec.id) for e in registry.entries)
    error = InvalidRequestError(
        f"This server does not {action} models: they are configured locally when it starts "
        f"(--model / --models), with no model hub. It serves: {served}."
    )
    return JSONResponse({"error": error.message}, status_code=ollama_status_of(error))


@router.post("/api/push")
@takes(None, errors="OllamaError")
async def push(request: Request) -> JSONResponse:
    return _not_managed("push", request.app.state.registry)


@router.post("/api/create")
@takes(None, errors="OllamaError")
async def create(request: Request) -> JSONResponse:
    return _not_managed("create", request.app.state.registry)


@router.post("/api/copy")
@takes(None, errors="OllamaError")
async def copy(request: Request) -> JSONResponse:
    return _not_managed("copy", request.app.state.registry)


@router.delete("/api/delete")
@takes(None, errors="OllamaError")
async def delete(request: Request) -> JSONResponse:
    return _not_managed("delete", request.app.state.registry)


# -- embeddings ------------------------------------------------------------------------------


class EmbedRequest(ModelRequest):
    input: Any
    truncate: bool = True
    dimensions: int | None = Field(None, ge=1)
    options: Options | None = None
    keep_alive: Any = None

    def check(self) -> None:
        parse_keep_alive(self.keep_alive)
        self.inputs()

    def inputs(self) -> list[str]:
        value = self.input
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
            raise InvalidRequestError("Invalid 'input': expected a string or a list of strings.", "input")
        if not items:
            raise InvalidRequestError("Invalid 'input': it must not be empty.", "input")
        return items


class EmbeddingsRequest(ModelRequest):
    prompt: str = Field(min_length=1)
    options: Options | None = None
    keep_alive: Any = None

    def check(self) -> None:
        parse_keep_alive(self.keep_alive)


def _shortened(vector: list[float], dimensions: int | None) -> list[float]:
    if dimensions is None or dimensions >= len(vector):
        return vector
    cut = np.asarray(vector[:dimensions], dtype=np.float64)
    norm = float(np.linalg.norm(cut))
    return (cut / norm if norm > 0 else cut).tolist()


def _context_of(embedder_limit: int, options: Options | None) -> int:
    """The tokens an input may take: the model's, or `options.num_ctx` when smaller (Ollama
    runs the model with that context)."""
    num_ctx = options.num_ctx if options is not None else None
    return min(embedder_limit, num_ctx) if num_ctx is not None else embedder_limit


class EmbedRoute(OllamaRoute[EmbedRequest]):
    route = "POST /api/embed"
    kind = ("embedding", "chat")
    body_type = EmbedRequest

    def qos(self, body: EmbedRequest, request: Request) -> str:
        return "interactive"

    async def serve(self, body: EmbedRequest, service: object, call: RouteCall) -> Response:
        served_at = time.perf_counter()
        apply_keep_alive(body.keep_alive, call)
        embedder = embedder_of(service)
        items = body.inputs()
        is_single = isinstance(body.input, str)
        limit = _context_of(embedder.max_input_tokens, body.options)
        token_ids = embedder.tokenize(items)
        if not body.truncate:
            _refuse_past(token_ids, limit, "input", is_single)
        token_ids = embedder.check_lengths(token_ids, "input", limit, is_single)
        result = await embedder.embed(token_ids)
        now = time.perf_counter()
        return JSONResponse(
            {
                "model": body.model,
                "embeddings": [_shortened(vector, body.dimensions) for vector in result.vectors],
                "total_duration": nanoseconds(now - call.ctx.started),
                "load_duration": nanoseconds(served_at - call.ctx.started),
                "prompt_eval_count": result.num_prompt_tokens,
            }
        )


def _refuse_past(inputs: list[list[int]], limit: int, param: str, is_single: bool) -> None:
    """`truncate: false`: an input past the context is a 400 naming it, as Ollama's."""
    for index, ids in enumerate(inputs):
        if len(ids) > limit:
            raise InvalidRequestError(
                f"the input length exceeds the context length ({len(ids)} tokens > {limit})",
                param=param if is_single else f"{param}[{index}]",
                code="context_length_exceeded",
            )


class EmbeddingsRoute(OllamaRoute[EmbeddingsRequest]):
    route = "POST /api/embeddings"
    kind = ("embedding", "chat")
    body_type = EmbeddingsRequest

    def qos(self, body: EmbeddingsRequest, request: Request) -> str:
        return "interactive"

    async def serve(self, body: EmbeddingsRequest, service: object, call: RouteCall) -> Response:
        apply_keep_alive(body.keep_alive, call)
        embedder = embedder_of(service)
        token_ids = embedder.tokenize([body.prompt])
        _refuse_past(token_ids, _context_of(embedder.max_input_tokens, body.options), "prompt", True)
        token_ids = embedder.check_lengths(token_ids, "prompt", None, True)
        result = await embedder.embed(token_ids)
        return JSONResponse({"embedding": result.vectors[0]})


@router.post("/api/embed")
@takes(EmbedRequest, errors="OllamaError")
async def embed(request: Request) -> Response:
    return await run_route(request, EmbedRoute())


@router.post("/api/embeddings")
@takes(EmbeddingsRequest, errors="OllamaError")
async def embeddings(request: Request) -> Response:
    return await run_route(request, EmbeddingsRoute())
