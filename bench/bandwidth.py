"""The memory-bandwidth ceiling of single-stream decode on this machine.

A decode step reads every weight once (the token embedding only in the rows it gathers), so
a model can decode no faster than `read bandwidth / bytes read per token`. This measures the
read bandwidth with the threads a benchmark runs (torch's multithreaded amax over a buffer far
larger than the caches; best of several passes), counts the bytes the GGUF's tensors take
per token, and says what fraction of that ceiling a measured tokens/s is.

    python bench/bandwidth.py --model qwen2.5-coder-1.5b --threads 2
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BUFFER_BYTES = 1 << 30
EMBEDDING = "token_embd.weight"
OUTPUT = "output.weight"


def read_bandwidth_gbps(threads: int, passes: int = 5) -> float:
    """GB/s (10^9 bytes) read by `threads` threads scanning a 1 GiB buffer (amax: one compare per
    value, the fastest of torch's reductions here): the best pass."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(BUFFER_BYTES // 4, dtype=torch.float32)
        buffer.amax()  # fault the pages in
        best = float("inf")
        for _ in range(passes):
            started = time.perf_counter()
            buffer.amax()
            best = min(best, time.perf_counter() - started)
        return BUFFER_BYTES / best / 1e9
    finally:
        torch.set_num_threads(previous)


def gguf_bytes_per_token(gguf_path: Path) -> int:
    """The tensor bytes one decode step reads from the file's weights: all of them, except a
    token embedding that a separate output head leaves to row gathers (a tied embedding is read
    whole, as the head)."""
    from argosy.models.gguf_file import GGUFFile

    tensors = {tensor.name: tensor.data.nbytes for tensor in GGUFFile(gguf_path).tensors}
    total = sum(tensors.values())
    if OUTPUT in tensors and EMBEDDING in tensors:
        total -= tensors[EMBEDDING]
    return total


@dataclass(frozen=True)
class Ceiling:
    gbps: float
    bytes_per_token: int
    threads: int

    @property
    def tokens_per_s(self) -> float:
        return self.gbps * 1e9 / self.bytes_per_token

    def fraction(self, tokens_per_s: float) -> float:
        return tokens_per_s / self.tokens_per_s

    def line(self) -> str:
        return (
            f"read bandwidth {self.gbps:.1f} GB/s ({self.threads} threads, torch amax over 1 GiB, best of 5); "
            f"the model's weights read {self.bytes_per_token / 1e6:,.0f} MB per token (GGUF tensors, embedding "
            f"gathered unless tied): single-stream ceiling {self.tokens_per_s:.1f} tok/s"
        )


def measure(gguf_path: Path, threads: int) -> Ceiling:
    return Ceiling(read_bandwidth_gbps(threads), gguf_bytes_per_token(gguf_path), threads)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="a registry name or a .gguf file")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from argosy.models.loader import MODEL_REGISTRY

    path = Path(args.model) if args.model.endswith(".gguf") else Path(MODEL_REGISTRY[args.model]())
    print(measure(path, args.threads).line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
