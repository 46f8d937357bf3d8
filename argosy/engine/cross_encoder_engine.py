"""CrossEncoderEngine (sync): text pairs in, one relevance score per pair out.

It owns the cross-encoder's tokenizer and model (models/cross_encoder.py) and has the shape
of an EmbeddingEngine, so AsyncEmbeddingEngine runs it on its worker thread and coalesces
concurrent requests into shared forward passes the same way.

A pair crosses the worker's queue as one list of ints (plain data, as an embedding input
does): each token's id plus its token type times the vocabulary size (`coded ids`). A BERT
pair is `[CLS] query [SEP] document [SEP]` with the document's tokens (and the last [SEP])
of type 1, exactly as the tokenizer's post-processor types them; a model of one token type
(XLM-RoBERTa) takes type 0 everywhere, as transformers feeds it.

A pair longer than the model takes is cut in the document (the query is kept whole; a query
that leaves no room for a document token is a 400 naming `query`). sentence-transformers
cuts the longer of the two instead (`longest_first`): the scores differ only for such pairs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from argosy.engine.embedding_engine import DEFAULT_MAX_BATCH_TOKENS, PackedEncoderEngine
from argosy.errors import ContextLengthExceededError
from argosy.models.bert import PackedBatch
from argosy.models.cross_encoder import (
    CrossEncoder,
    CrossEncoderSource,
    build_cross_encoder,
    encoder_config,
    load_cross_encoder_source,
)


class CrossEncoderEngine(PackedEncoderEngine):
    """Not thread-safe: one thread calls `embed()` (tokenizing is safe anywhere). Its inputs
    are coded pairs, and `embed()` gives [score] per pair."""

    _input_noun = "pair"
    _input_param = "documents"

    def __init__(
        self,
        model: str | Path | CrossEncoderSource,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        dtype: torch.dtype = torch.float32,
        max_input_tokens: int | None = None,
    ) -> None:
        self.source: CrossEncoderSource = (
            model if isinstance(model, CrossEncoderSource) else load_cross_encoder_source(model)
        )
        config = self.source.hf_config
        max_positions = (
            int(config.get("max_position_embeddings", 512)) - encoder_config(config).position_offset
        )
        self._set_limits(max_input_tokens, max_batch_tokens, (4, max_positions))
        self.model: CrossEncoder = build_cross_encoder(self.source.hf_config, self.source.path, dtype)
        self.vocab_size = self.model.config.vocab_size
        self.num_token_types = self.model.config.type_vocab_size
        self._num_pair_special = self.source.tokenizer.num_special_tokens_to_add(is_pair=True)

    @property
    def dimensions(self) -> int:
        return 1  # one score per pair

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Single texts with the special tokens the tokenizer adds (what /tokenize shows)."""
        return [e.ids for e in self.source.tokenizer.encode_batch(texts, add_special_tokens=True)]

    def truncate(self, token_ids: list[int]) -> list[int]:
        return token_ids[: self.max_input_tokens]

    def encode_pairs(
        self, pairs: list[tuple[str, str]], max_document_tokens: int | None = None
    ) -> list[list[int]]:
        """The coded ids (see the module doc) of each (query, document) pair, the document cut
        to fit the model and to `max_document_tokens`."""
        tokenizer = self.source.tokenizer
        queries = tokenizer.encode_batch([q for q, _ in pairs], add_special_tokens=False)
        documents = tokenizer.encode_batch([d for _, d in pairs], add_special_tokens=False)
        coded: list[list[int]] = []
        for query, document in zip(queries, documents, strict=True):
            room = self.max_input_tokens - self._num_pair_special - len(query.ids)
            if room < 1:
                raise ContextLengthExceededError(
                    f"The query is {len(query.ids)} tokens long; this model takes pairs of at most "
                    f"{self.max_input_tokens} tokens, its special tokens and a document included.",
                    "query",
                )
            keep = room if max_document_tokens is None else min(room, max_document_tokens)
            if len(document.ids) > keep:
                document.truncate(keep)
            pair = tokenizer.post_process(query, document, add_special_tokens=True)
            types = pair.type_ids if self.num_token_types > 1 else [0] * len(pair.ids)  # XLM-R: one type
            coded.append([t + k * self.vocab_size for t, k in zip(pair.ids, types, strict=True)])
        return coded

    def validate(self, inputs: list[list[int]]) -> None:
        """Raise InvalidRequestError for a coded pair the model cannot score."""
        self._check_inputs(inputs, self.vocab_size * self.num_token_types, "a token outside the vocabulary")

    @torch.inference_mode()
    def _forward(self, inputs: list[list[int]]) -> torch.Tensor:
        """[num_pairs, 1]: each pair's score (`embed` gives [score] per coded pair)."""
        self.num_forwards += 1
        ids = [[t % self.vocab_size for t in coded] for coded in inputs]
        types = [[t // self.vocab_size for t in coded] for coded in inputs]
        logits = self.model(PackedBatch.build(ids, types)).float().unsqueeze(1)
        return torch.sigmoid(logits) if self.source.activation == "sigmoid" else logits
