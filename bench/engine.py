"""Engine benchmark: Argosy's engine vs transformers `generate`, same weights, same dtype.

Prints one line per figure with the ratio Argosy / transformers. Seeded and repeatable:
    .venv/bin/python bench/engine.py [--model smollm2] [--dtype bfloat16] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import resource
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from argosy.config import EngineConfig  # noqa: E402
from argosy.engine.llm_engine import LLMEngine  # noqa: E402
from argosy.sampling_params import SamplingParams  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)


def run_engine(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, float]:
    """Run prompts concurrently; returns wall time, first-token time and output count."""
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", p, params)
    first: dict[str, float] = {}
    finished: dict[str, float] = {}
    total = 0
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            total += len(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = now
    end = time.perf_counter()
    return {
        "wall": end - start,
        "ttft": statistics.median(t - start for t in first.values()),
        "tokens": total,
        "decode_span": statistics.median(finished[r] - first[r] for r in finished),
    }


def bench_argosy(args: argparse.Namespace, rng: random.Random) -> dict[str, float]:
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            compile="wait" if args.compile == "on" else "off",  # measured from the first step
            enable_prefix_caching=True,
        )
    )
    vocab = engine.vocab_size
    run_engine(engine, [random_prompt(rng, 16, vocab)], greedy(8))  # warm-up
    res: dict[str, float] = {}
    # The KV pool's pages become resident on first write (calloc'd, so a fresh server's memory
    # is what it uses) and freed blocks are reused least recently used first, so a new engine's
    # first pass over its pool pays page faults (~25 ms per 1,000 prompt tokens measured) that a
    # server in steady state does not. Measure cold once, then write the pool and measure warm,
    # as transformers' repeated generate() calls reuse memory its allocator already holds.
    cold = run_engine(engine, [random_prompt(rng, 1000, vocab)], greedy(1))
    res["prefill_cold_kv"] = 1000 / cold["ttft"]
    engine.runner.k_all.zero_()
    engine.runner.v_all.zero_()
    n = args.decode_tokens
    single = [run_engine(engine, [random_prompt(rng, 16, vocab)], greedy(n)) for _ in range(args.repeats)]
    res["decode_1"] = statistics.median((n - 1) / r["decode_span"] for r in single)
    prefill = []
    for _ in range(args.repeats):
        r = run_engine(engine, [random_prompt(rng, 1000, vocab)], greedy(1))
        prefill.append(1000 / r["ttft"])
    res["prefill"] = statistics.median(prefill)
    shared = random_prompt(rng, 1000, vocab)
    miss = run_engine(engine, [shared], greedy(1))["ttft"]
    hit = statistics.median(run_engine(engine, [shared], greedy(1))["ttft"] for _ in range(args.repeats))
    res["prefix_hit_speedup"] = miss / hit
    for conc in args.concurrency:
        prompts = [random_prompt(rng, 16, vocab) for _ in range(conc)]
        r = run_engine(engine, prompts, greedy(n))
        res[f"aggregate_{conc}"] = r["tokens"] / r["wall"]
    res["peak_rss_mb"] = peak_rss_mb()
    if args.soak:

        def soak(num_requests: int) -> None:
            for _ in range(num_requests // 50):
                prompts = [random_prompt(rng, rng.randrange(8, 64), vocab) for _ in range(50)]
                run_engine(engine, prompts, greedy(4))

        # The KV cache's pages become resident only as blocks are first written (calloc'd):
        # write the whole pool first, so the soak measures everything else.
        gc.collect()
        res["soak_rss_start_mb"] = rss_mb()
        engine.runner.k_all.zero_()
        engine.runner.v_all.zero_()
        soak(100)
        gc.collect()
        before = rss_mb()
        soak(args.soak)
        gc.collect()
        res["soak_rss_before_mb"], res["soak_rss_after_mb"] = before, rss_mb()
    return res


def bench_transformers(args: argparse.Namespace, rng: random.Random, weights_dir: Path) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(weights_dir, dtype=dtype).eval()
    vocab = model.config.vocab_size

    def gen(batch: list[list[int]], new: int) -> float:
        ids = torch.tensor(batch)
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        return time.perf_counter() - start

    gen([random_prompt(rng, 16, vocab)], 8)
    res: dict[str, float] = {}
    n = args.decode_tokens
    rates = []
    for _ in range(args.repeats):
        p = random_prompt(rng, 16, vocab)
        rates.append((n - 1) / (gen([p], n) - gen([p], 1)))
    res["decode_1"] = statistics.median(rates)
    res["prefill"] = statistics.median(
        1000 / gen([random_prompt(rng, 1000, vocab)], 1) for _ in range(args.repeats)
    )
    for conc in args.concurrency:
        batch = [random_prompt(rng, 16, vocab) for _ in range(conc)]
        res[f"aggregate_{conc}"] = conc * n / gen(batch, n)
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--quantization", default="none", help="none (bf16 weights, like transformers) | auto | int4 | int8"
    )
    parser.add_argument("--compile", default="on", choices=["on", "off"], help="compiled decode step")
    parser.add_argument("--quick", action="store_true", help="fewer repeats and tokens")
    parser.add_argument("--no-peer", action="store_true", help="skip transformers")
    parser.add_argument("--soak", type=int, default=1000, help="requests in the RSS soak (0: skip)")
    args = parser.parse_args()
    args.repeats = 1 if args.quick else 3
    args.decode_tokens = 64 if args.quick else 128
    args.concurrency = [16] if args.quick else [16, 64]
    if args.quick:
        args.soak = min(args.soak, 200)
    print(f"# bench/engine.py model={args.model} dtype={args.dtype} threads={torch.get_num_threads()}")
    ours = bench_argosy(args, random.Random(0))
    peer: dict[str, float] = {}
    if not args.no_peer:
        from argosy.models.loader import resolve_model

        peer = bench_transformers(args, random.Random(0), Path(resolve_model(args.model).weights_dir))
    units = {"decode_1": "tok/s", "prefill": "tok/s", "prefix_hit_speedup": "x", "peak_rss_mb": "MB"}
    for key, value in ours.items():
        unit = units.get(key, "MB" if key.endswith("_mb") else "tok/s")
        line = f"{key:<22} argosy {value:9.1f} {unit}"
        if key in peer:
            line += f" | transformers {peer[key]:9.1f} {unit} | ratio {value / peer[key]:5.2f}x"
        print(line, flush=True)


if __name__ == "__main__":
    main()
