"""The GGUF header as Hugging Face files: metadata reading, config.json and generation_config.json.

A GGUF keeps the model's hyper-parameters under llama.cpp key names prefixed by the
architecture (`llama.embedding_length`, `qwen2.attention.head_count` ...). This module maps
them onto the `config.json` fields transformers (and our own model modules) read, so the
converted folder is an ordinary Hugging Face folder.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import gguf
import numpy as np

from argosy.errors import ModelLoadError
from argosy.models.gguf_file import GGUFFile

# general.architecture -> (HF architecture, HF model_type). Mistral files say "llama" and are
# recognised by name below, as transformers' own GGUF loader does.
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
_MISTRAL = ("MistralForCausalLM", "mistral")

# The key under which the converted config.json records the GGUF's quantization, e.g. "Q4_1".
GGUF_FILE_TYPE_KEY = "argosy_gguf_file_type"
# ... and each weight matrix's own type, {HF name: "Q4_K"} (a Q4_K_M file mixes them)
GGUF_TENSOR_TYPES_KEY = "argosy_gguf_tensor_types"

_LAYER_PREFIX = re.compile(r"^model\.layers\.\d+\.")


def tensor_formats(types: dict[str, str] | None) -> dict[str, str] | None:
    """Per role of a weight matrix (self_attn.q_proj, mlp.down_proj, embed_tokens, lm_head),
    the GGUF types its tensors have across layers, commonest first: {"mlp.down_proj": "Q6_K x9,
    Q5_0 x9"}; None for a model not converted from a GGUF."""
    if not types:
        return None
    roles: dict[str, Counter[str]] = {}
    for name, kind in types.items():
        role = _LAYER_PREFIX.sub("", name).removeprefix("model.").removesuffix(".weight")
        roles.setdefault(role, Counter())[kind] += 1
    return {
        role: ", ".join(kind if len(counts) == 1 else f"{kind} x{n}" for kind, n in counts.most_common())
        for role, counts in sorted(roles.items())
    }


def read_gguf_metadata(file: GGUFFile) -> dict[str, Any]:
    """Every key/value of the header as plain Python values (str, int, float, bool, lists)."""
    return {
        key: _shortest_float(value) if file.value_types[key] == gguf.GGUFValueType.FLOAT32 else value
        for key, value in file.metadata.items()
    }


def _shortest_float(value: float) -> float:
    # A FLOAT32 field reads back as 9.999999747378752e-06; the model's author wrote 1e-05. The
    # shortest decimal that rounds to the same float32 is that original value.
    return float(str(np.float32(value)))


def gguf_file_type_name(metadata: dict[str, Any], tensor_types: list[gguf.GGMLQuantizationType]) -> str:
    """ "Q4_1"-style name of the file's quantization: `general.file_type`, else the commonest 2-D type."""
    file_type = metadata.get("general.file_type")
    if file_type is not None:
        try:
            name = gguf.LlamaFileType(int(file_type)).name
        except ValueError:
            name = ""
        if name:
            return name.removeprefix("MOSTLY_").removeprefix("ALL_")
    counts = Counter(t.name for t in tensor_types)
    return counts.most_common(1)[0][0] if counts else "unknown"


def build_hf_config(metadata: dict[str, Any], tensor_names: set[str], file_type: str) -> dict[str, Any]:
    """config.json for the model a GGUF holds; raises ModelLoadError for other architectures."""
    arch = _required(metadata, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported; supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    hf_architecture, model_type = GGUF_ARCHITECTURES[arch]
    if arch == "llama" and "mistral" in str(metadata.get("general.name", "")).lower():
        hf_architecture, model_type = _MISTRAL

    num_attention_heads = int(_required(metadata, f"{arch}.attention.head_count"))
    hidden_size = int(_required(metadata, f"{arch}.embedding_length"))
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    config: dict[str, Any] = {
        "architectures": [hf_architecture],
        "model_type": model_type,
        "hidden_size": hidden_size,
        "intermediate_size": int(_required(metadata, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_required(metadata, f"{arch}.block_count")),
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": _num_key_value_heads(metadata, arch, num_attention_heads),
        "head_dim": int(metadata.get(f"{arch}.attention.key_length", hidden_size // num_attention_heads)),
        "rms_norm_eps": float(metadata.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(metadata.get(f"{arch}.context_length", 2048)),
        "vocab_size": int(metadata.get(f"{arch}.vocab_size", len(tokens))),
        "hidden_act": "silu",
        # llama.cpp writes no output.weight when the head shares the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",  # the converter stores dequantized weights exactly, in float32
        GGUF_FILE_TYPE_KEY: file_type,
    }
    if metadata.get("tokenizer.ggml.padding_token_id") is not None:
        config["pad_token_id"] = metadata["tokenizer.ggml.padding_token_id"]
    rope_scaling = _rope_scaling(metadata, arch)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    if model_type == "mistral":
        config["sliding_window"] = metadata.get(f"{arch}.attention.sliding_window")
    if model_type == "gemma3_text":
        config |= _gemma3(metadata, arch, config)
    return config


# Gemma 3 as llama.cpp writes it: every sixth layer global (rope base `freq_base`), the others
# local over `sliding_window` positions with rope base 10000 (neither is in the file's header)
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_BASE = 10000.0


def _gemma3(metadata: dict[str, Any], arch: str, config: dict[str, Any]) -> dict[str, Any]:
    layers = int(config["num_hidden_layers"])
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(metadata.get(f"{arch}.attention.sliding_window", 4096)),
        "layer_types": [
            "full_attention" if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else "sliding_attention"
            for i in range(layers)
        ],
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
        "query_pre_attn_scalar": int(config["head_dim"]),
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    }


def build_generation_config(metadata: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: bos, and every end-of-generation id llama.cpp would stop on."""
    eos_ids: list[int] = []
    # llama.cpp stops on eos and also on end-of-turn / end-of-message tokens (Llama 3's <|eot_id|>).
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and int(token_id) not in eos_ids:
            eos_ids.append(int(token_id))
    # Gemma's files name no eot token; llama.cpp ends generation on <end_of_turn> by its text
    if metadata.get("general.architecture") == "gemma3":
        tokens = metadata.get("tokenizer.ggml.tokens") or []
        if "<end_of_turn>" in tokens and tokens.index("<end_of_turn>") not in eos_ids:
            eos_ids.append(tokens.index("<end_of_turn>"))
    generation_config: dict[str, Any] = {}
    if metadata.get("tokenizer.ggml.bos_token_id") is not None:
        generation_config["bos_token_id"] = int(metadata["tokenizer.ggml.bos_token_id"])
    if eos_ids:
        generation_config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    return generation_config


def _required(metadata: dict[str, Any], key: str) -> Any:
    if key not in metadata:
        raise ModelLoadError(f"GGUF metadata has no {key!r}")
    return metadata[key]


def _num_key_value_heads(metadata: dict[str, Any], arch: str, num_attention_heads: int) -> int:
    value = metadata.get(f"{arch}.attention.head_count_kv", num_attention_heads)
    if isinstance(value, list):
        # Some files store one count per layer; our models need one count for all layers.
        if len(set(value)) != 1:
            raise ModelLoadError(f"GGUF has per-layer KV head counts {sorted(set(value))}; unsupported")
        value = value[0]
    return int(value)


def _rope_scaling(metadata: dict[str, Any], arch: str) -> dict[str, Any] | None:
    scaling_type = metadata.get(f"{arch}.rope.scaling.type")
    if scaling_type in (None, "none"):
        return None
    rope_scaling: dict[str, Any] = {"rope_type": scaling_type, "type": scaling_type}
    if f"{arch}.rope.scaling.factor" in metadata:
        rope_scaling["factor"] = float(metadata[f"{arch}.rope.scaling.factor"])
    if f"{arch}.rope.scaling.original_context_length" in metadata:
        rope_scaling["original_max_position_embeddings"] = int(
            metadata[f"{arch}.rope.scaling.original_context_length"]
        )
    return rope_scaling
