"""The LoRA adapters one engine serves: their names, files and slots.

An adapter is added by name and path (`--lora NAME=PATH`, `adapters` in the models file,
`POST /v1/load_lora_adapter`), read and checked against the base at once (argosy/models/
lora_file.py: a file that does not fit is refused then, naming what differs). Up to
`max_loras` adapters are resident: their weights in a slot of the model's LoRA layers
(argosy/models/lora.py). A request for one that is not resident takes a free slot, or the least
recently used slot that no running request holds (that adapter's weights are dropped and read
from its file again on its next use); when every slot serves running requests, the request is
refused with a 503 and a Retry-After rather than waiting (a decision: the scheduler never sees
more adapters than slots).

Only the engine thread calls the methods that change state (add, remove, acquire, release);
`get` and `names` are plain reads for the request-checking threads.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from argosy.config import EngineConfig
from argosy.errors import (
    ArgosyError,
    ConflictError,
    InvalidRequestError,
    ModelLoadError,
    NotFoundError,
    OverloadedError,
)
from argosy.models.lora import LoraModel
from argosy.models.lora_file import LoraWeights, check_fits, read_adapter

if TYPE_CHECKING:
    from argosy.engine.sequence import Sequence
    from argosy.models.source import ModelSource
    from argosy.runner.model_runner import ModelRunner

log = logging.getLogger("argosy.engine")

_generations = itertools.count(1)


@dataclass(slots=True)
class Adapter:
    name: str
    path: str
    id: int  # its index in load order (llama.cpp's `lora: [{id, scale}]`)
    rank: int
    format: str  # "peft" or "gguf"
    salt: bytes  # its requests' prefix-cache root: its KV is not the base's, nor a reloaded file's
    weights: LoraWeights | None = None  # None while not resident
    slot: int | None = None
    users: int = 0  # requests in the engine running with it
    last_used: float = 0.0

    def describe(self) -> dict[str, object]:
        return {"name": self.name, "id": self.id, "path": self.path, "rank": self.rank, "format": self.format}


class AdapterSet:
    def __init__(
        self,
        lora: LoraModel,
        max_loras: int,
        max_rank: int,
        *,
        architecture: str | None,
        num_heads: int,
        num_kv_heads: int,
    ) -> None:
        self.lora = lora
        self.max_loras = max_loras
        self.max_rank = max_rank
        self._read_options = {
            "architecture": architecture,
            "num_heads": num_heads,
            "num_kv_heads": num_kv_heads,
        }
        self.adapters: dict[str, Adapter] = {}
        self._slots: list[str | None] = [None] * max_loras
        self._ids = itertools.count()
        self._held: dict[str, str] = {}  # request id -> the adapter it runs with
        self.num_loads = 0  # adapter files read (first loads and reloads after eviction)

    # -- reads (any thread) ----------------------------------------------------------------
    def get(self, name: str) -> Adapter | None:
        return self.adapters.get(name)

    def names(self) -> list[str]:
        return list(self.adapters)

    def by_id(self, adapter_id: int) -> Adapter | None:
        return next((a for a in self.adapters.values() if a.id == adapter_id), None)

    def stats(self) -> dict[str, int]:
        """EngineStats' LoRA fields."""
        resident = sum(1 for held in self._slots if held is not None)
        return {"lora_adapters": len(self.adapters), "lora_resident": resident, "lora_reads": self.num_loads}

    def describe(self) -> list[dict[str, object]]:
        return [a.describe() for a in sorted(self.adapters.values(), key=lambda a: a.id)]

    # -- changes (the engine thread) -------------------------------------------------------
    def add(self, name: str, path: str) -> Adapter:
        """Read and check `path`, then serve it as `name` (resident if a slot is free)."""
        if not name or not name.strip():
            raise InvalidRequestError("An adapter needs a name.", param="lora_name")
        if name in self.adapters:
            raise ConflictError(f"An adapter named {name!r} is already loaded.", param="lora_name")
        weights = self._read(path)
        adapter = Adapter(
            name,
            str(Path(path)),
            next(self._ids),
            weights.rank,
            weights.format,
            salt=f"lora:{name}:{next(_generations)}".encode(),
        )
        self.adapters[name] = adapter
        free = self._free_slot()
        if free is not None:
            self._place(adapter, weights, free)
        return adapter

    def remove(self, name: str) -> None:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise NotFoundError(f"No adapter named {name!r} is loaded.", param="lora_name")
        if adapter.users:
            raise ConflictError(
                f"The adapter {name!r} serves {adapter.users} running request(s); unload it when they end.",
                param="lora_name",
            )
        self._evict(adapter)
        del self.adapters[name]

    def acquire(self, name: str) -> Adapter:
        """The adapter resident and counted as used by one more request."""
        adapter = self.adapters.get(name)
        if adapter is None:
            raise NotFoundError(f"No adapter named {name!r} is loaded.", param="model")
        if adapter.slot is None:
            slot = self._free_slot()
            if slot is None:
                idle = [self.adapters[n] for n in self._slots if n is not None and not self.adapters[n].users]
                if not idle:
                    raise OverloadedError(
                        f"All {self.max_loras} adapter slots (--max-loras) serve running requests; "
                        f"{name!r} can run when one of them ends.",
                        retry_after_s=2,
                    )
                victim = min(idle, key=lambda a: a.last_used)
                slot = victim.slot
                self._evict(victim)
            assert slot is not None
            self._place(adapter, adapter.weights or self._read(adapter.path), slot)
        adapter.users += 1
        adapter.last_used = time.monotonic()
        return adapter

    def hold(self, seq: Sequence) -> None:
        """`seq`'s adapter resident until `let_go`: its slot and prefix-cache root on `seq`, the
        adapter's and its scale's (llama.cpp's `lora: [{id, scale}]`): a prompt's KV under
        another scale of the same adapter is not this request's."""
        assert seq.params.lora is not None
        adapter = self.acquire(seq.params.lora)
        assert adapter.slot is not None
        scale = seq.params.lora_scale
        salt = adapter.salt if scale == 1.0 else adapter.salt + b"@" + float(scale).hex().encode()
        seq.lora_slot, seq.cache_salt = adapter.slot, salt
        self._held[seq.request_id] = adapter.name

    def let_go(self, request_id: str) -> None:
        """A request left the engine: its adapter may leave its slot."""
        name = self._held.pop(request_id, None)
        adapter = self.adapters.get(name) if name is not None else None
        if adapter is not None and adapter.users:
            adapter.users -= 1
            adapter.last_used = time.monotonic()

    # -- slots -----------------------------------------------------------------------------
    def _read(self, path: str) -> LoraWeights:
        weights = read_adapter(path, max_rank=self.max_rank, **self._read_options)  # type: ignore[arg-type]
        check_fits(weights, self.lora.shapes, self.lora.num_layers)
        self.num_loads += 1
        return weights

    def _free_slot(self) -> int | None:
        return next((i for i, held in enumerate(self._slots) if held is None), None)

    def _place(self, adapter: Adapter, weights: LoraWeights, slot: int) -> None:
        self.lora.put(slot, weights.modules)
        self._slots[slot] = adapter.name
        adapter.slot = slot
        adapter.weights = weights

    def _evict(self, adapter: Adapter) -> None:
        if adapter.slot is not None:
            self.lora.clear(adapter.slot)
            self._slots[adapter.slot] = None
        adapter.slot = None
        adapter.weights = None


