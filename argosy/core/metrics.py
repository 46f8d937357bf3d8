"""Prometheus metrics: what the server's requests did, and what its engines hold now.

Two sources, one per-app CollectorRegistry (never prometheus_client's global one, so many
apps in one process — the tests — do not collide):
- RequestMetrics, an observer of the request events (core/events.py): every `finished`
  event counts its request by HTTP status, its refusal's kind, its generation's finish and
  tokens, and its latencies;
- EngineCollector, read at scrape time (no thread, no polling): each loaded chat model's
  engine counters (service.engine_stats()), each loaded encoder's forward passes (embedding
  and rerank models) and the registry's loads and unloads.

Names follow vLLM's where the meaning is the same (`argosy:` for `vllm:`). Labels are
bounded whatever clients send: `model` is a configured model id or "none" (an event carries
only a resolved id; one not configured here is "none" too), `dialect` one of DIALECTS,
`key_name` a configured key's name or "none", `finished_reason` one of FINISH_REASONS,
`reason` an error kind of the code's own (a malformed one is "other"), `status` the status
the server sent.

Queue time is vLLM's meaning: the engine took the sequence -> its first scheduling step, as
the engine reports it on its outputs (RequestOutput.queue_s; the first choice's with n > 1).
"""

from __future__ import annotations

import bisect
import re
import threading
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from argosy.core.embedding_service import EmbeddingService
from argosy.core.events import RequestEvent
from argosy.core.registry import ModelRegistry
from argosy.core.rerank_service import RerankService
from argosy.core.service import ModelService
from argosy.errors import ArgosyError

NONE = "none"
OTHER = "other"
DIALECTS = frozenset({"openai", "anthropic", "ollama", "argosy"})
FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "abort", "error"})
_KIND = re.compile(r"[a-z][a-z0-9_]{0,39}")  # an error kind as the code names them

REQUEST_LABELS = ("model", "dialect", "key_name")

