"""A converted GGUF's float32 copies of its coded weights (loader.ensure_float_copies): not
written by the conversion, written once when asked for, one writer at a time."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file as load_numpy

from argosy.models import loader
from argosy.models.gguf_convert import coded_weight_names, float_copies_missing
from argosy.models.loader import ensure_float_copies, resolve_model
from tests.unit.test_loader import EXPECTED_SMOLLM2_NAMES, Q, float_weights, write_tiny_gguf


def test_the_coded_weights_float_copies_are_written_on_demand(tmp_path: Path) -> None:
    source = resolve_model("smollm2", cache_dir=tmp_path)
    folder = source.weights_dir
    # The conversion holds the file's own 4-bit blocks, the Q8_0 table's codes, and in float32
    # only the weights without codes (the norms): 0.11 GB, not 0.65.
    assert sorted(p.name for p in folder.iterdir()) == [
        "argosy-blocks.safetensors",
        "argosy-int4.safetensors",
        "config.json",
        "generation_config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    floats = load_numpy(str(folder / "model-00001-of-00001.safetensors"))
    assert sorted(floats) == sorted(n for n in EXPECTED_SMOLLM2_NAMES if n.endswith("norm.weight"))
    coded = coded_weight_names(folder)
    assert len(coded) == 30 * 7 + 1 and float_copies_missing(folder) == coded

    ensure_float_copies(source)
    assert float_copies_missing(folder) == set()
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(EXPECTED_SMOLLM2_NAMES)
    assert set(index["weight_map"].values()) == {
        "model-00001-of-00001.safetensors",
        "model-of-codes-00001-of-00001.safetensors",
    }
    sizes = sum(v.nbytes for v in float_weights(folder).values())
    assert index["metadata"]["total_size"] == sizes
    written = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    ensure_float_copies(source)  # once only
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == written
    shutil.rmtree(folder)  # 0.65 GB: not kept with the test's other temporary files


def test_two_loads_asking_for_the_float_copies_at_once_write_them_once(tmp_path: Path) -> None:
    """ensure_float_copies locks the folder: the second caller waits, then finds them written."""
    gguf_path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(gguf_path, "qwen2", Q.Q8_0)
    source = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    folder = source.weights_dir
    assert float_copies_missing(folder) == coded_weight_names(folder) != set()
    calls: list[int] = []
    real = loader.write_float_copies

    def counted(gguf_file: Path, into: Path) -> int:
        calls.append(real(gguf_file, into))
        return calls[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loader, "write_float_copies", counted)
        threads = [threading.Thread(target=ensure_float_copies, args=(source,)) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    # the first wrote every coded weight; the second, let in after it, found none missing (or
    # saw them written before it asked for the lock)
    assert calls in ([len(coded_weight_names(folder))], [len(coded_weight_names(folder)), 0])
    ours = float_weights(folder)
    assert sorted(ours) == sorted(expected)
    for name, values in ours.items():
        np.testing.assert_array_equal(values, expected[name], err_msg=name)
    assert not list(folder.glob("*.partial"))
