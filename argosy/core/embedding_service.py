"""Embedders: what the embedding routes use, whichever kind of model serves them.

EmbeddingService is one loaded embedding model (an encoder): inputs arrive as text or token
ids; text is tokenized here (the model's own special tokens added), every input is checked
against the model's length limit (`truncate` cuts instead, keeping the leading tokens and the
closing special token), and the engine batches the inputs of concurrent requests into shared
forward passes (argosy/engine/embedding_engine.py).

ChatEmbedder serves embeddings from a loaded chat model, as Ollama and llama-server do: the
mean of the last hidden states (after the final norm) over every input token, L2-normalised,
in float32. Text is tokenized as a raw prompt, no chat template: the tokenizer's own special
tokens and the BOS the model's config asks for (SmolLM2 and Qwen add none; Llama 3 and
Gemma add their BOS), all of them pooled, as llama.cpp pools them. The inputs go to the chat
model's own engine as prefill-only pooling requests (engine/async_engine.py `embed`), batched
with its generations on the same weights: no second copy of the model. An input past the
context is a 400 naming it, unless truncation is asked for (the leading tokens are kept).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from argosy.core.engine_client import PoolingEngineClient
from argosy.core.service import ModelInfo, ModelService
from argosy.engine.arrivals import Arrival
from argosy.errors import InvalidRequestError

if TYPE_CHECKING:
    from argosy.engine.outputs import RequestOutput


@dataclass(slots=True)
class EmbeddingResult:
    vectors: list[list[float]]
    num_prompt_tokens: int


class Embedder(Protocol):
    """What /v1/embeddings, /api/embed and /api/embeddings need of the model they name."""

    model_id: str

    @property
    def max_input_tokens(self) -> int: ...

    @property
    def dimensions(self) -> int: ...

    def tokenize(self, texts: list[str]) -> list[list[int]]: ...

    def check_lengths(
        self, inputs: list[list[int]], param: str, truncate: int | None, is_single: bool = False
    ) -> list[list[int]]: ...

    async def embed(self, inputs: list[list[int]]) -> EmbeddingResult: ...


def embedder_of(service: object) -> Embedder:
    """The Embedder of a leased model: an embedding model itself, or a chat model's pooling."""
    if isinstance(service, EmbeddingService):
        return service
    if isinstance(service, ModelService):
        return ChatEmbedder(service)
    raise InvalidRequestError("This model cannot compute embeddings.", param="model", code="wrong_model_kind")


class EncoderService:
    """One loaded encoder model: `engine` is an AsyncEmbeddingEngine (over an EmbeddingEngine
    or a CrossEncoderEngine). What an EmbeddingService and a RerankService share."""

    kind = "embedding"  # the model kind its ModelInfo names

    def __init__(self, model_id: str, engine: Any, created: int | None = None) -> None:
        self.model_id = model_id
        self.engine = engine
        self.created = created if created is not None else int(time.time())

    @property
    def is_alive(self) -> bool:
        return bool(self.engine.is_alive)

    @property
    def max_input_tokens(self) -> int:
        return int(self.engine.max_input_tokens)

    @property
    def num_forwards(self) -> int:
        """The encoder's forward passes so far (a request's inputs share them)."""
        return int(self.engine.num_forwards)

    def arriving(self) -> Arrival:
        return Arrival()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def model_info(self, state: str = "loaded") -> ModelInfo:
        engine = self.engine.engine
        return ModelInfo(
            id=self.model_id,
            created=self.created,
            kind=self.kind,
            state=state if self.is_alive else "dead",
            is_loaded=True,
            context_length=self.max_input_tokens,
            architecture=engine.source.hf_config.get("architectures", [None])[0],
            dtype="float32",
            quantization=None,
            has_chat_template=False,
            sampling_defaults={},
            memory_bytes=_module_bytes(engine.model),
            **self._model_details(),
        )

    def _model_details(self) -> dict[str, Any]:
        """The ModelInfo fields of its kind alone."""
        return {}


class EmbeddingService(EncoderService):
    @property
    def dimensions(self) -> int:
        return int(self.engine.dimensions)

    def _model_details(self) -> dict[str, Any]:
        return {"dimensions": self.dimensions, "pooling": self.engine.engine.source.pooling}

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        ids: list[list[int]] = self.engine.tokenize(texts)
        return ids

    def check_lengths(
        self, inputs: list[list[int]], param: str, truncate: int | None, is_single: bool = False
    ) -> list[list[int]]:
        """Inputs within the model's limit: over-long ones are a 400 naming their index (just
        `param` for a request's single input), or cut to `truncate` tokens (at most the limit)
        when the request asks for it."""
        limit, vocab_size = self.max_input_tokens, self.engine.engine.vocab_size
        return checked_lengths(inputs, limit, vocab_size, param, truncate, is_single, _truncated)

    async def embed(self, inputs: list[list[int]]) -> EmbeddingResult:
        vectors = await self.engine.embed(inputs)
        return EmbeddingResult(vectors=vectors, num_prompt_tokens=sum(len(ids) for ids in inputs))


