"""GGUF block formats read as int8 codes (argosy/models/gguf_quant.py `block_codes`): for each of
Q8_0, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K, the codes read from the bits times the scales plus the
mins (`block_values`, the converter's float32 weights) equal the gguf package's dequantization of
the file, value for value, and so do the rows the invariant kernels'
layout gives back (the tied-embedding path)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file as load_torch

from argosy.models.build import describe_weights, load_model, resolve_numerics, served_by_codes
from argosy.models.gguf_config import GGUF_TENSOR_TYPES_KEY, tensor_formats
from argosy.models.gguf_quant import BLOCKS_FILE, block_codes, block_values
from argosy.models.loader import ensure_float_copies, resolve_model
from argosy.models.quantize import FUSED_PARTS
from argosy.ops.native import load_invariant_ops
from argosy.ops.quantized_linear import BlockCodes, CodesEmbedding, Int8Linear

Q = gguf.GGMLQuantizationType
# format -> (weights a scale, whether it has mins, offsets of its fp16 fields in a block)
FORMATS = {
    Q.Q8_0: (32, False, (0,)),
    Q.Q5_0: (32, False, (0,)),
    Q.Q5_1: (32, True, (0, 2)),
    Q.Q4_K: (32, True, (0, 2)),
    Q.Q5_K: (32, True, (0, 2)),
    Q.Q6_K: (16, False, (208,)),
}
N, K = 32, 512


def random_blocks(qtype: gguf.GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """Random bytes in the block layout, with finite fp16 scales (some negative, some zero) and,
    for Q8_0, codes within [-127, 127] (llama.cpp never writes -128)."""
    per_block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(N, K // per_block, block_bytes), dtype=np.uint8)
    for at in FORMATS[qtype][2]:
        scale = rng.uniform(1e-4, 2e-2, size=blocks.shape[:2]) * rng.choice(
            [-1, 1, 0], size=blocks.shape[:2], p=[0.1, 0.85, 0.05]
        )
        blocks[..., at : at + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    if qtype == Q.Q8_0:
        codes = blocks[..., 2:]
        codes[codes == 0x80] = 0x81
    return blocks.reshape(N, -1)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> gguf.GGUFReader:
    path = tmp_path_factory.mktemp("blocks") / "formats.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    rng = np.random.default_rng(7)
    for qtype in FORMATS:
        writer.add_tensor(f"{qtype.name}.weight", random_blocks(qtype, rng), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(path)


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
def test_codes_times_scales_plus_mins_are_the_files_values(gguf_file: gguf.GGUFReader, qtype: Q) -> None:
    tensor = next(t for t in gguf_file.tensors if t.name == f"{qtype.name}.weight")
    found = block_codes(tensor)
    assert found is not None
    codes, scales, mins = found
    group, has_mins, _ = FORMATS[qtype]
    assert codes.dtype == np.int8 and codes.shape == (N, K) and np.abs(codes).max() <= 127
    assert scales.dtype == np.float32 and scales.shape == (N, K // group)
    assert (mins is not None) == has_mins
    expected = gguf.quants.dequantize(np.asarray(tensor.data), qtype).reshape(N, K)
    # the converter's float32 weights: the values from the codes, as gguf computes them
    np.testing.assert_array_equal(block_values(found), expected)
    if not load_invariant_ops():
        return  # no compiler: the layout below is the kernels'
    weight = BlockCodes(
        torch.from_numpy(codes), torch.from_numpy(scales), None if mins is None else torch.from_numpy(mins)
    )
    head = Int8Linear(None, None, torch.bfloat16, invariant=True, blocks=weight)
    assert torch.equal(CodesEmbedding(head)(torch.arange(N)), torch.from_numpy(expected))


def test_a_q8_0_code_of_minus_128_is_left_to_the_float_weights(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    blocks = random_blocks(Q.Q8_0, rng)
    blocks[0, 2] = 0x80  # code -128 in the first block
    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("odd.weight", blocks, raw_dtype=Q.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert block_codes(gguf.GGUFReader(path).tensors[0]) is None


@pytest.mark.skipif(not load_invariant_ops(), reason="the invariant kernels need a C++ compiler")
@pytest.mark.parametrize(
    ("arch", "qtype", "held"),
    [
        (
            "llama",
            Q.Q5_1,
            "the GGUF's codes at their own bits (5), int8",
        ),  # a 281-row head: no 16-row tiles, per-channel int8
        ("qwen2", Q.Q5_0, "the GGUF's codes at their own bits (5), 5-bit"),
        ("qwen2", Q.Q8_0, "int8 codes of the GGUF's other blocks, int8"),
    ],
)
def test_a_gguf_of_other_blocks_serves_its_own_codes(tmp_path: Path, arch: str, qtype: Q, held: str) -> None:
    """A Q5_0 / Q5_1 / Q8_0 file converts with its codes beside the float weights, numerics auto
    turns invariant for it, every projection and the head run on the file's own codes (their
    values are the float weights', exactly), and /v1/models' formats name the types."""
    from tests.unit.test_loader import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, arch, qtype)
    source = resolve_model(str(path), cache_dir=tmp_path / "cache")
    assert (source.weights_dir / BLOCKS_FILE).exists()
    invariant, dtype = resolve_numerics("auto", "auto", "cpu", "auto", source)
    assert invariant and dtype == torch.bfloat16
    model = load_model(source, dtype, quantization="auto", invariant=True)
    # every projection's float copy was left unread (its codes serve it), the head's too where
    # it tiles (the 281-row head does not)
    served = served_by_codes(load_model(source, dtype), source)
    assert (
        "model.layers.0.self_attn.q_proj.weight" in served and "model.layers.1.mlp.down_proj.weight" in served
    )
    assert ("lm_head.weight" in served or "model.embed_tokens.weight" in served) == (arch == "qwen2")
    ensure_float_copies(source)  # the float values of the codes, written only when asked for
    floats = {
        k: v
        for f in sorted(source.weights_dir.glob("model*.safetensors"))
        for k, v in load_torch(str(f)).items()
    }
    for i in range(source.hf_config["num_hidden_layers"]):
        for fused, parts in FUSED_PARTS.items():
            layer = model.get_submodule(f"layers.{i}.{fused}")
            assert isinstance(layer, Int8Linear) and layer.own_codes and layer.invariant
            expected = torch.cat([floats[f"model.layers.{i}.{p}.weight"] for p in parts])
            assert torch.equal(CodesEmbedding(layer)(torch.arange(layer.out_features)), expected)
    assert isinstance(model.lm_head, Int8Linear) and model.lm_head.own_codes
    # Q5_0 / Q5_1 held at their 5 bits (iq_packed.cpp), Q8_0 as its int8 codes
    assert describe_weights(model, dtype) == (
        f"{held} output head (invariant kernels: every row count, fp32 logits)"
    )
    formats = tensor_formats(source.hf_config[GGUF_TENSOR_TYPES_KEY])
    assert formats is not None and formats["self_attn.q_proj"] == qtype.name
    assert formats["embed_tokens"] == qtype.name
