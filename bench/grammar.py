"""Grammar-constrained decoding: its cost per token, and the cost of compiling a grammar.

Same model, same prompts, same seeds, same number of tokens: decode tok/s unconstrained vs
constrained by a JSON schema (one that cannot complete within the budget, so both runs
decode every token), at batch 1 and batch 8 (from the median decode step); the time the
guides themselves take per token (mask fill + accept, measured around them); and the first
compile of a schema / a forced tool call vs a cache hit. One line per figure:
    .venv/bin/python bench/grammar.py [--model smollm2] [--tokens 48] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from argosy.config import EngineConfig  # noqa: E402
from argosy.engine.llm_engine import LLMEngine  # noqa: E402
from argosy.runner.sampler import Sampler  # noqa: E402
from argosy.runner.structured import (  # noqa: E402
    CompiledGrammar,
    GrammarBackend,
    GrammarSpec,
    TokenGuide,
    ToolCallGrammar,
    ToolSchema,
    make_grammar_backend,
)
from argosy.sampling_params import SamplingParams  # noqa: E402

# Long on purpose: at least 64 strings, so no run completes before the token budget.
WORDS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"words": {"type": "array", "items": {"type": "string"}, "minItems": 64}},
    "required": ["words"],
}
PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age"],
}
WEATHER = ToolSchema(
    "get_weather",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
)
QUESTIONS = [
    "List many English words as JSON.",
    "Give me a JSON list of fruit names.",
    "Write the names of animals you know, as JSON.",
    "Which colours exist? Answer in JSON.",
    "Name cities in Europe, as a JSON object.",
    "List verbs as JSON, please.",
    "What musical instruments do you know? JSON.",
    "Write a JSON array of words about the sea.",
]


class GrammarClock:
    """Adds up the seconds decoding spends on grammars: in the guides (mask fill, accept) and
    in the sampler applying their masks. Counted only while guided requests run."""

    guide_s = 0.0
    mask_s = 0.0
    num_steps = 0
    _guide_s_in_step = 0.0  # guide time inside the current sampler call (not mask time)

    @classmethod
    def reset(cls) -> None:
        cls.guide_s, cls.mask_s, cls.num_steps = 0.0, 0.0, 0

    @classmethod
    def install(cls) -> None:
        apply = Sampler._apply_bias_and_guides

        def timed(sampler: Sampler, logits: torch.Tensor, rows: list[Any]) -> None:
            started = time.perf_counter()
            apply(sampler, logits, rows)
            if any(row.guide is not None for row in rows):
                cls.mask_s += time.perf_counter() - started - cls._guide_s_in_step
                cls.num_steps += 1
            cls._guide_s_in_step = 0.0

        Sampler._apply_bias_and_guides = timed  # type: ignore[method-assign,assignment]


class TimedGuide:
    """Wraps a guide and adds up the seconds spent in it."""

    def __init__(self, inner: TokenGuide) -> None:
        self.inner = inner

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        started = time.perf_counter()
        self.inner.fill_bitmask(bitmask, row)
        elapsed = time.perf_counter() - started
        GrammarClock.guide_s += elapsed
        GrammarClock._guide_s_in_step += elapsed  # inside the sampler's mask step

    def accept_token(self, token_id: int) -> bool:
        started = time.perf_counter()
        accepted = self.inner.accept_token(token_id)
        GrammarClock.guide_s += time.perf_counter() - started
        return accepted

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()


def decode_rate(
    engine: LLMEngine,
    prompts: list[list[int]],
    tokens: int,
    backend: GrammarBackend | None,
    compiled: CompiledGrammar | None,
) -> float:
    """Decode tok/s of the batch: tokens per decode step over its median step time (the median
    shrugs off the stalls a shared machine adds to a few steps)."""
    for i, prompt in enumerate(prompts):
        params = SamplingParams(
            max_tokens=tokens, temperature=0.8, top_k=40, seed=i, ignore_eos=True, detokenize=False
        )
        guide = TimedGuide(backend.guide(compiled)) if backend is not None and compiled is not None else None
        engine.add_request(f"g{time.monotonic_ns()}-{i}", prompt, params, guide=guide)
    rates: list[float] = []
    while engine.has_unfinished():
        started = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - started
        if len(outputs) == len(prompts) and all(out.num_output_tokens > 1 for out in outputs):
            rates.append(len(outputs) / elapsed)  # a decode step of the whole batch
    return statistics.median(rates)


def compile_times(backend: GrammarBackend, spec: GrammarSpec) -> tuple[float, float]:
    started = time.perf_counter()
    backend.compile(spec)
    first = time.perf_counter() - started
    started = time.perf_counter()
    backend.compile(spec)
    return first, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    engine = LLMEngine(EngineConfig(model=args.model, compile="wait"))  # measured from the first step
    source = engine.source
    started = time.perf_counter()
    backend = make_grammar_backend("xgrammar", source.tokenizer, engine.vocab_size, source.eos_token_ids)
    print(
        f"grammar backend build (xgrammar, vocab {engine.vocab_size}): {time.perf_counter() - started:.2f} s"
    )

    for label, spec in [
        ("json_schema (person, 5 fields)", GrammarSpec("json_schema", PERSON_SCHEMA)),
        ("tool_call (1 tool, forced)", GrammarSpec("tool_call", ToolCallGrammar([WEATHER]))),
    ]:
        first, cached = compile_times(backend, spec)
        print(f"compile {label}: first {first * 1e3:.1f} ms, cached {cached * 1e6:.0f} us")

    compiled = backend.compile(GrammarSpec("json_schema", WORDS_SCHEMA))
    prompts = [
        engine.encode(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
        for question in QUESTIONS
    ]
    decode_rate(engine, prompts[:1], 8, None, None)  # warm-up
    decode_rate(engine, prompts[:1], 8, backend, compiled)
    GrammarClock.install()
    for batch in (1, 8):
        free: list[float] = []
        guided: list[float] = []
        GrammarClock.reset()
        for _ in range(args.repeats):  # interleaved, so a noisy neighbour hits both alike
            free.append(decode_rate(engine, prompts[:batch], args.tokens, None, None))
            guided.append(decode_rate(engine, prompts[:batch], args.tokens, backend, compiled))
        free_rate, guided_rate = statistics.median(free), statistics.median(guided)
        print(
            f"decode batch={batch}: unconstrained {free_rate:.1f} tok/s, json_schema {guided_rate:.1f} tok/s "
            f"({(guided_rate - free_rate) / free_rate * 100:+.1f}%)"
        )
        steps = max(GrammarClock.num_steps, 1)
        guide_ms, mask_ms = GrammarClock.guide_s / steps * 1e3, GrammarClock.mask_s / steps * 1e3
        step_ms = batch / free_rate * 1e3
        print(
            f"grammar work batch={batch}: {guide_ms:.2f} ms/step in guides + {mask_ms:.2f} ms/step applying "
            f"masks = {(guide_ms + mask_ms) / step_ms * 100:.1f}% of an unconstrained decode step ({step_ms:.0f} ms)"
        )


if __name__ == "__main__":
    main()