class ChatEmbedder:
    """Embeddings from a loaded chat model (see the module doc); built per request, cheap."""

    pooling = "mean"

    def __init__(self, service: ModelService) -> None:
        self.service = service
        self.model_id = service.model_id
        self.description = service.description

    @property
    def max_input_tokens(self) -> int:
        return self.description.context_length

    @property
    def dimensions(self) -> int:
        return self.description.hidden_size or 0

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Raw-prompt token ids (no chat template), with the BOS the model's config asks for."""
        encodings = self.description.tokenizer.encode_batch(texts, add_special_tokens=True)
        bos = self.description.bos_token_id if self.description.add_bos_token else None
        return [e.ids if bos is None or e.ids[:1] == [bos] else [bos, *e.ids] for e in encodings]

    def check_lengths(
        self, inputs: list[list[int]], param: str, truncate: int | None, is_single: bool = False
    ) -> list[list[int]]:
        """As EmbeddingService's; a cut keeps the leading tokens (a chat model closes its
        input with no special token), and an input of no tokens is a 400 naming it."""
        for index, ids in enumerate(inputs):
            if not ids:
                raise InvalidRequestError(
                    "An input must have at least one token.",
                    param=param if is_single else f"{param}[{index}]",
                )
        limit, vocab_size = self.max_input_tokens, self.description.vocab_size
        return checked_lengths(inputs, limit, vocab_size, param, truncate, is_single, leading_tokens)

    async def embed(self, inputs: list[list[int]]) -> EmbeddingResult:
        refusal = "it serves no embeddings"
        outputs = await pool_on_engine(self.service, inputs, self.pooling, refusal, "embeddings_unsupported")
        vectors = [out.embedding or [] for out in outputs]
        return EmbeddingResult(vectors=vectors, num_prompt_tokens=sum(len(ids) for ids in inputs))


async def pool_on_engine(
    service: ModelService, inputs: list[list[int]], pooling: str, refusal: str, code: str
) -> list[RequestOutput]:
    """`inputs` as prefill-only pooling requests on a chat model's own engine (chat-model
    embeddings, a causal LM reranker's yes/no logits), admitted like a generation waiting to
    start; a 400 saying `refusal` (code `code`) where the engines cannot pool (a fleet)."""
    client = service.require_engine()
    if not service.can_pool or not isinstance(client, PoolingEngineClient):
        raise InvalidRequestError(
            f"Model {service.model_id!r} runs on engines that cannot pool hidden states (a fleet); {refusal}.",
            param="model",
            code=code,
        )
    ticket = service.admission.admit()
    try:
        return await client.embed(inputs, pooling=pooling)
    finally:
        ticket.release()


def checked_lengths(
    inputs: list[list[int]],
    limit: int,
    vocab_size: int,
    param: str,
    truncate: int | None,
    is_single: bool,
    cut: Callable[[list[int], int], list[int]],
) -> list[list[int]]:
    """Inputs within `limit` tokens: an over-long one is a 400 naming its index (just `param`
    for a request's single input), or `cut` to `truncate` tokens (at most the limit) when the
    request asks for it; a token id outside the vocabulary is a 400 naming its input."""
    checked: list[list[int]] = []
    for index, ids in enumerate(inputs):
        where = param if is_single else f"{param}[{index}]"
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise InvalidRequestError(
                f"Token id {bad[0]} is out of range for a vocabulary of {vocab_size}.", param=where
            )
        if truncate is not None:
            ids = cut(ids, min(truncate, limit))
        elif len(ids) > limit:
            raise InvalidRequestError(
                f"Input {index} is {len(ids)} tokens long; this model takes at most {limit} "
                "(ask for truncation to cut it: truncate_prompt_tokens, or Ollama's truncate).",
                param=where,
                code="context_length_exceeded",
            )
        checked.append(ids)
    return checked


def leading_tokens(ids: list[int], keep: int) -> list[int]:
    return ids[:keep]


def _truncated(ids: list[int], keep: int) -> list[int]:
    """The first `keep` tokens, the last one kept last (it is the closing special token)."""
    if len(ids) <= keep:
        return ids
    return [*ids[: keep - 1], ids[-1]] if keep > 1 else ids[:keep]


def _module_bytes(module: Any) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
