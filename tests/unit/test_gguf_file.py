"""argosy.models.gguf_file reads what the gguf package's GGUFReader reads (every metadata value,
every tensor's type, shape and bytes), on the files Argosy ships and on one written here with
every value type, and refuses broken files with a ValueError the loader turns into a 4xx-style
ModelLoadError."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from argosy.models.gguf_config import read_gguf_metadata
from argosy.models.gguf_file import GGUFFile
from argosy.models.loader import MODEL_REGISTRY


def reader_metadata(reader: gguf.GGUFReader) -> dict[str, object]:
    """GGUFReader's values, as read_gguf_metadata returned them when it read through GGUFReader."""
    values: dict[str, object] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if field.types == [gguf.GGUFValueType.FLOAT32]:
            value = float(str(np.float32(value)))
        values[key] = value
    return values


def assert_same_as_the_reader(path: Path) -> None:
    reader = gguf.GGUFReader(path)
    mine = GGUFFile(path)
    assert read_gguf_metadata(mine) == reader_metadata(reader)
    assert [t.name for t in mine.tensors] == [t.name for t in reader.tensors]
    for theirs, ours in zip(reader.tensors, mine.tensors, strict=True):
        assert ours.tensor_type == theirs.tensor_type
        assert ours.shape.tolist() == theirs.shape.tolist()
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        assert np.asarray(ours.data).tobytes() == np.asarray(theirs.data).tobytes()


def shipped(name: str) -> Path:
    try:
        return Path(MODEL_REGISTRY[name]())
    except Exception as exc:  # noqa: BLE001 - a model package that is not installed
        pytest.skip(f"{name} is not available: {exc}")


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_the_shipped_files_read_as_the_gguf_package_reads_them(name: str) -> None:
    assert_same_as_the_reader(shipped(name))


@pytest.mark.parametrize("pad", [0, 16, 32, 48])  # moves the header's end against the alignment
def test_every_value_type_and_tensor_type(tmp_path: Path, pad: int) -> None:
    path = tmp_path / "all.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("t.pad", "p" * pad)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 1e-5)
    writer.add_uint64("t.u64", 2**63 + 1)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ▁ 世界")
    writer.add_array("t.strs", ["a", "", "ü", "<|im_end|>"])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, 1e-5])
    writer.add_array("t.bools", [True, False])
    writer.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 64)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 32)).astype(np.float16))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_as_the_reader(path)
    assert GGUFFile(path).metadata["t.f32"] == float(np.float32(1e-5))  # the float32 it is
    assert read_gguf_metadata(GGUFFile(path))["t.f32"] == 1e-5  # the author's decimal


def test_broken_files_are_value_errors(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ValueError, match="magic"):
        GGUFFile(path)
    path.write_bytes(b"GGUF" + (7).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match="version 7"):
        GGUFFile(path)
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "big") + bytes(16))
    with pytest.raises(ValueError, match="big-endian"):
        GGUFFile(path)
    whole = shipped("smollm2").read_bytes()
    path.write_bytes(whole[: len(whole) // 2])  # the header is whole, the tensors are not
    with pytest.raises(ValueError, match="past the end"):
        GGUFFile(path)
