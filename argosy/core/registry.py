"""ModelRegistry: every configured model, loaded on request, unloaded when room is needed.

A model is `unloaded`, `loading`, `loaded`, `unloading` or `failed`. `acquire(name, kind)`
resolves a request's `model` (unknown: 404; the wrong kind: 400 naming the model's kind —
both before any load) and returns a Lease on the loaded model, loading it first if need be:
concurrent requests for one model wait for one load; at most `max_concurrent_loads` loads
run at once, and a request that needs one more while they all run gets 503 + Retry-After at
once; a request that would wait past `model_load_timeout` gets 503 + Retry-After (the load
goes on). A lease is held from acquire until its generation ends; a model is
unloaded only when it holds none.

Room: before a load, past `max_loaded_models` the least recently used unpinned model is
unloaded (its in-flight requests finish first); after a load, past `max_loaded_memory`
(the loaded models' own count of their weights and KV pool) likewise. A model idle for
longer than its keep-alive (the model's, else the server's; None: forever) is unloaded by
`sweep_idle`. Pinned models and the first configured one are loaded at start-up
(`preload`); pinned ones are never unloaded to make room.

Loading itself (files, quantization, packing, compile) happens in `load_fn`, on a worker
thread: the registry only orders it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from argosy.config import ModelSpec, OperatorSampling
from argosy.core.adapter_names import AdapterNames
from argosy.core.service import ModelInfo
from argosy.engine.arrivals import Arrival
from argosy.errors import ArgosyError, InvalidRequestError, ModelNotFoundError, ModelUnavailableError
from argosy.sampling_params import effective_defaults

log = logging.getLogger("argosy.registry")


class LoadedModel(Protocol):
    """What a load returns: a ModelService (chat) or an EmbeddingService."""

    model_id: str

    def model_info(self, state: str = "loaded") -> ModelInfo: ...

    def arriving(self) -> Arrival: ...

    def shutdown(self) -> None: ...

    @property
    def is_alive(self) -> bool: ...


LoadFn = Callable[[ModelSpec], LoadedModel]


@dataclass(slots=True, eq=False)
class ModelEntry:
    spec: ModelSpec
    created: int
    state: str = "unloaded"
    service: Any = None  # the LoadedModel while loaded
    error: str | None = None
    num_active: int = 0  # leases held
    last_used: float = field(default_factory=time.monotonic)
    num_loads: int = 0
    # a request's keep-alive (Ollama's `keep_alive`): seconds idle before it is unloaded, from
    # the last request's end; math.inf: never; None: the model's or the server's setting
    keep_alive_override: float | None = None
    loading: asyncio.Future[None] | None = None
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    unloaded: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def is_evictable(self) -> bool:
        return self.state == "loaded" and not self.spec.pinned


class Lease:
    """A request's hold on a loaded model; `release()` once it is done (idempotent)."""

    __slots__ = ("_entry", "_registry", "service")

    def __init__(self, registry: ModelRegistry, entry: ModelEntry) -> None:
        self._registry = registry
        self._entry: ModelEntry | None = entry
        self.service: Any = entry.service
        entry.num_active += 1
        entry.idle.clear()
        entry.last_used = time.monotonic()

    def release(self) -> None:
        entry, self._entry = self._entry, None
        if entry is None:
            return
        entry.num_active -= 1
        entry.last_used = time.monotonic()
        if entry.num_active == 0:
            entry.idle.set()


class ArrivalGroup:
    """One request on its way, counted at every loaded chat model until the pipeline knows
    which model it names (`keep`); then only that one's count stays until it is queued."""

    __slots__ = ("_arrivals",)

    def __init__(self, arrivals: dict[str, Arrival]) -> None:
        self._arrivals = arrivals

    def keep(self, model_id: str) -> Arrival | None:
        kept = self._arrivals.pop(model_id, None)
        self.done()
        return kept

    def done(self) -> None:
        arrivals, self._arrivals = self._arrivals, {}
        for arrival in arrivals.values():
            arrival.done()


