"""Read a Hugging Face model folder (config, safetensors, tokenizer files) into a ModelSource.

The folder is used in place: `weights_dir` is the folder itself. Only what Argosy needs is
read: config.json, tokenizer.json, tokenizer_config.json (or chat_template.jinja for the
template), and the optional generation_config.json and special_tokens_map.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from argosy.errors import ModelLoadError
from argosy.models.llava import vlm_text_config
from argosy.models.source import ModelSource


def load_hf_folder(folder: Path, name: str, tokenizer: Tokenizer | None = None) -> ModelSource:
    """ModelSource for an HF folder; ModelLoadError when a required file is missing or
    unreadable. `tokenizer`: its tokenizer.json's, already in memory (a conversion's)."""
    config = vlm_text_config(_read_json(folder / "config.json", required=True))  # a VLM: its decoder
    architectures = config.get("architectures") or []
    if not architectures:
        raise ModelLoadError(f"{folder / 'config.json'} names no architecture ('architectures' is empty)")
    if not any(folder.glob("*.safetensors")):
        raise ModelLoadError(f"{folder} has no *.safetensors weights (only safetensors are supported)")
    generation_config = _read_json(folder / "generation_config.json", required=False)
    tokenizer_config = _read_json(folder / "tokenizer_config.json", required=False)
    special_tokens_map = _read_json(folder / "special_tokens_map.json", required=False)
    if tokenizer is None:
        tokenizer = _read_tokenizer(folder / "tokenizer.json")

    bos_token = _token_text(tokenizer_config.get("bos_token") or special_tokens_map.get("bos_token"))
    eos_token = _token_text(tokenizer_config.get("eos_token") or special_tokens_map.get("eos_token"))
    bos_token_id = _first_id(
        tokenizer.token_to_id(bos_token) if bos_token else None,
        config.get("bos_token_id"),
        generation_config.get("bos_token_id"),
    )
    if bos_token is None and bos_token_id is not None:
        bos_token = tokenizer.id_to_token(bos_token_id)
    eos_token_ids = _union_ids(
        config.get("eos_token_id"),
        generation_config.get("eos_token_id"),
        tokenizer.token_to_id(eos_token) if eos_token else None,
    )
    if eos_token is None and eos_token_ids:
        eos_token = tokenizer.id_to_token(eos_token_ids[0])

    add_bos_token = bool(tokenizer_config.get("add_bos_token", False))
    # Some tokenizer.json files (Llama 3's) add BOS in their post-processor whenever
    # encode(..., add_special_tokens=True) runs. Then the flag must be off, or the caller would
    # prepend a second BOS. add_bos_token therefore means "the caller must prepend BOS itself".
    if _post_processor_adds_bos(tokenizer, bos_token_id):
        add_bos_token = False
    if add_bos_token and bos_token_id is None:
        raise ModelLoadError(f"{folder} asks for a BOS token (add_bos_token) but defines none")

    return ModelSource(
        name=name,
        architecture=str(architectures[0]),
        hf_config=config,
        weights_dir=folder,
        tokenizer=tokenizer,
        chat_template=_chat_template(folder, tokenizer_config),
        bos_token=bos_token,
        eos_token=eos_token,
        bos_token_id=bos_token_id,
        eos_token_ids=eos_token_ids,
        add_bos_token=add_bos_token,
        generation_config=generation_config,
        source_format="hf",
        source_path=folder,
    )


def _read_json(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path.parent} is not a Hugging Face model folder: no {path.name}")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


def _read_tokenizer(path: Path) -> Tokenizer:
    if not path.is_file():
        raise ModelLoadError(f"{path.parent} has no tokenizer.json (slow tokenizers are not supported)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises plain Exception subclasses for bad files
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def _token_text(token: Any) -> str | None:
    # tokenizer_config.json spells a token as a string or as a serialized AddedToken dict.
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) and token else None


def _first_id(*candidates: Any) -> int | None:
    for candidate in candidates:
        if isinstance(candidate, int):
            return candidate
        if isinstance(candidate, list) and candidate and isinstance(candidate[0], int):
            return int(candidate[0])
    return None


def _union_ids(*sources: Any) -> list[int]:
    """Ids from each source (int, list of ints or None), in order, without repeats."""
    ids: list[int] = []
    for source in sources:
        values = source if isinstance(source, list) else [source]
        for value in values:
            if isinstance(value, int) and not isinstance(value, bool) and value not in ids:
                ids.append(value)
    return ids


def _post_processor_adds_bos(tokenizer: Tokenizer, bos_token_id: int | None) -> bool:
    if bos_token_id is None:
        return False
    with_special = tokenizer.encode("a", add_special_tokens=True).ids
    without_special = tokenizer.encode("a", add_special_tokens=False).ids
    return with_special[:1] == [bos_token_id] and without_special[:1] != [bos_token_id]


def _chat_template(folder: Path, tokenizer_config: dict[str, Any]) -> str | None:
    # transformers >= 4.43 saves the template beside the config; that file wins, as it does there.
    template_file = folder / "chat_template.jinja"
    if template_file.is_file():
        try:
            return template_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"cannot read {template_file}: {exc}") from exc
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        # Several named templates ("default", "tool_use"); the default one renders chats.
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) and template else None
