"""The seeded-request invariant: the same request with the same `seed` gives the same text
whether or not its prefix was cached and whatever else runs beside it.

This file's server runs bf16 weights (quantization none), so numerics fast: beside other
requests the invariant holds there with `batch_invariant` (the request is scheduled alone);
across a prefix-cache hit it does not: the miss runs the whole prompt as one prefill (81 rows),
the hit only its uncached tail (1 row), and the bf16 matmul and attention kernels round
differently for the two shapes (measured 2026-12-01: the hit's text differs). That test is a
strict xfail: it documents what fast numerics cost. The default mode on the default model
(numerics invariant) holds both without asking: tests/e2e/test_default_mode_server.py.
"""

from __future__ import annotations

import concurrent.futures

import openai
import pytest

from tests.e2e.server import AUTO_FLOAT

# long enough that a repeat is a prefix-cache hit of all but its last token
PROMPT = (
    "You are helping a sailor. The sailor owns a small wooden boat with a red sail, two oars and a "
    "brass bell, and keeps it in a quiet harbour near an old lighthouse. Invent a name for the boat "
    "and describe it in two sentences."
)
SEEDED = {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0.9, "seed": 7, "max_tokens": 32}
NEIGHBOURS = [f"Write one sentence about the number {i}." for i in range(6)]
# strict where the weights are bf16 (measured there: the hit's text differs); float32 weights
# (a CPU without bf16 compute) round 2^16 times finer, and on this prompt the texts held
# (AVX2-only EPYC, 2026-12-02) — not promised, so not strict there
CACHE_HIT_XFAIL = pytest.mark.xfail(
    strict=AUTO_FLOAT == "bfloat16",
    reason="numerics fast: a prefix-cache hit runs the prompt's uncached tail through kernels whose "
    "rounding depends on the row count, so the seeded text changes",
)


def seeded_text(client: openai.OpenAI, model: str, **extra: object) -> str:
    reply = client.chat.completions.create(model=model, **SEEDED, extra_body=extra or None)  # type: ignore[call-overload]
    return reply.choices[0].message.content or ""


def texts_on_miss_and_hits(client: openai.OpenAI, model: str) -> list[str]:
    """The seeded request three times on a fresh prompt: a miss, then two prefix-cache hits."""
    return [seeded_text(client, model) for _ in range(3)]


@CACHE_HIT_XFAIL
def test_seeded_text_is_the_same_on_a_cache_miss_and_hits(client: openai.OpenAI) -> None:
    texts = texts_on_miss_and_hits(client, "smollm2-test")
    assert texts[0] and texts.count(texts[0]) == 3, texts


def test_seeded_text_is_the_same_beside_other_requests(client: openai.OpenAI) -> None:
    seeded_text(client, "smollm2-test")  # the prompt is cached from here on: both runs below hit it
    alone = seeded_text(client, "smollm2-test", batch_invariant=True)

    def neighbour(prompt: str) -> None:
        client.chat.completions.create(
            model="smollm2-test",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=48,
            temperature=0.7,
        )

    with concurrent.futures.ThreadPoolExecutor(len(NEIGHBOURS) + 1) as pool:
        others = [pool.submit(neighbour, prompt) for prompt in NEIGHBOURS]
        beside = pool.submit(seeded_text, client, "smollm2-test", batch_invariant=True)
        for future in others:
            future.result()
        assert beside.result() == alone
