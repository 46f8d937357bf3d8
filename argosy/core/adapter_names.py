"""Which chat model serves each LoRA adapter's name.

An adapter is a model id of its own (`"model": "NAME"`, as vLLM serves it), resolved to its
base model's entry; the engine of that model holds the weights (argosy/engine/adapters.py). The
names live in the base's ModelSpec (`adapters`), so a base unloaded and loaded again serves the
same adapters, those loaded at run time (POST /v1/load_lora_adapter) included.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from argosy.config import ModelSpec
from argosy.errors import ArgosyError, ConflictError, InvalidRequestError, NotFoundError

if TYPE_CHECKING:
    from argosy.core.registry import ModelEntry


class AdapterNames:
    def __init__(self, model_names: dict[str, ModelEntry]) -> None:
        self._models = model_names  # the registry's own names: an adapter may not take one
        self._base: dict[str, ModelEntry] = {}

    def claim(self, entry: ModelEntry, name: str) -> None:
        if name in self._models or name in self._base:
            raise ConflictError(f"The name {name!r} is already a served model or adapter.", param="lora_name")
        if entry.spec.kind != "chat":
            raise InvalidRequestError(
                f"LoRA adapters adapt a chat model; {entry.spec.id!r} is a {entry.spec.kind} model.", "model"
            )
        self._base[name] = entry

    def add(self, entry: ModelEntry, name: str, path: str) -> None:
        """A new adapter of `entry` from now on (kept in its spec across loads)."""
        self.claim(entry, name)
        entry.spec = dataclasses.replace(entry.spec, adapters=(*entry.spec.adapters, (name, path)))

    def remove(self, name: str) -> ModelEntry:
        entry = self._base.pop(name, None)
        if entry is None:
            raise NotFoundError(f"No LoRA adapter named {name!r} is served.", param="lora_name")
        entry.spec = dataclasses.replace(
            entry.spec, adapters=tuple(a for a in entry.spec.adapters if a[0] != name)
        )
        return entry

    def base_of(self, name: str | None) -> ModelEntry | None:
        return self._base.get(name) if name is not None else None

    def of(self, entry: ModelEntry) -> list[tuple[str, str]]:
        return list(entry.spec.adapters)


def lora_pairs(values: Any, param: str) -> tuple[tuple[str, str], ...]:
    """LoRA adapters as (name, path): from "NAME=PATH" strings or {name, path} tables."""
    pairs = []
    for value in values if isinstance(values, list) else [values]:
        if isinstance(value, dict) and set(value) == {"name", "path"}:
            name, path = str(value["name"]), str(value["path"])
        elif isinstance(value, str) and "=" in value:
            name, _, path = value.partition("=")
        else:
            raise ArgosyError(f"a LoRA adapter is NAME=PATH or {{name, path}}, got {value!r}", param)
        if not name.strip() or not path.strip():
            raise ArgosyError(f"a LoRA adapter needs a name and a path, got {value!r}", param)
        pairs.append((name.strip(), path.strip()))
    return tuple(pairs)


def with_adapters(specs: list[ModelSpec], loras: list[str]) -> list[ModelSpec]:
    """--lora's adapters added to the first chat model's."""
    if not loras:
        return specs
    chat = next((i for i, spec in enumerate(specs) if spec.kind == "chat"), None)
    if chat is None:
        raise ArgosyError("--lora needs a chat model to adapt; none is configured", "loras")
    specs = list(specs)
    spec = specs[chat]
    specs[chat] = dataclasses.replace(spec, adapters=(*spec.adapters, *lora_pairs(loras, "loras")))
    return specs


def adapter_by_id(engine: Any, choices: list[tuple[int, float]]) -> tuple[str | None, float]:
    """llama.cpp's `lora: [{id, scale}]` as (adapter name, scale): the one entry with a
    non-zero scale (none: the base model). One adapter per request: a second is refused."""
    listing = getattr(engine, "adapters", None)  # a fleet's engines serve none (yet)
    served = {int(a["id"]): str(a["name"]) for a in (listing() if listing is not None else [])}
    chosen = [(i, position, scale) for position, (i, scale) in enumerate(choices) if scale != 0.0]
    for i, position, _ in chosen:
        if i not in served:
            known = ", ".join(str(k) for k in sorted(served)) or "none"
            raise InvalidRequestError(
                f"No LoRA adapter has id {i} (this model's adapter ids: {known}).",
                param=f"lora[{position}].id",
            )
    if len(chosen) > 1:
        raise InvalidRequestError(
            "Argosy applies one LoRA adapter per request; this one gives a non-zero scale to "
            f"{len(chosen)} (a combination is not supported yet).",
            param="lora",
        )
    if not chosen:
        return None, 1.0
    i, _, scale = chosen[0]
    return served[i], scale
