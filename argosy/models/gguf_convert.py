"""Convert one GGUF file into a Hugging Face folder (config, float32 safetensors, tokenizer).

The folder written is an ordinary HF folder, so the rest of Argosy (and transformers) reads a
converted GGUF exactly like a downloaded model:

    config.json                  + "argosy_gguf_file_type": "Q4_1" (the source quantization)
    generation_config.json
    tokenizer.json, tokenizer_config.json (chat_template, bos/eos, add_bos_token)
    argosy-int4.safetensors      Q4_0/Q4_1 weights' own 4-bit codes, scales and mins (if any)
    argosy-blocks.safetensors    Q8_0/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K weights as int8 codes, scales and
                                 mins (if any), exactly their values (gguf_quant.block_codes)
    model-0000i-of-0000n.safetensors + model.safetensors.index.json
                                 the float32 weights that have no codes (norms, biases, F16/F32
                                 tensors): all the invariant kernels need besides the codes
    model-of-codes-0000i-of-0000n.safetensors
                                 the coded weights' float32 values, written only when something
                                 asks for them (`write_float_copies`: the fast numerics,
                                 transformers), and then added to the index

Weights are dequantized to float32: every Q4_0/Q4_1/Q8_0/F16/BF16 value is exactly
representable there, so the HF weights equal what llama.cpp computes with (bfloat16 would round
Q4_1's `d * q + m`). The cost is size, 4 bytes per parameter, hence the float copies of the
coded weights only on demand (Qwen2.5-Coder-1.5B's folder: 2.3 GB without them, 8.9 GB with).

`convert_gguf` writes into a folder its caller provides; making that write atomic and cached
is loader.py's job, as is serialising `write_float_copies` between processes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file
from tokenizers import Tokenizer

from argosy.errors import ModelLoadError
from argosy.models.gguf_config import (
    GGUF_TENSOR_TYPES_KEY,
    build_generation_config,
    build_hf_config,
    gguf_file_type_name,
    read_gguf_metadata,
)
from argosy.models.gguf_file import GGUFFile, GGUFTensor
from argosy.models.gguf_quant import (
    BLOCKS_FILE,
    INT4_FILE,
    block_codes,
    block_values,
    file_block_codes,
    iter_block_tensors,
    iter_int4_tensors,
)
from argosy.models.gguf_tensors import hf_tensor_name, iter_hf_tensors
from argosy.models.gguf_tokenizer import build_tokenizer, build_tokenizer_config

# Shards bound peak memory while writing (a shard is held whole by safetensors) and keep each
# file a manageable size; 2 GiB matches what HF tooling commonly writes.
MAX_SHARD_BYTES = 2 * 1024**3
FLOAT_INDEX = "model.safetensors.index.json"
FLOAT_SHARDS = "model"  # the weights without codes: model-0000i-of-0000n.safetensors
CODED_FLOAT_SHARDS = "model-of-codes"  # the coded weights' float values, on demand


def open_gguf(gguf_path: Path) -> GGUFFile:
    """A reader over the file; ModelLoadError if it is not a readable GGUF."""
    try:
        return GGUFFile(gguf_path)
    except (ValueError, OSError, KeyError, IndexError, TypeError, UnicodeDecodeError, struct.error) as exc:
        raise ModelLoadError(f"{gguf_path} is not a readable GGUF file: {exc}") from exc


def convert_gguf(gguf_path: Path, out_dir: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> Tokenizer:
    """Write the HF folder for `gguf_path` into the existing folder `out_dir`; returns the
    tokenizer it wrote (the loader's, without reading tokenizer.json back: ~1.3 s for Gemma's)."""
    reader = open_gguf(gguf_path)
    metadata = read_gguf_metadata(reader)
    tensor_names = {tensor.name for tensor in reader.tensors}
    file_type = gguf_file_type_name(metadata, [tensor.tensor_type for tensor in reader.tensors])
    config = build_hf_config(metadata, tensor_names, file_type)
    config[GGUF_TENSOR_TYPES_KEY] = {
        name: tensor.tensor_type.name
        for tensor in reader.tensors
        if len(tensor.shape) == 2 and (name := hf_tensor_name(tensor.name, config["model_type"])) is not None
    }
    _write_json(out_dir / "tokenizer_config.json", build_tokenizer_config(metadata))
    _write_json(out_dir / "generation_config.json", build_generation_config(metadata))

    # The tokenizer (Python, holding the GIL: ~3 s of Gemma 3's 262k SentencePiece pieces) is
    # built on a thread beside the weights (numpy and safetensors, which release it).
    with ThreadPoolExecutor(1, thread_name_prefix="argosy-tokenizer") as pool:
        tokenizer_job = pool.submit(_write_tokenizer, metadata, out_dir)
        # the block formats' codes (their float values are written only on demand)
        found = file_block_codes(reader)
        if tokenizer_job.done():  # a tokenizer we cannot build fails the conversion early
            tokenizer_job.result()

        int4 = dict(iter_int4_tensors(reader, config))
        if int4:  # the file's own 4-bit blocks, for weight-only int4 matmuls
            save_file(int4, str(out_dir / INT4_FILE), metadata={"format": "argosy-int4-g32"})
        codes = dict(iter_block_tensors(reader, config, found))
        if codes:  # the other block formats' own codes, for the int8 kernels
            save_file(codes, str(out_dir / BLOCKS_FILE), metadata={"format": "argosy-int8-codes"})
        coded = _coded_names([*int4, *codes])
        del int4, codes
        tensors = iter_hf_tensors(reader, config, include=lambda name: name not in coded)
        _write_index(out_dir, *_write_shards(tensors, out_dir, FLOAT_SHARDS, max_shard_bytes))
        tokenizer = tokenizer_job.result()
    _write_json(out_dir / "config.json", config)
    return tokenizer


def _write_tokenizer(metadata: dict[str, Any], out_dir: Path) -> Tokenizer:
    tokenizer = build_tokenizer(metadata)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    return tokenizer


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_float_copies(gguf_path: Path, folder: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> int:
    """Write the float32 values of the weights `folder` (converted from `gguf_path`) holds only
    as codes, and add them to its index; the number of weights written (0: all were there).
    The caller keeps other writers out (loader.ensure_float_copies)."""
    for stale in folder.glob("*.partial"):  # a write cut short before
        stale.unlink()
    index = json.loads((folder / FLOAT_INDEX).read_text(encoding="utf-8"))
    missing = float_copies_missing(folder)
    if not missing:
        return 0
    tensors = iter_float_weights(gguf_path, folder, include=missing.__contains__)
    written, size = _write_shards(tensors, folder, CODED_FLOAT_SHARDS, max_shard_bytes)
    _write_index(folder, {**index["weight_map"], **written}, index["metadata"]["total_size"] + size)
    return len(written)


def iter_float_weights(
    gguf_path: Path, folder: Path, include: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array) of every weight of the folder converted from `gguf_path` (those
    `include` takes, if given), computed from the file one at a time: what its float files hold
    (a reference model can be built from them in memory, writing nothing)."""
    reader = open_gguf(gguf_path)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))

    def known(tensor: GGUFTensor) -> np.ndarray | None:  # a block format's values from its codes
        codes = block_codes(tensor)
        return None if codes is None else block_values(codes)

    yield from iter_hf_tensors(reader, config, known, include)


