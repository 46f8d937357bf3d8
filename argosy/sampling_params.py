"""SamplingParams: the resolved, validated per-request knobs the engine obeys.

Everything here is plain data. Values are final: precedence between request, operator,
model defaults and fallbacks (SPEC §3) is resolved before a SamplingParams is built, by
resolve_sampling() below.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from argosy.config import OperatorSampling
from argosy.errors import ContextLengthExceededError, InvalidRequestError

MAX_LOGPROBS = 20


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: until the context is full
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    logprobs: int | None = None  # None: off; k: sampled token's logprob + top-k alternatives
    prompt_logprobs: int | None = None  # None: off; k: each prompt token's logprob + top-k
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    batch_invariant: bool = False  # run so its tokens equal a solo run (scheduled alone)
    lora: str | None = None  # the LoRA adapter it runs with (argosy/engine/adapters.py); None: the base
    lora_scale: float = 1.0  # its adapter's product scaled by this (llama.cpp's per-request scale)

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be at least 1, got {self.max_tokens}.", param="max_tokens"
            )
        if self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be >= 0, got {self.temperature}.", param="temperature"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}.", param="top_p")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}.", param="top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}.", param="min_p")
        if self.repetition_penalty <= 0:
            raise InvalidRequestError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}.",
                param="repetition_penalty",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise InvalidRequestError(
                    f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}.", param=name
                )
        self.stop = [s for s in self.stop if s]

    def effective(self) -> dict[str, float | int | None]:
        """The knobs that decide which tokens are drawn, as the engine runs them (what the
        x-argosy-sampling header and the request's events report); seed None: greedy."""
        return {
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "top_k": self.top_k,
            "min_p": float(self.min_p),
            "seed": self.seed,
            "max_tokens": self.max_tokens,
            "presence_penalty": float(self.presence_penalty),
            "frequency_penalty": float(self.frequency_penalty),
            "repetition_penalty": float(self.repetition_penalty),
        }

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


# --- Precedence resolver (SPEC §3) -------------------------------------------------------------
#
# Every knob resolves request > operator flag > model's generation_config.json > server fallback.
# The dialects (OpenAI, Anthropic, Ollama) fill a RequestSampling; the core calls
# resolve_sampling() once per request and hands the engine the resulting SamplingParams.

FALLBACK_TEMPERATURE = 1.0  # OpenAI's default when nobody says otherwise
FALLBACK_TOP_K = 40  # rule 2: sampling with no truncation at any level gets top_k 40
FALLBACK_REPETITION_PENALTY = 1.0


@dataclass(slots=True)
class RequestSampling:
    """What one request asked for, in engine terms; None = the client did not give it.

    The dialect does its own spelling work before filling this: OpenAI's
    `max_completion_tokens` wins over `max_tokens`; `repeat_penalty` (Ollama) and
    `repetition_penalty` both land in `repetition_penalty`; `logprobs` is the number of top
    alternatives wanted (OpenAI chat's `logprobs: true` + `top_logprobs: k` → k).
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None


def _number(value: Any) -> float | None:
    """A JSON number (bool excluded: in Python True is an int) as float, else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


@dataclass(frozen=True, slots=True)
class ModelSamplingDefaults:
    """The sampling knobs a model's generation_config.json publishes; None = not published.

    Values that are malformed or out of range are left unset (the client is not at fault
    for a model's file) and named in `ignored`, so the loader can say so at start-up.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    do_sample: bool | None = None
    ignored: tuple[str, ...] = ()

    @classmethod
    def from_generation_config(cls, config: Mapping[str, Any] | None) -> ModelSamplingDefaults:
        config = config or {}
        checks: dict[str, Callable[[float], bool]] = {
            "temperature": lambda v: v >= 0.0,
            "top_p": lambda v: 0.0 < v <= 1.0,
            "top_k": lambda v: v >= 0 and v == int(v),
            "min_p": lambda v: 0.0 <= v <= 1.0,
            "repetition_penalty": lambda v: v > 0.0,
        }
        values: dict[str, Any] = {}
        ignored: list[str] = []
        for name, is_valid in checks.items():
            if config.get(name) is None:
                continue
            number = _number(config[name])
            if number is None or not is_valid(number):
                ignored.append(name)
            else:
                values[name] = int(number) if name == "top_k" else number
        do_sample = config.get("do_sample")
        if do_sample is not None and not isinstance(do_sample, bool):
            ignored.append("do_sample")
            do_sample = None
        return cls(**values, do_sample=do_sample, ignored=tuple(ignored))


def draw_fresh_seed() -> int:
    """A fresh, unpredictable seed for an unseeded sampled request (rule 6)."""
    return secrets.randbits(63)


def _resolve_temperature(
    request: RequestSampling,
    operator: OperatorSampling,
    model: ModelSamplingDefaults,
    speculation_enabled: bool,
) -> float:
    # Rule 3: a model that says do_sample false is greedy, but only at the model's own level:
    # a request or operator temperature still wins.
    model_temperature = 0.0 if model.do_sample is False else model.temperature
    explicit = request.temperature if request.temperature is not None else operator.temperature
    if explicit is not None:
        return explicit
    temperature = model_temperature if model_temperature is not None else FALLBACK_TEMPERATURE
    # Rule 4: the speculation cap only touches a temperature nobody chose explicitly.
    cap = operator.spec_max_temperature
    if speculation_enabled and cap is not None:
        temperature = min(temperature, cap)
    return temperature


def _resolve_truncation(
    request: RequestSampling,
    operator: OperatorSampling,
    model: ModelSamplingDefaults,
    temperature: float,
) -> tuple[float, int, float]:
    """(top_p, top_k, min_p), rules 1–2: the first level that sets any of them supplies all."""
    for level in (request, operator, model):
        if level.top_p is not None or level.top_k is not None or level.min_p is not None:
            return (
                level.top_p if level.top_p is not None else 1.0,
                level.top_k if level.top_k is not None else 0,
                level.min_p if level.min_p is not None else 0.0,
            )
    return (1.0, FALLBACK_TOP_K if temperature > 0.0 else 0, 0.0)


def _resolve_repetition_penalty(
    request: RequestSampling, operator: OperatorSampling, model: ModelSamplingDefaults
) -> float:
    """The first level that sets it; 0 is "off" (llama.cpp's and Ollama's spelling), i.e. 1.0."""
    for value in (request.repetition_penalty, operator.repetition_penalty, model.repetition_penalty):
        if value is not None:
            return value if value != 0.0 else FALLBACK_REPETITION_PENALTY
    return FALLBACK_REPETITION_PENALTY


def _context_message(context_length: int, prompt_len: int, completion: int | None) -> str:
    head = f"This model's maximum context length is {context_length} tokens. However, you requested "
    if completion is None:
        return head + f"{prompt_len} tokens in the messages. Please reduce the length of the messages."
    return head + (
        f"{prompt_len + completion} tokens ({prompt_len} in the messages, {completion} in the "
        "completion). Please reduce the length of the messages or completion."
    )


def _resolve_max_tokens(
    request: RequestSampling, operator: OperatorSampling, *, context_length: int, prompt_len: int
) -> int:
    """Rule 8: request > operator default > the room left in the context.

    Like OpenAI and vLLM, a prompt that leaves no room, or an explicit max_tokens that does
    not fit beside the prompt, is a 400 context_length_exceeded carrying the numbers. The
    operator default is a ceiling the client never asked for, so it is clamped to the room
    left instead (vLLM does the same with its server-side default).
    """
    requested = request.max_tokens
    if requested is not None and requested < 1:
        raise InvalidRequestError(f"max_tokens must be at least 1, got {requested}.", param="max_tokens")
    if prompt_len >= context_length:
        raise ContextLengthExceededError(
            _context_message(context_length, prompt_len, requested), param="messages"
        )
    room = context_length - prompt_len
    if requested is not None:
        if requested > room:
            raise ContextLengthExceededError(
                _context_message(context_length, prompt_len, requested), param="max_tokens"
            )
        return requested
    if operator.max_tokens is not None:
        return min(operator.max_tokens, room)
    return room


def resolve_sampling(
    request: RequestSampling,
    operator: OperatorSampling,
    model_defaults: ModelSamplingDefaults,
    *,
    context_length: int,
    prompt_len: int,
    speculation_enabled: bool = False,
    fresh_seed: Callable[[], int] = draw_fresh_seed,
) -> SamplingParams:
    """The SamplingParams one request runs with (SPEC §3, rules 1–8).

    Raises InvalidRequestError (param names the field) for out-of-range values, and
    ContextLengthExceededError when the prompt, or prompt + max_tokens, exceeds the context.
    """
    max_tokens = _resolve_max_tokens(request, operator, context_length=context_length, prompt_len=prompt_len)
    temperature = _resolve_temperature(request, operator, model_defaults, speculation_enabled)
    top_p, top_k, min_p = _resolve_truncation(request, operator, model_defaults, temperature)
    # Rule 6: an explicit seed is used as is; an unseeded sampled request gets its own stream;
    # greedy needs none.
    seed = request.seed
    if seed is None and temperature > 0.0:
        seed = fresh_seed()
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=_resolve_repetition_penalty(request, operator, model_defaults),
        logit_bias=request.logit_bias or None,
        seed=seed,
        logprobs=request.logprobs,
        prompt_logprobs=request.prompt_logprobs,
        ignore_eos=bool(request.ignore_eos),
        stop_token_ids=list(request.stop_token_ids or []),
        stop=list(request.stop or []),
        include_stop_str_in_output=bool(request.include_stop_str_in_output),
        skip_special_tokens=request.skip_special_tokens is not False,
    )


def effective_defaults(
    operator: OperatorSampling,
    model_defaults: ModelSamplingDefaults | None,
    *,
    speculation_enabled: bool = False,
) -> dict[str, float | int]:
    """What /v1/models advertises (rule 7): the values a request that sets nothing runs with.

    Sending these back as a request resolves to the same SamplingParams (modulo the drawn
    seed), as long as the prompt leaves room for the advertised max_tokens. With
    `model_defaults` None (the model's generation_config is not known yet) only the values
    the operator pins are advertised: anything else may still change when the model loads.
    """
    no_request = RequestSampling()
    model = model_defaults if model_defaults is not None else ModelSamplingDefaults()
    temperature = _resolve_temperature(no_request, operator, model, speculation_enabled)
    top_p, top_k, min_p = _resolve_truncation(no_request, operator, model, temperature)
    repetition_penalty = _resolve_repetition_penalty(no_request, operator, model)
    operator_truncates = (
        operator.top_p is not None or operator.top_k is not None or operator.min_p is not None
    )
    advertised: dict[str, float | int] = {}
    if model_defaults is not None or operator.temperature is not None:
        advertised["temperature"] = temperature
    if model_defaults is not None or operator_truncates:
        advertised.update(top_p=top_p, top_k=top_k, min_p=min_p)
    if model_defaults is not None or operator.repetition_penalty is not None:
        advertised["repetition_penalty"] = repetition_penalty
    if operator.max_tokens is not None:
        advertised["max_tokens"] = operator.max_tokens
    return advertised
