"""The engine on CUDA vs transformers on the same random weights and dtype (bench/gpu_models.py):
single stream, a 1,000-token prefill, and 8 / 32 / 256 concurrent requests, against
transformers' `generate` (one padded batch) and its continuous batching (`generate_batch`);
plus whether a request's greedy tokens are the same solo and in a batch of 64. Writes a
Markdown table with the date, the GPU and torch's version, and Argosy / transformers ratios.

    python bench/gpu.py MODEL_DIR [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from argosy.config import EngineConfig  # noqa: E402
from argosy.engine.llm_engine import LLMEngine  # noqa: E402
from argosy.sampling_params import SamplingParams  # noqa: E402


def prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab - 10) for _ in range(n)]


def greedy(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)


def run(
    engine: LLMEngine, prompts: list[list[int]], tokens: int
) -> tuple[float, float, dict[str, list[int]]]:
    """(wall seconds, median first-token seconds, tokens per request) for prompts sent at once."""
    start = time.perf_counter()
    names = [f"b{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for name, p in zip(names, prompts, strict=True):
        engine.add_request(name, p, greedy(tokens))
    first: dict[str, float] = {}
    out: dict[str, list[int]] = {name: [] for name in names}
    while engine.has_unfinished():
        for o in engine.step():
            first.setdefault(o.request_id, time.perf_counter())
            out[o.request_id].extend(o.new_token_ids)
    torch.cuda.synchronize()
    return time.perf_counter() - start, statistics.median(t - start for t in first.values()), out


def bench_argosy(folder: Path, args: argparse.Namespace) -> dict[str, float | str]:
    engine = LLMEngine(
        EngineConfig(
            model=str(folder),
            device="cuda",
            dtype="bfloat16",
            quantization="none",
            compile="on",  # CUDA graphs, captured at start
            max_num_seqs=max(args.concurrency),
            max_num_batched_tokens=4096,
        )
    )
    rng, vocab, n = random.Random(0), engine.vocab_size, args.tokens
    run(engine, [prompt(rng, 16, vocab)], 8)  # warm-up: Triton's kernels for these shapes
    res: dict[str, float | str] = {"weights": engine.weights, "graphs": engine.compile_status}
    singles = []
    for _ in range(args.repeats):
        p = prompt(rng, 16, vocab)
        singles.append((n - 1) / (run(engine, [p], n)[0] - run(engine, [p], 1)[0]))
    res["single"] = statistics.median(singles)
    res["prefill"] = statistics.median(
        1000 / run(engine, [prompt(rng, 1000, vocab)], 1)[1] for _ in range(args.repeats)
    )
    for c in args.concurrency:
        wall, _, out = run(engine, [prompt(rng, 32, vocab) for _ in range(c)], n)
        res[f"c{c}"] = sum(len(t) for t in out.values()) / wall
    probe = prompt(random.Random(9), 100, vocab)
    solo = run(engine, [probe], 64)[2]
    batch = run(engine, [probe, *(prompt(rng, rng.randrange(8, 300), vocab) for _ in range(63))], 64)[2]
    res["solo_equals_batch_of_64"] = (
        "yes" if next(iter(solo.values())) == next(iter(batch.values())) else "NO"
    )
    return res


def bench_transformers(folder: Path, args: argparse.Namespace) -> dict[str, float | str]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    vocab, n, rng = model.config.vocab_size, args.tokens, random.Random(0)

    def generate(batch: list[list[int]], new: int) -> float:
        ids = torch.tensor(batch, device="cuda")
        torch.cuda.synchronize()
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
        torch.cuda.synchronize()
        return time.perf_counter() - start

    generate([prompt(rng, 16, vocab)], 8)
    res: dict[str, float | str] = {}
    singles = []
    for _ in range(args.repeats):
        p = prompt(rng, 16, vocab)
        singles.append((n - 1) / (generate([p], n) - generate([p], 1)))
    res["single"] = statistics.median(singles)
    res["prefill"] = statistics.median(
        1000 / generate([prompt(rng, 1000, vocab)], 1) for _ in range(args.repeats)
    )
    for c in args.concurrency:
        res[f"c{c}"] = c * n / generate([prompt(rng, 32, vocab) for _ in range(c)], n)
    res.update(continuous_batching(folder, args))
    return res


def continuous_batching(folder: Path, args: argparse.Namespace) -> dict[str, float | str]:
    """transformers' own continuous batching (generate_batch), where this version has it."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    res: dict[str, float | str] = {}
    for attention in ("sdpa_paged", "paged|sdpa", "sdpa"):
        try:
            model = AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.bfloat16, attn_implementation=attention
            ).cuda()
            config = GenerationConfig(
                max_new_tokens=args.tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
            )
            rng = random.Random(0)
            model.generate_batch(
                [prompt(rng, 16, model.config.vocab_size)], generation_config=config, progress_bar=False
            )
            for c in args.concurrency:
                inputs = [prompt(rng, 32, model.config.vocab_size) for _ in range(c)]
                torch.cuda.synchronize()
                start = time.perf_counter()
                outputs = model.generate_batch(inputs, generation_config=config, progress_bar=False)
                torch.cuda.synchronize()
                tokens = sum(len(o.generated_tokens) for o in outputs.values())
                res[f"cb{c}"] = tokens / (time.perf_counter() - start)
            res["cb_attention"] = attention
            return res
        except Exception as exc:  # noqa: BLE001 - another attention, or no generate_batch here
            res["cb_error"] = f"{attention}: {type(exc).__name__}: {str(exc)[:200]}"
    return res


