"""Speculative decoding benchmark: single-stream decode with and without n-gram drafts.

Input-grounded workloads (the answer copies much of the prompt): repeat a ~300-word passage,
rewrite it, and for contrast an open question that copies little. Greedy, one request at a
time, through the engine directly. Prints decode tok/s off and on, the speed-up, the
acceptance rate (accepted / proposed draft tokens), tokens per step, and whether the
greedy texts are identical.

    .venv/bin/python bench/spec.py [--model smollm2] [--threads 1] [--max-tokens 400]
        [--k 4] [--ngram 2 4] [--sweep]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from argosy.chat.template import ChatTemplate  # noqa: E402
from argosy.config import EngineConfig  # noqa: E402
from argosy.engine.llm_engine import LLMEngine  # noqa: E402
from argosy.sampling_params import SamplingParams  # noqa: E402
from bench.workloads import PASSAGE  # noqa: E402

WORKLOADS = {
    "repeat": f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    "rewrite": f"Rewrite the following text in your own words, keeping every fact:\n\n{PASSAGE}",
    "summary": f"Summarise the following text in a few sentences:\n\n{PASSAGE}",
}


@dataclass
class Run:
    tokens: list[int]
    decode_tok_s: float
    steps: int
    proposed: int
    accepted: int


def render(engine: LLMEngine, text: str) -> list[int]:
    source = engine.source
    assert source.chat_template is not None
    template = ChatTemplate(source.chat_template, bos_token=source.bos_token, eos_token=source.eos_token)
    rendered = template.render([{"role": "user", "content": text}], add_generation_prompt=True)
    ids: list[int] = source.tokenizer.encode(rendered, add_special_tokens=False).ids
    return ids


def run_one(engine: LLMEngine, prompt: list[int], max_tokens: int, request_id: str) -> Run:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False)
    engine.add_request(request_id, prompt, params)
    tokens: list[int] = []
    first = last = 0.0
    steps = 0
    proposed = accepted = 0
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if not tokens:
                first = now
                first_count = len(out.new_token_ids)
            tokens.extend(out.new_token_ids)
            last = now
            proposed, accepted = out.num_spec_proposed or 0, out.num_spec_accepted or 0
            steps += 1
    span = last - first
    rate = (len(tokens) - first_count) / span if span > 0 else 0.0
    return Run(tokens, rate, steps, proposed, accepted)


def run_batch(
    engine: LLMEngine, prompt: list[int], max_tokens: int, n: int, tag: str
) -> tuple[float, int, int]:
    """n copies at once (distinct request ids; prefix cache shared): (output tok/s over the
    whole run, proposed, accepted)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False)
    start = time.perf_counter()
    for i in range(n):
        engine.add_request(f"{tag}-{i}", prompt, params)
    total = 0
    spec: dict[str, tuple[int, int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            total += len(out.new_token_ids)
            spec[out.request_id] = (out.num_spec_proposed or 0, out.num_spec_accepted or 0)
    elapsed = time.perf_counter() - start
    return total / elapsed, sum(p for p, _ in spec.values()), sum(a for _, a in spec.values())


def build(args: argparse.Namespace, speculative: str, k: int, ngram: tuple[int, int]) -> LLMEngine:
    config = EngineConfig(
        model=args.model,
        num_threads=args.threads,
        speculative=speculative,
        num_speculative_tokens=k,
        ngram_min=ngram[0],
        ngram_max=ngram[1],
        compile="wait",  # measured from the first step
    )
    return LLMEngine(config)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=400)
    defaults = EngineConfig()
    parser.add_argument("--k", type=int, default=defaults.num_speculative_tokens)
    parser.add_argument("--ngram", type=int, nargs=2, default=(defaults.ngram_min, defaults.ngram_max))
    parser.add_argument("--sweep", action="store_true", help="also try other k / n-gram settings")
    parser.add_argument(
        "--batch", type=int, nargs="*", default=[], help="also N concurrent copies (throughput)"
    )
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    args = parser.parse_args()

    plain = build(args, "none", 1, (1, 1))
    prompts = {name: render(plain, WORKLOADS[name]) for name in args.workloads}
    run_one(plain, prompts[args.workloads[0]], 16, "warm-up")
    baseline = {name: run_one(plain, ids, args.max_tokens, f"plain-{name}") for name, ids in prompts.items()}
    first = args.workloads[0]
    batch_plain = {n: run_batch(plain, prompts[first], args.max_tokens, n, f"bp{n}") for n in args.batch}
    del plain
    gc.collect()
    print(f"model={args.model} threads={args.threads} max_tokens={args.max_tokens} (greedy, single stream)")
    for name, r in baseline.items():
        print(
            f"  {name:8s} prompt={len(prompts[name])} tokens={len(r.tokens)} plain decode={r.decode_tok_s:.1f} tok/s"
        )

    settings = [(args.k, tuple(args.ngram))]
    if args.sweep:
        settings += [(k, ng) for k, ng in [(2, (2, 4)), (6, (2, 4)), (8, (2, 4)), (4, (1, 3)), (4, (3, 5))]]
    for k, ngram in dict.fromkeys(settings):
        engine = build(args, "ngram", k, ngram)  # type: ignore[arg-type]
        run_one(engine, prompts[args.workloads[0]], 16, "warm-up")
        for name, ids in prompts.items():
            r = run_one(engine, ids, args.max_tokens, f"spec-{name}")
            base = baseline[name]
            rate = r.accepted / r.proposed if r.proposed else 0.0
            same = r.tokens == base.tokens
            diverge = (
                "" if same else f" (first difference at token {_first_difference(r.tokens, base.tokens)})"
            )
            print(
                f"  k={k} ngram={ngram[0]}..{ngram[1]} {name:8s} decode={r.decode_tok_s:.1f} tok/s "
                f"x{r.decode_tok_s / base.decode_tok_s:.2f} acceptance={rate:.0%} ({r.accepted}/{r.proposed}) "
                f"tokens/step={len(r.tokens) / max(r.steps, 1):.2f} identical={same}{diverge}"
            )
        for n in args.batch:
            rate, proposed, accepted = run_batch(engine, prompts[first], args.max_tokens, n, f"bs{n}")
            base_rate = batch_plain[n][0]
            print(
                f"  k={k} ngram={ngram[0]}..{ngram[1]} {first} x{n} concurrent: {rate:.1f} tok/s vs plain "
                f"{base_rate:.1f} (x{rate / base_rate:.2f}) acceptance={accepted / max(proposed, 1):.0%}"
            )
        del engine
        gc.collect()


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


if __name__ == "__main__":
    main()
