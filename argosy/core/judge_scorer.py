"""JudgeScorer: relevance from a causal LM reranker (Qwen3-Reranker's way), for rerank and score.

The model is asked, in its chat layout, whether a document meets a query, with an answer that
can only be "yes" or "no"; the score is P(yes) over the two, read from the logits of the two
tokens at the prompt's last position:

    score = exp(yes) / (exp(yes) + exp(no)) = sigmoid(yes - no)

Every pair of a request is one prefill-only request on the model's own engine (pooling
`logits:NO,YES`, runner/pooler.py), all queued together, so the scheduler runs them batched
beside the model's other work, as chat-model embeddings are. The prompt is the one the
Qwen3-Reranker model card documents (system line, `<Instruct>`, `<Query>`, `<Document>`, an
empty think block) with the card's default instruction (web search): the rerank and score
requests carry no instruction field. A document past what the context leaves it is cut to
fit (its leading tokens kept), as the other scorers cut theirs; a query that leaves no room
is a 400 naming it.

A model is served this way when its kind is `rerank` and its folder holds a causal LM (a
models file's `kind = "rerank"`, or a folder whose name says reranker: commands/model_specs.py model_kind); a
plain chat model asked to rerank stays a 400 naming it (rerank_service.scorer_of).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from argosy.core.embedding_service import checked_lengths, leading_tokens, pool_on_engine
from argosy.errors import InvalidRequestError

if TYPE_CHECKING:
    from argosy.core.rerank_service import ScoreResult
    from argosy.core.service import ModelService

DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
    'the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def judge_prompt(query: str, document: str, instruction: str = DEFAULT_INSTRUCTION) -> str:
    """The text a pair is judged by (see the module doc)."""
    return f"{_PREFIX}<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}{_SUFFIX}"


class JudgeScorer:
    """A Scorer over a loaded causal LM reranker (a ModelService); built per request, cheap."""

    def __init__(self, service: ModelService) -> None:
        self.service = service
        self.model_id = service.model_id
        tokenizer = service.description.tokenizer
        yes, no = tokenizer.token_to_id("yes"), tokenizer.token_to_id("no")
        if yes is None or no is None:
            raise InvalidRequestError(
                f"The reranker {self.model_id!r} has no single 'yes' and 'no' tokens in its vocabulary; "
                "it cannot be scored as a yes/no judge.",
                param="model",
                code="wrong_model_kind",
            )
        self.pooling = f"logits:{no},{yes}"

    async def score(
        self, pairs: list[tuple[str, str]], max_document_tokens: int | None = None
    ) -> ScoreResult:
        from argosy.core.rerank_service import ScoreResult

        description = self.service.description
        tokenizer = description.tokenizer
        room: dict[str, int] = {}  # per query: the document tokens the context leaves
        for query in dict.fromkeys(q for q, _ in pairs):
            layout = len(tokenizer.encode(judge_prompt(query, ""), add_special_tokens=False).ids)
            room[query] = description.context_length - layout
            if room[query] < 1:
                raise InvalidRequestError(
                    f"The query takes the whole context of {self.model_id!r} "
                    f"({description.context_length} tokens) once laid out for judging.",
                    param="query",
                )
        if max_document_tokens is not None:
            room = {query: min(limit, max_document_tokens) for query, limit in room.items()}
        pairs = [(query, self._cut(document, room[query])) for query, document in pairs]
        texts = [judge_prompt(query, document) for query, document in pairs]
        inputs = [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
        inputs = checked_lengths(
            inputs,
            description.context_length,
            description.vocab_size,
            "documents",
            None,
            False,
            leading_tokens,
        )
        refusal = "it cannot score"
        outputs = await pool_on_engine(self.service, inputs, self.pooling, refusal, "rerank_unsupported")
        scores = [
            _sigmoid(logits[1] - logits[0]) for logits in (out.embedding or [0.0, 0.0] for out in outputs)
        ]
        return ScoreResult(scores=scores, num_prompt_tokens=sum(len(ids) for ids in inputs))

    def _cut(self, document: str, max_tokens: int) -> str:
        tokenizer = self.service.description.tokenizer
        ids = tokenizer.encode(document, add_special_tokens=False).ids
        return document if len(ids) <= max_tokens else tokenizer.decode(ids[:max_tokens])


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)
