"""LiveServer: the real app (uvicorn, middlewares, registry, a real engine on SmolLM2 in bf16
eager) served from a thread of the test process, so a fault test can reach inside — stop an
engine thread, fill a disk — and watch what clients see over real HTTP."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from argosy.api.app import build_app
from argosy.config import EngineConfig, ModelSpec, ServerConfig
from argosy.core.lifespan import registry_lifespan
from argosy.core.local import LocalModelLoader
from argosy.core.recording import SessionRecorder, open_recorder
from argosy.core.registry import ModelRegistry
from tests.e2e.server import free_port

MODEL = "smollm2"


@dataclass
class LiveServer:
    data_dir: Path | None = None  # None: no session store
    server_options: dict[str, Any] = field(default_factory=dict)
    maintain_every_s: float | None = None  # None: the test drives maintenance itself
    # each connection's kernel send buffer (SO_SNDBUF, inherited from the listening socket;
    # None: the kernel's autotuned default, up to megabytes on loopback)
    send_buffer_bytes: int | None = None
    port: int = 0
    registry: ModelRegistry | None = None
    sessions: SessionRecorder | None = None
    _server: uvicorn.Server | None = None
    _thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0) -> LiveServer:
        self.port = self.port or free_port()
        engine_config = EngineConfig(model=MODEL, quantization="none", compile="off")
        server_config = ServerConfig(port=self.port, **self.server_options)
        if self.data_dir is not None:
            self.sessions = open_recorder(self.data_dir, ttl_seconds=3600.0, max_bytes=None)
        self.registry = ModelRegistry(
            [ModelSpec(MODEL, MODEL)],
            LocalModelLoader(engine_config, server_config, self.sessions),
            load_timeout_s=server_config.model_load_timeout,
        )
        app = build_app(self.registry, server_config, sessions=self.sessions, preloaded=[MODEL])
        app.router.lifespan_context = registry_lifespan(self.registry, [MODEL], self.maintain_every_s)
        self._server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False)
        )
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.send_buffer_bytes is not None:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
        listener.bind(("127.0.0.1", self.port))
        server = self._server
        self._thread = threading.Thread(
            target=lambda: server.run(sockets=[listener]), name="live-server", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError("the live server did not become healthy")

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
        if self.registry is not None:
            self.registry.shutdown()
        if self.sessions is not None:
            self.sessions.close()
