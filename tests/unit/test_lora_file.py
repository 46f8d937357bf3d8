"""LoRA adapter files: PEFT folders written by peft itself and GGUF LoRAs written with the gguf
package read back exactly (llama.cpp's q/k permutation undone), and every refusal names its cause."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gguf
import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from argosy.models.gguf_tensors import unpermute_rope_rows
from argosy.models.lora_file import LORA_MODULES, AdapterError, LoraWeights, check_fits, read_adapter

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
TINY_LLAMA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 128}
TINY_LLAMA |= {"num_attention_heads": 4, "num_key_value_heads": 2}
Expected = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]


def _save_peft(folder: Path, targets: tuple[str, ...] = ATTENTION, **options: Any) -> Expected:
    """A peft adapter of a tiny random Llama saved to `folder`; peft's (A, B, scaling) per module."""
    torch.manual_seed(0)
    config = LlamaConfig(**TINY_LLAMA)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=list(targets), init_lora_weights=False, **options)
    model = get_peft_model(LlamaForCausalLM(config), lora)
    model.save_pretrained(str(folder))
    expected: Expected = {}
    for name, module in model.named_modules():
        if name.endswith(targets) and hasattr(module, "lora_A"):
            key = (int(name.split("layers.")[1].split(".")[0]), name.rsplit(".", 1)[1])
            a, b = module.lora_A["default"].weight.detach(), module.lora_B["default"].weight.detach()
            expected[key] = (a, b, module.scaling["default"])
    return expected


@pytest.fixture(scope="module")
def attention_adapter(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Expected]:
    folder = tmp_path_factory.mktemp("peft")
    return folder, _save_peft(folder)


@pytest.fixture
def adapter_copy(attention_adapter: tuple[Path, Expected], tmp_path: Path) -> Path:
    return Path(shutil.copytree(attention_adapter[0], tmp_path / "adapter"))


def _assert_modules(weights: LoraWeights, expected: Expected, scale: float | None = None) -> None:
    assert set(weights.modules) == set(expected)
    for key, (a, b, peft_scale) in expected.items():
        got_a, got_b, got_scale = weights.modules[key]
        assert got_a.dtype == got_b.dtype == torch.float32
        assert torch.equal(got_a, a) and torch.equal(got_b, b), key
        assert got_scale == pytest.approx(peft_scale)
        assert scale is None or got_scale == pytest.approx(scale)


def test_peft_adapter_reads_back_exactly(attention_adapter: tuple[Path, Expected]) -> None:
    folder, expected = attention_adapter
    weights = read_adapter(folder)
    assert (weights.format, weights.rank, weights.alpha, weights.path) == ("peft", 8, 16.0, str(folder))
    assert len(expected) == 8
    _assert_modules(weights, expected, 2.0)
    assert weights.nbytes == sum(a.nbytes + b.nbytes for a, b, _ in expected.values())
    for entry in ("adapter_config.json", "adapter_model.safetensors"):
        assert set(read_adapter(folder / entry, max_rank=8).modules) == set(expected)


def test_peft_rslora_and_all_seven_targets(tmp_path: Path) -> None:
    expected = _save_peft(tmp_path / "rs", use_rslora=True)
    _assert_modules(read_adapter(tmp_path / "rs"), expected, 16 / math.sqrt(8))
    expected = _save_peft(tmp_path / "all", targets=LORA_MODULES)
    assert {name for _, name in expected} == set(LORA_MODULES)
    _assert_modules(read_adapter(tmp_path / "all"), expected, 2.0)


def test_peft_rank_and_alpha_patterns(tmp_path: Path) -> None:
    expected = _save_peft(
        tmp_path, rank_pattern={"v_proj": 4}, alpha_pattern={"layers.1.self_attn.q_proj": 4}
    )
    weights = read_adapter(tmp_path)
    assert weights.rank == 8
    assert expected[(0, "v_proj")][0].shape == (4, 64)
    _assert_modules(weights, expected)
    scales = {key: scale for key, (_, _, scale) in weights.modules.items()}
    assert (scales[(0, "v_proj")], scales[(1, "q_proj")], scales[(0, "q_proj")]) == (16 / 4, 4 / 8, 2.0)


