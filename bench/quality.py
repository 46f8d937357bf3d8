"""Quality: how far each engine's per-token log-probabilities are from an fp32 reference.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/quality.py [--tokens 8192] [--quick] [--model smollm2]
        [--systems argosy,argosy-fast,argosy-bf16,llama-server] [--top-k 20]

Model: --model, a registry name: SmolLM2-135M-Instruct's Q4_1 GGUF (the default model),
qwen2.5-coder-0.5b or qwen2.5-coder-1.5b (Q4_K_M; `argosy pull` them first). Every system scores the same
tokens, teacher-forced: at each position it gives the log-probabilities of the next token given
the text so far, and we compare them with a float32 reference.

Text: prose from Python's own documentation, `pydoc_data.topics.topics` (standard library, so no
data file), the entries in TOPICS concatenated in sorted order, tokenized with the model's
tokenizer; the first N+1 tokens give N scored positions. The text is fixed for a given Python
minor version (the header prints the version and a hash of the token ids).

Windows: the N positions are cut into windows of --window (1,024) positions; window k feeds tokens
[kW, kW+W] and scores the W next-token predictions inside it, so no prompt is longer than W+1
tokens and each position's context is the text since its window's start (the same for every
system).

Reference: transformers, float32, the GGUF's weights dequantized to float32 (Argosy's converted
folder by default; `--reference gguf` makes transformers dequantize the GGUF itself; the two are
bit-identical), one forward pass per window, the full log-softmax at every position.

Systems (same windows):
  argosy            LLMEngine in process, default mode: Q4 weights (quantization auto), numerics
                    auto = invariant (int8 activations per group of 32, 15-bit for the output head
                    and the q/k/v projection, a float32 residual stream, fp16 KV cache; native
                    kernels, path in the header). Scored through SamplingParams.prompt_logprobs: the engine
                    returns each prompt token's logprob and its top-k (the same code as the
                    completions API's echo + logprobs). compile off: requests with prompt logprobs
                    never take the compiled decode step, so it only saves start-up time.
  argosy-fast       the same with numerics fast: its prompts run the bf16 twin of the Q4 weights,
                    its output head the invariant kernels' (15-bit x, fp32 logits).
  argosy-bf16       quantization none: bf16 weights (dequantized from the same GGUF), numerics fast.
  argosy-kv8        the default mode over an int8 KV cache (--kv-cache-dtype int8: llama.cpp's
                    q8_0, codes and an fp16 scale per 32 dims).
  llama-server      the peer build (bench/peer_builds.py) on the same GGUF, started as bench/peers.py
                    does (one slot, its default f16 KV cache) with --server-threads threads (1: its
                    figures are the same at any count, and one-token requests on a busy 2-core
                    machine stall on ggml's thread barriers at 2). One /completion request per
                    position: the prefix as token ids, n_predict 1, n_probs K, cache_prompt,
                    temperature 0, post_sampling_probs false (log-softmax of the raw logits), and a
                    +100 logit bias on the true next token so that it is the token sampled: the
                    server reports the sampled token's pre-sampling logprob whatever its rank (the
                    bias acts in the sampler, after the probabilities are read; checked against the
                    top-K list wherever the token is in it). Consecutive prompts share their prefix,
                    so each request evaluates one new token.

Figures, per system:
  positions     positions scored (every system gives the true next token's logprob at each).
  |dlp|         mean |logprob_system(true next token) - logprob_reference(true next token)|, in
                nats; max|dlp| the largest.
  KL top-K      mean KL(reference || system) per position in nats, over a partition of the
                vocabulary: each of the reference's top-K tokens (K = --top-k, at most 20, the
                engine's limit) on its own, everything else in one "rest" bucket. A reference
                top-K token the system did not report (outside its top K, and not the true token)
                goes to the rest bucket for both sides (counted in `merged`). Coarser than the
                full KL, never more than it.
  KL full       the exact KL over the whole vocabulary, for the Argosy systems only: the bench
                wraps the function the engine's prompt-logprob path calls with each position's
                full log-softmax row (argosy.runner.model_runner.make_logprob) and compares that
                row with the reference's. llama-server gives no full distribution: n/a.
  argmax        the fraction of positions whose top token equals the reference's.
  +-95%         the half-width of KL top-K's 95% interval (1.96 standard errors over positions).
  time s        wall time of the scoring (informational: the machine may be shared).
  paired        with llama-server in the run: each Argosy system's KL top-K minus llama-server's,
                position by position, with its 95% interval, and whether the system is closer to
                the reference, further, or not distinguishable at 95%.
Written to bench/results/quality-<time>.json with the settings, each system's mean NLL, and every
position's true-token logprob per system.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

import torch  # noqa: E402
from quality_scores import Scores, score_llama_server  # noqa: E402

MODEL = "smollm2"  # the default --model
TOPICS = ("execmodel", "objects", "truth", "types")  # prose entries of pydoc_data.topics, sorted
ARGOSY_SYSTEMS: dict[str, tuple[str, str, str]] = {  # name: (quantization, numerics, KV cache)
    "argosy": ("auto", "auto", "auto"),
    "argosy-fast": ("auto", "fast", "auto"),
    "argosy-bf16": ("none", "fast", "auto"),
    "argosy-kv8": ("auto", "auto", "int8"),
}
SYSTEMS = (*ARGOSY_SYSTEMS, "llama-server")
MAX_TOP_K = 20  # argosy.sampling_params.MAX_LOGPROBS


@dataclass
class Reference:
    logprobs: torch.Tensor  # [N, vocab] float32, full log-softmax at each position
    targets: torch.Tensor  # [N] the true next token at each position
    seconds: float


def text_tokens(model: str, count: int) -> list[int]:
    """The first `count` tokens of the fixed text."""
    from pydoc_data.topics import topics

    from argosy.models.loader import resolve_model

    text = "\n\n".join(topics[name] for name in sorted(TOPICS))
    ids: list[int] = resolve_model(model).tokenizer.encode(text, add_special_tokens=False).ids
    if len(ids) < count:
        raise SystemExit(f"the text has {len(ids)} tokens; at most {len(ids) - 1} positions can be scored")
    return ids[:count]


def make_windows(num_positions: int, window: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of positions; position i predicts token i + 1."""
    return [(start, min(start + window, num_positions)) for start in range(0, num_positions, window)]


