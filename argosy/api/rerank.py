"""Rerank and score: `POST /v1/rerank`, `/rerank`, `/v2/rerank` and `POST /v1/score`.

Rerank, in the shape llama.cpp's, vLLM's, Jina's and Cohere's clients send it:
`{model, query, documents: [str | {text}], top_n?, return_documents?, max_tokens_per_doc?}`.
The answer lists every document (or the `top_n` best; 0 or absent: all) by relevance,
highest first (ties in request order): `{index, relevance_score, document?: {text}}`.
- `/v1/rerank` and `/rerank` (vLLM, llama.cpp, Jina; Cohere's v1 client) answer
  `{id, model, usage: {prompt_tokens, total_tokens}, results, meta}`; `return_documents`
  defaults to true, as Jina's does (Cohere's v1 client sends it explicitly).
- `/v2/rerank` (Cohere's v2 client) answers `{id, results, meta: {api_version, billed_units:
  {search_units}}}`, without documents unless asked: a search unit is a query with up to
  100 documents, as Cohere bills it.
`max_tokens_per_doc` (Cohere) cuts each document to that many tokens; a document past what
the model takes is cut to fit either way (as sentence-transformers and Cohere cut it).

Score, as vLLM takes it: `{model, text_1, text_2}`: one string and one string (one pair),
one and a list (one-to-many: `text_1` against each of `text_2`), or two lists of one length
(pairwise). Answer: `{id, object: "list", created, model, data: [{index, object: "score",
score}], usage}`.

Both are served by a cross-encoder (kind `rerank`) or an embedding model (the cosine of the
two embeddings); a chat model is a 400 naming it. A request's pairs are scored as one batch
(core/rerank_service.py). At most --max-rerank-documents documents (or pairs); an empty list,
an empty query or a malformed document is a 400 naming the field. Errors are OpenAI's.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, ClassVar

from fastapi import APIRouter
from pydantic import Field
from pydantic.json_schema import JsonDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from argosy.api.openapi import takes
from argosy.api.route import ModelRoute, RouteCall, run_route
from argosy.api.wire import WireModel
from argosy.core.rerank_service import SCORING_KINDS, ScoreResult, scorer_of
from argosy.errors import InvalidRequestError

router = APIRouter()

DOCUMENTS_PER_SEARCH_UNIT = 100  # Cohere bills a query with up to 100 documents as one unit
# what /openapi.json says a document is (read as Any, so that a bad one is a 400 naming its index)
_DOCUMENT_SCHEMA: JsonDict = {
    "anyOf": [
        {"type": "string"},
        {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    ]
}


def _max_documents(request: Request) -> int:
    config = getattr(request.app.state, "server_config", None)
    return int(getattr(config, "max_rerank_documents", 1000))


class RerankRequest(WireModel):
    model: str | None = None
    query: str = Field(min_length=1)
    documents: list[Any] = Field(min_length=1, json_schema_extra={"items": _DOCUMENT_SCHEMA})  # see `texts`
    top_n: int | None = Field(None, ge=0)
    return_documents: bool | None = None
    max_tokens_per_doc: int | None = Field(None, ge=1)

    def check_with(self, max_documents: int) -> None:
        if not self.query.strip():
            raise InvalidRequestError("'query' must be a non-empty string.", param="query")
        self.texts(max_documents)

    def texts(self, max_documents: int) -> list[str]:
        """The documents' texts, in order; a malformed one is a 400 naming it."""
        documents = self.documents
        if not documents:
            raise InvalidRequestError("'documents' must not be empty.", param="documents")
        if len(documents) > max_documents:
            raise InvalidRequestError(
                f"At most {max_documents} documents per request, got {len(documents)}.", param="documents"
            )
        texts: list[str] = []
        for index, document in enumerate(documents):
            if isinstance(document, dict) and isinstance(document.get("text"), str):
                document = document["text"]
            if not isinstance(document, str):
                raise InvalidRequestError(
                    "A document must be a string or an object with a string 'text'.",
                    param=f"documents[{index}]",
                )
            texts.append(document)
        return texts


