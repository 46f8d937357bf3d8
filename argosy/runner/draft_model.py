"""A draft model for speculative decoding: a smaller model of the same vocabulary drafts, the
target verifies (`--draft-model`, `draft = "..."` in the models file).

The draft runs on its own engine (its own weights, paged KV cache and compiled decode step, in
the same numerics as the target's), driven here one request at a time: each call of `propose`
brings the draft's copy of the request up to the target's known tokens (a prefill of what the
draft has not seen: the prompt on the first call, then the tokens the target emitted), keeping
the longest common prefix it had computed (a rejected draft's KV lies beyond it and is
overwritten), then decodes greedily for up to k tokens. The prompt it computes beside the
target's, chunk for chunk (`follow`). The target's verification
(spec_decode.verify_batch) decides what is emitted, so greedy and seeded requests give the same
tokens with and without the draft; the draft only decides how many are emitted per step.
The draft scores only the first `draft_vocab` token ids (its head cut: `limit_logits`), and
its catch-up on the target's last tokens (1 + an accepted draft's last) runs as decode rows of
its compiled step (model_runner.DECODE_CHUNK_TOKENS), not as an eager prefill chunk.

With --speculative ngram too, the proposals chain (`ChainProposer`): the n-gram lookup's draft
where it finds one (free: copied from the context), else the draft model's.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from torch import nn

from argosy.engine.sequence import Sequence
from argosy.errors import ModelLoadError
from argosy.ops.quantized_linear import Int8Linear
from argosy.runner.spec_decode import NgramProposer, can_speculate, draft_room
from argosy.sampling_params import SamplingParams

if TYPE_CHECKING:
    from argosy.config import EngineConfig
    from argosy.engine.llm_engine import LLMEngine
    from argosy.engine.scheduler import ScheduledRequest
    from argosy.models.source import ModelSource

log = logging.getLogger("argosy.engine")

_CHUNK = 1024  # the draft's prefill, in steps of at most this many tokens


def vocabulary_difference(draft: ModelSource, target: ModelSource) -> str | None:
    """Why the draft's tokens are not the target's (None: they are): a draft must map every token
    to the target's id for it, or its proposals mean other words."""
    draft_vocab, target_vocab = draft.tokenizer.get_vocab(), target.tokenizer.get_vocab()
    if len(draft_vocab) != len(target_vocab):
        return f"the draft's tokenizer has {len(draft_vocab)} tokens, the target's {len(target_vocab)}"
    for token, token_id in draft_vocab.items():
        if target_vocab.get(token) != token_id:
            return f"token {token!r} is id {token_id} in the draft, {target_vocab.get(token)} in the target"
    draft_size, target_size = int(draft.hf_config["vocab_size"]), int(target.hf_config["vocab_size"])
    if draft_size > target_size:
        return f"the draft's output layer has {draft_size} rows, the target's {target_size}"
    return None