def cpu_line() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    model = fields.get("Model name", "unknown").strip()
    flags = set(fields.get("Flags", "").split())
    wanted = ("avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
    shown = " ".join(f"{flag}{'+' if flag in flags else '-'}" for flag in wanted)
    return f"{model}, {os.cpu_count()} CPUs, {shown}"


def invariant_path() -> str:
    from argosy.ops.native import load_invariant_ops

    return str(torch.ops.argosy_iq.path()) if load_invariant_ops() else "unavailable"


# --- reference --------------------------------------------------------------------------------


def compute_reference(
    model_name: str, tokens: list[int], windows: list[tuple[int, int]], source: str
) -> Reference:
    from transformers import AutoModelForCausalLM

    from argosy.models.loader import MODEL_REGISTRY, float_folder, resolve_model

    started = time.perf_counter()
    if source == "gguf":
        gguf = Path(MODEL_REGISTRY[model_name]())
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            float_folder(resolve_model(model_name)), dtype=torch.float32
        )
    model.eval()
    rows = []
    with torch.inference_mode():
        for start, stop in windows:
            ids = torch.tensor([tokens[start:stop]])
            logits = model(ids).logits[0].float()
            rows.append(torch.log_softmax(logits, dim=-1))
    del model
    gc.collect()
    targets = torch.tensor(tokens[1 : windows[-1][1] + 1])
    return Reference(torch.cat(rows), targets, time.perf_counter() - started)


# --- Argosy, in process -----------------------------------------------------------------------


class FullRowProbe:
    """Wraps the engine's make_logprob (what its prompt-logprob path calls with each position's
    full log-softmax row) to compute the exact KL against the reference's row. Positions arrive in
    order within a request and requests run one at a time: `position` is set per window."""

    def __init__(self, reference: Reference) -> None:
        self.reference = reference
        self.position = 0
        self.exact_kl = [math.nan] * len(reference.targets)

    def wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def make_logprob(logprobs: torch.Tensor, token_id: int, num_top: int) -> Any:
            i = self.position
            if token_id != int(self.reference.targets[i]):
                raise RuntimeError(f"prompt logprob for token {token_id} arrived at position {i}")
            ref = self.reference.logprobs[i].double()
            self.exact_kl[i] = float((ref.exp() * (ref - logprobs.double())).sum())
            self.position += 1
            return original(logprobs, token_id, num_top)

        return make_logprob


