"""OpenAI `POST /v1/embeddings` over an embedding model, or a chat model.

`input`: a string, a list of strings, a list of token ids, or a list of token-id lists (one
embedding each, `index` in order). `encoding_format`: `float` (default) or `base64` (the
float32 little-endian bytes, which the openai client asks for by default and decodes).
`dimensions` is a 400 naming it: the served models cannot be shortened (no Matryoshka
training declared, and a chat model's mean-pooled hidden state has none either: its leading
values are not an embedding of their own). An input past the model's length is a 400 naming
its index, unless `truncate_prompt_tokens` asks to cut it (the leading tokens are kept, with
an encoder's closing special token). Empty strings and empty lists are 400s. A chat model
named here answers with its mean-pooled last hidden states (core/embedding_service.py's
ChatEmbedder); another kind (audio, image) is a 400 naming the model's kind (the registry
checks it before anything loads). With no `model`, the first embedding model serves, else
the first chat model.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from argosy.api.openapi import takes
from argosy.api.route import ModelRoute, RouteCall, run_route
from argosy.api.wire import WireModel
from argosy.core.embedding_service import embedder_of
from argosy.errors import InvalidRequestError

router = APIRouter()

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingRequest(WireModel):
    model: str | None = None
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=1)

    def check(self) -> None:
        if self.dimensions is not None:
            raise InvalidRequestError(
                "This model's embeddings cannot be shortened: 'dimensions' is not supported.",
                param="dimensions",
            )
        self.inputs()  # shape checks, before a model is resolved

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list, each a string or token ids; a malformed one is a 400 naming it."""
        value = self.input
        if isinstance(value, str):
            items: list[Any] = [value]
        elif isinstance(value, list) and any(_is_int(v) for v in value):
            items = [value]  # one input of token ids (checked below)
        elif isinstance(value, list):
            items = value
        else:
            raise InvalidRequestError(
                "'input' must be a string, a list of strings, a list of token ids or a list of token-id lists.",
                param="input",
            )
        if not items:
            raise InvalidRequestError("'input' must not be empty.", param="input")
        if len(items) > MAX_INPUTS:
            raise InvalidRequestError(f"At most {MAX_INPUTS} inputs per request, got {len(items)}.", "input")
        single = self.is_single
        for index, item in enumerate(items):
            where = "input" if single else f"input[{index}]"
            if isinstance(item, str):
                if not item:
                    raise InvalidRequestError("An input must not be an empty string.", param=where)
            elif isinstance(item, list):
                if not item:
                    raise InvalidRequestError("An input must not be an empty list of tokens.", param=where)
                if not all(_is_token_id(t) for t in item):
                    raise InvalidRequestError(
                        "A token-id input must be a list of non-negative integers.", where
                    )
            else:
                raise InvalidRequestError("Each input must be a string or a list of token ids.", param=where)
        return items

    @property
    def is_single(self) -> bool:
        """One input (a string or one list of token ids): errors name `input` itself."""
        value = self.input
        return isinstance(value, str) or (isinstance(value, list) and any(_is_int(v) for v in value))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_id(value: Any) -> bool:
    return _is_int(value) and value >= 0


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


class EmbeddingsRoute(ModelRoute[EmbeddingRequest]):
    route = "POST /v1/embeddings"
    kind = ("embedding", "chat")
    body_type = EmbeddingRequest

    def qos(self, body: EmbeddingRequest, request: Request) -> str:
        return "interactive"

    async def serve(self, body: EmbeddingRequest, service: object, call: RouteCall) -> Response:
        embedder = embedder_of(service)
        items = body.inputs()
        texts = [item for item in items if isinstance(item, str)]
        tokenized = iter(embedder.tokenize(texts)) if texts else iter(())
        token_ids = [next(tokenized) if isinstance(item, str) else item for item in items]
        token_ids = embedder.check_lengths(token_ids, "input", body.truncate_prompt_tokens, body.is_single)
        result = await embedder.embed(token_ids)
        data = [
            {"object": "embedding", "index": index, "embedding": _encoded(vector, body.encoding_format)}
            for index, vector in enumerate(result.vectors)
        ]
        usage = {"prompt_tokens": result.num_prompt_tokens, "total_tokens": result.num_prompt_tokens}
        payload: dict[str, Any] = {"object": "list", "data": data, "model": call.model_id, "usage": usage}
        return JSONResponse(payload)


@router.post("/v1/embeddings")
@takes(EmbeddingRequest)
async def create_embeddings(request: Request) -> Response:
    return await run_route(request, EmbeddingsRoute())
