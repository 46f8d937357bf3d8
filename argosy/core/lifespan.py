"""The server's lifespan around the model registry: the start-up models loaded, and a
maintenance task that restarts dead engines, unloads idle models and gives free heap back to
the OS; other services with tasks of their own (the audio job queue) started and stopped with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from argosy.core.registry import ModelRegistry
from argosy.ops.memory import release_free_memory

log = logging.getLogger("argosy.registry")


# How often the heap's free pages go back to the OS. Under steady traffic glibc's per-thread
# arenas keep what requests freed: the 30-minute soak's RSS grew ~2.5 MiB a minute (+5.6%),
# all of it free heap (one malloc_trim gave back 52 MiB); a trim costs milliseconds.
TRIM_EVERY_S = 60.0


async def maintain(registry: ModelRegistry, preloaded: list[str], every_s: float) -> None:
    """Forever: restart models whose engine died, unload the idle ones past keep-alive, and
    give free heap back to the OS every TRIM_EVERY_S."""
    last_trim = time.monotonic()
    while True:
        await asyncio.sleep(every_s)
        try:
            await registry.restart_dead(preloaded)
            await registry.sweep_idle()
            if time.monotonic() - last_trim >= TRIM_EVERY_S:
                last_trim = time.monotonic()
                await asyncio.to_thread(release_free_memory)
        except Exception:
            log.exception("registry maintenance failed")


class Service(Protocol):
    """Something of the server's with its own tasks (the audio job queue)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def registry_lifespan(
    registry: ModelRegistry,
    preloaded: list[str],
    maintain_every_s: float | None,
    also: list[Service] | None = None,
) -> Callable[[Any], contextlib.AbstractAsyncContextManager[None]]:
    """The server's lifespan: load the start-up models, keep the registry maintained
    (`maintain_every_s` None: no maintenance task), start `also`; stop all at shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(registry.preload())]
        if maintain_every_s is not None:
            tasks.append(asyncio.create_task(maintain(registry, preloaded, maintain_every_s)))
        for service in also or ():
            await service.start()
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for service in also or ():
                await service.stop()

    return lifespan
