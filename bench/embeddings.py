"""Embeddings benchmark: Argosy's EmbeddingEngine vs sentence-transformers `encode`, same model,
same CPU, same run.

Prints one line per figure: embeddings per second at batch 1, 32 and 256 of short texts
(5-20 words) and for one batch of long texts (--long-tokens each, 512 by default), with the
ratio Argosy / sentence-transformers. Both sides include tokenization and run float32 on
the same torch thread count, taking turns call by call (this CPU is shared). With --http URL,
Argosy is also measured over HTTP through an OpenAI-compatible POST {URL}/v1/embeddings (the
server's own thread settings; skipped for texts past the model's limit, which a server keeps).
Seeded and repeatable:
    .venv/bin/python bench/embeddings.py [--model minilm] [--threads 2] [--http http://127.0.0.1:8000]

A long-text batch needs every text to fit: for it both sides are allowed --long-tokens
(all-MiniLM-L6-v2's own limit is 256, its position table holds 512), and each text is
tokenized to exactly that length (sentence-transformers truncates, Argosy truncates the
same way, keeping [SEP]).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from argosy.engine.embedding_engine import EmbeddingEngine  # noqa: E402
from argosy.models.embedding_source import load_embedding_source  # noqa: E402

_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his it an were are which this be "
    "has or had first one their its new after but who not they have her she two been other when "
    "there all during into school time may years more most only over city some world would where "
    "later up such used many can state about national out known university united then made team "
    "river music engine vector query model server token cache layer batch memory speed latency "
    "garden window yellow quickly carefully ocean mountain library history science ancient modern "
    "électricité naïve café 東京 数据 emoji 🙂 42 3.14 2026 e-mail"
)
WORDS = _WORD_TEXT.split()


def short_texts(rng: random.Random, count: int) -> list[str]:
    return [" ".join(rng.choices(WORDS, k=rng.randint(5, 20))) for _ in range(count)]


def long_texts(rng: random.Random, count: int, num_tokens: int, engine: EmbeddingEngine) -> list[str]:
    """Texts of at least `num_tokens` tokens (both sides then cut them to exactly that)."""
    texts = []
    for _ in range(count):
        words = rng.choices(WORDS, k=num_tokens)
        while len(engine.tokenize([" ".join(words)])[0]) < num_tokens:
            words += rng.choices(WORDS, k=32)
        texts.append(" ".join(words))
    return texts


def per_second(
    sides: dict[str, Callable[[list[str]], object]], batches: list[list[str]], min_s: float
) -> dict[str, float]:
    """Embeddings per second of each side: the median over calls. The sides take turns on the
    same batch (one warm-up call each first), so a neighbour's load on this shared CPU falls
    on both alike; batches are cycled until every side has run each once and `min_s` passed."""
    for run in sides.values():
        run(batches[0])
    rates: dict[str, list[float]] = {name: [] for name in sides}
    start = time.perf_counter()
    i = 0
    while i < len(batches) or (time.perf_counter() - start < min_s and i < 20 * len(batches)):
        batch = batches[i % len(batches)]
        for name, run in sides.items():
            t0 = time.perf_counter()
            run(batch)
            rates[name].append(len(batch) / (time.perf_counter() - t0))
        i += 1
    return {name: statistics.median(values) for name, values in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="minilm", help="embedding model name or sentence-transformers folder"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads, both sides")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-seconds", type=float, default=3.0, help="time spent per figure and side")
    parser.add_argument("--long-tokens", type=int, default=512)
    parser.add_argument("--long-batch", type=int, default=16)
    parser.add_argument("--http", metavar="URL", help="also measure POST URL/v1/embeddings")
    parser.add_argument("--http-model", default="minilm", help="the model name sent over HTTP")
    parser.add_argument(
        "--encoding",
        choices=("base64", "float"),
        default="base64",
        help="encoding_format over HTTP (base64: what the openai client asks by default)",
    )
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    source = load_embedding_source(args.model)
    long_limit = min(args.long_tokens, int(source.hf_config.get("max_position_embeddings", 512)))
    engine = EmbeddingEngine(
        dataclasses.replace(source, max_seq_length=max(source.max_seq_length, long_limit))
    )
    st = SentenceTransformer(str(source.path), device="cpu")
    print(
        f"model {source.name} ({source.path}); torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, float32"
    )

    def argosy(texts: list[str]) -> object:
        return engine.embed([engine.truncate(ids) for ids in engine.tokenize(texts)])

    def sentence_transformers(texts: list[str]) -> object:
        return st.encode(texts, batch_size=len(texts), show_progress_bar=False)

    http = _http_runner(args.http, args.http_model, args.encoding) if args.http else None

    rng = random.Random(args.seed)
    figures: list[tuple[str, list[list[str]], int]] = [
        ("batch 1 short", [short_texts(rng, 1) for _ in range(32)], source.max_seq_length),
        ("batch 32 short", [short_texts(rng, 32) for _ in range(4)], source.max_seq_length),
        ("batch 256 short", [short_texts(rng, 256) for _ in range(2)], source.max_seq_length),
        (
            f"batch {args.long_batch} x {long_limit} tokens",
            [long_texts(rng, args.long_batch, long_limit, engine)],
            long_limit,
        ),
    ]
    for name, batches, limit in figures:
        st.max_seq_length = limit
        rates = per_second({"argosy": argosy, "st": sentence_transformers}, batches, args.min_seconds)
        ours, theirs = rates["argosy"], rates["st"]
        print(
            f"{name:>26}: argosy {ours:9.1f} emb/s | sentence-transformers {theirs:9.1f} emb/s "
            f"| ratio {ours / theirs:5.2f}x"
        )
        if http is None:
            continue
        # measured on its own, not in turns: after each request the server's idle OpenMP
        # threads spin for a while and would slow the in-process side's next call
        try:
            over_http = per_second({"http": http}, batches, args.min_seconds)["http"]
        except RuntimeError as exc:  # e.g. a server that keeps the model's own 256-token limit
            print(f"{name:>26}: argosy http skipped ({exc})")
            continue
        print(
            f"{name:>26}: argosy http {over_http:9.1f} emb/s ({args.encoding}) | vs in-process "
            f"{over_http / ours:5.2f}x | vs sentence-transformers {over_http / theirs:5.2f}x"
        )


def _http_runner(url: str, model: str, encoding: str) -> Callable[[list[str]], object]:
    """One POST per batch; the vectors decoded as a client would (base64: numpy from bytes)."""
    import base64

    import httpx
    import numpy as np

    client = httpx.Client(base_url=url.rstrip("/"), timeout=600.0)

    def run(texts: list[str]) -> object:
        # cut as the in-process side cuts (the long figure's texts are made to fill the limit)
        body = {"model": model, "input": texts, "encoding_format": encoding, "truncate_prompt_tokens": 512}
        response = client.post("/v1/embeddings", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        data = response.json()["data"]
        if len(data) != len(texts):
            raise RuntimeError(f"asked for {len(texts)} embeddings, got {len(data)}")
        if encoding == "base64":
            return [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in data]
        return data

    return run


if __name__ == "__main__":
    main()
