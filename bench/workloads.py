"""Seeded workloads for bench/compare.py, driven through one httpx async client over SSE.

Every request is a streaming /v1/chat/completions call, greedy (temperature 0), asked to run to
`max_tokens` (each server's own way, see peers.request_overrides). Per request we record the
time to the first content chunk (TTFT), the time of the last one and the total latency; tokens
come from `usage` when the server sends it, else `max_tokens` when it finished with "length",
else the number of content chunks.

Workloads (each returns figures for one repetition; prompts are fresh per repetition so no
prefix cache carries one repetition into the next):
- single: one stream, short prompt -> decode tok/s (tokens after the first / their time span)
  and TTFT.
- prefill: a ~1,000-token prompt, max_tokens 1 -> prompt_tokens / TTFT.
- concurrency_N: N clients at once, each sending `requests_per_client` requests -> aggregate
  tok/s (all completion tokens / wall time), TTFT and latency p50/p95, failures.
- shared_prefix: one request primes a ~1,000-token system prompt, then `num_requests` distinct
  short questions behind that same system prompt, `concurrency` at a time -> TTFT p50/p95.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

_WORDS_TEXT = (
    "river mountain harbor lantern quiet engine garden copper winter signal orchard canvas "
    "ledger meadow pattern silver thunder market window bridge compass velvet anchor ember "
    "falcon granite horizon island journal kettle lemon marble needle ocean pepper quartz "
    "ribbon saddle timber umbrella valley walnut yellow zephyr archive beacon candle desert "
    "engineer festival glacier harvest insect jungle kingdom library machine network orbit "
    "planet question railway satellite theory universe village weather history science "
    "music travel kitchen doctor teacher student city forest animal language energy"
)
WORDS = tuple(_WORDS_TEXT.split())

TOPICS = (
    "the history of the printing press",
    "how bees make honey",
    "why the sky is blue",
    "the rules of chess",
    "how a steam engine works",
    "the water cycle",
    "the life of a star",
    "how vaccines train the immune system",
    "the causes of ocean tides",
    "how bread rises",
    "the invention of the telescope",
    "how birds migrate",
)


# an input-grounded task (speculative decoding's case): the answer copies much of the prompt
PASSAGE = (
    "The lighthouse at Cape Ellery was built in 1871, after three ships ran aground on the "
    "reef in a single winter. Its tower is made of local granite, cut from a quarry two miles "
    "inland and carried to the coast on ox carts. The first keeper, Thomas Hale, lived in the "
    "small cottage at the foot of the tower with his wife and four children. Every evening he "
    "climbed the one hundred and twelve steps to light the lamp, which burned whale oil until "
    "1890 and kerosene after that. The light could be seen from eighteen miles out at sea on a "
    "clear night. In bad weather the keeper also rang a heavy bronze bell every thirty seconds, "
    "sometimes for days without rest. Supplies arrived by boat once a month, and when storms "
    "kept the boat away the family lived on salted fish, potatoes from their garden and "
    "rainwater collected in a stone cistern. In 1936 the lamp was replaced by an electric light "
    "and the bell by a foghorn, and the keepers no longer had to climb the tower every night. "
    "The last keeper left in 1968, when the light became fully automatic. Today the cottage is "
    "a small museum run by volunteers. Visitors can see the keeper's logbooks, which record the "
    "weather, passing ships and the occasional rescue, written in careful handwriting over "
    "almost a hundred years. The tower itself is still an active aid to navigation, and its "
    "white flash every ten seconds still warns ships away from the reef that gave it its "
    "reason to exist. Local schools visit every spring, and children are allowed to climb the "
    "steps and look out over the water, imagining the long nights the keepers spent watching "
    "the sea and keeping the light burning for sailors they would never meet."
)

CODE_TASKS = [
    "Write a Python function that merges two sorted lists into one sorted list, with a docstring "
    "and type hints, then three pytest tests for it.",
    "Write a Python class LRUCache with get and put in O(1), with docstrings, then a short usage example.",
    "Write a JavaScript function that debounces another function, with JSDoc comments, then an example.",
    "Write a Python function that parses an ISO 8601 date string without libraries, with a docstring "
    "and tests.",
]
GROUNDED_PROMPT = f"Rewrite the following text in your own words, keeping every fact:\n\n{PASSAGE}"


@dataclass
class RequestResult:
    is_ok: bool
    error: str | None = None
    ttft_s: float | None = None
    last_token_s: float | None = None  # from send to the last content chunk
    latency_s: float = 0.0
    num_completion_tokens: int = 0
    num_prompt_tokens: int | None = None
    finish_reason: str | None = None
    spec_proposed: int = 0  # Argosy's usage.speculative, when speculation is on
    spec_accepted: int = 0


@dataclass
class Workloads:
    """Sizes of every workload; `quick()` is the < 5 minute variant."""

    repetitions: int = 3
    decode_tokens: int = 256
    prefill_prompt_tokens: int = 1000
    concurrency_levels: tuple[int, ...] = (8, 32)
    concurrency_tokens: int = 128
    requests_per_client: int = 2
    shared_prefix_tokens: int = 1000
    shared_prefix_requests: int = 32
    shared_prefix_concurrency: int = 8
    shared_prefix_max_tokens: int = 16
    long_context_tokens: int = (
        0  # > 0: the "long" workload, one stream decoding after this many prompt tokens
    )
    seed: int = 0

    @classmethod
    def quick(cls) -> Workloads:
        return cls(
            repetitions=1,
            decode_tokens=64,
            concurrency_tokens=32,
            requests_per_client=1,
            shared_prefix_requests=16,
            shared_prefix_max_tokens=8,
        )

    def names(self) -> list[str]:
        return (
            ["single", "code", "grounded", "prefill"]
            + [f"concurrency_{n}" for n in self.concurrency_levels]
            + ["shared_prefix"]
            + (["long"] if self.long_context_tokens else [])
        )


class PromptTokenCounter:
    """Exact prompt lengths: the model's own tokenizer and chat template (HF folder, offline)."""

    def __init__(self, hf_dir: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        if not self.tokenizer.chat_template:  # a base model (Gemma 3 270M): the template Argosy ships
            import json
            from pathlib import Path

            from argosy.chat.builtin_templates import builtin_template

            config = json.loads((Path(hf_dir) / "config.json").read_text())
            shipped = builtin_template((config.get("architectures") or [None])[0])
            if shipped is not None:
                self.tokenizer.chat_template = shipped[1]

    def count_text(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def count_messages(self, messages: list[dict[str, str]]) -> int:
        rendered: Any = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True
        )
        # transformers 5 returns a BatchEncoding here, 4.x a plain list of ids
        ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
        return len(ids)


def filler_text(rng: random.Random, counter: PromptTokenCounter, num_tokens: int) -> str:
    """Seeded word salad in sentences, cut to about `num_tokens` tokens."""
    words: list[str] = []
    while True:
        sentence = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
        words.extend(sentence[:-1] + [sentence[-1] + "."])
        if len(words) * 1.1 > num_tokens:
            text = " ".join(words)
            if counter.count_text(text) >= num_tokens:
                break
    while len(words) > 1 and counter.count_text(" ".join(words[:-1])) >= num_tokens:
        words.pop()
    return " ".join(words)


@dataclass
class Client:
    """One server as the workloads see it: base URL, model id and the body fields it needs."""

    base_url: str
    model: str
    overrides: Callable[[int], dict[str, Any]]  # max_tokens -> extra body fields
    timeout_s: float = 900.0
    http: httpx.AsyncClient | None = field(default=None, repr=False)

    async def __aenter__(self) -> Client:
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        self.http = httpx.AsyncClient(base_url=self.base_url, timeout=self.timeout_s, limits=limits)
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self.http is not None
        await self.http.aclose()

    async def chat(self, messages: list[dict[str, str]], max_tokens: int, seed: int) -> RequestResult:
        assert self.http is not None
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "seed": seed,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.overrides(max_tokens),
        }
        result = RequestResult(is_ok=False)
        num_chunks = 0
        sent = time.perf_counter()
        try:
            async with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    result.error = f"HTTP {response.status_code}: {text[:200]}"
                    return result
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        result.error = str(chunk["error"])[:200]
                        return result
                    usage = chunk.get("usage")
                    if usage:
                        result.num_completion_tokens = int(usage.get("completion_tokens") or 0)
                        result.num_prompt_tokens = usage.get("prompt_tokens")
                        speculative = usage.get("speculative") or {}
                        result.spec_proposed = int(speculative.get("proposed_tokens") or 0)
                        result.spec_accepted = int(speculative.get("accepted_tokens") or 0)
                    for choice in chunk.get("choices") or []:
                        if choice.get("finish_reason"):
                            result.finish_reason = choice["finish_reason"]
                        delta = choice.get("delta") or {}
                        if delta.get("content") or delta.get("reasoning_content"):
                            now = time.perf_counter() - sent
                            if result.ttft_s is None:
                                result.ttft_s = now
                            result.last_token_s = now
                            num_chunks += 1
        except (httpx.HTTPError, json.JSONDecodeError) as error:
            result.error = f"{type(error).__name__}: {error}"[:200]
            return result
        result.latency_s = time.perf_counter() - sent
        if result.num_completion_tokens == 0:
            result.num_completion_tokens = max_tokens if result.finish_reason == "length" else num_chunks
        result.is_ok = result.ttft_s is not None
        if not result.is_ok:
            result.error = f"no content (finish_reason {result.finish_reason})"
        return result


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class WorkloadError(RuntimeError):
    pass