def limit_logits(model: nn.Module, rows: int) -> None:
    """The model's logits for its first `rows` tokens only (rounded up to the kernels' tile of
    16): its output head cut to those rows, on views of its buffers (a tied embedding keeps the
    whole table); a head of another form stays whole."""
    head = getattr(model, "lm_head", None)
    rows = -(-rows // 16) * 16
    if isinstance(head, Int8Linear) and head.invariant:
        if rows < head.out_features:
            model.lm_head = head.first_outputs(rows)
        return
    if type(head) is nn.Linear:
        if rows < head.out_features:
            part = nn.Linear(head.in_features, rows, bias=head.bias is not None, device="meta")
            part.weight = nn.Parameter(head.weight[:rows], requires_grad=False)
            if head.bias is not None:
                part.bias = nn.Parameter(head.bias[:rows], requires_grad=False)
            model.lm_head = part
        return
    log.info("draft model: its output head (%s) is not cut; it scores every token", type(head).__name__)


class DraftModelProposer:
    def __init__(
        self, config: EngineConfig, target: ModelSource, max_model_len: int, source: ModelSource | None = None
    ) -> None:
        """`source`: the draft model already resolved (else config.draft_model is)."""
        from argosy.engine.llm_engine import LLMEngine
        from argosy.models.loader import resolve_model

        assert config.draft_model is not None
        source = source or resolve_model(config.draft_model, config.cache_dir)
        difference = vocabulary_difference(source, target)
        if difference is not None:
            raise ModelLoadError(
                f"draft model {config.draft_model!r} cannot draft for {config.model!r}: {difference}"
            )
        draft_config = dataclasses.replace(
            config,
            model=config.draft_model,
            draft_model=None,
            speculative="none",
            max_model_len=max_model_len,
            enable_prefix_caching=False,  # a rejected draft's slots are rewritten in place
        )
        self.engine: LLMEngine = LLMEngine(draft_config, source, logits_rows=config.draft_vocab or None)
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.states: dict[str, Sequence] = {}  # request id -> the draft engine's copy: tokens, KV blocks
        self._ids = 0
        self.name = source.name

    def stop_compiling(self, timeout: float = 0.0) -> None:
        """The target engine is closing: so is the draft's background compile."""
        self.engine.stop_compiling(timeout)

    def compiling(self) -> bool:
        """The draft engine's decode graphs are being built (in the background, beside the
        target's): its steps run eagerly until they are."""
        return self.engine.compile_status == "compiling"

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        limit = min(limit, draft_room(seq, self.k, self.max_model_len))
        if limit <= 0 or not can_speculate(seq):
            return []
        draft = self._align(seq, seq.all_token_ids())
        proposal: list[int] = []
        while len(proposal) < limit:
            token = self._step(draft)
            if token is None:
                break
            proposal.append(token)
            draft.output_token_ids.append(token)
        return proposal

    def follow(self, scheduled: list[ScheduledRequest]) -> None:
        """The target computed these requests' tokens: each chunk of a prompt the draft computes
        too, in the same step (as vLLM's and SGLang's drafts prefill beside their target), so its
        prefill is part of the time to the first token, not a stall after it."""
        for req in scheduled:
            seq = req.seq
            if req.num_new_tokens < 2 or req.num_spec_tokens or seq.is_finished or seq.pooling is not None:
                continue
            if draft_room(seq, self.k, self.max_model_len) <= 0 or not can_speculate(seq):
                continue
            draft = self._align(seq, seq.all_token_ids()[: seq.num_computed_tokens])
            if draft.num_computed_tokens < draft.num_tokens:
                self._step(draft)

    def _align(self, seq: Sequence, tokens: list[int]) -> Sequence:
        """The draft's copy of `seq` holding `tokens`, its KV kept over their longest prefix it
        has computed (a rejected draft's KV lies beyond it and is overwritten)."""
        draft = self._draft_for(seq)
        known = draft.all_token_ids()
        common = 0
        bound = min(draft.num_computed_tokens, len(tokens))
        while common < bound and known[common] == tokens[common]:
            common += 1
        draft.prompt_token_ids = tokens
        draft.output_token_ids = []
        draft.num_computed_tokens = common
        return draft

    def _step(self, draft: Sequence) -> int | None:
        """Compute the draft's tokens not yet computed (in chunks) and return its greedy next
        token; None when its KV cache has no room."""
        from argosy.engine.scheduler import ScheduledRequest, SchedulerOutput

        engine = self.engine
        while True:
            num_new = min(_CHUNK, draft.num_tokens - draft.num_computed_tokens)
            if not engine.block_manager.can_append(draft, num_new):
                return None
            engine.block_manager.append_slots(draft, num_new)
            result = engine.runner.execute(SchedulerOutput([ScheduledRequest(draft, num_new)]))
            draft.num_computed_tokens += num_new
            if draft.num_computed_tokens == draft.num_tokens:
                sampled = result.sampled.get(draft.request_id)
                return None if sampled is None else sampled[0]

    def _draft_for(self, seq: Sequence) -> Sequence:
        """The draft engine's copy of `seq`, made on its first draft: room for its context, the
        least recently begun drafts giving theirs back."""
        draft = self.states.get(seq.request_id)
        if draft is None:
            self._ids += 1
            draft = Sequence(f"draft-{self._ids}", [], SamplingParams(temperature=0.0, max_tokens=None))
            needed = self.engine.block_manager.num_blocks_for(min(self.max_model_len, seq.num_tokens + 256))
            while self.engine.block_manager.num_free_blocks < needed and self.states:
                self.release(next(iter(self.states)))
            self.states[seq.request_id] = draft
        return draft

    def release(self, request_id: str) -> None:
        """The request left the target engine: its draft's KV blocks go back."""
        draft = self.states.pop(request_id, None)
        if draft is not None:
            self.engine.block_manager.free(draft)
            self.engine.runner.release(draft.request_id)


class ChainProposer:
    """The n-gram lookup's draft where it finds one, else the draft model's."""

    def __init__(self, ngram: NgramProposer, model: DraftModelProposer) -> None:
        self.ngram, self.model = ngram, model

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        return self.ngram.propose(seq, limit) or self.model.propose(seq, limit)

    def stop_compiling(self, timeout: float = 0.0) -> None:
        self.model.stop_compiling(timeout)

    def compiling(self) -> bool:
        return self.model.compiling()

    def follow(self, scheduled: list[ScheduledRequest]) -> None:
        self.model.follow(scheduled)

    def release(self, request_id: str) -> None:
        self.model.release(request_id)


def make_proposer(
    config: EngineConfig, target: ModelSource, max_model_len: int
) -> NgramProposer | DraftModelProposer | ChainProposer | None:
    """The engine's proposer: n-gram lookup (--speculative ngram), a draft model
    (--draft-model), both chained, or none."""

    ngram = (
        NgramProposer(config.num_speculative_tokens, config.ngram_min, config.ngram_max, max_model_len)
        if config.speculative == "ngram"
        else None
    )
    if config.draft_model is None:
        return ngram
    model = DraftModelProposer(config, target, max_model_len)
    return model if ngram is None else ChainProposer(ngram, model)
