"""Access-log rates: prefill counts only what was prefilled; decode is the inter-token rate."""

from __future__ import annotations

import pytest

from argosy.chat.events import Usage
from argosy.core.access_log import GenerationTiming, decode_rate, format_line, prefill_rate, tagged_route


@pytest.mark.parametrize(
    ("prompt", "cached", "ttft_ms", "expected"),
    [
        (12961, 0, 10444, "1241"),
        (14481, 12800, 5716, "294"),
        (15627, 14900, 5057, "144"),
        (16045, 15900, 2138, "68"),
    ],
)
def test_prefill_counts_only_what_was_prefilled(
    prompt: int, cached: int, ttft_ms: int, expected: str
) -> None:
    assert prefill_rate(prompt, cached, ttft_ms / 1000) == expected


def test_a_fully_cached_prompt_prefilled_nothing() -> None:
    assert prefill_rate(4096, 4096, 0.08) == "-"
    assert prefill_rate(4096, 9000, 0.08) == "-"


def test_prefill_needs_a_ttft() -> None:
    assert prefill_rate(1024, 0, None) == "-"
    assert prefill_rate(1024, 0, 0.0) == "-"


def test_decode_is_the_inter_token_rate() -> None:
    timing = GenerationTiming(arrival_time=0.0)
    timing.stamp(0, 1, now=0.5)
    timing.stamp(0, 200, now=0.5 + 0.781)
    assert timing.decode() == (199, pytest.approx(0.781))
    assert decode_rate(*timing.decode()) == "254.8"
    assert timing.ttft_s == 0.5


def test_decode_excludes_the_whole_first_output() -> None:
    timing = GenerationTiming(arrival_time=0.0)
    timing.stamp(0, 5, now=1.0)  # five tokens arrived with the first output
    timing.stamp(0, 100, now=2.0)
    assert timing.decode()[0] == 95
    assert decode_rate(*timing.decode()) == "95.0"


def test_one_output_has_no_decode_rate() -> None:
    timing = GenerationTiming(arrival_time=0.0)
    timing.stamp(0, 1, now=0.2)
    assert decode_rate(*timing.decode()) == "-"


def test_n_choices_decode_together() -> None:
    timing = GenerationTiming(arrival_time=0.0)
    for index in (0, 1):
        timing.stamp(index, 1, now=1.0)
        timing.stamp(index, 11, now=2.0)
    assert timing.decode() == (20, 1.0)


def test_the_line() -> None:
    timing = GenerationTiming(arrival_time=10.0)
    timing.stamp(0, 1, now=10.1)
    timing.stamp(0, 9, now=10.5)
    line = format_line("POST /v1/chat/completions", "smollm2", Usage(37, 9, 5), timing, "stop", now=10.6)
    assert line == (
        "POST /v1/chat/completions model=smollm2 prompt=37 cached=5 completion=9 ttft=100ms "
        "prefill=320 tok/s decode=20.0 tok/s total=600ms finish=stop"
    )


def test_a_line_without_output() -> None:
    line = format_line("POST /v1/completions", "m", Usage(3, 0, 0), GenerationTiming(0.0), "abort", now=1.0)
    assert "ttft=-ms prefill=- tok/s decode=- tok/s total=1000ms finish=abort" in line


def test_the_route_carries_the_requests_tags() -> None:
    assert tagged_route("POST /v1/completions", ()) == "POST /v1/completions"
    assert tagged_route("POST /v1/completions", ("fim", "stream")) == "POST /v1/completions (fim) (stream)"


def test_a_rate_past_one_token_a_millisecond_is_not_believed() -> None:
    """The reference's guard: 200 tokens in 150 ms came in a burst, not decoded one by one."""
    assert decode_rate(200, 0.150) == "-"
    assert decode_rate(150, 0.150) == "1000.0"  # exactly one a millisecond still is
    assert decode_rate(199, 0.781) == "254.8"
