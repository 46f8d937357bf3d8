"""The checks of a request that need no engine state: an engine's, or a fleet head's for its
nodes' model. Raise typed errors (a 400 naming the field at fault)."""

from __future__ import annotations

from argosy.config import QOS_CLASSES
from argosy.errors import ContextLengthExceededError, InvalidRequestError
from argosy.runner.pooler import POOLING_METHODS, pooling_token_ids
from argosy.sampling_params import SamplingParams

# a pooling request's params: it is never sampled
PREFILL_ONLY = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)


def validate_request(
    prompt_token_ids: list[int], params: SamplingParams, qos: str, vocab_size: int, max_model_len: int
) -> None:
    """Every check of a request that needs no engine state (an engine's, or a fleet head's
    for its nodes' model); raises typed errors."""
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("The prompt is empty.", param="prompt")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"Token id {bad[0]} is out of range for a vocabulary of {vocab_size}.", param="prompt"
        )
    if params.logit_bias:
        bad = [t for t in params.logit_bias if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(
                f"logit_bias token id {bad[0]} is out of range for a vocabulary of {vocab_size}.",
                param="logit_bias",
            )
    if qos not in QOS_CLASSES:
        raise InvalidRequestError(
            f"Unknown QoS class {qos!r}; use one of {', '.join(QOS_CLASSES)}.", "priority"
        )
    requested = params.max_tokens or 1
    if n + requested > max_model_len:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{n + requested} tokens ({n} in the prompt, {requested} in the completion). "
            "Please reduce the prompt or the completion length.",
            param="max_tokens" if n < max_model_len else "prompt",
        )


def validate_pooling_request(
    prompt_token_ids: list[int], pooling: str, qos: str, vocab_size: int, max_model_len: int
) -> None:
    """A prefill-only request: its input takes at most the whole context (no completion)."""
    if pooling.partition(":")[0] not in POOLING_METHODS:
        raise InvalidRequestError(f"Unknown pooling {pooling!r}; use one of {', '.join(POOLING_METHODS)}.")
    try:
        token_ids = pooling_token_ids(pooling) or []
    except ValueError as exc:
        raise InvalidRequestError(f"Bad pooling {pooling!r}: {exc}.") from exc
    if any(not 0 <= token_id < vocab_size for token_id in token_ids):
        raise InvalidRequestError(f"Bad pooling {pooling!r}: a token id is outside the vocabulary.")
    n = len(prompt_token_ids)
    if n > max_model_len:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens; the input has {n}.",
            param="input",
        )
    validate_request(prompt_token_ids, PREFILL_ONLY, qos, vocab_size, n + 1)