def float_copies_missing(folder: Path) -> set[str]:
    """The coded weights of a converted folder that its float files do not hold (yet)."""
    index = folder / FLOAT_INDEX
    if not index.exists():  # a folder of another kind: its float files are what they are
        return set()
    return coded_weight_names(folder) - set(json.loads(index.read_text(encoding="utf-8"))["weight_map"])


def coded_weight_names(folder: Path) -> set[str]:
    """The HF weight names that `folder`'s code files (argosy-int4 / argosy-blocks) hold."""
    names: list[str] = []
    for file in (INT4_FILE, BLOCKS_FILE):
        if (folder / file).exists():
            with safe_open(str(folder / file), framework="np") as f:
                names += f.keys()
    return _coded_names(names)


def _coded_names(keys: Iterable[str]) -> set[str]:
    return {key.removesuffix(".codes") for key in keys if key.endswith(".codes")}


def _write_shards(
    tensors: Iterable[tuple[str, np.ndarray]], out_dir: Path, prefix: str, max_shard_bytes: int
) -> tuple[dict[str, str], int]:
    """Write (name, array) pairs as HF-style shards `<prefix>-0000i-of-0000n.safetensors`;
    returns which file holds each name, and their bytes."""
    # Shards are written as they fill, so at most one shard of float32 is held in memory.
    shard: dict[str, np.ndarray] = {}
    shard_bytes = 0
    total_bytes = 0
    shard_names: list[list[str]] = []
    for name, array in tensors:
        if shard and shard_bytes + array.nbytes > max_shard_bytes:
            shard_names.append(_save_partial_shard(shard, out_dir, len(shard_names)))
            shard, shard_bytes = {}, 0
        shard[name] = array
        shard_bytes += array.nbytes
        total_bytes += array.nbytes
    if shard:
        shard_names.append(_save_partial_shard(shard, out_dir, len(shard_names)))

    # Shard file names carry the total count, known only now.
    count = len(shard_names)
    weight_map: dict[str, str] = {}
    for index, names in enumerate(shard_names):
        final_name = f"{prefix}-{index + 1:05d}-of-{count:05d}.safetensors"
        (out_dir / _partial_shard_name(index)).rename(out_dir / final_name)
        weight_map.update(dict.fromkeys(names, final_name))
    return weight_map, total_bytes


def _write_index(folder: Path, weight_map: dict[str, str], total: int) -> None:
    """The index of every float file (HF's model.safetensors.index.json), replaced whole."""
    partial = folder / f"{FLOAT_INDEX}.partial"
    _write_json(partial, {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    partial.replace(folder / FLOAT_INDEX)


def _partial_shard_name(index: int) -> str:
    return f"shard-{index:05d}.partial"


def _save_partial_shard(shard: dict[str, np.ndarray], out_dir: Path, index: int) -> list[str]:
    save_file(shard, str(out_dir / _partial_shard_name(index)), metadata={"format": "pt"})
    return list(shard)
