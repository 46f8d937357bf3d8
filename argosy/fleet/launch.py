"""Starting a fleet: Ray (a local instance for `argosy fleet --nodes N`, or a running cluster
for `--address`), and the registry's loader that puts each chat model on the nodes.

A local instance binds to 127.0.0.1 only. Ray still looks up outside addresses at start-up
(to find this host's IP), so on a machine that must not reach out, run it inside a
loopback-only network namespace (README: "More than one machine").

With `--address`, each alive Ray node gets one engine actor per model (pinned to it by node
affinity); `--nodes N` then caps how many. Embedding, audio and image models run on the head
itself, as in `argosy serve`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from argosy.config import EngineConfig, ModelSpec, ServerConfig
from argosy.core.local import LocalModelLoader
from argosy.core.recording import SessionRecorder
from argosy.core.registry import LoadedModel
from argosy.core.service import ModelService, ServiceOptions
from argosy.errors import ModelLoadError
from argosy.fleet.client import FleetEngineClient, FleetNode
from argosy.fleet.node import node_actor
from argosy.fleet.placement import DEFAULT_PLACEMENT, NodeView, Placer

log = logging.getLogger("argosy.fleet")

NODE_START_TIMEOUT_S = 900.0  # a node builds its engine: a first start compiles native kernels


@dataclass(frozen=True, slots=True)
class FleetOptions:
    nodes: int = 2  # engine actors per chat model (with --address: at most one per Ray node)
    address: str | None = None  # a running Ray cluster; None: start one on this machine
    placement: tuple[str, ...] = DEFAULT_PLACEMENT
    node_cpus: float | None = None  # CPUs each node reserves (default: the machine's / nodes)
    node_ip_address: str | None = None  # this head's address on the cluster's network (--address)


def start_ray(options: FleetOptions) -> bool:
    """Ray for this fleet; True when this process started a local instance (it stops it)."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if options.address is not None:
        ray.init(address=options.address, log_to_driver=True, _node_ip_address=options.node_ip_address)
        log.info("joined the Ray cluster at %s: %d nodes", options.address, len(alive_ray_nodes()))
        return False
    cpus = max(os.cpu_count() or 1, int(options.nodes * (options.node_cpus or 1) + 0.999))
    # a short folder: Ray's socket paths must fit 107 bytes
    temp_dir = tempfile.mkdtemp(prefix="argosy-ray-", dir="/tmp")
    ray.init(
        num_cpus=cpus,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _temp_dir=temp_dir,
        log_to_driver=True,
    )
    log.info("started a local Ray instance (%d CPUs, %s)", cpus, temp_dir)
    return True


def alive_ray_nodes() -> list[dict[str, Any]]:
    import ray

    return [n for n in ray.nodes() if n.get("Alive")]


class FleetModelLoader:
    """The registry's loader in a fleet: chat models on the nodes, the rest on the head."""

    def __init__(
        self,
        options: FleetOptions,
        engine_config: EngineConfig,
        server_config: ServerConfig,
        sessions: SessionRecorder | None = None,
    ) -> None:
        self.options = options
        self.engine_config = engine_config
        self.server_config = server_config
        self.sessions = sessions
        self.local = LocalModelLoader(engine_config, server_config, sessions)
        self.owns_ray = False  # started a local Ray instance: stopped by close()

    def prepare(self) -> None:
        """Start (or join) Ray now, on the main thread before the HTTP server: Ray's native
        layer installs its own SIGTERM / SIGINT handlers when it starts, and the server's
        (its drain, then a normal exit that stops Ray) must be installed after them."""
        self.owns_ray = start_ray(self.options) or self.owns_ray

    def close(self) -> None:
        """After the registry shut its models down: stop the local Ray instance this process
        started (its GCS, raylet and workers); a joined cluster is left running."""
        if self.owns_ray:
            import ray

            ray.shutdown()
            self.owns_ray = False
            log.info("stopped the local Ray instance")

    def __call__(self, spec: ModelSpec) -> LoadedModel:
        if spec.kind != "chat":
            return self.local(spec)
        import ray

        self.owns_ray = start_ray(self.options) or self.owns_ray
        config = spec.engine_config(self.engine_config)
        node_cpus = self.options.node_cpus or max(1.0, (os.cpu_count() or 1) / self.options.nodes)
        if config.num_threads is None:
            config = dataclasses.replace(config, num_threads=max(1, int(node_cpus)))
        actor_class = node_actor(num_cpus=node_cpus)
        names, strategies = self._slots()
        handles = [
            actor_class.options(scheduling_strategy=strategy).remote(name, config)
            for name, strategy in zip(names, strategies, strict=True)
        ]
        try:
            described = ray.get([h.describe.remote() for h in handles], timeout=NODE_START_TIMEOUT_S)
        except Exception as exc:
            for handle in handles:
                ray.kill(handle, no_restart=True)
            raise ModelLoadError(f"model {spec.id!r}: a fleet node could not start: {exc}") from exc
        nodes = [
            FleetNode(name, handle, NodeView(name), pid=pid)
            for name, handle, (_, pid) in zip(names, handles, described, strict=True)
        ]
        description = described[0][0]
        log.info("model %s on %d fleet nodes: %s", spec.id, len(nodes), ", ".join(names))
        client = FleetEngineClient(
            nodes, description, config.block_size, Placer(self.options.placement, config.block_size)
        )
        options = ServiceOptions.of(spec, self.server_config, config.speculation_method)
        return ModelService(spec.id, client, options, sessions=self.sessions)

    def _slots(self) -> tuple[list[str], list[Any]]:
        """The nodes' names and Ray scheduling strategies: N on this machine's instance, or one
        per alive node of a cluster (pinned there), at most N."""
        if self.options.address is None:
            return [f"node{i}" for i in range(self.options.nodes)], ["DEFAULT"] * self.options.nodes
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        cluster = alive_ray_nodes()[: self.options.nodes]
        names = [f"{n.get('NodeManagerAddress', 'node')}#{i}" for i, n in enumerate(cluster)]
        return names, [NodeAffinitySchedulingStrategy(n["NodeID"], soft=False) for n in cluster]


def fleet_loader(options: FleetOptions) -> Any:
    """A LoaderFactory (commands/serve.py) for this fleet."""

    def make(
        engine_config: EngineConfig, server_config: ServerConfig, sessions: SessionRecorder
    ) -> FleetModelLoader:
        return FleetModelLoader(options, engine_config, server_config, sessions)

    return make
