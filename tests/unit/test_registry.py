"""ModelRegistry with a fake load function: exact load/unload order, one load per burst,
LRU room-making that waits for in-flight requests, keep-alive, bounded waits, kinds."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from argosy.config import ModelSpec
from argosy.core.registry import ModelRegistry
from argosy.core.service import ModelInfo
from argosy.engine.arrivals import Arrival
from argosy.errors import InvalidRequestError, ModelUnavailableError, NotFoundError


class FakeModel:
    def __init__(self, model_id: str, memory_bytes: int) -> None:
        self.model_id = model_id
        self.memory_bytes = memory_bytes
        self.is_alive = True

    def model_info(self, state: str = "loaded") -> ModelInfo:
        return ModelInfo(
            id=self.model_id,
            created=0,
            kind="chat",
            state=state,
            is_loaded=True,
            context_length=64,
            architecture="Fake",
            dtype="float32",
            quantization=None,
            has_chat_template=False,
            sampling_defaults={},
            memory_bytes=self.memory_bytes,
        )

    def arriving(self) -> Arrival:
        return Arrival()

    def shutdown(self) -> None:
        self.is_alive = False


class Loads:
    """Records every load and unload; a load can be held back with `gate`."""

    def __init__(self, memory: dict[str, int] | None = None) -> None:
        self.log: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.memory = memory or {}

    def __call__(self, spec: ModelSpec) -> Any:
        self.gate.wait(10)
        self.log.append(f"load {spec.id}")
        model = FakeModel(spec.id, self.memory.get(spec.id, 100))
        original = model.shutdown

        def shutdown() -> None:
            self.log.append(f"unload {spec.id}")
            original()

        model.shutdown = shutdown  # type: ignore[method-assign]
        return model


def registry(loads: Loads, *specs: ModelSpec, **options: Any) -> ModelRegistry:
    return ModelRegistry(
        list(specs) or [ModelSpec("a", "a"), ModelSpec("b", "b"), ModelSpec("c", "c")], loads, **options
    )


def test_a_burst_for_an_unloaded_model_loads_it_once() -> None:
    loads = Loads()

    async def main() -> None:
        reg = registry(loads)
        loads.gate.clear()
        entry = reg.resolve("b")
        tasks = [asyncio.ensure_future(reg.acquire(entry)) for _ in range(8)]
        await asyncio.sleep(0.05)
        assert entry.state == "loading"
        loads.gate.set()
        leases = await asyncio.gather(*tasks)
        assert {id(lease.service) for lease in leases} == {id(entry.service)}
        assert entry.num_active == 8 and entry.num_loads == 1
        for lease in leases:
            lease.release()
            lease.release()  # idempotent
        assert entry.num_active == 0

    asyncio.run(main())
    assert loads.log == ["load b"]


def test_max_loaded_models_unloads_the_least_recently_used_after_its_requests() -> None:
    loads = Loads()

    async def main() -> None:
        reg = registry(loads, max_loaded_models=2)
        a, b, c = (reg.resolve(name) for name in "abc")
        in_flight = await reg.acquire(a)  # a: least recently used, but busy
        (await reg.acquire(b)).release()
        load_c = asyncio.ensure_future(reg.acquire(c))
        await asyncio.sleep(0.05)
        assert a.state == "unloading" and not load_c.done() and loads.log == ["load a", "load b"]
        in_flight.release()  # a's request ends: it is unloaded, c loads
        (await load_c).release()
        assert [e.state for e in (a, b, c)] == ["unloaded", "loaded", "loaded"]
        (await reg.acquire(a)).release()  # reloads a, unloading b (least recently used now)
        assert [e.state for e in (a, b, c)] == ["loaded", "unloaded", "loaded"]

    asyncio.run(main())
    assert loads.log == ["load a", "load b", "unload a", "load c", "unload b", "load a"]


def test_pinned_models_are_never_unloaded_and_a_load_that_cannot_start_is_503() -> None:
    loads = Loads()

    async def main() -> None:
        reg = registry(
            loads,
            ModelSpec("a", "a", pinned=True),
            ModelSpec("b", "b"),
            max_loaded_models=1,
            load_timeout_s=0.2,
        )
        await reg.preload()
        with pytest.raises(ModelUnavailableError) as caught:
            await reg.acquire(reg.resolve("b"))
        assert caught.value.retry_after_s >= 1 and caught.value.kind == "model_loading"
        assert reg.resolve("a").state == "loaded"

    asyncio.run(main())
    assert loads.log == ["load a"]


def test_a_slow_load_answers_503_and_goes_on() -> None:
    loads = Loads()

    async def main() -> None:
        reg = registry(loads, load_timeout_s=0.1)
        entry = reg.resolve("a")
        loads.gate.clear()
        with pytest.raises(ModelUnavailableError):
            await reg.acquire(entry)
        assert entry.state == "loading"
        loads.gate.set()
        (await reg.acquire(entry)).release()
        assert entry.num_loads == 1

    asyncio.run(main())


def test_memory_budget_unloads_least_recently_used() -> None:
    loads = Loads(memory={"a": 60, "b": 30, "c": 50})

    async def main() -> None:
        reg = registry(loads, max_loaded_memory=100)
        for name in "abc":
            (await reg.acquire(reg.resolve(name))).release()
            await asyncio.sleep(0.01)
        assert [e.state for e in reg.entries] == ["unloaded", "loaded", "loaded"]

    asyncio.run(main())
    assert loads.log == ["load a", "load b", "load c", "unload a"]


def test_keep_alive_unloads_idle_models_only() -> None:
    loads = Loads()

    async def main() -> None:
        reg = registry(loads, ModelSpec("a", "a", keep_alive=0.0), ModelSpec("b", "b"), keep_alive_s=None)
        (await reg.acquire(reg.resolve("a"))).release()
        busy = await reg.acquire(reg.resolve("b"))
        assert await reg.sweep_idle() == ["a"]
        held = await reg.acquire(reg.resolve("a"))
        assert await reg.sweep_idle() == []  # in use
        held.release()
        busy.release()

    asyncio.run(main())
    assert loads.log == ["load a", "load b", "unload a", "load a"]


def test_names_kinds_and_unknown_models() -> None:
    reg = registry(
        Loads(),
        ModelSpec("chat", "smollm2", aliases=("default",)),
        ModelSpec("minilm", "minilm", kind="embedding"),
    )
    assert reg.resolve("default").spec.id == "chat"
    assert reg.resolve(None, "embedding").spec.id == "minilm"
    assert reg.resolve(None, "chat").spec.id == "chat"
    with pytest.raises(NotFoundError) as missing:
        reg.resolve("gpt-9")
    assert missing.value.param == "model" and "chat, minilm" in missing.value.message
    with pytest.raises(InvalidRequestError) as wrong:
        reg.resolve("minilm", "chat")
    assert "an embedding model" in wrong.value.message and wrong.value.param == "model"
    with pytest.raises(InvalidRequestError):
        registry(Loads(), ModelSpec("x", "a"), ModelSpec("y", "b", aliases=("x",)))


def test_a_failed_load_fails_its_requests_and_is_retried() -> None:
    attempts: list[str] = []

    def load(spec: ModelSpec) -> Any:
        attempts.append(spec.id)
        if len(attempts) == 1:
            raise OSError("disk on fire")
        return FakeModel(spec.id, 1)

    async def main() -> None:
        reg = ModelRegistry([ModelSpec("a", "a")], load)
        entry = reg.resolve("a")
        with pytest.raises(Exception, match="disk on fire"):
            await reg.acquire(entry)
        assert entry.state == "failed" and reg.info(entry).error == "OSError: disk on fire"
        (await reg.acquire(entry)).release()
        assert entry.state == "loaded"

    asyncio.run(main())
    assert attempts == ["a", "a"]


def test_a_dead_engine_is_discarded_and_reloaded() -> None:
    loads = Loads()

    async def main() -> None:
        reg = registry(loads, ModelSpec("a", "a"), ModelSpec("b", "b"))
        a, b = reg.resolve("a"), reg.resolve("b")
        (await reg.acquire(a)).release()
        (await reg.acquire(b)).release()
        a.service.is_alive = False  # its engine thread died
        b.service.is_alive = False
        assert await reg.restart_dead(preloaded=["a"]) == ["a", "b"]
        assert a.state == "loading" and b.state == "unloaded"  # a (preloaded) reloads at once
        (await reg.acquire(a)).release()
        (await reg.acquire(b)).release()  # b reloads on its next request
        assert a.service.is_alive and b.service.is_alive

    asyncio.run(main())
    assert loads.log == ["load a", "load b", "unload a", "unload b", "load a", "load b"]


def test_a_satellite_serves_fim_and_must_be_another_chat_model() -> None:
    def load(spec: ModelSpec) -> Any:
        raise AssertionError("nothing loads")

    specs = [
        ModelSpec("chat", "smollm2", satellite="coder"),
        ModelSpec("coder", "coder.gguf", aliases=("c",)),
    ]
    registry = ModelRegistry(specs, load)
    assert registry.fim_model("chat") == "coder" and registry.fim_model("c") == "c"
    assert registry.fim_model(None) == "coder"  # the first chat model, and its satellite
    for satellite, other in (
        ("nope", None),
        ("chat", None),
        ("mini", ModelSpec("mini", "minilm", kind="embedding")),
    ):
        bad = [ModelSpec("chat", "smollm2", satellite=satellite), *([other] if other else [])]
        with pytest.raises(InvalidRequestError, match="satellite"):
            ModelRegistry(bad, load)