def table(
    folder: Path, ours: dict[str, float | str], peer: dict[str, float | str], args: argparse.Namespace
) -> str:
    gpu = torch.cuda.get_device_name()
    lines = [
        f"## bench/gpu.py — {datetime.date.today()}, {gpu}, torch {torch.__version__}, model {folder.name}",
        "",
        f"Argosy weights: {ours['weights']}; CUDA graphs: {ours['graphs']}; {args.tokens} new tokens a request.",
        "",
        "| figure | Argosy | transformers generate | ratio | transformers continuous batching | ratio |",
        "|---|---|---|---|---|---|",
    ]
    rows = [("single", "single stream (tok/s)"), ("prefill", "prefill 1,000 tokens (tok/s)")]
    rows += [(f"c{c}", f"{c} concurrent, aggregate (tok/s)") for c in args.concurrency]
    for key, label in rows:
        a, g, cb = ours.get(key), peer.get(key), peer.get(f"cb{key[1:]}" if key.startswith("c") else "")
        line = (
            f"| {label} | {a:.1f} | {g:.1f} | {a / g:.2f}x |"
            if isinstance(a, float) and isinstance(g, float)
            else f"| {label} | {a} | {g} | |"
        )
        line += (
            f" {cb:.1f} | {a / cb:.2f}x |" if isinstance(a, float) and isinstance(cb, float) else " n/a | |"
        )
        lines.append(line)
    lines += ["", f"Greedy tokens solo == in a batch of 64: **{ours['solo_equals_batch_of_64']}**"]
    if "cb_error" in peer and "cb_attention" not in peer:
        lines.append(f"transformers continuous batching not measured: {peer['cb_error']}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", type=Path)
    parser.add_argument("--quick", action="store_true", help="one repetition, 64 new tokens")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs CUDA")
    args.repeats = 1 if args.quick else 3
    args.tokens = 64 if args.quick else 128
    args.concurrency = [8, 32, 256]
    ours = bench_argosy(args.folder, args)
    gc.collect()  # the engine (and its KV cache: most of the GPU) goes before transformers loads
    torch.cuda.empty_cache()
    peer = bench_transformers(args.folder, args)
    text = table(args.folder, ours, peer, args)
    print(text, flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