def score_argosy(
    model: str, name: str, tokens: list[int], windows: list[tuple[int, int]], reference: Reference, top_k: int
) -> Scores:
    import argosy.runner.model_runner as model_runner
    from argosy.config import EngineConfig
    from argosy.engine.llm_engine import LLMEngine
    from argosy.sampling_params import SamplingParams

    quantization, numerics, kv_cache_dtype = ARGOSY_SYSTEMS[name]
    config = EngineConfig(
        model=model,
        dtype="bfloat16",
        quantization=quantization,
        numerics=numerics,
        kv_cache_dtype=kv_cache_dtype,
        compile="off",
    )
    engine = LLMEngine(config)
    params = SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False, prompt_logprobs=top_k
    )
    probe = FullRowProbe(reference)
    scores = Scores(name, [], [])
    described = engine.describe()
    scores.notes.append(
        f"dtype {described.dtype}, weights {described.weights}, kernels {described.kernels}, "
        f"deterministic {described.deterministic}"
    )
    original = model_runner.make_logprob
    model_runner.make_logprob = probe.wrap(original)
    started = time.perf_counter()
    try:
        for start, stop in windows:
            probe.position = start
            engine.add_request(f"quality-{start}", tokens[start : stop + 1], params)
            prompt_logprobs = None
            while engine.has_unfinished():
                for out in engine.step():
                    if out.error:
                        raise RuntimeError(f"{name}: {out.error}")
                    if out.prompt_logprobs is not None:
                        prompt_logprobs = out.prompt_logprobs
            entries = (prompt_logprobs or [])[1:]  # the first prompt token has no prefix
            if len(entries) != stop - start or probe.position != stop:
                raise RuntimeError(f"{name}: {len(entries)} prompt logprobs for window {start}..{stop}")
            for entry in entries:
                assert entry is not None
                scores.true_logprob.append(entry.logprob)
                scores.top.append(entry.top)
    finally:
        model_runner.make_logprob = original
    scores.seconds = time.perf_counter() - started
    scores.exact_kl = probe.exact_kl
    del engine
    gc.collect()
    return scores


# --- figures ----------------------------------------------------------------------------------


def partition_kl(
    ref_ids: list[int], ref_logprobs: list[float], system: dict[int, float]
) -> tuple[float, int]:
    """KL(reference || system) over {each reference top-K token the system reported} + {the rest};
    returns it and how many of the top-K went to the rest bucket."""
    kept = [(lp, system[t]) for t, lp in zip(ref_ids, ref_logprobs, strict=True) if t in system]
    kl = sum(math.exp(p) * (p - q) for p, q in kept)
    p_rest = 1.0 - sum(math.exp(p) for p, _ in kept)
    q_rest = 1.0 - sum(math.exp(q) for _, q in kept)
    if p_rest > 1e-12:
        kl += p_rest * (math.log(p_rest) - math.log(max(q_rest, 1e-12)))
    return kl, len(ref_ids) - len(kept)


# each system's per-position KL top-K (figures fills it), for the paired comparison
per_position_kl: dict[str, list[float]] = {}


def paired_differences(peer: str = "llama-server") -> list[str]:
    """Each Argosy system's KL top-K minus the peer's, position by position: the mean and a 95%
    interval (1.96 standard errors of the paired differences; the text's hard positions are hard
    for both, so this is far tighter than comparing the two means' own intervals)."""
    lines = []
    for name, kls in per_position_kl.items():
        if name == peer or peer not in per_position_kl:
            continue
        diffs = [a - b for a, b in zip(kls, per_position_kl[peer], strict=True)]
        half = 1.96 * statistics.stdev(diffs) / math.sqrt(len(diffs))
        mean = sum(diffs) / len(diffs)
        verdict = "closer" if mean + half < 0 else "further" if mean - half > 0 else "no difference at 95%"
        lines.append(f"paired KL top-K, {name} - {peer}: {mean:+.3e} +- {half:.3e} (95%): {name} {verdict}")
    return lines


def figures(scores: Scores, reference: Reference, top_k: int) -> dict[str, Any]:
    n = len(scores.top)
    ref_true = reference.logprobs[torch.arange(n), reference.targets[:n]].tolist()
    ref_top_lp, ref_top_ids = reference.logprobs[:n].topk(top_k, dim=-1)
    deltas, kls, merged, agree = [], [], 0, 0
    for i in range(n):
        deltas.append(abs(scores.true_logprob[i] - ref_true[i]))
        reported = {**dict(scores.top[i][:top_k]), int(reference.targets[i]): scores.true_logprob[i]}
        kl, num_merged = partition_kl(ref_top_ids[i].tolist(), ref_top_lp[i].tolist(), reported)
        kls.append(kl)
        merged += num_merged
        agree += scores.top[i][0][0] == int(ref_top_ids[i, 0])
    exact = scores.exact_kl
    per_position_kl[scores.name] = kls
    return {
        "positions": n,
        "mean_abs_dlogprob": sum(deltas) / n,
        "max_abs_dlogprob": max(deltas),
        "mean_kl_topk": sum(kls) / n,
        "kl_topk_ci95": 1.96 * statistics.stdev(kls) / math.sqrt(n) if n > 1 else None,
        "merged_topk_entries": merged,
        "mean_kl_full": sum(exact) / n if exact is not None else None,
        "argmax_agreement": agree / n,
        "mean_nll": -sum(scores.true_logprob) / n,
        "seconds": round(scores.seconds, 1),
    }


