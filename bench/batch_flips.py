"""How often does batching flip a greedy near-tie? 100 prompts, solo vs in batches of 16.

    .venv/bin/python bench/batch_flips.py [--dtype bfloat16] [--prompts 100] [--tokens 32]
        [--quantization auto|none|int4|int8] [--numerics auto|fast|invariant]

Prints the number of prompts whose greedy tokens differ between a solo run and a batched
run, and the mean position of the first difference. The defaults are the server's (int4 from
the GGUF, numerics auto = invariant): there it must be 0; `--numerics fast` or
`--quantization none` measure the fast kernels.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from argosy.config import EngineConfig  # noqa: E402
from argosy.engine.llm_engine import LLMEngine  # noqa: E402
from argosy.sampling_params import SamplingParams  # noqa: E402

TOPICS = ["the ocean", "a city at night", "bread", "mountains", "a robot", "the moon", "music", "rain"]


def run(engine: LLMEngine, prompts: list[list[int]], tokens: int, tag: str) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).extend(out.new_token_ids)
    return [outs[f"{tag}-{i}"] for i in range(len(prompts))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--quantization",
        default="auto",
        help="auto (the GGUF's Q4 blocks) | none (bf16 weights) | int4 | int8",
    )
    parser.add_argument("--compile", default="on", choices=["on", "off"], help="compiled decode step")
    parser.add_argument(
        "--numerics", default="auto", choices=["auto", "fast", "invariant"], help="the engine's numerics mode"
    )
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            compile="wait" if args.compile == "on" else "off",  # measured from the first step
            numerics=args.numerics,
            enable_prefix_caching=False,
        )
    )
    rng = random.Random(0)
    texts = [
        f"Write {rng.choice(['a short', 'a long', 'a sad', 'a funny'])} story about {rng.choice(TOPICS)}"
        + " and " * rng.randrange(0, 4 * (i % 5) + 1)
        + rng.choice(TOPICS)
        for i in range(args.prompts)
    ]
    prompts = [engine.encode(t) for t in texts]
    solo = [run(engine, [p], args.tokens, f"solo{i}")[0] for i, p in enumerate(prompts)]
    batched: list[list[int]] = []
    for start in range(0, len(prompts), args.batch):
        batched += run(engine, prompts[start : start + args.batch], args.tokens, f"batch{start}")
    flips = [
        next(j for j, (a, b) in enumerate(zip(s, b_, strict=True)) if a != b)
        for s, b_ in zip(solo, batched, strict=True)
        if s != b_
    ]
    mean_pos = sum(flips) / len(flips) if flips else float("nan")
    print(
        f"numerics={args.numerics} quantization={args.quantization} dtype={args.dtype} prompts={len(prompts)} tokens={args.tokens} batch={args.batch}: "
        f"{len(flips)} differ (first difference at token {mean_pos:.1f} on average)"
    )


if __name__ == "__main__":
    main()