def serve_adapters(
    config: EngineConfig, runner: ModelRunner, source: ModelSource, device: str
) -> AdapterSet | None:
    """The engine's adapters when LoRA is on (`--lora`, `--enable-lora`), its layers wrapped
    for them; None when it is off. A configured adapter that cannot be served fails the load."""
    if not (config.enable_lora or config.loras):
        return None
    if not device.startswith("cpu"):
        raise ModelLoadError(f"LoRA adapters run on the CPU here, not on {device} (yet).")
    cfg = runner.model.config
    # the most rows a step can hold: a full token budget and every running sequence's draft
    max_rows = config.max_num_batched_tokens + config.max_num_seqs * (config.num_speculative_tokens + 1)
    adapters = AdapterSet(
        runner.enable_lora(max_rows),
        config.max_loras,
        config.max_lora_rank,
        architecture=source.hf_config.get("model_type"),
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
    )
    for name, path in config.loras:
        try:
            adapters.add(name, path)
        except ArgosyError as exc:
            raise ModelLoadError(f"LoRA adapter {name}={path}: {exc.message}") from exc
    log.info(
        "LoRA: %d adapter(s), up to %d resident, rank <= %d",
        len(config.loras),
        config.max_loras,
        config.max_lora_rank,
    )
    return adapters


def check_adapter(adapters: AdapterSet | None, name: str | None) -> None:
    """A 400 naming `lora` unless the engine serves an adapter of that name (None: the base)."""
    if name is None or (adapters is not None and adapters.get(name) is not None):
        return
    served = ", ".join(adapters.names()) if adapters is not None else ""
    raise InvalidRequestError(
        f"This model has no LoRA adapter named {name!r}"
        + (f" (it serves: {served})." if served else " (it serves none)."),
        param="lora",
    )
