"""bench/bandwidth.py: the bytes a decode step reads from a GGUF's weights, and the ceiling."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bandwidth.py"


@pytest.fixture(scope="module")
def bandwidth():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bench_bandwidth", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_bandwidth"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _gguf(path: Path, names: list[str]) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name in names:
        writer.add_tensor(name, np.zeros((16, 64), dtype=np.float32))  # 4,096 bytes each
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_untied_embedding_is_only_gathered_a_tied_one_is_read_as_the_head(
    bandwidth, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    untied = _gguf(tmp_path / "untied.gguf", ["token_embd.weight", "blk.0.attn_q.weight", "output.weight"])
    assert bandwidth.gguf_bytes_per_token(untied) == 2 * 4096
    tied = _gguf(tmp_path / "tied.gguf", ["token_embd.weight", "blk.0.attn_q.weight"])
    assert bandwidth.gguf_bytes_per_token(tied) == 2 * 4096


def test_the_ceiling_is_bandwidth_over_bytes_per_token(bandwidth) -> None:  # type: ignore[no-untyped-def]
    ceiling = bandwidth.Ceiling(gbps=20.0, bytes_per_token=1_000_000_000, threads=2)
    assert ceiling.tokens_per_s == pytest.approx(20.0)
    assert ceiling.fraction(15.0) == pytest.approx(0.75)
    assert "ceiling 20.0 tok/s" in ceiling.line()
    assert bandwidth.read_bandwidth_gbps(1, passes=1) > 0
