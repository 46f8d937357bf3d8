"""`argosy serve` (and `argosy fleet`): the HTTP server over a model registry, started once the
port is known to be free; the registry's models load through `loader` — this process's
engines (core/local.py) or a fleet's nodes (argosy/fleet/).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from argosy.config import EngineConfig, ModelSpec, ServerConfig
from argosy.core.recording import SessionRecorder
from argosy.core.registry import LoadedModel
from argosy.errors import ArgosyError

log = logging.getLogger("argosy")

# how a server loads its models, given its session store
LoaderFactory = Callable[[EngineConfig, ServerConfig, SessionRecorder], Callable[[ModelSpec], LoadedModel]]

# The engine thread gives up the GIL in every torch kernel and must get it back quickly
# between kernels; with CPython's default 5 ms switch interval the HTTP thread can hold
# it that long per token.
SWITCH_INTERVAL_S = 0.0005


MAINTAIN_EVERY_S = 1.0  # how often dead engines are restarted and idle models unloaded


def _exit_if_loading(registry: Any, sessions: Any, status: int) -> None:
    """After the HTTP server stopped: a model load still running cannot be interrupted, and
    tearing down the event loop would wait for its thread (minutes, for a large model). Close
    what holds state (engines, the session store) and exit at once instead, as uvicorn's
    re-raised signal used to."""
    loading = [entry.spec.id for entry in registry.entries if entry.state == "loading"]
    if not loading:
        return
    log.warning("stopping while %s loads; not waiting for the load", ", ".join(loading))
    registry.shutdown()
    sessions.close()
    logging.shutdown()
    os._exit(status)


def serve(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    specs: list[ModelSpec] | None = None,
    loader: LoaderFactory | None = None,
) -> int:

    import uvicorn

    from argosy.api.app import build_app
    from argosy.api.server import DrainingServer
    from argosy.core.lifespan import registry_lifespan
    from argosy.core.local import LocalModelLoader
    from argosy.core.recording import open_recorder
    from argosy.core.registry import ModelRegistry
    from argosy.process import configure_process

    specs = specs or [ModelSpec(id=engine_config.model, source=engine_config.model)]
    in_use = _port_in_use(server_config.host, server_config.port)
    if in_use is not None:
        log.error(
            "cannot listen on %s:%d: %s. Another server (perhaps an argosy serve) holds it: stop it or pick "
            "another port with --port",
            server_config.host,
            server_config.port,
            in_use,
        )
        return 1
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    configure_process(engine_config)
    data_dir = Path(server_config.data_dir).expanduser()
    try:
        sessions = open_recorder(
            data_dir, ttl_seconds=server_config.session_ttl, max_bytes=server_config.session_max_bytes
        )
    except (ArgosyError, OSError) as exc:
        log.error("cannot open the session store in %s: %s", data_dir, exc)
        return 1
    log.info("sessions stored in %s", data_dir)
    model_loader = (loader or LocalModelLoader)(engine_config, server_config, sessions)
    prepare = getattr(model_loader, "prepare", None)  # a fleet's loader starts Ray here
    if prepare is not None:
        try:
            prepare()
        except Exception as exc:  # noqa: BLE001 - cannot serve: say why and stop
            log.error("cannot start the fleet: %s", exc)
            sessions.close()
            return 1
    registry = ModelRegistry(
        specs,
        model_loader,
        max_loaded_models=server_config.max_loaded_models,
        max_loaded_memory=server_config.max_loaded_memory,
        max_concurrent_loads=server_config.max_concurrent_loads,
        load_timeout_s=server_config.model_load_timeout,
        keep_alive_s=server_config.keep_alive,
        operator_sampling=server_config.operator_sampling,
    )
    preloaded = [specs[0].id, *(s.id for s in specs[1:] if s.pinned)]
    app = build_app(registry, server_config, sessions=sessions, preloaded=preloaded)
    failed: list[str] = []
    # SIGTERM / SIGINT drain the server (argosy/api/server.py): 503s for new requests, the
    # in-flight ones run on for --shutdown-grace; uvicorn's own timeout then only bounds
    # connections whose clients stopped reading.
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=server_config.host,
            port=server_config.port,
            workers=1,
            log_config=None,
            log_level=server_config.log_level,
            access_log=False,
            timeout_graceful_shutdown=5,
        ),
        app.state.drain,
        live=registry.num_live_streams,
        abort=registry.abort_streams,
        on_stopped=lambda: _exit_if_loading(registry, sessions, 1 if failed else 0),
    )

    def on_load_failed(entry: Any) -> None:
        if entry.spec.id in preloaded:  # the server cannot serve what it was started for
            failed.append(entry.spec.id)
            server.should_exit = True

    registry.on_load_failed = on_load_failed

    app.router.lifespan_context = registry_lifespan(
        registry,
        preloaded,
        MAINTAIN_EVERY_S,
        also=[app.state.stats_history, *([app.state.audio_jobs] if app.state.audio_jobs else [])],
    )
    try:
        server.run()
    finally:
        registry.shutdown()
        close = getattr(model_loader, "close", None)  # a fleet's loader stops the Ray it started
        if close is not None:
            close()
        sessions.close()  # after the last generation committed its events
    return 1 if failed else 0


def _port_in_use(host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on (None: it can), checked before anything loads."""
    import socket

    if port == 0:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None
