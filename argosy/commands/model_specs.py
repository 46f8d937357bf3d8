"""The models a server is configured with: `--model [ID=]SOURCE[:QUANT]` (repeatable), a
`--models` TOML file's [[model]] tables (a --config file's too), `--lora` adapters added to the
first chat model; each source's kind inferred from what it is (argosy/cli.py builds the rest of
the configuration)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from argosy.commands.units import parse_duration
from argosy.config import ModelSpec, OperatorSampling
from argosy.core.adapter_names import lora_pairs
from argosy.errors import ArgosyError

# `argosy serve` with no model: the real model of the box (SmolLM2 stays the tests' small model)
DEFAULT_CHAT_MODEL = "qwen2.5-coder-0.5b"

_QUANTIZATIONS = ("none", "int4", "int8", "auto")


def known_model_names() -> list[str]:
    from argosy.audio.sources import AUDIO_REGISTRY
    from argosy.models.embedding_source import EMBEDDING_REGISTRY
    from argosy.models.loader import MODEL_REGISTRY

    return sorted({*MODEL_REGISTRY, *EMBEDDING_REGISTRY, *AUDIO_REGISTRY})


def check_source(source: str) -> None:
    """A registered name or an existing path; anything else is refused naming the close ones."""
    import difflib

    names = known_model_names()
    looks_like_path = "/" in source or source.startswith("~") or Path(source).suffix in (".gguf", ".onnx")
    if source in names or looks_like_path or Path(source).expanduser().exists():
        return  # a path that does not exist is reported when its model loads
    close = difflib.get_close_matches(source, names, n=3, cutoff=0.5)
    hint = f"did you mean {' or '.join(close)}?" if close else f"registered names: {', '.join(names)}"
    raise ArgosyError(
        f"no model {source!r}: not a registered name nor an existing file or folder; {hint}", "model"
    )


def parse_model_arg(text: str) -> ModelSpec:
    """`[ID=]SOURCE[:QUANT]` -> a ModelSpec; the kind is inferred from the source."""
    model_id, has_id, rest = text.partition("=")
    if not has_id:
        model_id, rest = "", text
    source, quantization = rest, None
    head, colon, tail = rest.rpartition(":")
    if colon and tail in _QUANTIZATIONS:
        source, quantization = head, tail
    if not source:
        raise ArgosyError(f"no model source in {text!r}", param="model")
    return ModelSpec(
        id=model_id or source,
        source=source,
        kind=model_kind(source),
        quantization=quantization,
    )


def model_kind(source: str) -> str:
    """embedding for a registered embedding name or a sentence-transformers folder; rerank for a
    cross-encoder folder (a BERT *ForSequenceClassification) or a causal LM reranker's (a
    *ForCausalLM folder named *reranker*); transcription or speech for an
    audio model (argosy/audio/sources.py); image for a diffusers pipeline folder; music for a
    MusicGen folder; else chat."""
    from argosy.audio.music import is_musicgen_folder
    from argosy.audio.sources import audio_kind
    from argosy.images.service import is_diffusers_folder
    from argosy.models.cross_encoder import is_causal_reranker_folder, is_cross_encoder_folder
    from argosy.models.embedding_source import EMBEDDING_REGISTRY

    kind = audio_kind(source)
    if kind is not None:
        return kind
    if is_diffusers_folder(source):
        return "image"
    if is_musicgen_folder(source):
        return "music"

    if source in EMBEDDING_REGISTRY:
        return "embedding"
    if is_cross_encoder_folder(source) or is_causal_reranker_folder(source):
        return "rerank"
    folder = Path(source).expanduser()
    if folder.is_dir() and (
        (folder / "modules.json").exists() or (folder / "sentence_bert_config.json").exists()
    ):
        return "embedding"
    return "chat"


def models_from_toml(path: str) -> list[ModelSpec]:
    import tomllib

    try:
        with open(Path(path).expanduser(), "rb") as file:
            document = tomllib.load(file)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ArgosyError(f"cannot read {path}: {exc}", param="models_file") from exc
    return specs_from_tables(document.get("model", []), path, "models_file")


def specs_from_tables(tables: Any, path: str, param: str) -> list[ModelSpec]:
    """[[model]] tables (a models.toml's, or a --config file's) as ModelSpecs."""
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ArgosyError(f"{path}: expected [[model]] tables", param=param)
    specs = []
    known = {f.name for f in dataclasses.fields(ModelSpec)}
    for position, table in enumerate(tables):
        unknown = sorted(set(table) - known)
        if unknown:
            raise ArgosyError(f"{path}: model {position}: unknown keys {', '.join(unknown)}", param)
        values = dict(table)
        if "source" not in values:
            raise ArgosyError(f"{path}: model {position} has no source", param=param)
        values.setdefault("id", values["source"])
        values.setdefault("kind", model_kind(values["source"]))
        values["aliases"] = tuple(values.get("aliases", ()))
        if "keep_alive" in values and isinstance(values["keep_alive"], str):
            values["keep_alive"] = parse_duration(values["keep_alive"])
        if "sampling" in values:
            values["sampling"] = OperatorSampling(**values["sampling"])
        if "adapters" in values:
            values["adapters"] = lora_pairs(values["adapters"], param)
        try:
            specs.append(ModelSpec(**values))
        except TypeError as exc:
            raise ArgosyError(f"{path}: model {position}: {exc}", param=param) from exc
    return specs


def model_specs(model_args: list[str] | None, models_file: str | None) -> list[ModelSpec]:
    """The configured models: --models' file first, then each --model; the default chat model
    (Qwen2.5-Coder-0.5B, assembled from its packages) when none."""
    specs = models_from_toml(models_file) if models_file else []
    specs += [parse_model_arg(text) for text in model_args or []]
    if not specs:
        specs = [parse_model_arg(DEFAULT_CHAT_MODEL)]
    return specs