class ScoreRequest(WireModel):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]

    def check_with(self, max_documents: int) -> None:
        self.pairs(max_documents)

    def pairs(self, max_documents: int) -> list[tuple[str, str]]:
        """(text_1, text_2) pairs: one-to-one, one-to-many or pairwise (see the module doc)."""
        firsts, seconds = _text_list(self.text_1, "text_1"), _text_list(self.text_2, "text_2")
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        elif len(firsts) != len(seconds):
            raise InvalidRequestError(
                f"'text_1' has {len(firsts)} texts and 'text_2' {len(seconds)}: pairwise scoring "
                "takes lists of one length (or one text_1 against many).",
                param="text_2",
            )
        if len(seconds) > max_documents:
            raise InvalidRequestError(
                f"At most {max_documents} pairs per request, got {len(seconds)}.", param="text_2"
            )
        return list(zip(firsts, seconds, strict=True))


def _text_list(value: Any, param: str) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise InvalidRequestError(f"'{param}' must be a string or a list of strings.", param=param)
    if not items:
        raise InvalidRequestError(f"'{param}' must not be empty.", param=param)
    if param == "text_1" and not all(item.strip() for item in items):
        raise InvalidRequestError("A query ('text_1') must not be empty.", param=param)
    return items


class _ScoringRoute(ModelRoute[Any]):
    kind = SCORING_KINDS

    def __init__(self, max_documents: int) -> None:
        self.max_documents = max_documents

    def check(self, body: Any) -> None:
        body.check_with(self.max_documents)

    def qos(self, body: Any, request: Request) -> str:
        return "interactive"


class RerankRoute(_ScoringRoute):
    route: ClassVar[str] = "POST /v1/rerank"
    body_type = RerankRequest
    is_cohere_v2 = False

    async def serve(self, body: RerankRequest, service: object, call: RouteCall) -> Response:
        texts = body.texts(self.max_documents)
        scorer = scorer_of(service)
        result = await scorer.score([(body.query, text) for text in texts], body.max_tokens_per_doc)
        return JSONResponse(self.render(body, texts, result, call.model_id))

    def render(
        self, body: RerankRequest, texts: list[str], result: ScoreResult, model_id: str
    ) -> dict[str, Any]:
        ranked = sorted(range(len(texts)), key=lambda i: -result.scores[i])  # stable: ties in order
        ranked = ranked[: body.top_n] if body.top_n else ranked
        return_documents = (
            body.return_documents if body.return_documents is not None else not self.is_cohere_v2
        )
        results = [
            {"index": i, "relevance_score": result.scores[i]}
            | ({"document": {"text": texts[i]}} if return_documents else {})
            for i in ranked
        ]
        units = math.ceil(len(texts) / DOCUMENTS_PER_SEARCH_UNIT)
        meta = {
            "api_version": {"version": "2" if self.is_cohere_v2 else "1"},
            "billed_units": {"search_units": units},
        }
        payload: dict[str, Any] = {"id": f"rerank-{uuid.uuid4().hex}", "results": results, "meta": meta}
        if not self.is_cohere_v2:
            tokens = result.num_prompt_tokens
            payload |= {"model": model_id, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        return payload


class BareRerankRoute(RerankRoute):
    route: ClassVar[str] = "POST /rerank"


class CohereRerankRoute(RerankRoute):
    route: ClassVar[str] = "POST /v2/rerank"
    is_cohere_v2 = True


class ScoreRoute(_ScoringRoute):
    route: ClassVar[str] = "POST /v1/score"
    body_type = ScoreRequest

    async def serve(self, body: ScoreRequest, service: object, call: RouteCall) -> Response:
        result = await scorer_of(service).score(body.pairs(self.max_documents))
        tokens = result.num_prompt_tokens
        data = [
            {"index": index, "object": "score", "score": score} for index, score in enumerate(result.scores)
        ]
        payload = {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": call.model_id,
            "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        }
        return JSONResponse(payload)


def _add_endpoint(route_type: type[_ScoringRoute], name: str) -> None:
    """Serve `route_type` at its route (its method and path), as endpoint `name` (what
    /openapi.json's operationId is made of)."""
    method, path = route_type.route.split(" ", 1)

    @takes(route_type.body_type)
    async def endpoint(request: Request) -> Response:
        return await run_route(request, route_type(_max_documents(request)))

    router.add_api_route(path, endpoint, methods=[method], name=name)


_add_endpoint(RerankRoute, "rerank")
_add_endpoint(BareRerankRoute, "rerank_bare")
_add_endpoint(CohereRerankRoute, "rerank_cohere_v2")
_add_endpoint(ScoreRoute, "score")
