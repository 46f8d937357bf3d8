"""The seeded-request invariant: the same request with the same `seed` gives the same text
whether or not its prefix was cached and whatever else runs beside it.

In bf16 (the e2e server's mode) it holds for a cache miss and the hits after it, and with
`batch_invariant` beside other requests. In the default mode (int4 decode, bf16 prefill) a
prefix-cache hit still changes the text (the prompt's uncached tail goes through another
kernel): that mode's test (test_default_mode_server.py, on its server) is a strict xfail until
the numerics issue (issue 16) makes the kernels agree; it then passes and the marker must go,
so the invariant stays fixed.
"""

from __future__ import annotations

import concurrent.futures

import openai

SEEDED = {
    "messages": [{"role": "user", "content": "Invent a name for a small boat and describe it."}],
    "temperature": 0.9,
    "seed": 7,
    "max_tokens": 32,
}
NEIGHBOURS = [f"Write one sentence about the number {i}." for i in range(6)]


def seeded_text(client: openai.OpenAI, model: str, **extra: object) -> str:
    reply = client.chat.completions.create(model=model, **SEEDED, extra_body=extra or None)  # type: ignore[call-overload]
    return reply.choices[0].message.content or ""


def test_seeded_text_is_the_same_on_a_cache_miss_and_hits(client: openai.OpenAI) -> None:
    texts = [seeded_text(client, "smollm2-test") for _ in range(3)]  # the 2nd and 3rd: prefix hits
    assert texts[0] and texts.count(texts[0]) == 3, texts


def test_seeded_text_is_the_same_beside_other_requests(client: openai.OpenAI) -> None:
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
