"""SPEC §3 sampling precedence, pinned rule by rule with exact values.

Cases marked "ref:" port the intent of the reference daemon's sampling tests
(`penalty_alias_tests`, `embedding_sampling_tests`); SPEC §3 wins where the two differ.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from argosy.config import OperatorSampling
from argosy.errors import ContextLengthExceededError, InvalidRequestError
from argosy.sampling_params import (
    FALLBACK_TOP_K,
    MAX_LOGPROBS,
    ModelSamplingDefaults,
    RequestSampling,
    SamplingParams,
    draw_fresh_seed,
    effective_defaults,
    resolve_sampling,
)

NO_MODEL = ModelSamplingDefaults()
NO_OPERATOR = OperatorSampling()
FIXED_SEED = 777

# Qwen3-8B's generation_config.json, as the reference's fixtures spell it.
QWEN3 = ModelSamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.0, do_sample=True)


def counting_seeds(start: int = 1000) -> Callable[[], int]:
    seeds: Iterator[int] = iter(range(start, start + 1000))
    return lambda: next(seeds)


def resolve(
    request: RequestSampling | None = None,
    operator: OperatorSampling = NO_OPERATOR,
    model: ModelSamplingDefaults = NO_MODEL,
    *,
    context_length: int = 4096,
    prompt_len: int = 10,
    speculation_enabled: bool = False,
    fresh_seed: Callable[[], int] = lambda: FIXED_SEED,
) -> SamplingParams:
    return resolve_sampling(
        request or RequestSampling(),
        operator,
        model,
        context_length=context_length,
        prompt_len=prompt_len,
        speculation_enabled=speculation_enabled,
        fresh_seed=fresh_seed,
    )


def knobs(p: SamplingParams) -> tuple[float, float, int, float]:
    return (p.temperature, p.top_p, p.top_k, p.min_p)


def echo(advertised: dict[str, float | int]) -> RequestSampling:
    """A request that sends back exactly what /v1/models advertised."""
    top_k = advertised.get("top_k")
    max_tokens = advertised.get("max_tokens")
    return RequestSampling(
        temperature=advertised.get("temperature"),
        top_p=advertised.get("top_p"),
        top_k=int(top_k) if top_k is not None else None,
        min_p=advertised.get("min_p"),
        repetition_penalty=advertised.get("repetition_penalty"),
        max_tokens=int(max_tokens) if max_tokens is not None else None,
    )


def same_but_seed(a: SamplingParams, b: SamplingParams) -> None:
    a.seed = b.seed = None
    assert a == b


# --- Fallbacks ----------------------------------------------------------------------------------


def test_nothing_set_anywhere_gives_openai_temperature_and_top_k_40() -> None:
    # ref: unspecified_truncation_defaults_to_top_k, empty_model_defaults_keep_the_fallback
    p = resolve()
    assert knobs(p) == (1.0, 1.0, 40, 0.0)
    assert FALLBACK_TOP_K == 40
    assert p.repetition_penalty == 1.0
    assert (p.presence_penalty, p.frequency_penalty) == (0.0, 0.0)
    assert p.logit_bias is None
    assert p.logprobs is None and p.prompt_logprobs is None
    assert p.stop == [] and p.stop_token_ids == []
    assert p.ignore_eos is False and p.include_stop_str_in_output is False
    assert p.skip_special_tokens is True


# --- Rule 1: truncation set ---------------------------------------------------------------------


def test_rule1_spec_example_request_top_k_sets_aside_model_top_p() -> None:
    # ref: explicit_top_k_suppresses_the_model_top_p
    model = ModelSamplingDefaults(top_p=0.95, top_k=20)
    p = resolve(RequestSampling(top_k=5), model=model)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 5, 0.0)


def test_rule1_request_top_p_sets_aside_model_top_k() -> None:
    # ref: explicit_top_p_suppresses_the_model_top_k
    model = ModelSamplingDefaults(top_p=0.95, top_k=20)
    p = resolve(RequestSampling(top_p=1.0), model=model)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)


def test_rule1_request_min_p_alone_sets_aside_the_whole_model_set() -> None:
    model = ModelSamplingDefaults(top_p=0.95, top_k=20, min_p=0.1)
    p = resolve(RequestSampling(min_p=0.05), model=model)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.05)


def test_rule1_explicit_request_knobs_are_never_overridden() -> None:
    # ref: explicit_sampling_knobs_are_never_overridden
    assert resolve(RequestSampling(top_p=1.0)).top_k == 0
    assert resolve(RequestSampling(top_p=0.9)).top_k == 0
    assert resolve(RequestSampling(top_k=7)).top_k == 7
    assert resolve(RequestSampling(top_k=0)).top_k == 0  # explicit 0 means disabled


def test_rule1_request_sets_all_three() -> None:
    p = resolve(RequestSampling(top_p=0.8, top_k=12, min_p=0.02), model=QWEN3)
    assert (p.top_p, p.top_k, p.min_p) == (0.8, 12, 0.02)


def test_rule1_model_set_beats_the_fallback() -> None:
    # ref: model_defaults_beat_the_runtime_fallback
    model = ModelSamplingDefaults(temperature=1.0, top_p=0.95, top_k=20, min_p=0.0, do_sample=True)
    p = resolve(model=model)
    assert knobs(p) == (1.0, 0.95, 20, 0.0)


def test_rule1_operator_level_takes_the_whole_set_over_the_model() -> None:
    # ref: operator_flags_sit_between_caller_and_bundle
    operator = OperatorSampling(top_k=64)
    p = resolve(operator=operator, model=QWEN3)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 64, 0.0)
    assert p.temperature == 0.6  # temperature is its own rung: still the model's
    assert resolve(RequestSampling(top_k=7), operator, QWEN3).top_k == 7
    assert (resolve(RequestSampling(top_k=7), operator, QWEN3).top_p) == 1.0
    assert knobs(resolve(operator=operator)) == (1.0, 1.0, 64, 0.0)


def test_rule1_request_set_beats_operator_set() -> None:
    operator = OperatorSampling(top_p=0.7, min_p=0.1)
    p = resolve(RequestSampling(top_k=3), operator)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 3, 0.0)


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        (ModelSamplingDefaults(top_p=0.95), (0.95, 0, 0.0)),
        (ModelSamplingDefaults(top_k=9), (1.0, 9, 0.0)),
        (ModelSamplingDefaults(min_p=0.1), (1.0, 0, 0.1)),
    ],
)
def test_rule1_any_single_model_knob_claims_the_whole_set(
    model: ModelSamplingDefaults, expected: tuple[float, int, float]
) -> None:
    # ref: model_truncation_wins_as_a_set..., model_top_p_alone_suppresses_the_fallback_top_k,
    # model_min_p_alone_is_a_truncation_claim
    p = resolve(model=model)
    assert (p.top_p, p.top_k, p.min_p) == expected


def test_rule1_model_top_p_1_is_still_a_truncation_claim() -> None:
    p = resolve(model=ModelSamplingDefaults(top_p=1.0))
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)


# --- Rule 2: fallback top_k 40 for sampling, none for greedy ------------------------------------


def test_rule2_sampling_without_truncation_gets_top_k_40() -> None:
    assert resolve(RequestSampling(temperature=0.7)).top_k == 40
    assert resolve(model=ModelSamplingDefaults(temperature=0.3)).top_k == 40


def test_rule2_greedy_gets_no_truncation_default() -> None:
    # ref: greedy_gets_no_truncation_default
    p = resolve(RequestSampling(temperature=0.0))
    assert knobs(p) == (0.0, 1.0, 0, 0.0)
    assert resolve(operator=OperatorSampling(temperature=0.0)).top_k == 0
    assert resolve(model=ModelSamplingDefaults(do_sample=False)).top_k == 0


# --- Rule 3: do_sample false --------------------------------------------------------------------


def test_rule3_do_sample_false_means_greedy() -> None:
    # ref: do_sample_false_means_greedy
    model = ModelSamplingDefaults(temperature=0.7, do_sample=False)
    assert resolve(model=model).temperature == 0.0
    assert resolve(RequestSampling(temperature=0.8), model=model).temperature == 0.8


def test_rule3_operator_temperature_outranks_do_sample_false() -> None:
    # ref: operator_temperature_precedence
    model = ModelSamplingDefaults(do_sample=False)
    operator = OperatorSampling(temperature=0.9)
    assert resolve(operator=operator, model=model).temperature == 0.9
    assert resolve(RequestSampling(temperature=0.0), operator, model).temperature == 0.0


def test_rule3_do_sample_true_keeps_model_temperature() -> None:
    model = ModelSamplingDefaults(temperature=0.6, do_sample=True)
    assert resolve(model=model).temperature == 0.6


def test_temperature_precedence_request_operator_model_fallback() -> None:
    # ref: caller_beats_the_model_defaults
    model = ModelSamplingDefaults(temperature=0.5, top_k=20, top_p=0.95)
    operator = OperatorSampling(temperature=0.4)
    assert resolve(RequestSampling(temperature=0.3), operator, model).temperature == 0.3
    assert resolve(operator=operator, model=model).temperature == 0.4
    assert resolve(model=model).temperature == 0.5
    assert resolve().temperature == 1.0
    assert resolve(RequestSampling(top_p=0.5), model=model).top_p == 0.5


# --- Rule 4: spec_max_temperature ---------------------------------------------------------------


def test_rule4_spec_cap_touches_only_unchosen_temperatures_when_speculating() -> None:
    # ref: spec_max_temperature_caps_only_the_bundle_default
    model = ModelSamplingDefaults(temperature=1.0)
    operator = OperatorSampling(spec_max_temperature=0.6)

    def temp(
        request: RequestSampling | None = None,
        op: OperatorSampling = operator,
        m: ModelSamplingDefaults = model,
    ) -> float:
        return resolve(request, op, m, speculation_enabled=True).temperature

    assert temp() == 0.6  # model bundle value capped
    assert temp(RequestSampling(temperature=0.9)) == 0.9  # the caller wins
    assert temp(op=OperatorSampling(temperature=0.8, spec_max_temperature=0.6)) == 0.8  # the flag wins
    assert temp(m=ModelSamplingDefaults(temperature=0.3)) == 0.3  # already below the cap
    assert temp(m=ModelSamplingDefaults(do_sample=False)) == 0.0  # greedy stays greedy
    assert temp(m=NO_MODEL) == 0.6  # the server fallback 1.0 is capped too
    assert effective_defaults(operator, model, speculation_enabled=True)["temperature"] == 0.6


def test_rule4_spec_cap_is_inert_without_speculation() -> None:
    model = ModelSamplingDefaults(temperature=1.0)
    operator = OperatorSampling(spec_max_temperature=0.6)
    assert resolve(operator=operator, model=model).temperature == 1.0
    assert resolve(operator=operator).temperature == 1.0
    assert effective_defaults(operator, model)["temperature"] == 1.0


def test_rule4_cap_to_zero_makes_the_default_greedy_and_untruncated() -> None:
    operator = OperatorSampling(spec_max_temperature=0.0)
    p = resolve(operator=operator, speculation_enabled=True)
    assert knobs(p) == (0.0, 1.0, 0, 0.0)
    assert p.seed is None


# --- Rule 5: repetition penalty -----------------------------------------------------------------


def test_rule5_repetition_penalty_request_operator_model_fallback() -> None:
    # ref: repeat_penalty_resolves_caller_then_operator_then_bundle_then_default
    model = ModelSamplingDefaults(repetition_penalty=1.1)
    operator = OperatorSampling(repetition_penalty=1.2)
    assert resolve().repetition_penalty == 1.0
    assert resolve(RequestSampling(repetition_penalty=1.2)).repetition_penalty == 1.2
    assert resolve(model=model).repetition_penalty == 1.1  # bundle beats the fallback
    opted_out = ModelSamplingDefaults(repetition_penalty=1.0)
    assert resolve(model=opted_out).repetition_penalty == 1.0
    assert resolve(operator=operator, model=model).repetition_penalty == 1.2  # flag beats bundle
    caller_opts_out = RequestSampling(repetition_penalty=1.0)
    assert resolve(caller_opts_out, operator, model).repetition_penalty == 1.0


def test_rule5_frequency_penalty_stays_additive() -> None:
    # ref: penalty_mapping_is_opt_in... (without the embedding policy: no mapping)
    p = resolve(RequestSampling(frequency_penalty=0.2))
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.2, 1.0)
    p = resolve(RequestSampling(presence_penalty=0.3))
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.3, 0.0, 1.0)


# --- Rule 6: seeds ------------------------------------------------------------------------------


def test_rule6_unseeded_sampled_requests_draw_distinct_seeds() -> None:
    # ref: unseeded_sampled_requests_draw_distinct_seeds
    seeds = counting_seeds()
    a = resolve(RequestSampling(temperature=0.7), fresh_seed=seeds)
    b = resolve(RequestSampling(temperature=0.7), fresh_seed=seeds)
    assert (a.seed, b.seed) == (1000, 1001)


def test_rule6_default_seed_source_differs_between_requests() -> None:
    a = resolve_sampling(RequestSampling(), NO_OPERATOR, NO_MODEL, context_length=64, prompt_len=1)
    b = resolve_sampling(RequestSampling(), NO_OPERATOR, NO_MODEL, context_length=64, prompt_len=1)
    assert isinstance(a.seed, int) and isinstance(b.seed, int)
    assert a.seed != b.seed
    assert 0 <= draw_fresh_seed() < 2**63


def test_rule6_explicit_seed_is_used_as_is() -> None:
    def never() -> int:
        raise AssertionError("an explicit seed must not draw")

    assert resolve(RequestSampling(temperature=0.7, seed=42), fresh_seed=never).seed == 42
    assert resolve(RequestSampling(temperature=0.7, seed=0), fresh_seed=never).seed == 0
    assert resolve(RequestSampling(temperature=0.0, seed=5), fresh_seed=never).seed == 5


def test_rule6_greedy_needs_no_seed() -> None:
    def never() -> int:
        raise AssertionError("greedy must not draw")

    assert resolve(RequestSampling(temperature=0.0), fresh_seed=never).seed is None
    assert resolve(model=ModelSamplingDefaults(do_sample=False), fresh_seed=never).seed is None


def test_rule6_a_seed_is_drawn_for_a_defaulted_sampled_temperature() -> None:
    assert resolve(model=ModelSamplingDefaults(temperature=0.6)).seed == FIXED_SEED
    assert resolve(operator=OperatorSampling(temperature=0.2)).seed == FIXED_SEED


# --- Rule 7: advertised defaults ----------------------------------------------------------------


def test_rule7_advertised_fallback_defaults_match_the_effective_ones() -> None:
    # ref: advertised_defaults_match_the_effective_ones
    advertised = effective_defaults(NO_OPERATOR, NO_MODEL)
    assert advertised == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 40,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
    }
    p = resolve()
    assert (p.temperature, p.top_p, p.top_k, p.min_p) == (
        advertised["temperature"],
        advertised["top_p"],
        advertised["top_k"],
        advertised["min_p"],
    )


def test_rule7_advertised_defaults_follow_the_model() -> None:
    # ref: advertised_defaults_follow_the_model
    advertised = effective_defaults(NO_OPERATOR, ModelSamplingDefaults(top_p=0.95, top_k=20))
    assert (advertised["top_p"], advertised["top_k"], advertised["min_p"]) == (0.95, 20, 0.0)
    assert advertised["temperature"] == 1.0


def test_rule7_advertised_defaults_with_operator_flags() -> None:
    # ref: caller_and_operator_values_override_embedding_without_merging_truncation
    model = ModelSamplingDefaults(top_k=90)
    operator = OperatorSampling(temperature=0.6, top_k=12, repetition_penalty=1.3, max_tokens=256)
    assert effective_defaults(operator, model) == {
        "temperature": 0.6,
        "top_p": 1.0,
        "top_k": 12,
        "min_p": 0.0,
        "repetition_penalty": 1.3,
        "max_tokens": 256,
    }
    p = resolve(RequestSampling(temperature=0.2, top_p=1.0, seed=42), operator, model)
    assert (*knobs(p), p.seed) == (0.2, 1.0, 0, 0.0, 42)
    assert resolve(RequestSampling(repetition_penalty=1.0), operator, model).repetition_penalty == 1.0


def test_rule7_max_tokens_advertised_only_when_the_operator_sets_it() -> None:
    assert "max_tokens" not in effective_defaults(NO_OPERATOR, QWEN3)
    assert effective_defaults(OperatorSampling(max_tokens=512), QWEN3)["max_tokens"] == 512


@pytest.mark.parametrize(
    ("operator", "model", "speculation_enabled"),
    [
        (NO_OPERATOR, NO_MODEL, False),  # ref: round_tripping_advertised_defaults_is_stable
        (NO_OPERATOR, ModelSamplingDefaults(top_p=0.95, top_k=20), False),
        # ref: echoing_advertised_min_p_is_stable
        (NO_OPERATOR, ModelSamplingDefaults(top_p=0.95, top_k=20, min_p=0.05), False),
        (NO_OPERATOR, QWEN3, False),
        (NO_OPERATOR, ModelSamplingDefaults(temperature=0.7, do_sample=False, top_p=0.9), False),
        (NO_OPERATOR, ModelSamplingDefaults(repetition_penalty=1.1), False),
        (OperatorSampling(top_k=64, max_tokens=100), QWEN3, False),
        (OperatorSampling(temperature=0.0), NO_MODEL, False),
        (OperatorSampling(min_p=0.05, repetition_penalty=1.2), QWEN3, False),
        (OperatorSampling(spec_max_temperature=0.6), ModelSamplingDefaults(temperature=1.0), True),
        (OperatorSampling(spec_max_temperature=0.0), NO_MODEL, True),
    ],
)
def test_rule7_sending_the_advertised_defaults_back_changes_nothing(
    operator: OperatorSampling, model: ModelSamplingDefaults, speculation_enabled: bool
) -> None:
    advertised = effective_defaults(operator, model, speculation_enabled=speculation_enabled)
    silent = resolve(operator=operator, model=model, speculation_enabled=speculation_enabled)
    echoed = resolve(echo(advertised), operator, model, speculation_enabled=speculation_enabled)
    same_but_seed(echoed, silent)


def test_rule7_unknown_model_advertises_only_what_the_operator_pins() -> None:
    # ref: operator_owned_settings_survive_a_failed_bundle_lookup,
    # an_unknown_penalty_is_omitted_but_a_pinned_one_is_not
    assert effective_defaults(NO_OPERATOR, None) == {}
    assert effective_defaults(OperatorSampling(top_k=64), None) == {"top_p": 1.0, "top_k": 64, "min_p": 0.0}
    assert effective_defaults(OperatorSampling(temperature=0.4), None) == {"temperature": 0.4}
    assert effective_defaults(OperatorSampling(repetition_penalty=1.2), None) == {"repetition_penalty": 1.2}
    assert effective_defaults(OperatorSampling(max_tokens=64), None) == {"max_tokens": 64}
    # Once the model is known, everything is advertised.
    assert effective_defaults(OperatorSampling(top_k=64), QWEN3) == {
        "temperature": 0.6,
        "top_p": 1.0,
        "top_k": 64,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
    }
    assert effective_defaults(NO_OPERATOR, NO_MODEL)["repetition_penalty"] == 1.0
    opted_out = ModelSamplingDefaults(repetition_penalty=1.0)
    assert effective_defaults(NO_OPERATOR, opted_out)["repetition_penalty"] == 1.0


# --- Rule 8: max_tokens -------------------------------------------------------------------------


def test_rule8_max_tokens_request_operator_room_left() -> None:
    operator = OperatorSampling(max_tokens=100)
    assert resolve(RequestSampling(max_tokens=30), operator).max_tokens == 30
    assert resolve(operator=operator).max_tokens == 100
    assert resolve(context_length=4096, prompt_len=10).max_tokens == 4086


def test_rule8_operator_default_is_clamped_to_the_room_left() -> None:
    operator = OperatorSampling(max_tokens=100)
    assert resolve(operator=operator, context_length=64, prompt_len=60).max_tokens == 4


@pytest.mark.parametrize("max_tokens", [0, -1])
def test_rule8_zero_or_negative_max_tokens_is_a_400(max_tokens: int) -> None:
    with pytest.raises(InvalidRequestError) as info:
        resolve(RequestSampling(max_tokens=max_tokens))
    assert info.value.param == "max_tokens"
    assert info.value.kind == "invalid_request"
    assert not isinstance(info.value, ContextLengthExceededError)


def test_rule8_bad_max_tokens_is_reported_before_the_context_check() -> None:
    with pytest.raises(InvalidRequestError) as info:
        resolve(RequestSampling(max_tokens=0), context_length=8, prompt_len=100)
    assert info.value.param == "max_tokens"
    assert not isinstance(info.value, ContextLengthExceededError)


@pytest.mark.parametrize("prompt_len", [100, 101])
def test_rule8_prompt_that_fills_the_context_is_context_length_exceeded(prompt_len: int) -> None:
    with pytest.raises(ContextLengthExceededError) as info:
        resolve(context_length=100, prompt_len=prompt_len)
    error = info.value
    assert (error.kind, error.code, error.param) == (
        "context_length_exceeded",
        "context_length_exceeded",
        "messages",
    )
    assert error.message == (
        f"This model's maximum context length is 100 tokens. However, you requested "
        f"{prompt_len} tokens in the messages. Please reduce the length of the messages."
    )


def test_rule8_prompt_too_long_with_explicit_max_tokens_says_both_numbers() -> None:
    with pytest.raises(ContextLengthExceededError) as info:
        resolve(RequestSampling(max_tokens=20), context_length=100, prompt_len=120)
    assert info.value.message == (
        "This model's maximum context length is 100 tokens. However, you requested 140 tokens "
        "(120 in the messages, 20 in the completion). Please reduce the length of the messages "
        "or completion."
    )


def test_rule8_prompt_plus_max_tokens_over_the_context_is_context_length_exceeded() -> None:
    with pytest.raises(ContextLengthExceededError) as info:
        resolve(RequestSampling(max_tokens=50), context_length=100, prompt_len=60)
    assert info.value.param == "max_tokens"
    assert info.value.message == (
        "This model's maximum context length is 100 tokens. However, you requested 110 tokens "
        "(60 in the messages, 50 in the completion). Please reduce the length of the messages "
        "or completion."
    )


def test_rule8_prompt_plus_max_tokens_exactly_filling_the_context_is_fine() -> None:
    assert resolve(RequestSampling(max_tokens=40), context_length=100, prompt_len=60).max_tokens == 40
    assert resolve(context_length=100, prompt_len=99).max_tokens == 1


def test_rule8_operator_default_that_does_not_fit_is_not_an_error() -> None:
    operator = OperatorSampling(max_tokens=4096)
    assert resolve(operator=operator, context_length=2048, prompt_len=2000).max_tokens == 48


# --- Pass-through fields ------------------------------------------------------------------------


def test_request_only_fields_pass_through() -> None:
    request = RequestSampling(
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={7: -100.0, 9: 2.5},
        logprobs=3,
        prompt_logprobs=1,
        stop=["END", ""],
        stop_token_ids=[2, 3],
        ignore_eos=True,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
    )
    p = resolve(request)
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, -0.5)
    assert p.logit_bias == {7: -100.0, 9: 2.5}
    assert (p.logprobs, p.prompt_logprobs) == (3, 1)
    assert p.stop == ["END"]
    assert p.stop_token_ids == [2, 3]
    assert (p.ignore_eos, p.include_stop_str_in_output, p.skip_special_tokens) == (True, True, False)


def test_resolved_lists_are_copies() -> None:
    stop, stop_ids = ["x"], [1]
    p = resolve(RequestSampling(stop=stop, stop_token_ids=stop_ids))
    p.stop.append("y")
    p.stop_token_ids.append(2)
    assert (stop, stop_ids) == (["x"], [1])


@pytest.mark.parametrize(
    ("request_values", "param"),
    [
        (RequestSampling(temperature=-0.1), "temperature"),
        (RequestSampling(top_p=0.0), "top_p"),
        (RequestSampling(top_p=1.5), "top_p"),
        (RequestSampling(top_k=-1), "top_k"),
        (RequestSampling(min_p=1.1), "min_p"),
        (RequestSampling(repetition_penalty=-0.5), "repetition_penalty"),  # 0 is "off"
        (RequestSampling(logprobs=MAX_LOGPROBS + 1), "logprobs"),
        (RequestSampling(prompt_logprobs=-1), "prompt_logprobs"),
    ],
)
def test_out_of_range_request_values_name_their_param(request_values: RequestSampling, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        resolve(request_values)
    assert info.value.param == param


# --- Model defaults from generation_config.json -------------------------------------------------


def test_model_defaults_from_generation_config() -> None:
    config = {
        "bos_token_id": 151643,
        "eos_token_id": [151645, 151643],
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0,
        "repetition_penalty": 1.05,
        "transformers_version": "4.51.0",
    }
    model = ModelSamplingDefaults.from_generation_config(config)
    assert model == ModelSamplingDefaults(
        temperature=0.6, top_p=0.95, top_k=20, min_p=0.0, repetition_penalty=1.05, do_sample=True
    )
    assert isinstance(model.top_k, int) and isinstance(model.min_p, float)


def test_model_defaults_from_empty_or_missing_generation_config() -> None:
    assert ModelSamplingDefaults.from_generation_config({}) == NO_MODEL
    assert ModelSamplingDefaults.from_generation_config(None) == NO_MODEL
    assert ModelSamplingDefaults.from_generation_config({"temperature": None}) == NO_MODEL


def test_model_defaults_leave_bad_values_unset_and_name_them() -> None:
    config = {
        "temperature": "hot",
        "top_p": 0.0,
        "top_k": 2.5,
        "min_p": True,
        "repetition_penalty": -1,
        "do_sample": "yes",
    }
    model = ModelSamplingDefaults.from_generation_config(config)
    assert (model.temperature, model.top_p, model.top_k, model.min_p) == (None, None, None, None)
    assert (model.repetition_penalty, model.do_sample) == (None, None)
    assert model.ignored == ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "do_sample")
    assert knobs(resolve(model=model)) == (1.0, 1.0, 40, 0.0)


def test_generation_config_do_sample_false_resolves_greedy() -> None:
    model = ModelSamplingDefaults.from_generation_config({"do_sample": False, "temperature": 0.9})
    p = resolve(model=model)
    assert (p.temperature, p.top_k, p.seed) == (0.0, 0, None)
    assert ModelSamplingDefaults.from_generation_config({"top_k": 20.0}).top_k == 20


# --- SamplingParams validation ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"temperature": -0.01}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.01}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs"),
    ],
)
def test_sampling_params_rejects_bad_values_naming_the_param(
    kwargs: dict[str, float | int], param: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.param == param
    assert info.value.kind == "invalid_request"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 1},
        {"max_tokens": None},
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"top_k": 0},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"repetition_penalty": 1e-3},
        {"logprobs": 0},
        {"logprobs": MAX_LOGPROBS},
        {"prompt_logprobs": 0},
        {"prompt_logprobs": MAX_LOGPROBS},
    ],
)
def test_sampling_params_accepts_boundary_values(kwargs: dict[str, float | int | None]) -> None:
    SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_sampling_params_drops_empty_stop_strings_and_reports_its_mode() -> None:
    p = SamplingParams(stop=["", "a", ""])
    assert p.stop == ["a"]
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams().is_greedy
    assert not SamplingParams().needs_penalties
    assert SamplingParams(presence_penalty=0.1).needs_penalties
    assert SamplingParams(frequency_penalty=-0.1).needs_penalties
    assert SamplingParams(repetition_penalty=1.1).needs_penalties
