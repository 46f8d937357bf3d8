"""The host KV cache costs memory only for the blocks written: its pages become resident when a
block is first used, not at load, even where the heap holds freed memory that calloc would
have reused (and zeroed, touching every page)."""

from __future__ import annotations

import struct
import sys

import numpy as np
import pytest
import torch

from tests.unit.conftest import TinyModel
from tests.unit.test_engine import greedy, prompt, run_one

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/pagemap")

PAGE = 4096


def resident_bytes(t: torch.Tensor) -> int:
    """The tensor's bytes in pages present in this process (/proc/self/pagemap's bit 63)."""
    start = t.data_ptr() // PAGE
    stop = -(-(t.data_ptr() + t.numel() * t.element_size()) // PAGE)
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(start * 8)
        entries = pagemap.read((stop - start) * 8)
    return PAGE * sum(struct.unpack_from("Q", entries, i * 8)[0] >> 63 for i in range(stop - start))


def test_the_cache_is_not_resident_at_load_and_grows_with_the_blocks_used(tiny_llama: TinyModel) -> None:
    # 64 MiB allocated and freed on the heap first, as a model's loader does: glibc serves the
    # next large calloc from that memory and zeroes it
    churn = np.ones(64 << 20, dtype=np.uint8)
    del churn
    engine = tiny_llama.engine(kv_cache_memory=32 << 20)
    runner = engine.runner
    capacity = runner.k_all.numel() * runner.k_all.element_size()
    assert capacity >= 15 << 20
    assert resident_bytes(runner.k_all) + resident_bytes(runner.v_all) <= 2 * PAGE

    run_one(engine, prompt(40, seed=3), greedy(8))
    used = resident_bytes(runner.k_all)
    assert 0 < used < capacity // 8  # one request's few blocks (each layer's), not the cache
    assert torch.count_nonzero(runner.k_all) > 0