class ModelRegistry:
    def __init__(
        self,
        specs: list[ModelSpec],
        load_fn: LoadFn,
        *,
        max_loaded_models: int | None = None,
        max_loaded_memory: int | None = None,
        max_concurrent_loads: int = 1,
        load_timeout_s: float = 120.0,
        keep_alive_s: float | None = None,
        operator_sampling: OperatorSampling | None = None,
    ) -> None:
        if not specs:
            raise InvalidRequestError("at least one model must be configured", "model")
        created = int(time.time())
        self.entries: list[ModelEntry] = [ModelEntry(spec, created) for spec in specs]
        self._by_name: dict[str, ModelEntry] = {}
        for entry in self.entries:
            for name in entry.spec.names:
                if name in self._by_name:
                    raise InvalidRequestError(f"two configured models are named {name!r}", "model")
                self._by_name[name] = entry
        self.adapters = AdapterNames(self._by_name)  # LoRA adapters: model ids of their own
        for entry in self.entries:
            for name, _ in entry.spec.adapters:
                self.adapters.claim(entry, name)
        for entry in self.entries:
            satellite = entry.spec.satellite
            if satellite is None:
                continue
            target = self._by_name.get(satellite)
            if target is None or target.spec.kind != "chat" or target is entry:
                raise InvalidRequestError(
                    f"model {entry.spec.id!r}: its satellite {satellite!r} must be another configured chat model",
                    "model",
                )
        self._load_fn = load_fn
        self.max_loaded_models = max_loaded_models
        self.max_loaded_memory = max_loaded_memory
        self.load_timeout_s = load_timeout_s
        self.keep_alive_s = keep_alive_s
        self.operator_sampling = operator_sampling or OperatorSampling()
        self.max_concurrent_loads = max_concurrent_loads
        self._load_slots = asyncio.Semaphore(max_concurrent_loads)
        self._num_loading = 0  # loads started and not ended (a request past the slots: 503)
        self._room_lock = asyncio.Lock()  # one load at a time decides what to unload
        self.on_load_failed: Callable[[ModelEntry], None] | None = None

    def add(self, spec: ModelSpec) -> ModelEntry:
        """Serve one more model from now on (a pulled one), unloaded until a request names it;
        a name already served is refused."""
        taken = [name for name in spec.names if name in self._by_name]
        if taken:
            raise InvalidRequestError(f"a served model is already named {taken[0]!r}", "model")
        entry = ModelEntry(spec, int(time.time()))
        self.entries.append(entry)
        for name in spec.names:
            self._by_name[name] = entry
        return entry

    # -- names -----------------------------------------------------------------------------
    def fim_model(self, name: str | None) -> str | None:
        """The model that serves `name`'s fill-in-the-middle requests: its satellite, if the
        models file names one, else itself."""
        entry = self.resolve(name, "chat")
        return entry.spec.satellite or name

    def resolve(self, name: str | None, kind: str | tuple[str, ...] | None = None) -> ModelEntry:
        """The entry a request's `model` names (None: the first model of `kind`, or of the
        first of several kinds that has one: ("embedding", "chat") for the embedding routes,
        which a chat model serves too); no load."""
        kinds = (kind,) if isinstance(kind, str) else kind
        if name is None:
            for wanted in kinds or (None,):
                for entry in self.entries:
                    if wanted is None or entry.spec.kind == wanted:
                        return entry
            raise InvalidRequestError(
                f"This server serves no {' or '.join(kinds or ())} model.", param="model"
            )
        found = self._by_name.get(name) or self.adapters.base_of(name)
        if found is None:
            served = [e.spec.id for e in self.entries] + [a for e in self.entries for a, _ in e.spec.adapters]
            raise ModelNotFoundError(name, served)
        if kinds is not None and found.spec.kind not in kinds:
            article = "an" if found.spec.kind[0] in "aeiou" else "a"
            needed = " or ".join(kinds)
            raise InvalidRequestError(
                f"The model '{name}' is {article} {found.spec.kind} model; this route needs "
                f"{'an' if needed[0] in 'aeiou' else 'a'} {needed} model.",
                param="model",
                code="wrong_model_kind",
            )
        return found

    def loaded(self) -> list[ModelEntry]:
        return [e for e in self.entries if e.state == "loaded"]

    def info(self, entry: ModelEntry) -> ModelInfo:
        if entry.state == "loaded" and entry.service is not None:
            info: ModelInfo = entry.service.model_info("loaded")
            return _replace_info(info, created=entry.created, aliases=entry.spec.aliases)
        return ModelInfo(
            id=entry.spec.id,
            created=entry.created,
            kind=entry.spec.kind,
            state=entry.state,
            is_loaded=False,
            context_length=entry.spec.max_model_len,
            architecture=None,
            dtype=None,
            quantization=None,
            has_chat_template=False,
            # only what the operator pins: the rest may change when the model loads
            sampling_defaults=(
                effective_defaults(entry.spec.sampling or self.operator_sampling, None)
                if entry.spec.kind == "chat"
                else {}
            ),
            aliases=entry.spec.aliases,
            error=entry.error,
        )

    def arriving(self) -> ArrivalGroup:
        """Count a request on its way at every loaded model (see ArrivalGroup)."""
        return ArrivalGroup({e.spec.id: e.service.arriving() for e in self.loaded()})

    # -- leases ----------------------------------------------------------------------------
    async def acquire(self, entry: ModelEntry, *, queue_for_slot: bool = False) -> Lease:
        """A lease on `entry`'s loaded model, loading it first if need be (bounded wait).
        A client's request that needs a load while every load slot is busy is refused at once
        (503); the server's own work (`queue_for_slot`: an audio job run again after a
        restart) has no client to retry and waits its turn for a slot."""
        deadline = time.monotonic() + self.load_timeout_s
        while True:
            if entry.state == "loaded" and not entry.service.is_alive:
                await self._discard_dead(entry)  # its engine stopped: load it afresh
            if entry.state == "loaded":
                return Lease(self, entry)
            if entry.state == "unloading":
                await self._wait(entry.unloaded.wait(), entry, deadline)
                continue
            if entry.state in ("unloaded", "failed"):
                if not queue_for_slot:
                    self._check_load_slot(entry)
                self._start_load(entry)
            assert entry.loading is not None
            await self._wait(asyncio.shield(entry.loading), entry, deadline)
            if entry.state == "failed":
                raise ArgosyError(f"Model {entry.spec.id!r} failed to load: {entry.error}")

    async def _wait(self, awaitable: Any, entry: ModelEntry, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise TimeoutError
            await asyncio.wait_for(awaitable, remaining)
        except TimeoutError:
            if asyncio.iscoroutine(awaitable):
                awaitable.close()
            raise ModelUnavailableError(
                f"Model {entry.spec.id!r} is {entry.state} and was not ready within "
                f"{self.load_timeout_s:g} s; retry shortly.",
                retry_after_s=max(1, round(self.load_timeout_s / 4)),
            ) from None

    def _check_load_slot(self, entry: ModelEntry) -> None:
        """A request that needs a load while every load slot is taken is answered 503 +
        Retry-After at once rather than queued behind the loads (as the reference bounds its
        resolutions): a client retries, perhaps elsewhere, instead of holding a connection for
        up to `model_load_timeout`. A request for a model already loading waits for that load."""
        if self._num_loading >= self.max_concurrent_loads:
            raise ModelUnavailableError(
                f"Model {entry.spec.id!r} is not loaded and every load slot "
                f"({self.max_concurrent_loads}) is busy loading other models; retry shortly.",
                retry_after_s=max(1, round(self.load_timeout_s / 4)),
            )

    # -- loading and unloading -----------------------------------------------------------------
    def _start_load(self, entry: ModelEntry) -> None:
        self._num_loading += 1  # until _load ends (counted now: its task takes the slot later)
        entry.state, entry.error = "loading", None
        entry.unloaded.clear()
        entry.loading = asyncio.get_running_loop().create_future()
        asyncio.create_task(self._load(entry), name=f"load-{entry.spec.id}")

    async def _load(self, entry: ModelEntry) -> None:
        assert entry.loading is not None
        future = entry.loading
        try:
            async with self._load_slots:
                async with self._room_lock:
                    await self._make_room_for(entry)
                started = time.perf_counter()
                log.info("loading model %r (%s, %s)", entry.spec.id, entry.spec.source, entry.spec.kind)
                service = await asyncio.to_thread(self._load_fn, entry.spec)
            entry.service, entry.state = service, "loaded"
            entry.num_loads += 1
            entry.last_used = time.monotonic()
            entry.idle.set()
            log.info("model %r loaded in %.1fs", entry.spec.id, time.perf_counter() - started)
        except BaseException as exc:  # a model that cannot load fails its requests, not the server
            log.exception("model %r failed to load", entry.spec.id)
            entry.state, entry.error = "failed", f"{type(exc).__name__}: {exc}"
            entry.unloaded.set()
            if self.on_load_failed is not None:
                self.on_load_failed(entry)
        finally:
            self._num_loading -= 1
            future.set_result(None)
        if entry.state == "loaded" and self.max_loaded_memory is not None:
            async with self._room_lock:
                await self._fit_memory(keep=entry)

    async def _make_room_for(self, entry: ModelEntry) -> None:
        """Unload least recently used models until one more fits max_loaded_models."""
        limit = self.max_loaded_models
        if limit is None:
            return
        while True:
            holding = [
                e for e in self.entries if e is not entry and e.state in ("loaded", "loading", "unloading")
            ]
            if len(holding) < limit:
                return
            victims = sorted((e for e in holding if e.is_evictable), key=lambda e: e.last_used)
            if victims:
                await self.unload(
                    victims[0], reason=f"room for {entry.spec.id!r} (--max-loaded-models {limit})"
                )
                continue
            unloading = [e for e in holding if e.state == "unloading"]
            if unloading:
                await unloading[0].unloaded.wait()
                continue
            await asyncio.sleep(0.05)  # every other model is pinned or loading: wait (bounded by callers)

    async def _fit_memory(self, keep: ModelEntry) -> None:
        budget = self.max_loaded_memory
        assert budget is not None
        while True:
            loaded = self.loaded()
            total = sum(e.service.model_info().memory_bytes or 0 for e in loaded)
            victims = sorted(
                (e for e in loaded if e is not keep and e.is_evictable), key=lambda e: e.last_used
            )
            if total <= budget or not victims:
                return
            await self.unload(victims[0], reason=f"memory {total} > --max-loaded-memory {budget}")

    async def unload(self, entry: ModelEntry, reason: str = "requested") -> None:
        """Unload once its in-flight requests are done; new requests for it wait, then reload."""
        if entry.state != "loaded":
            return
        entry.state = "unloading"
        log.info("unloading model %r: %s (waiting for %d requests)", entry.spec.id, reason, entry.num_active)
        if entry.num_active:
            await entry.idle.wait()
        service, entry.service = entry.service, None
        await asyncio.to_thread(service.shutdown)
        entry.state = "unloaded"
        entry.keep_alive_override = None
        entry.unloaded.set()
        log.info("model %r unloaded", entry.spec.id)

    async def _discard_dead(self, entry: ModelEntry) -> None:
        """A loaded model whose engine stopped: its requests have had their error; shut it
        down and mark it unloaded, so the next request loads it again."""
        if entry.state != "loaded" or entry.service is None or entry.service.is_alive:
            return
        log.error("model %r: its engine stopped; unloading it (the next request reloads it)", entry.spec.id)
        service, entry.service = entry.service, None
        entry.state = "unloaded"
        entry.unloaded.set()
        entry.idle.set()
        await asyncio.to_thread(service.shutdown)

    async def restart_dead(self, preloaded: list[str]) -> list[str]:
        """Discard every loaded model whose engine stopped, and load the `preloaded` ones
        among them again at once (the others reload on their next request)."""
        restarted = []
        for entry in self.entries:
            if entry.state == "loaded" and not entry.service.is_alive:
                await self._discard_dead(entry)
                if entry.spec.id in preloaded:
                    self._start_load(entry)
                restarted.append(entry.spec.id)
        return restarted

    def keep_alive_of(self, entry: ModelEntry) -> float | None:
        """Seconds `entry` may sit idle before it is unloaded (None: forever)."""
        if entry.keep_alive_override is not None:
            return None if math.isinf(entry.keep_alive_override) else entry.keep_alive_override
        return entry.spec.keep_alive if entry.spec.keep_alive is not None else self.keep_alive_s

    def set_keep_alive(self, entry: ModelEntry, seconds: float) -> None:
        """A request's keep-alive for `entry` (negative or math.inf: keep it loaded; 0: unload it
        as soon as its requests are done), until another request sets one; the idle sweep acts
        on it. The configuration's setting applies again once the model unloads."""
        entry.keep_alive_override = math.inf if seconds < 0 else seconds

    def expires_in(self, entry: ModelEntry, now: float | None = None) -> float | None:
        """Seconds until the idle sweep unloads a loaded `entry` (None: never); a model in
        use counts its keep-alive from now."""
        keep_alive = self.keep_alive_of(entry)
        if keep_alive is None or not entry.is_evictable:
            return None
        if entry.num_active:
            return keep_alive
        now = time.monotonic() if now is None else now
        return max(0.0, keep_alive - (now - entry.last_used))

    async def sweep_idle(self, now: float | None = None) -> list[str]:
        """Unload models idle past their keep-alive; the ids unloaded."""
        now = time.monotonic() if now is None else now
        unloaded = []
        for entry in self.entries:
            keep_alive = self.keep_alive_of(entry)
            if keep_alive is None or not entry.is_evictable or entry.num_active:
                continue
            if now - entry.last_used >= keep_alive:
                await self.unload(entry, reason=f"idle for {keep_alive:g} s (keep-alive)")
                unloaded.append(entry.spec.id)
        return unloaded

    async def preload(self) -> None:
        """Load the first configured model and every pinned one (start-up)."""
        wanted = [self.entries[0], *(e for e in self.entries[1:] if e.spec.pinned)]
        for entry in wanted:
            if entry.state in ("unloaded", "failed"):
                self._start_load(entry)
        await asyncio.gather(*(e.loading for e in wanted if e.loading is not None))

    def num_live_streams(self) -> int:
        """Generations running on any model (background jobs included), not yet closed."""
        return sum(len(getattr(e.service, "live_streams", ())) for e in self.entries if e.service is not None)

    def abort_streams(self, error: ArgosyError) -> int:
        """Abort every live generation on every model with `error`; how many were stopped."""
        total = 0
        for entry in self.entries:
            abort = getattr(entry.service, "abort_streams", None)  # generation models only
            if abort is not None:
                total += abort(error)
        return total

    def shutdown(self) -> None:
        for entry in self.entries:
            if entry.service is not None:
                entry.service.shutdown()
                entry.service = None
                entry.state = "unloaded"


def _replace_info(info: ModelInfo, **changes: Any) -> ModelInfo:
    import dataclasses

    return dataclasses.replace(info, **changes)
