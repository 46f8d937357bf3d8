"""What OpenAI's chat and completions endpoints share: the sampling fields and their range
checks, stream options, logprobs, usage and error rendering (what every dialect shares is in
api/wire.py).

Request models are strict (a string is not a number) and accept unknown fields. Fields
whose type is a union are declared `Any` and normalized by a validator, so an error names
the field itself rather than one arm of the union.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AliasChoices, BeforeValidator, ConfigDict, Field

from argosy.api.errors import openai_error_body
from argosy.api.wire import StopField, WireModel
from argosy.chat.events import Usage
from argosy.errors import ArgosyError
from argosy.sampling_params import RequestSampling

MAX_N = 16
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


def _logit_bias(value: Any) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("logit_bias must be an object mapping token ids to a bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries are allowed, got {len(value)}")
    bias: dict[int, float] = {}
    for key, number in value.items():
        try:
            token_id = int(key)
        except ValueError:
            raise ValueError(f"logit_bias key {key!r} is not a token id") from None
        if isinstance(number, bool) or not isinstance(number, int | float) or not math.isfinite(number):
            raise ValueError(f"logit_bias value for token {key} is not a number")
        if not -100 <= number <= 100:
            raise ValueError(f"logit_bias value for token {key} must be in [-100, 100], got {number}")
        bias[token_id] = float(number)
    return bias


LogitBiasField = Annotated[Any, BeforeValidator(_logit_bias)]


class StreamOptions(WireModel):
    include_usage: bool = False  # one last chunk, `choices: []`, with the whole usage
    continuous_usage_stats: bool = False  # every chunk carries the usage so far


class LoraChoice(WireModel):
    """One of llama.cpp's per-request `lora` entries: an adapter's id (GET /lora-adapters) and
    the scale of its product (0: off)."""

    model_config = ConfigDict(strict=True)

    id: int = Field(ge=0)
    scale: float = Field(1.0, ge=-100.0, le=100.0)


class SamplingFields(WireModel):
    """The generation knobs both endpoints take, with OpenAI's ranges."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # -1 (vLLM's spelling) and 0 both disable it
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(  # 0: off (as 1.0), llama.cpp's spelling
        None, ge=0.0, validation_alias=AliasChoices("repetition_penalty", "repeat_penalty")
    )
    logit_bias: LogitBiasField = None
    stop: StopField = None
    ignore_eos: bool = False
    user: str | None = None
    priority: Any = None  # QoS class (admission.request_qos checks it, with x-argosy-qos)
    batch_invariant: bool = False  # tokens equal a solo run, whatever else is batched
    lora: list[LoraChoice] | None = Field(None, max_length=64)  # llama.cpp's adapters for this request

    def lora_ids(self) -> list[tuple[int, float]] | None:
        return None if self.lora is None else [(choice.id, choice.scale) for choice in self.lora]

    def request_sampling(self, *, max_tokens: int | None, logprobs: int | None) -> RequestSampling:
        return request_sampling(self, max_tokens=max_tokens, logprobs=logprobs)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "logit_bias",
    "stop",
)


def request_sampling(body: Any, *, max_tokens: int | None, logprobs: int | None = None) -> RequestSampling:
    """The sampling an OpenAI request asks for, from whichever of SamplingFields' names its
    body has (the Responses body has fewer); top_k -1 (vLLM's "off") is 0."""
    values = {name: getattr(body, name, None) for name in _SAMPLING_FIELDS}
    top_k = getattr(body, "top_k", None)
    return RequestSampling(
        **values,
        top_k=0 if top_k == -1 else top_k,
        max_tokens=max_tokens,
        logprobs=logprobs,
        ignore_eos=bool(getattr(body, "ignore_eos", False)),
    )


def usage_json(usage: Usage) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
    if usage.spec_proposed_tokens is not None:  # an extension; only when speculation is on
        body["speculative"] = speculative_json(usage)
    return body


def speculative_json(usage: Usage) -> dict[str, int]:
    return {
        "proposed_tokens": usage.spec_proposed_tokens or 0,
        "accepted_tokens": usage.spec_accepted_tokens or 0,
    }


def render_error(error: ArgosyError) -> dict[str, Any]:
    return openai_error_body(error)
