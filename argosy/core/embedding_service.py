"""EmbeddingService: one loaded embedding model as the core sees it.

Inputs arrive as text or token ids; text is tokenized here (the model's own special tokens
added), every input is checked against the model's length limit (`truncate` cuts instead,
keeping the leading tokens and the closing special token), and the engine batches the inputs
of concurrent requests into shared forward passes (argosy/engine/embedding_engine.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from argosy.core.service import ModelInfo
from argosy.engine.arrivals import Arrival
from argosy.errors import InvalidRequestError


@dataclass(slots=True)
class EmbeddingResult:
    vectors: list[list[float]]
    num_prompt_tokens: int


class EmbeddingService:
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
    def dimensions(self) -> int:
        return int(self.engine.dimensions)

    def arriving(self) -> Arrival:
        return Arrival()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def model_info(self, state: str = "loaded") -> ModelInfo:
        engine = self.engine
        return ModelInfo(
            id=self.model_id,
            created=self.created,
            kind="embedding",
            state=state if self.is_alive else "dead",
            is_loaded=True,
            context_length=self.max_input_tokens,
            architecture=engine.engine.source.hf_config.get("architectures", [None])[0],
            dtype="float32",
            quantization=None,
            has_chat_template=False,
            sampling_defaults={},
            dimensions=self.dimensions,
            memory_bytes=_module_bytes(engine.engine.model),
        )

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        ids: list[list[int]] = self.engine.tokenize(texts)
        return ids

    def check_lengths(
        self, inputs: list[list[int]], param: str, truncate: int | None, is_single: bool = False
    ) -> list[list[int]]:
        """Inputs within the model's limit: over-long ones are a 400 naming their index (just
        `param` for a request's single input), or cut to `truncate` tokens (at most the limit)
        when the request asks for it."""
        limit = self.max_input_tokens
        vocab_size = self.engine.engine.vocab_size
        checked: list[list[int]] = []
        for index, ids in enumerate(inputs):
            where = param if is_single else f"{param}[{index}]"
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"Token id {bad[0]} is out of range for a vocabulary of {vocab_size}.", param=where
                )
            if truncate is not None:
                ids = _truncated(ids, min(truncate, limit))
            elif len(ids) > limit:
                raise InvalidRequestError(
                    f"Input {index} is {len(ids)} tokens long; this model takes at most {limit} "
                    "(set truncate_prompt_tokens to cut it).",
                    param=where,
                    code="context_length_exceeded",
                )
            checked.append(ids)
        return checked

    async def embed(self, inputs: list[list[int]]) -> EmbeddingResult:
        vectors = await self.engine.embed(inputs)
        return EmbeddingResult(vectors=vectors, num_prompt_tokens=sum(len(ids) for ids in inputs))


def _truncated(ids: list[int], keep: int) -> list[int]:
    """The first `keep` tokens, the last one kept last (it is the closing special token)."""
    if len(ids) <= keep:
        return ids
    return [*ids[: keep - 1], ids[-1]] if keep > 1 else ids[:keep]


def _module_bytes(module: Any) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