# vLLM's buckets; inter-token latency with two finer ones (a small model decodes in ms)
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
    0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class WeightedHistogram(Collector):
    """A histogram that takes one value `count` times in one call: a request's mean
    inter-token gap stands for each of its decode tokens (as vLLM counts them, one
    observation per token) without one call per token."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], buckets: Sequence[float]):
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.bounds = tuple(buckets)
        self._series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}
        self._lock = threading.Lock()

    def observe(self, labels: tuple[str, ...], value: float, count: int = 1) -> None:
        if count <= 0:
            return
        with self._lock:
            counts, total = self._series.setdefault(labels, ([0] * (len(self.bounds) + 1), [0.0]))
            counts[bisect.bisect_left(self.bounds, value)] += count
            total[0] += value * count

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        with self._lock:
            series = [(labels, list(counts), total[0]) for labels, (counts, total) in self._series.items()]
        for labels, counts, total in series:
            cumulative, buckets = 0, []
            for bound, count in zip((*self.bounds, float("inf")), counts, strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(cumulative)))
            family.add_metric(list(labels), buckets, total)
        yield family


class RequestMetrics:
    """An EventObserver: each finished request, counted and timed (see the module's head)."""

    def __init__(self, registry: CollectorRegistry, model_ids: Iterable[str]) -> None:
        self.model_ids = frozenset(model_ids)
        labels = REQUEST_LABELS

        def counter(name: str, documentation: str, *extra: str) -> Counter:
            return Counter(name, documentation, [*labels, *extra], registry=registry)

        self.http_requests = counter("argosy:http_requests", "HTTP requests answered, by status.", "status")
        self.rejected = counter(
            "argosy:requests_rejected", "Requests refused with an error, by the error's kind.", "reason"
        )
        self.success = counter(
            "argosy:request_success", "Generations finished, by finish reason.", "finished_reason"
        )
        self.prompt_tokens = counter("argosy:prompt_tokens", "Prompt tokens of finished generations.")
        self.cached_tokens = counter(
            "argosy:prompt_tokens_cached", "Prompt tokens served by the prefix cache (of prompt_tokens)."
        )
        self.generation_tokens = counter("argosy:generation_tokens", "Tokens generated.")
        self.ttft = Histogram(
            "argosy:time_to_first_token_seconds",
            "Arrival to first output token.",
            labels,
            registry=registry,
            buckets=TTFT_BUCKETS,
        )
        self.e2e = Histogram(
            "argosy:e2e_request_latency_seconds",
            "Arrival to the end of a generation's response.",
            labels,
            registry=registry,
            buckets=E2E_BUCKETS,
        )
        self.queue = Histogram(
            "argosy:request_queue_time_seconds",
            "Time a generation waited in the engine's queue before its first scheduling step.",
            labels,
            registry=registry,
            buckets=TTFT_BUCKETS,
        )
        self.itl = WeightedHistogram(
            "argosy:inter_token_latency_seconds",
            "Gap between output tokens after the first (one observation per token: its request's mean gap).",
            labels,
            ITL_BUCKETS,
        )
        registry.register(self.itl)

    def labels_of(self, event: RequestEvent) -> tuple[str, str, str]:
        model = event.model_id if event.model_id in self.model_ids else None
        dialect = event.dialect if event.dialect in DIALECTS else OTHER
        return model or NONE, dialect, event.key_name or NONE

    def __call__(self, event: RequestEvent) -> None:
        if event.kind != "finished":
            return
        labels = self.labels_of(event)
        self.http_requests.labels(*labels, str(event.status or 0)).inc()
        if event.error_kind is not None:
            reason = event.error_kind if _KIND.fullmatch(event.error_kind) else OTHER
            self.rejected.labels(*labels, reason).inc()
        if event.prompt_tokens is not None:
            self.prompt_tokens.labels(*labels).inc(event.prompt_tokens)
            self.cached_tokens.labels(*labels).inc(event.cached_tokens or 0)
            self.generation_tokens.labels(*labels).inc(event.completion_tokens or 0)
        if event.finish_reason is None:
            return
        reason = event.finish_reason if event.finish_reason in FINISH_REASONS else OTHER
        self.success.labels(*labels, reason).inc()
        self.e2e.labels(*labels).observe(event.duration_s)
        if event.ttft_s is not None:
            self.ttft.labels(*labels).observe(event.ttft_s)
        if event.queue_s is not None:
            self.queue.labels(*labels).observe(event.queue_s)
        if event.decode_tokens and event.decode_s is not None:
            self.itl.observe(labels, event.decode_s / event.decode_tokens, event.decode_tokens)


class EngineCollector(Collector):
    """Read at each scrape: the registry's models and each loaded chat model's engine."""

    def __init__(self, models: ModelRegistry) -> None:
        self.models = models

    def collect(self) -> Iterator[Metric]:
        def gauge(name: str, documentation: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, documentation, labels=["model"])

        def counter(name: str, documentation: str) -> CounterMetricFamily:
            return CounterMetricFamily(name, documentation, labels=["model"])

        running = gauge("argosy:num_requests_running", "Sequences in the engine's running batch.")
        waiting = gauge("argosy:num_requests_waiting", "Sequences waiting in the engine's scheduler.")
        queued = gauge(
            "argosy:num_requests_queued",
            "Requests admitted and not yet started (first output), bounded by --max-queued-requests.",
        )
        kv_usage = gauge("argosy:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).")
        kv_bytes = gauge(
            "argosy:kv_bytes_per_token", "K and V bytes of one token, all layers (--kv-cache-dtype)."
        )
        kv_capacity = gauge("argosy:kv_cache_capacity_tokens", "Tokens the KV cache holds.")
        queries = counter("argosy:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        hits = counter("argosy:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        preemptions = counter("argosy:num_preemptions", "Sequences preempted (KV cache full).")
        drafts = counter(
            "argosy:spec_decode_num_draft_tokens", "Draft tokens verified (speculative decoding)."
        )
        accepted = counter("argosy:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        adapters = gauge(
            "argosy:lora_adapters", "LoRA adapters the model serves (--lora, load_lora_adapter)."
        )
        resident = gauge(
            "argosy:lora_adapters_resident", "LoRA adapters in a slot now (at most --max-loras)."
        )
        adapter_reads = counter(
            "argosy:lora_adapter_reads", "LoRA adapter files read (loads, and reloads after eviction)."
        )
        images = counter("argosy:images_encoded", "Images through a vision-language model's encoder.")
        image_hits = counter(
            "argosy:image_cache_hits", "Images sent again, their features cached (not encoded)."
        )
        loads = counter("argosy:model_loads", "Times a model was loaded.")
        unloads = counter("argosy:model_unloads", "Times a model was unloaded (idle, for room, engine died).")
        num_loaded = GaugeMetricFamily("argosy:num_models_loaded", "Models loaded now.")
        encoder_forwards = counter(
            "argosy:encoder_forwards",
            "Forward passes of a loaded embedding or rerank model (a request's inputs share them).",
        )
        for entry in self.models.entries:
            model = [entry.spec.id]
            holds = entry.state in ("loaded", "unloading")
            loads.add_metric(model, entry.num_loads)
            unloads.add_metric(model, max(0, entry.num_loads - holds))
            if entry.state == "loaded" and isinstance(entry.service, (EmbeddingService, RerankService)):
                encoder_forwards.add_metric(model, entry.service.num_forwards)
            if entry.state != "loaded" or entry.spec.kind != "chat" or entry.service is None:
                continue
            try:
                stats, _ = entry.service.engine_stats()
            except ArgosyError:  # its engine stopped: the registry reloads it
                continue
            running.add_metric(model, stats.num_running)
            waiting.add_metric(model, stats.num_waiting)
            queued.add_metric(model, entry.service.admission.num_waiting)
            kv_usage.add_metric(model, stats.kv_cache_usage)
            kv = entry.service.model_info().kv_cache
            if kv is not None:
                kv_bytes.add_metric(model, float(kv["bytes_per_token"]))  # type: ignore[arg-type]
                kv_capacity.add_metric(model, float(kv["capacity_tokens"]))  # type: ignore[arg-type]
            queries.add_metric(model, stats.prefix_cache_queries)
            hits.add_metric(model, stats.prefix_cache_hits)
            preemptions.add_metric(model, stats.num_preemptions)
            drafts.add_metric(model, stats.spec_proposed_tokens)
            accepted.add_metric(model, stats.spec_accepted_tokens)
            adapters.add_metric(model, stats.lora_adapters)
            resident.add_metric(model, stats.lora_resident)
            adapter_reads.add_metric(model, stats.lora_reads)
            images.add_metric(model, stats.images_encoded)
            image_hits.add_metric(model, stats.image_cache_hits)
        num_loaded.add_metric([], len(self.models.loaded()))
        yield from (running, waiting, queued, kv_usage, kv_bytes, kv_capacity, queries, hits, preemptions)
        yield from (drafts, accepted, adapters, resident, adapter_reads, images, image_hits)
        yield from (loads, unloads, num_loaded, encoder_forwards)
        yield from self._fleet()

    def _fleet(self) -> Iterator[Metric]:
        """A fleet's nodes per model: up, in flight, restarts, and requests placed per policy."""
        up = GaugeMetricFamily(
            "argosy:fleet_node_up", "1 while the fleet node answers.", labels=["model", "node"]
        )
        in_flight = GaugeMetricFamily(
            "argosy:fleet_node_in_flight", "This head's requests on the node now.", labels=["model", "node"]
        )
        restarts = CounterMetricFamily(
            "argosy:fleet_node_restarts",
            "Times the node came back after being down.",
            labels=["model", "node"],
        )
        placed = CounterMetricFamily(
            "argosy:fleet_placements",
            "Requests placed on the node, by the placement policy that chose it.",
            labels=["model", "node", "policy"],
        )
        found = False
        for entry in self.models.loaded():
            nodes = entry.service.nodes() if isinstance(entry.service, ModelService) else None
            for node in nodes or ():
                found = True
                labels = [entry.spec.id, node.name]
                up.add_metric(labels, 1 if node.up else 0)
                in_flight.add_metric(labels, node.in_flight)
                restarts.add_metric(labels, node.restarts)
                for policy, count in sorted(node.placements.items()):
                    placed.add_metric([*labels, policy], count)
        if found:
            yield from (up, in_flight, restarts, placed)


class ServerMetrics:
    """One app's metrics: `observe` goes on its EventBus; `exposition()` is the scrape."""

    def __init__(self, models: ModelRegistry) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.observe = RequestMetrics(self.registry, (e.spec.id for e in models.entries))
        self.registry.register(EngineCollector(models))

    def exposition(self) -> bytes:
        """The text exposition format (prometheus_client.CONTENT_TYPE_LATEST)."""
        return generate_latest(self.registry)
