"""A GGUF file's header read in one pass: its metadata as plain Python values and its tensors
as numpy views of the memory-mapped file.

Why not `gguf.GGUFReader`: it makes a numpy memmap slice for every part of every field, so a
tokenizer's 49k-token vocabulary and merges cost ~150k slices: 2.8 s for SmolLM2's 100 MB file,
the largest piece of a first start. Here an array of numbers is one `np.frombuffer` and an array
of strings one loop over the bytes. Values and views are those GGUFReader gives (a unit test
compares both on every file Argosy ships), so the rest of the loader is unchanged: a tensor has
GGUFReader's `name`, `tensor_type`, `shape` (innermost dimension first) and `data` (uint8 rows of
blocks for a quantized type, else the values in their own dtype, outermost dimension first).

Only little-endian files (every file llama.cpp writes on x86 and ARM) are read; a big-endian
one is refused with a clear error rather than read wrongly.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF value types (gguf.GGUFValueType) with a fixed size: their numpy dtype.
_FIXED: dict[int, np.dtype[Any]] = {
    gguf.GGUFValueType.UINT8: np.dtype("<u1"),
    gguf.GGUFValueType.INT8: np.dtype("<i1"),
    gguf.GGUFValueType.UINT16: np.dtype("<u2"),
    gguf.GGUFValueType.INT16: np.dtype("<i2"),
    gguf.GGUFValueType.UINT32: np.dtype("<u4"),
    gguf.GGUFValueType.INT32: np.dtype("<i4"),
    gguf.GGUFValueType.FLOAT32: np.dtype("<f4"),
    gguf.GGUFValueType.BOOL: np.dtype("?"),
    gguf.GGUFValueType.UINT64: np.dtype("<u8"),
    gguf.GGUFValueType.INT64: np.dtype("<i8"),
    gguf.GGUFValueType.FLOAT64: np.dtype("<f8"),
}
# Tensor types held as their own values (GGUFReader's choice); the rest are uint8 block rows.
_PLAIN_TENSORS: dict[gguf.GGMLQuantizationType, np.dtype[Any]] = {
    gguf.GGMLQuantizationType.F16: np.dtype("<f2"),
    gguf.GGMLQuantizationType.F32: np.dtype("<f4"),
    gguf.GGMLQuantizationType.F64: np.dtype("<f8"),
    gguf.GGMLQuantizationType.I8: np.dtype("<i1"),
    gguf.GGMLQuantizationType.I16: np.dtype("<i2"),
    gguf.GGMLQuantizationType.I32: np.dtype("<i4"),
    gguf.GGMLQuantizationType.I64: np.dtype("<i8"),
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: np.ndarray  # uint64, innermost dimension first (as the file lists it)
    data: np.ndarray  # a view of the mapped file


class GGUFFile:
    """`metadata`: key -> value (str, int, float, bool, or a list of them); a scalar FLOAT32
    value as the float32 it is (`value_types` says which keys those are). `tensors`: in file order."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        # plain views: no memmap subclass per slice
        self.buffer = np.memmap(self.path, mode="r").view(np.ndarray)
        self._view = self.buffer.data  # a memoryview of the mapped bytes
        self._offset = 0
        if bytes(self._view[:4]) != MAGIC:
            raise ValueError("GGUF magic invalid")
        self._offset = 4
        version = self._scalar("<I")
        if version & 0xFFFF == 0:
            raise ValueError("big-endian GGUF files are not supported")
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (only {SUPPORTED_VERSIONS})")
        tensor_count = self._scalar("<Q")
        kv_count = self._scalar("<Q")
        self.metadata: dict[str, Any] = {}
        self.value_types: dict[str, int] = {}
        for _ in range(kv_count):
            key = self._string()
            value_type = self._scalar("<I")
            self.value_types[key] = value_type
            self.metadata[key] = self._value(value_type)
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if self.value_types.get("general.alignment", gguf.GGUFValueType.UINT32) != gguf.GGUFValueType.UINT32:
            raise ValueError("Bad type for general.alignment field")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError("Invalid alignment: must be a non-zero power of two")
        data_start = -(-self._offset // alignment) * alignment
        self.tensors: list[GGUFTensor] = []
        names: set[str] = set()
        for name, dims, raw_type, offset in infos:
            if name in names:
                raise ValueError(f"Found duplicated tensor with name {name}")
            names.add(name)
            self.tensors.append(self._tensor(name, dims, raw_type, data_start + offset))

    # -- header pieces ---------------------------------------------------------------------
    def _scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._view, self._offset)
        self._offset += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar("<Q")
        start = self._offset
        self._offset += length
        return str(self._view[start : self._offset], encoding="utf-8")

    def _value(self, value_type: int) -> Any:
        if value_type == gguf.GGUFValueType.STRING:
            return self._string()
        if value_type == gguf.GGUFValueType.ARRAY:
            item_type = self._scalar("<I")
            count = self._scalar("<Q")
            dtype = _FIXED.get(item_type)
            if dtype is not None:  # numbers: one read for the whole array
                values = np.frombuffer(self._view, dtype=dtype, count=count, offset=self._offset)
                self._offset += dtype.itemsize * count
                return values.tolist()
            return [self._value(item_type) for _ in range(count)]
        dtype = _FIXED.get(value_type)
        if dtype is None:
            raise ValueError(f"unknown GGUF value type {value_type} at byte {self._offset}")
        value = np.frombuffer(self._view, dtype=dtype, count=1, offset=self._offset)[0]
        self._offset += dtype.itemsize
        return value.item()

    def _tensor_info(self) -> tuple[str, np.ndarray, int, int]:
        name = self._string()
        n_dims = self._scalar("<I")
        dims = np.frombuffer(self._view, dtype="<u8", count=n_dims, offset=self._offset).copy()
        self._offset += 8 * n_dims
        raw_type = self._scalar("<I")
        offset = self._scalar("<Q")
        return name, dims, raw_type, offset

    def _tensor(self, name: str, dims: np.ndarray, raw_type: int, start: int) -> GGUFTensor:
        tensor_type = gguf.GGMLQuantizationType(raw_type)
        n_elements = int(np.prod(dims))
        hf_dims = tuple(int(d) for d in reversed(dims.tolist()))
        dtype = _PLAIN_TENSORS.get(tensor_type)
        if dtype is not None:
            n_bytes = n_elements * dtype.itemsize
        else:
            block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
            n_bytes = n_elements * type_size // block_size
        if start + n_bytes > len(self.buffer):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        if dtype is not None:
            data = self.buffer[start : start + n_bytes].view(dtype).reshape(hf_dims)
        else:
            data = self.buffer[start : start + n_bytes].reshape(
                gguf.quant_shape_to_byte_shape(hf_dims, tensor_type)
            )
        return GGUFTensor(name, tensor_type, dims, data)
