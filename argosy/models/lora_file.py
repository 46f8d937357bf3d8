"""LoRA adapter files read into one plain form: per (layer, module), A [r, in], B [out, r] and
the scale, all float32 torch tensors, whatever the file held.

Two formats: a PEFT folder (adapter_config.json + adapter_model.safetensors) and a llama.cpp
GGUF LoRA (convert_lora_to_gguf.py's output). Both store PEFT's nn.Linear layout: A [r, in],
B [out, r] (GGUF's ggml dims are the reverse, ne = [in, r] and [r, out]; llama-adapter.cpp
checks a.ne[0] == the base's in and b.ne[1] == its out). Only the seven attention/MLP
projections are served; anything else an adapter changes (embeddings, biases, saved modules,
LoRA variants) is refused by name, never silently dropped, since the output would be wrong.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from argosy.errors import InvalidRequestError, ModelLoadError
from argosy.models.gguf_file import GGUFFile
from argosy.models.gguf_tensors import _PERMUTED_MODEL_TYPES, dequantize_tensor, unpermute_rope_rows

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn"}
_PARENT |= {"gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_GGUF_ROLES = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj"}
_GGUF_ROLES |= {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}

_PEFT_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight")
_GGUF_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight\.lora_([ab])")
_PEFT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# adapter_config.json fields that, when set, make the adapter compute something other than
# B @ A on the seven projections (so serving A and B alone would be wrong): field -> what it is.
_UNSUPPORTED_FIELDS = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "fully trained modules (modules_to_save)",
    "trainable_token_indices": "trained token embeddings (trainable_token_indices)",
    "lora_bias": "a bias on lora_B (lora_bias)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "layer_replication": "layer replication (layer_replication)",
    "target_parameters": "LoRA on parameters (target_parameters)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "kasa_config": "KaSA (kasa_config)",
}

ModuleKey = tuple[int, str]


class AdapterError(InvalidRequestError):
    """An adapter file that cannot be served; the message names the file and what is wrong."""

    def __init__(self, message: str, param: str | None = "lora_path") -> None:
        super().__init__(message, param=param)


@dataclass(slots=True)
class LoraWeights:
    path: str  # the folder or file read
    rank: int  # the largest rank of any module
    alpha: float
    # (layer index, module name in LORA_MODULES) -> (A float32 [r, in], B float32 [out, r], scale)
    modules: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]
    base_hint: str | None  # base_model_name_or_path, or the GGUF's general.architecture
    format: str  # "peft" or "gguf"

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b, _ in self.modules.values())


def read_adapter(
    path: str | Path,
    *,
    max_rank: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    architecture: str | None = None,
) -> LoraWeights:
    """A PEFT folder (or its adapter_config.json / adapter_model.safetensors given directly) or a
    GGUF LoRA file. `architecture` (the base's HF model_type; default: the GGUF's own) decides
    whether llama.cpp permuted q/k rows; undoing that needs `num_heads` / `num_kv_heads`."""
    path = Path(path)
    try:  # the file system's refusals (a name too long, no permission) are the client's path's
        if not path.exists():
            raise _error(path, "does not exist")
        if path.is_dir():
            weights = _read_peft(path)
        elif path.name in ("adapter_config.json", "adapter_model.bin") or path.suffix == ".safetensors":
            weights = _read_peft(path.parent)
        else:
            weights = _read_gguf(path, num_heads, num_kv_heads, architecture)
    except OSError as exc:
        raise _error(path, f"cannot be read ({exc.strerror or exc})") from exc
    if max_rank is not None and weights.rank > max_rank:
        raise _error(path, f"rank {weights.rank} is above this server's --max-lora-rank {max_rank}")
    return weights


def check_fits(weights: LoraWeights, shapes: dict[str, tuple[int, int]], num_layers: int) -> None:
    """Refuse (AdapterError naming module, layer and shapes) an adapter that does not fit a base
    whose module `name` takes `in` features to `out` (`shapes[name] = (out, in)`, the same for every
    layer) and has `num_layers` layers: a layer index out of range, an A whose in differs, a B whose out
    differs, A's rank != B's rank."""
    for (layer, name), (a, b, _) in sorted(weights.modules.items()):
        where = f"{name} of layer {layer}"
        if not 0 <= layer < num_layers:
            raise _error(weights.path, f"{where} is out of range: the base model has {num_layers} layers")
        if name not in shapes:
            raise _error(weights.path, f"{where}: the base model has no {name}")
        _check_pair(weights.path, where, a, b)
        out_features, in_features = shapes[name]
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise _error(
                weights.path,
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base's "
                f"{name}, which takes {in_features} features to {out_features}",
            )


def _error(path: str | Path, problem: str) -> AdapterError:
    return AdapterError(f"LoRA adapter {path}: {problem}")


def _check_pair(path: str | Path, where: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
        raise _error(
            path, f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not [r, in] and [out, r]"
        )


def _pair_up(
    path: str | Path, halves: dict[ModuleKey, dict[str, torch.Tensor]]
) -> dict[ModuleKey, tuple[torch.Tensor, torch.Tensor]]:
    """Each module's (A, B), checked: both present, 2-D, the same rank, finite."""
    if not halves:
        raise _error(path, "has no LoRA tensors (lora_A / lora_B)")
    pairs: dict[ModuleKey, tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, name), half in sorted(halves.items()):
        where = f"{name} of layer {layer}"
        if "A" not in half or "B" not in half:
            have, lack = ("lora_A", "lora_B") if "A" in half else ("lora_B", "lora_A")
            raise _error(path, f"{where} has a {have} without its {lack}")
        a, b = half["A"], half["B"]
        _check_pair(path, where, a, b)
        for role, tensor in (("lora_A", a), ("lora_B", b)):
            if not bool(torch.isfinite(tensor).all()):
                raise _error(path, f"{where}: {role} holds non-finite values (NaN or inf)")
        pairs[(layer, name)] = (a, b)
    return pairs