def test_peft_bfloat16_tensors_become_float32(adapter_copy: Path) -> None:
    path = adapter_copy / "adapter_model.safetensors"
    tensors = {name: t.to(torch.bfloat16) for name, t in load_file(path).items()}
    save_file(tensors, path)
    weights = read_adapter(adapter_copy)
    a, _, _ = weights.modules[(0, "q_proj")]
    assert a.dtype == torch.float32
    assert torch.equal(a, tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].float())


def _refused(path: Path, *words: str, **options: Any) -> None:
    with pytest.raises(AdapterError) as info:
        read_adapter(path, **options)
    assert info.value.param == "lora_path"
    for word in words:
        assert word in info.value.message, info.value.message


def test_peft_file_refusals(adapter_copy: Path, tmp_path: Path) -> None:
    _refused(tmp_path / "nowhere", "does not exist")
    _refused(
        tmp_path / ("T\u0335o\u0336" * 100), "cannot be read (File name too long)"
    )  # 800 bytes: ENAMETOOLONG
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "adapter.gguf").write_bytes(b"GGUF")
    locked.chmod(0)
    try:
        if os.geteuid() != 0:  # root reads through any mode
            _refused(locked / "adapter.gguf", "cannot be read (Permission denied)")
    finally:
        locked.chmod(0o755)
    (tmp_path / "empty").mkdir()
    _refused(tmp_path / "empty", "adapter_config.json")
    _refused(adapter_copy, "rank 8 is above this server's --max-lora-rank 4", max_rank=4)
    weights = adapter_copy / "adapter_model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:-100])
    _refused(adapter_copy, "not a readable safetensors")
    weights.write_bytes(np.random.default_rng(0).bytes(300))
    _refused(adapter_copy, "not a readable safetensors")
    weights.rename(adapter_copy / "adapter_model.bin")
    _refused(adapter_copy, "adapter_model.bin", "only adapter_model.safetensors")
    (adapter_copy / "adapter_model.bin").unlink()
    _refused(adapter_copy, "no adapter_model.safetensors")
    (adapter_copy / "adapter_config.json").write_text("{r: 8")
    _refused(adapter_copy, "not readable JSON")


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"use_dora": True}, ("DoRA",)),
        ({"bias": "lora_only"}, ("bias", "lora_only")),
        ({"modules_to_save": ["lm_head"]}, ("modules_to_save",)),
        ({"target_modules": ["q_proj", "embed_tokens"]}, ("embed_tokens",)),
        ({"target_modules": ["lm_head"]}, ("lm_head",)),
        ({"peft_type": "IA3"}, ("IA3",)),
    ],
)
def test_peft_config_refusals(adapter_copy: Path, change: dict[str, Any], words: tuple[str, ...]) -> None:
    path = adapter_copy / "adapter_config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | change))
    _refused(adapter_copy, *words)


def test_peft_tensor_refusals(adapter_copy: Path) -> None:
    path = adapter_copy / "adapter_model.safetensors"
    tensors = load_file(path)
    q_b = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    save_file(tensors | {"base_model.model.lm_head.lora_A.weight": torch.ones(8, 64)}, path)
    _refused(adapter_copy, "lm_head", "unsupported target")
    save_file({k: v for k, v in tensors.items() if k != q_b}, path)
    _refused(adapter_copy, "q_proj of layer 0", "lora_A without its lora_B")
    save_file(tensors | {q_b: torch.full_like(tensors[q_b], math.inf)}, path)
    _refused(adapter_copy, "q_proj of layer 0", "non-finite")
    save_file(tensors | {q_b: torch.full_like(tensors[q_b], math.nan)}, path)
    _refused(adapter_copy, "non-finite")
    save_file({}, path)
    _refused(adapter_copy, "no LoRA tensors")