def _require_ok(result: RequestResult, what: str) -> RequestResult:
    if not result.is_ok:
        raise WorkloadError(f"{what}: {result.error}")
    return result


class WorkloadRunner:
    """Builds the seeded prompts for one repetition and turns results into figures."""

    def __init__(self, workloads: Workloads, counter: PromptTokenCounter) -> None:
        self.workloads = workloads
        self.counter = counter
        self._prompt_cache: dict[tuple[str, int], Any] = {}

    def _rng(self, name: str, repetition: int) -> random.Random:
        return random.Random(f"{self.workloads.seed}/{name}/{repetition}")

    def short_prompt(self, rng: random.Random) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"Write a long, detailed essay about {rng.choice(TOPICS)}."}]

    async def warm_up(self, client: Client) -> None:
        rng = self._rng("warm-up", 0)
        for index in range(2):
            _require_ok(await client.chat(self.short_prompt(rng), 8, index), "warm-up")

    async def run(self, name: str, client: Client, repetition: int) -> dict[str, float]:
        if name == "single":
            return await self.single(client, repetition)
        if name == "prefill":
            return await self.prefill(client, repetition)
        if name == "grounded":
            return await self.grounded(client, repetition)
        if name == "code":
            return await self.code(client, repetition)
        if name.startswith("concurrency_"):
            return await self.concurrency(client, int(name.removeprefix("concurrency_")), repetition)
        if name == "shared_prefix":
            return await self.shared_prefix(client, repetition)
        if name == "long":
            return await self.long(client, repetition)
        raise ValueError(f"unknown workload {name!r}")

    async def single(self, client: Client, repetition: int) -> dict[str, float]:
        rng = self._rng("single", repetition)
        max_tokens = self.workloads.decode_tokens
        result = _require_ok(await client.chat(self.short_prompt(rng), max_tokens, repetition), "single")
        assert result.ttft_s is not None and result.last_token_s is not None
        span_s = result.last_token_s - result.ttft_s
        figures = {"single_ttft_ms": result.ttft_s * 1000}
        if result.num_completion_tokens > 1 and span_s > 0:
            figures["decode_tok_s"] = (result.num_completion_tokens - 1) / span_s
        return figures

    async def code(self, client: Client, repetition: int) -> dict[str, float]:
        """Single stream, writing code: what a draft model is for (a smaller coder predicts
        most of a larger one's tokens)."""
        task = self._rng("code", repetition).choice(CODE_TASKS)
        return await self._drafted_stream(client, task, "code", repetition)

    async def grounded(self, client: Client, repetition: int) -> dict[str, float]:
        """Single stream, rewriting a given passage: what n-gram speculation is for."""
        return await self._drafted_stream(client, GROUNDED_PROMPT, "grounded", repetition)

    async def _drafted_stream(
        self, client: Client, prompt: str, name: str, repetition: int
    ) -> dict[str, float]:
        """One stream's decode rate (`<name>_tok_s`) and, where the server drafts, the share of
        its draft tokens accepted (`<name>_accept_pct`)."""
        messages = [{"role": "user", "content": prompt}]
        result = _require_ok(await client.chat(messages, self.workloads.decode_tokens, repetition), name)
        assert result.ttft_s is not None and result.last_token_s is not None
        span_s = result.last_token_s - result.ttft_s
        figures: dict[str, float] = {}
        if result.num_completion_tokens > 1 and span_s > 0:
            figures[f"{name}_tok_s"] = (result.num_completion_tokens - 1) / span_s
        if result.spec_proposed:
            figures[f"{name}_accept_pct"] = 100.0 * result.spec_accepted / result.spec_proposed
        return figures

    async def long(self, client: Client, repetition: int) -> dict[str, float]:
        """One stream's decode rate after a long prompt (each step attends over the whole
        context: what a KV cache's element costs): `long_tok_s`."""
        key = ("long", repetition)
        if key not in self._prompt_cache:
            text = filler_text(
                self._rng("long", repetition), self.counter, self.workloads.long_context_tokens
            )
            self._prompt_cache[key] = [{"role": "user", "content": text + "\nContinue the text above."}]
        messages = self._prompt_cache[key]
        result = _require_ok(await client.chat(messages, self.workloads.decode_tokens, repetition), "long")
        assert result.ttft_s is not None and result.last_token_s is not None
        span_s = result.last_token_s - result.ttft_s
        if result.num_completion_tokens < 2 or span_s <= 0:
            return {}
        return {"long_tok_s": (result.num_completion_tokens - 1) / span_s}

    async def prefill(self, client: Client, repetition: int) -> dict[str, float]:
        key = ("prefill", repetition)
        if key not in self._prompt_cache:
            rng = self._rng("prefill", repetition)
            text = filler_text(rng, self.counter, self.workloads.prefill_prompt_tokens)
            messages = [{"role": "user", "content": text + "\nSummarize the text above."}]
            self._prompt_cache[key] = (messages, self.counter.count_messages(messages))
        messages, num_prompt_tokens = self._prompt_cache[key]
        result = _require_ok(await client.chat(messages, 1, repetition), "prefill")
        assert result.ttft_s is not None
        num_tokens = result.num_prompt_tokens or num_prompt_tokens
        if num_tokens < num_prompt_tokens // 2:  # a server that did not see the prompt measures nothing
            raise WorkloadError(
                f"prefill: the server counted {num_tokens} prompt tokens of ~{num_prompt_tokens}: "
                "it did not see the prompt (its chat template?)"
            )
        return {"prefill_tok_s": num_tokens / result.ttft_s, "prefill_ttft_ms": result.ttft_s * 1000}

    async def _batch(
        self, client: Client, prompts: list[list[dict[str, str]]], max_tokens: int, concurrency: int
    ) -> tuple[list[RequestResult], float]:
        semaphore = asyncio.Semaphore(concurrency)

        async def one(index: int) -> RequestResult:
            async with semaphore:
                return await client.chat(prompts[index], max_tokens, index)

        started = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        return list(results), time.perf_counter() - started

    async def concurrency(self, client: Client, concurrency: int, repetition: int) -> dict[str, float]:
        rng = self._rng(f"concurrency_{concurrency}", repetition)
        num_requests = concurrency * self.workloads.requests_per_client
        prompts = [self.short_prompt(rng) for _ in range(num_requests)]
        results, wall_s = await self._batch(client, prompts, self.workloads.concurrency_tokens, concurrency)
        ok = [r for r in results if r.is_ok]
        ttfts_ms = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
        latencies_s = [r.latency_s for r in ok]
        prefix = f"c{concurrency}"
        return {
            f"{prefix}_tok_s": sum(r.num_completion_tokens for r in ok) / wall_s,
            f"{prefix}_ttft_p50_ms": percentile(ttfts_ms, 50),
            f"{prefix}_ttft_p95_ms": percentile(ttfts_ms, 95),
            f"{prefix}_latency_p50_s": percentile(latencies_s, 50),
            f"{prefix}_latency_p95_s": percentile(latencies_s, 95),
            f"{prefix}_failures": float(len(results) - len(ok)),
        }

    async def shared_prefix(self, client: Client, repetition: int) -> dict[str, float]:
        key = ("shared_prefix", repetition)
        if key not in self._prompt_cache:
            rng = self._rng("shared_prefix", repetition)
            system = filler_text(rng, self.counter, self.workloads.shared_prefix_tokens)
            prompts = [
                [
                    {"role": "system", "content": system},
                    {
                        "role": "user",
                        "content": f"Question {i}: in one sentence, what about {rng.choice(TOPICS)}?",
                    },
                ]
                for i in range(self.workloads.shared_prefix_requests + 1)
            ]
            self._prompt_cache[key] = prompts
        prompts = self._prompt_cache[key]
        max_tokens = self.workloads.shared_prefix_max_tokens
        _require_ok(await client.chat(prompts[0], max_tokens, 0), "shared-prefix priming")
        results, _ = await self._batch(
            client, prompts[1:], max_tokens, self.workloads.shared_prefix_concurrency
        )
        ttfts_ms = [r.ttft_s * 1000 for r in results if r.is_ok and r.ttft_s is not None]
        return {
            "shared_prefix_ttft_p50_ms": percentile(ttfts_ms, 50),
            "shared_prefix_ttft_p95_ms": percentile(ttfts_ms, 95),
            "shared_prefix_failures": float(len(results) - len(ttfts_ms)),
        }