# -- PEFT ----------------------------------------------------------------------------------------
def _read_peft(folder: Path) -> LoraWeights:
    config_path = folder / "adapter_config.json"
    if not config_path.is_file():
        raise _error(folder, "has no adapter_config.json (not a PEFT adapter folder)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _error(config_path, f"is not readable JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise _error(config_path, "is not a JSON object")
    alpha, alpha_pattern, use_rslora = _peft_settings(config_path, config)
    halves, module_names = _peft_halves(folder)
    pairs = _pair_up(folder, halves)
    modules: dict[ModuleKey, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for key, (a, b) in pairs.items():
        module_alpha = _pattern_value(alpha_pattern, module_names[key], alpha)
        rank = a.shape[0]
        modules[key] = (a, b, module_alpha / (math.sqrt(rank) if use_rslora else rank))
    base_hint = config.get("base_model_name_or_path")
    return LoraWeights(
        path=str(folder),
        rank=max(a.shape[0] for a, _ in pairs.values()),
        alpha=alpha,
        modules=modules,
        base_hint=base_hint if isinstance(base_hint, str) and base_hint else None,
        format="peft",
    )


AlphaPattern = list[tuple[re.Pattern[str], float]]


def _peft_settings(config_path: Path, config: dict[str, Any]) -> tuple[float, AlphaPattern, bool]:
    """(lora_alpha, alpha_pattern, use_rslora), after refusing what cannot be served. Ranks,
    rank_pattern's included, come from the tensors' shapes; fan_in_fan_out only transposes the
    merged delta for Conv1D bases (A and B are nn.Linear-shaped either way), so it is ignored."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _error(config_path, f"is a {peft_type} adapter; only LoRA adapters are served")
    bias = config.get("bias", "none")
    if bias != "none":
        raise _error(config_path, f"trains biases (bias={bias!r}); only bias='none' adapters are served")
    for field, what in _UNSUPPORTED_FIELDS.items():
        if config.get(field):
            raise _error(config_path, f"uses {what}, which is not supported: {config[field]!r}")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        for target in targets:
            if str(target).rsplit(".", 1)[-1] not in LORA_MODULES:
                raise _error(config_path, f"targets {target!r}; only {', '.join(LORA_MODULES)} are supported")
    alpha = config.get("lora_alpha")
    alpha_pattern = config.get("alpha_pattern") or {}
    values: list[Any] = [alpha, *alpha_pattern.values()] if isinstance(alpha_pattern, dict) else [None]
    if not all(isinstance(x, int | float) and not isinstance(x, bool) for x in values):
        raise _error(config_path, f"lora_alpha {alpha!r} / alpha_pattern {alpha_pattern!r} are not numbers")
    try:
        # peft's get_pattern_key: a key matches a dotted suffix of the module's name
        pattern = [(re.compile(rf"(.*\.)?({key})$"), float(v)) for key, v in alpha_pattern.items()]
    except re.error as exc:
        raise _error(config_path, f"alpha_pattern has a key that is not a regular expression: {exc}") from exc
    return float(values[0]), pattern, bool(config.get("use_rslora"))


def _pattern_value(pattern: AlphaPattern, module: str, default: float) -> float:
    # the first key that matches, as peft; `module` is the name the model has (the tensor's,
    # less "base_model.model." and ".lora_A.weight")
    for key, value in pattern:
        if key.match(module):
            return value
    return default


def _peft_halves(folder: Path) -> tuple[dict[ModuleKey, dict[str, torch.Tensor]], dict[ModuleKey, str]]:
    """Each module's {"A": A, "B": B} as float32, and its name in the model (for alpha_pattern)."""
    weights_path = folder / "adapter_model.safetensors"
    if not weights_path.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise _error(folder, "has only adapter_model.bin; only adapter_model.safetensors is read")
        raise _error(folder, "has no adapter_model.safetensors")
    try:
        with safe_open(str(weights_path), framework="pt") as file:
            tensors = {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as exc:
        raise _error(weights_path, f"is not a readable safetensors file: {exc}") from exc
    halves: dict[ModuleKey, dict[str, torch.Tensor]] = {}
    module_names: dict[ModuleKey, str] = {}
    for name, tensor in tensors.items():
        match = _PEFT_TENSOR.search(name)
        if match is None or match.group(3) not in LORA_MODULES or _PARENT[match.group(3)] != match.group(2):
            raise _error(
                weights_path,
                f"has tensor {name!r}, an unsupported target (only {', '.join(LORA_MODULES)} are supported)",
            )
        if tensor.dtype not in _PEFT_DTYPES:
            raise _error(
                weights_path, f"tensor {name!r} has dtype {tensor.dtype}; float32/16 or bfloat16 expected"
            )
        layer, _, module, half = match.groups()
        key = (int(layer), module)
        halves.setdefault(key, {})[half] = tensor.to(torch.float32).contiguous()
        module_names[key] = name[: match.start(4) - len(".lora_")].removeprefix("base_model.model.")
    return halves, module_names


# -- GGUF ----------------------------------------------------------------------------------------
def _read_gguf(
    path: Path, num_heads: int | None, num_kv_heads: int | None, architecture: str | None
) -> LoraWeights:
    try:
        reader = GGUFFile(path)
    except (ValueError, struct.error, OSError, UnicodeDecodeError, OverflowError) as exc:
        raise _error(path, f"is not a readable GGUF file (or PEFT folder): {exc}") from exc
    meta = reader.metadata
    if meta.get("general.type") != "adapter":
        raise _error(path, f"is not an adapter (general.type is {meta.get('general.type')!r})")
    if meta.get("adapter.type") != "lora":
        raise _error(path, f"is a {meta.get('adapter.type')!r} adapter, not a LoRA")
    if meta.get("adapter.alora.invocation_tokens"):
        raise _error(path, "is an activated LoRA (adapter.alora.invocation_tokens), which is not supported")
    alpha = meta.get("adapter.lora.alpha", 0.0)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise _error(path, f"adapter.lora.alpha {alpha!r} is not a number")
    gguf_arch = meta.get("general.architecture")
    halves: dict[ModuleKey, dict[str, np.ndarray]] = {}
    for tensor in reader.tensors:
        match = _GGUF_TENSOR.fullmatch(tensor.name)
        if match is None or match.group(2) not in _GGUF_ROLES:
            raise _error(
                path,
                f"has tensor {tensor.name!r}, an unsupported target (only {', '.join(_GGUF_ROLES)} are supported)",
            )
        try:
            values = dequantize_tensor(tensor)
        except ModelLoadError as exc:
            raise _error(path, exc.message) from exc
        layer, role, half = match.groups()
        halves.setdefault((int(layer), _GGUF_ROLES[role]), {})[half.upper()] = values
    if (architecture or gguf_arch) in _PERMUTED_MODEL_TYPES:
        _unpermute_qk(path, halves, num_heads, num_kv_heads)
    tensors = {
        key: {h: torch.from_numpy(np.array(v, np.float32)) for h, v in half.items()}
        for key, half in halves.items()
    }
    pairs = _pair_up(path, tensors)
    # llama.cpp (llama-adapter.h get_scale): alpha / rank, rank = lora_b's ne[0]; alpha 0 means 1.0
    modules = {key: (a, b, alpha / b.shape[1] if alpha else 1.0) for key, (a, b) in pairs.items()}
    return LoraWeights(
        path=str(path),
        rank=max(a.shape[0] for a, _ in pairs.values()),
        alpha=float(alpha),
        modules=modules,
        base_hint=gguf_arch if isinstance(gguf_arch, str) else None,
        format="gguf",
    )


def _unpermute_qk(
    path: Path,
    halves: dict[ModuleKey, dict[str, np.ndarray]],
    num_heads: int | None,
    num_kv_heads: int | None,
) -> None:
    """Undo convert_hf_to_gguf's q/k row permutation, which LoRA conversion applies to lora_b
    only (A's rows are ranks, not output features)."""
    for (layer, name), half in halves.items():
        b = half.get("B")
        if name not in ("q_proj", "k_proj") or b is None or b.ndim != 2:
            continue
        heads = num_heads if name == "q_proj" else num_kv_heads
        if heads is None:
            raise ValueError(f"{path}: a q/k-permuted architecture needs num_heads and num_kv_heads")
        if b.shape[0] % (2 * heads):
            raise _error(
                path, f"{name} of layer {layer}: lora_B's {b.shape[0]} rows do not split into {heads} heads"
            )
        half["B"] = unpermute_rope_rows(b, heads)