# -- GGUF ----------------------------------------------------------------------------------------
def _write_gguf(
    path: Path, tensors: dict[str, np.ndarray], arch: str = "qwen2", q8_0: tuple[str, ...] = (), **meta: Any
) -> Path:
    """A GGUF LoRA as convert_lora_to_gguf.py writes it; the tensors named in `q8_0` as Q8_0."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(meta.get("general_type", "adapter"))
    writer.add_string("adapter.type", meta.get("adapter_type", "lora"))
    writer.add_float32("adapter.lora.alpha", meta.get("alpha", 16.0))
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, values in tensors.items():
        if name in q8_0:
            writer.add_tensor(name, gguf.quants.quantize(values, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _lora_tensors() -> dict[str, np.ndarray]:
    """Layer 0's q (64 rows: 4 heads), k (32 rows: 2 KV heads) and down projections, rank 4:
    A in float32, B in float16, in numpy's (torch's) shapes A [r, in], B [out, r]."""
    rng = np.random.default_rng(1)
    shapes = {"attn_q": (64, 64), "attn_k": (32, 64), "ffn_down": (64, 128)}
    tensors: dict[str, np.ndarray] = {}
    for role, (out_features, in_features) in shapes.items():
        tensors[f"blk.0.{role}.weight.lora_a"] = rng.standard_normal((4, in_features), dtype=np.float32)
        tensors[f"blk.0.{role}.weight.lora_b"] = rng.standard_normal((out_features, 4)).astype(np.float16)
    return tensors


def test_gguf_lora_reads_back(tmp_path: Path) -> None:
    written = _lora_tensors()
    weights = read_adapter(_write_gguf(tmp_path / "a.gguf", written))
    assert (weights.format, weights.rank, weights.alpha, weights.base_hint) == ("gguf", 4, 16.0, "qwen2")
    assert set(weights.modules) == {(0, "q_proj"), (0, "k_proj"), (0, "down_proj")}
    for (_, name), (a, b, scale) in weights.modules.items():
        role = {"q_proj": "attn_q", "k_proj": "attn_k", "down_proj": "ffn_down"}[name]
        assert np.array_equal(a.numpy(), written[f"blk.0.{role}.weight.lora_a"])
        assert np.array_equal(b.numpy(), written[f"blk.0.{role}.weight.lora_b"].astype(np.float32))
        assert scale == 16.0 / 4
    zero_alpha = read_adapter(_write_gguf(tmp_path / "z.gguf", written, alpha=0.0))
    assert {scale for _, _, scale in zero_alpha.modules.values()} == {1.0}  # llama.cpp: alpha 0 -> 1


def test_gguf_llama_unpermutes_q_and_k_rows_of_lora_b(tmp_path: Path) -> None:
    written = _lora_tensors()
    path = _write_gguf(tmp_path / "llama.gguf", written, arch="llama")
    weights = read_adapter(path, num_heads=4, num_kv_heads=2)
    for name, role, heads in (("q_proj", "attn_q", 4), ("k_proj", "attn_k", 2)):
        a, b, _ = weights.modules[(0, name)]
        b_written = written[f"blk.0.{role}.weight.lora_b"].astype(np.float32)
        assert np.array_equal(b.numpy(), unpermute_rope_rows(b_written, heads))
        assert not np.array_equal(b.numpy(), b_written)
        assert np.array_equal(a.numpy(), written[f"blk.0.{role}.weight.lora_a"])
    _, b, _ = weights.modules[(0, "down_proj")]
    assert np.array_equal(b.numpy(), written["blk.0.ffn_down.weight.lora_b"].astype(np.float32))
    with pytest.raises(ValueError, match="num_heads"):
        read_adapter(path)
    # the caller's architecture decides: a Qwen2 base was never permuted
    _, b, _ = read_adapter(path, architecture="qwen2").modules[(0, "q_proj")]
    assert np.array_equal(b.numpy(), written["blk.0.attn_q.weight.lora_b"].astype(np.float32))


def test_gguf_q8_0_lora_a(tmp_path: Path) -> None:
    written = _lora_tensors()
    name = "blk.0.attn_q.weight.lora_a"
    a, _, _ = read_adapter(_write_gguf(tmp_path / "q8.gguf", written, q8_0=(name,))).modules[(0, "q_proj")]
    q8 = gguf.GGMLQuantizationType.Q8_0
    assert np.array_equal(a.numpy(), gguf.quants.dequantize(gguf.quants.quantize(written[name], q8), q8))
    assert torch.allclose(a, torch.from_numpy(written[name]), atol=0.05)


def test_gguf_refusals(tmp_path: Path) -> None:
    written = _lora_tensors()
    (tmp_path / "noise.gguf").write_bytes(np.random.default_rng(0).bytes(500))
    _refused(tmp_path / "noise.gguf", "not a readable GGUF")
    good = _write_gguf(tmp_path / "good.gguf", written).read_bytes()
    (tmp_path / "cut.gguf").write_bytes(good[: len(good) // 2])
    _refused(tmp_path / "cut.gguf", "not a readable GGUF")
    _refused(_write_gguf(tmp_path / "m.gguf", written, general_type="model"), "not an adapter", "'model'")
    _refused(_write_gguf(tmp_path / "cv.gguf", written, adapter_type="control_vector"), "not a LoRA")
    embd = {"token_embd.weight.lora_a": np.ones((4, 128), np.float32)}
    _refused(_write_gguf(tmp_path / "e.gguf", written | embd), "token_embd", "unsupported target")
    half = {k: v for k, v in written.items() if k != "blk.0.ffn_down.weight.lora_b"}
    _refused(_write_gguf(tmp_path / "h.gguf", half), "down_proj of layer 0", "without its lora_B")
    nan = {"blk.0.attn_q.weight.lora_a": np.full((4, 64), np.nan, np.float32)}
    _refused(_write_gguf(tmp_path / "n.gguf", written | nan), "non-finite")
    _refused(_write_gguf(tmp_path / "0.gguf", {}), "no LoRA tensors")
    _refused(tmp_path / "good.gguf", "rank 4 is above this server's --max-lora-rank 2", max_rank=2)


# -- check_fits ----------------------------------------------------------------------------------
SHAPES = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64)}


@pytest.mark.parametrize(
    ("shapes", "num_layers", "words"),
    [
        (
            SHAPES | {"q_proj": (64, 48)},
            2,
            ("q_proj of layer 0", "lora_A (8, 64)", "takes 48 features to 64"),
        ),
        (
            SHAPES | {"k_proj": (16, 64)},
            2,
            ("k_proj of layer 0", "lora_B (32, 8)", "takes 64 features to 16"),
        ),
        (SHAPES, 1, ("k_proj of layer 1", "out of range", "1 layers")),
        ({"q_proj": (64, 64)}, 2, ("k_proj of layer 0", "no k_proj")),
    ],
)
def test_check_fits_refusals(
    attention_adapter: tuple[Path, Expected],
    shapes: dict[str, tuple[int, int]],
    num_layers: int,
    words: tuple[str, ...],
) -> None:
    weights = read_adapter(attention_adapter[0])
    check_fits(weights, SHAPES, 2)
    with pytest.raises(AdapterError) as info:
        check_fits(weights, shapes, num_layers)
    assert info.value.param == "lora_path" and all(w in info.value.message for w in words), info.value.message


def test_check_fits_refuses_unequal_ranks() -> None:
    weights = LoraWeights(
        "x", 4, 8.0, {(0, "q_proj"): (torch.ones(4, 64), torch.ones(64, 3), 2.0)}, None, "peft"
    )
    with pytest.raises(AdapterError, match="q_proj of layer 0: lora_A \\(4, 64\\) and lora_B \\(64, 3\\)"):
        check_fits(weights, SHAPES, 2)