COLUMNS = (  # heading, width, figure, format
    ("positions", 10, "positions", "d"),
    ("|dlp|", 9, "mean_abs_dlogprob", ".4f"),
    ("max|dlp|", 9, "max_abs_dlogprob", ".3f"),
    ("KL top-K", 11, "mean_kl_topk", ".3e"),
    ("+-95%", 10, "kl_topk_ci95", ".1e"),
    ("merged", 8, "merged_topk_entries", "d"),
    ("KL full", 11, "mean_kl_full", ".3e"),
    ("argmax", 8, "argmax_agreement", ".4f"),
    ("time s", 8, "seconds", ".1f"),
)


def render(results: dict[str, dict[str, Any]]) -> str:
    head = f"{'system':<18}" + "".join(f"{title:>{width}}" for title, width, _, _ in COLUMNS)
    lines = [head, "-" * len(head)]
    for name, row in results.items():
        cells = [
            f"{'n/a' if row[key] is None else format(row[key], fmt):>{width}}"
            for _, width, key, fmt in COLUMNS
        ]
        lines.append(f"{name:<18}" + "".join(cells))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=8192,
        help="positions scored (N+1 text tokens read; 8,192: the paired interval with llama-server is then ~5e-5)",
    )
    parser.add_argument("--quick", action="store_true", help="512 positions")
    parser.add_argument(
        "--model", default=MODEL, help="a registry name: smollm2, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, ..."
    )
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    parser.add_argument(
        "--top-k", type=int, default=MAX_TOP_K, help="K: the top tokens each system is asked for"
    )
    parser.add_argument("--server-threads", type=int, default=1, help="llama-server's -t and -tb")
    parser.add_argument("--window", type=int, default=1024, help="positions per window")
    parser.add_argument(
        "--reference", default="dir", choices=["dir", "gguf"], help="reference weights source"
    )
    parser.add_argument("--out", type=Path, help="JSON file (default bench/results/quality-<time>.json)")
    args = parser.parse_args()
    num_positions = 512 if args.quick else args.tokens
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        parser.error(f"unknown systems: {', '.join(sorted(unknown))}")
    if not 1 <= args.top_k <= MAX_TOP_K:
        parser.error(f"--top-k must be between 1 and {MAX_TOP_K} (the engine's prompt-logprob limit)")

    tokens = text_tokens(args.model, num_positions + 1)
    windows = make_windows(num_positions, args.window)
    digest = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:12]
    cpu, path = cpu_line(), invariant_path()
    print(
        f"# bench/quality.py model={args.model} CPU: {cpu}; invariant kernel path: {path}; torch threads {torch.get_num_threads()}"
    )
    print(
        f"# text: pydoc_data.topics {'+'.join(sorted(TOPICS))} (Python {platform.python_version()}), "
        f"{num_positions} positions scored (tokens sha256 {digest}), {len(windows)} window(s) of ≤{args.window} "
        f"positions (prompt ≤{args.window + 1} tokens); K={args.top_k}: KL over the reference's top-{args.top_k} + rest",
        flush=True,
    )

    reference = compute_reference(args.model, tokens, windows, args.reference)
    ref_nll = -float(reference.logprobs[torch.arange(num_positions), reference.targets].mean())
    print(
        f"# reference: transformers float32 ({args.reference}), mean NLL {ref_nll:.4f} "
        f"(perplexity {math.exp(ref_nll):.2f}), {reference.seconds:.1f} s",
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    per_position: dict[str, list[float]] = {
        "reference": reference.logprobs[torch.arange(num_positions), reference.targets].tolist()
    }
    notes: dict[str, list[str]] = {}
    for name in systems:
        print(f"[{name}] scoring {num_positions} positions", flush=True)
        if name in ARGOSY_SYSTEMS:
            scores = score_argosy(args.model, name, tokens, windows, reference, args.top_k)
        else:
            scores = score_llama_server(args.model, tokens, windows, args.top_k, args.server_threads)
        results[name] = figures(scores, reference, args.top_k)
        per_position[name] = scores.true_logprob
        notes[name] = scores.notes
        for note in scores.notes:
            print(f"[{name}] {note}")
        print(f"[{name}] done in {scores.seconds:.1f} s", flush=True)

    print(render(results))
    for line in paired_differences():
        print(line)
    out = args.out or BENCH_DIR / "results" / f"quality-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "model": args.model,
        "cpu": cpu,
        "invariant_path": path,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "text": {"topics": sorted(TOPICS), "positions": num_positions, "tokens_sha256": digest},
        "windows": windows,
        "top_k": args.top_k,
        "server_threads": args.server_threads,
        "reference": {"source": args.reference, "mean_nll": ref_nll, "seconds": round(reference.seconds, 1)},
        "systems": results,
        "paired": paired_differences(),
        "notes": notes,
        "true_token_logprobs": per_position,
    }
    out.write_text(json.dumps(report, indent=1))
    print(f"# written to {out}")


if __name__ == "__main__":
    main()
