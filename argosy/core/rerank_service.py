"""Scorers: what the rerank and score routes use, whichever kind of model serves them.

A Scorer takes (query, document) text pairs and returns one relevance score per pair. The
pairs of one request are scored as one batch: one queued job on the model's encoder worker
(engine/embedding_engine.py AsyncEmbeddingEngine), which runs them in as few forward passes
as its token budget allows (one for 64 short documents) and coalesces concurrent requests.

- RerankService: a loaded cross-encoder (kind `rerank`, models/cross_encoder.py): the score
  is its head's logit through the model's activation (the sigmoid unless its config names
  another, as sentence-transformers' CrossEncoder decides).
- EmbeddingScorer: an embedding model (kind `embedding`): the score is the cosine of the two
  texts' embeddings, as vLLM's score API computes it for embedding models. Each distinct
  query and every document is embedded once, all in one batch. Texts past the model's length
  are cut (the closing special token kept), as sentence-transformers cuts them.

- JudgeScorer (core/judge_scorer.py): a causal LM reranker (kind `rerank` over a causal LM,
  as Qwen3-Reranker ships): P(yes) of its yes/no judgement, run on its own engine.

A chat model has no scorer here: the routes name only these kinds, so the registry refuses
one with a 400 naming the model and its kind before anything loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from argosy.core.embedding_service import EmbeddingService, EncoderService
from argosy.core.service import ModelService
from argosy.errors import InvalidRequestError

# the model kinds that can score pairs, in the order a request naming no model looks for them
SCORING_KINDS = ("rerank", "embedding")


@dataclass(slots=True)
class ScoreResult:
    scores: list[float]  # one per pair, in order
    num_prompt_tokens: int  # tokens run through the model


class Scorer(Protocol):
    model_id: str

    async def score(
        self, pairs: list[tuple[str, str]], max_document_tokens: int | None = None
    ) -> ScoreResult:
        """One score per (query, document) pair; documents cut to `max_document_tokens`."""
        ...


def scorer_of(service: object) -> Scorer:
    """The Scorer of a leased model: a cross-encoder itself, or an embedding model's cosine."""
    if isinstance(service, RerankService):
        return service
    if isinstance(service, EmbeddingService):
        return EmbeddingScorer(service)
    if isinstance(service, ModelService) and service.options.kind == "rerank":
        from argosy.core.judge_scorer import JudgeScorer

        return JudgeScorer(service)
    model_id = getattr(service, "model_id", "?")
    raise InvalidRequestError(
        f"The model {model_id!r} cannot score text pairs: it is neither a cross-encoder (rerank) "
        "nor an embedding model, nor a causal LM reranker.",
        param="model",
        code="wrong_model_kind",
    )


class EmbeddingScorer:
    """Cosine relevance from an embedding model (see the module doc); built per request, cheap."""

    def __init__(self, service: EmbeddingService) -> None:
        self.service = service
        self.model_id = service.model_id

    async def score(
        self, pairs: list[tuple[str, str]], max_document_tokens: int | None = None
    ) -> ScoreResult:
        queries = list(dict.fromkeys(q for q, _ in pairs))  # one-to-many: the query once
        query_index = {q: i for i, q in enumerate(queries)}
        limit = self.service.max_input_tokens
        query_ids = self.service.check_lengths(self.service.tokenize(queries), "query", limit)
        document_limit = limit
        if max_document_tokens is not None:  # the text's tokens: the special ones come on top
            num_special = len(self.service.tokenize([""])[0])
            document_limit = min(limit, max_document_tokens + num_special)
        document_ids = self.service.check_lengths(
            self.service.tokenize([d for _, d in pairs]), "documents", document_limit
        )
        result = await self.service.embed([*query_ids, *document_ids])
        query_vectors, document_vectors = result.vectors[: len(queries)], result.vectors[len(queries) :]
        scores = [
            _cosine(query_vectors[query_index[q]], vector)
            for (q, _), vector in zip(pairs, document_vectors, strict=True)
        ]
        return ScoreResult(scores=scores, num_prompt_tokens=result.num_prompt_tokens)


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm > 0.0 else 0.0


class RerankService(EncoderService):
    """One loaded cross-encoder: `engine` is an AsyncEmbeddingEngine over a CrossEncoderEngine."""

    kind = "rerank"

    async def score(
        self, pairs: list[tuple[str, str]], max_document_tokens: int | None = None
    ) -> ScoreResult:
        coded = self.engine.engine.encode_pairs(pairs, max_document_tokens)
        scores = await self.engine.embed(coded)
        return ScoreResult(scores=[s[0] for s in scores], num_prompt_tokens=sum(len(ids) for ids in coded))
