"""Decode steps on CUDA replayed from captured CUDA graphs, one per batch-size bucket.

A decode step of a small model is launch-bound on a GPU (hundreds of kernel launches for a
few microseconds of work each); a graph replays them all in one. Each bucket (1, 2, 4, ...
rows) owns static input buffers, the step's whole forward (RoPE, every layer, the head) is
captured once, and a step of n rows copies its inputs into the smallest bucket >= n, pads the
rest (their K/V go to the scratch block, their context is one position) and replays.

The captured kernels are the eager step's (the Triton layers of ops/gpu_layers.py, each row
computed alone), so a replayed step gives the eager step's logits bit for bit, and padding
rows change nothing in the real ones.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from argosy.models.llama import DecoderForCausalLM
from argosy.ops.attention import AttentionMetadata

log = logging.getLogger("argosy.runner")


def buckets_up_to(max_rows: int) -> list[int]:
    """1, 2, 4, ... up to the first power of two >= max_rows."""
    sizes = [1]
    while sizes[-1] < max_rows:
        sizes.append(sizes[-1] * 2)
    return sizes


class _Bucket:
    def __init__(self, rows: int, max_blocks: int, device: torch.device) -> None:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        self.rows = rows
        self.ids, self.positions, self.slots, self.lens = zeros(rows), zeros(rows), zeros(rows), zeros(rows)
        self.tables = zeros(rows, max_blocks)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None


class CudaGraphDecoder:
    def __init__(
        self,
        model: DecoderForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        max_blocks: int,
        scratch_block: int,
        dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.scratch_block = scratch_block
        self.dtype = dtype
        self.device = kv_caches[0][0].device
        self.buckets: list[_Bucket] = []
        self.pool: Any = None  # the graphs' shared memory pool

    @property
    def max_rows(self) -> int:
        return self.buckets[-1].rows if self.buckets else 0

    def _forward(self, b: _Bucket) -> torch.Tensor:
        cos, sin = self.model.rope(b.positions, self.model.hidden_dtype or self.dtype)
        meta = AttentionMetadata(
            b.slots,
            cos,
            sin,
            num_decodes=b.rows,
            decode_block_ids=b.tables.view(-1),
            decode_max_context=self.max_blocks * self.block_size,
            block_size=self.block_size,
            decode_lens=b.lens,
        )
        return self.model.compute_logits(self.model(b.ids, self.kv_caches, meta))

    def _pad(self, b: _Bucket, start: int) -> None:
        """Rows from `start` on: no sequence; they write the scratch block and see one position."""
        b.ids[start:] = 0
        b.positions[start:] = 0
        b.slots[start:] = self.scratch_block * self.block_size
        b.tables[start:] = self.scratch_block
        b.lens[start:] = 1

    @torch.inference_mode()
    def capture(self, row_counts: list[int]) -> bool:
        """Capture a graph per bucket, largest first (the smaller ones share its memory pool)."""
        started = time.perf_counter()
        try:
            for rows in sorted(row_counts, reverse=True):
                b = _Bucket(rows, self.max_blocks, self.device)
                self._pad(b, 0)
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm-up: Triton compiles its kernels, the allocator settles
                        self._forward(b)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    b.logits = self._forward(b)
                self.pool = graph.pool()
                b.graph = graph
                self.buckets.append(b)
        except Exception:  # noqa: BLE001 - eager steps serve whatever happens here
            log.exception("capturing CUDA graphs failed; decode steps stay eager")
            self.buckets = []
            return False
        self.buckets.sort(key=lambda b: b.rows)
        log.info(
            "CUDA graphs captured for decode steps of %s rows in %.1fs",
            ", ".join(str(b.rows) for b in self.buckets),
            time.perf_counter() - started,
        )
        return True

    def __call__(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        tables: torch.Tensor,
        lens: torch.Tensor,
    ) -> torch.Tensor:
        """Logits [n, vocab] (float32, on the device) of n decode rows; tables [n, <= max_blocks]."""
        n = ids.shape[0]
        b = next(b for b in self.buckets if b.rows >= n)
        assert b.graph is not None and b.logits is not None
        b.ids[:n].copy_(ids, non_blocking=True)
        b.positions[:n].copy_(positions, non_blocking=True)
        b.slots[:n].copy_(slots, non_blocking=True)
        b.lens[:n].copy_(lens, non_blocking=True)
        b.tables[:n, : tables.shape[1]].copy_(tables, non_blocking=True)
        b.tables[:n, tables.shape[1] :] = self.scratch_block
        self._pad(b, n)
        b.graph.replay()
        return b.logits[:n]
