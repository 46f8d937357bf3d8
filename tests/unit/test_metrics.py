"""Prometheus metrics (argosy/core/metrics.py, argosy/api/metrics.py): request events counted
exactly, labels bounded whatever a client sends, engine figures read at scrape time, and the
loads and unloads of a real registry driven by a fake load."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from argosy.api.app import build_app
from argosy.config import ModelSpec, ServerConfig
from argosy.core.admission import AdmissionQueue
from argosy.core.events import RequestEvent
from argosy.core.metrics import EngineCollector, RequestMetrics, ServerMetrics
from argosy.core.registry import ModelRegistry
from argosy.core.service import ModelInfo
from argosy.engine.arrivals import Arrival
from argosy.engine.outputs import EngineStats
from argosy.errors import EngineDeadError

LABELS = {"model": "chat-a", "dialect": "openai", "key_name": "none"}


def finished(**fields: Any) -> RequestEvent:
    values: dict[str, Any] = {
        "kind": "finished",
        "request_id": "r",
        "route": "POST /v1/chat/completions",
        "dialect": "openai",
        "client": "127.0.0.1",
        "key_name": None,
        "model_id": "chat-a",
        "status": 200,
        "duration_s": 1.2,
    }
    return RequestEvent(**(values | fields))


def generation(**fields: Any) -> RequestEvent:
    usage = {"prompt_tokens": 20, "completion_tokens": 11, "cached_tokens": 16, "finish_reason": "length"}
    timing = {"ttft_s": 0.03, "decode_tokens": 10, "decode_s": 0.2}
    return finished(**(usage | timing | fields))


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def observe(registry: CollectorRegistry) -> RequestMetrics:
    return RequestMetrics(registry, ["chat-a", "chat-b"])


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def series(registry: CollectorRegistry) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    return {
        (sample.name, tuple(sorted(sample.labels.items())))
        for family in registry.collect()
        for sample in family.samples
    }


def test_a_generation_counts_its_request_tokens_finish_and_latencies(
    registry: CollectorRegistry, observe: RequestMetrics
) -> None:
    observe(generation())
    observe(
        generation(prompt_tokens=5, completion_tokens=3, cached_tokens=0, finish_reason="stop", queue_s=0.004)
    )
    assert value(registry, "argosy:http_requests_total", **LABELS, status="200") == 2
    assert value(registry, "argosy:prompt_tokens_total", **LABELS) == 25
    assert value(registry, "argosy:prompt_tokens_cached_total", **LABELS) == 16
    assert value(registry, "argosy:generation_tokens_total", **LABELS) == 14
    assert value(registry, "argosy:request_success_total", **LABELS, finished_reason="length") == 1
    assert value(registry, "argosy:request_success_total", **LABELS, finished_reason="stop") == 1
    assert value(registry, "argosy:time_to_first_token_seconds_count", **LABELS) == 2
    assert value(registry, "argosy:time_to_first_token_seconds_sum", **LABELS) == pytest.approx(0.06)
    assert value(registry, "argosy:time_to_first_token_seconds_bucket", **LABELS, le="0.02") == 0
    assert value(registry, "argosy:time_to_first_token_seconds_bucket", **LABELS, le="0.04") == 2
    assert value(registry, "argosy:e2e_request_latency_seconds_sum", **LABELS) == pytest.approx(2.4)
    # the queue time only where the engine said it (the first generation's event has none)
    assert value(registry, "argosy:request_queue_time_seconds_count", **LABELS) == 1
    assert value(registry, "argosy:request_queue_time_seconds_bucket", **LABELS, le="0.001") == 0
    assert value(registry, "argosy:request_queue_time_seconds_bucket", **LABELS, le="0.005") == 1
    assert value(registry, "argosy:requests_rejected_total", **LABELS, reason="not_found") is None


def test_inter_token_latency_counts_one_observation_per_decode_token(
    registry: CollectorRegistry, observe: RequestMetrics
) -> None:
    observe(generation(decode_tokens=10, decode_s=0.2))  # a 20 ms mean gap, 10 times
    observe(generation(decode_tokens=4, decode_s=0.4))  # 100 ms, 4 times
    observe(generation(decode_tokens=0, decode_s=None))  # one token: no gap
    name = "argosy:inter_token_latency_seconds"
    assert value(registry, f"{name}_count", **LABELS) == 14
    assert value(registry, f"{name}_sum", **LABELS) == pytest.approx(0.6)
    assert value(registry, f"{name}_bucket", **LABELS, le="0.01") == 0
    assert value(registry, f"{name}_bucket", **LABELS, le="0.025") == 10
    assert value(registry, f"{name}_bucket", **LABELS, le="0.075") == 10
    assert value(registry, f"{name}_bucket", **LABELS, le="0.1") == 14  # le is inclusive
    assert value(registry, f"{name}_bucket", **LABELS, le="+Inf") == 14


def test_a_refusal_counts_by_status_and_reason_without_tokens(
    registry: CollectorRegistry, observe: RequestMetrics
) -> None:
    observe(finished(model_id=None, status=404, error_kind="not_found"))
    observe(finished(model_id=None, status=404, error_kind="not_found", dialect="anthropic"))
    observe(finished(kind="started", status=None))  # not counted: its finish is
    none = {"model": "none", "key_name": "none"}
    assert value(registry, "argosy:http_requests_total", **none, dialect="openai", status="404") == 1
    assert value(registry, "argosy:http_requests_total", **none, dialect="anthropic", status="404") == 1
    assert (
        value(registry, "argosy:requests_rejected_total", **none, dialect="openai", reason="not_found") == 1
    )
    assert value(registry, "argosy:http_requests_total", **LABELS, status="200") is None
    assert value(registry, "argosy:prompt_tokens_total", **none, dialect="openai") is None
    assert value(registry, "argosy:time_to_first_token_seconds_count", **none, dialect="openai") is None


def test_labels_stay_bounded_whatever_the_event_carries(
    registry: CollectorRegistry, observe: RequestMetrics
) -> None:
    def strange(start: int, stop: int) -> None:
        for index in range(start, stop):
            observe(
                generation(
                    model_id=f"bogus-{index}",  # not configured here
                    dialect=f"dialect-{index}",
                    finish_reason=f"reason-{index}",
                    status=400,
                    error_kind=f"Kind {index}!",
                )
            )
            observe(generation(key_name="team-a", model_id=None))

    observe(generation(key_name="team-a"))
    before = series(registry)
    strange(0, 100)
    grown = series(registry) - before
    values: dict[str, set[str]] = {}
    for _, labels in grown:
        for name, label in labels:
            values.setdefault(name, set()).add(label)
    values.pop("le", None)
    assert values == {
        "model": {"none"},
        "dialect": {"other", "openai"},
        "key_name": {"none", "team-a"},
        "status": {"400", "200"},
        "reason": {"other"},
        "finished_reason": {"other", "length"},
    }
    after = series(registry)
    strange(100, 200)
    assert series(registry) == after  # new strings, no new series
    assert (
        value(
            registry,
            "argosy:requests_rejected_total",
            model="none",
            dialect="other",
            key_name="none",
            reason="other",
        )
        == 200
    )
    assert (
        value(
            registry,
            "argosy:http_requests_total",
            model="none",
            dialect="openai",
            key_name="team-a",
            status="200",
        )
        == 200
    )


# -- engine figures and the registry ------------------------------------------------------


class FakeService:
    """What the collector and the registry read of a loaded chat model."""

    def __init__(self, model_id: str, stats: EngineStats) -> None:
        self.model_id = model_id
        self.stats = stats
        self.admission = AdmissionQueue(8)
        self.is_alive = True

    def engine_stats(self) -> tuple[EngineStats, int]:
        if not self.is_alive:
            raise EngineDeadError("stopped")
        return self.stats, 0

    def model_info(self, state: str = "loaded") -> ModelInfo:
        return ModelInfo(self.model_id, 0, "chat", state, True, 64, None, None, None, False, {})

    def arriving(self) -> Arrival:
        return Arrival()

    def shutdown(self) -> None:
        self.is_alive = False


STATS = EngineStats(
    num_running=3,
    num_waiting=2,
    num_free_blocks=30,
    num_total_blocks=40,
    num_preemptions=1,
    prefix_cache_queries=500,
    prefix_cache_hits=320,
    spec_proposed_tokens=12,
    spec_accepted_tokens=9,
)


def model_registry() -> ModelRegistry:
    specs = [ModelSpec("chat-a", "a"), ModelSpec("chat-b", "b"), ModelSpec("embed", "e", kind="embedding")]
    return ModelRegistry(specs, lambda spec: FakeService(spec.id, STATS))


def test_engine_figures_are_read_from_each_loaded_chat_model_at_scrape() -> None:
    models = model_registry()
    metrics = CollectorRegistry()
    metrics.register(EngineCollector(models))

    async def load_a() -> None:
        (await models.acquire(models.entries[0])).release()

    asyncio.run(load_a())
    model = {"model": "chat-a"}
    assert value(metrics, "argosy:num_requests_running", **model) == 3
    assert value(metrics, "argosy:num_requests_waiting", **model) == 2
    assert value(metrics, "argosy:num_requests_queued", **model) == 0
    assert value(metrics, "argosy:kv_cache_usage_perc", **model) == 0.25
    assert value(metrics, "argosy:prefix_cache_queries_total", **model) == 500
    assert value(metrics, "argosy:prefix_cache_hits_total", **model) == 320
    assert value(metrics, "argosy:num_preemptions_total", **model) == 1
    assert value(metrics, "argosy:spec_decode_num_draft_tokens_total", **model) == 12
    assert value(metrics, "argosy:spec_decode_num_accepted_tokens_total", **model) == 9
    assert value(metrics, "argosy:num_requests_running", model="chat-b") is None  # not loaded
    assert value(metrics, "argosy:num_models_loaded") == 1

    service = models.entries[0].service
    ticket = service.admission.admit()
    assert value(metrics, "argosy:num_requests_queued", **model) == 1  # read live, not cached
    ticket.release()
    service.is_alive = False  # a dead engine: no figures, no failed scrape
    assert value(metrics, "argosy:num_requests_running", **model) is None
    assert value(metrics, "argosy:model_loads_total", **model) == 1


def test_loads_and_unloads_are_counted_per_model() -> None:
    models = model_registry()
    metrics = CollectorRegistry()
    metrics.register(EngineCollector(models))
    a, b, embed = models.entries

    async def cycle() -> None:
        for _ in range(3):
            (await models.acquire(a)).release()
            await models.unload(a)
        (await models.acquire(a)).release()
        (await models.acquire(embed)).release()

    asyncio.run(cycle())
    assert value(metrics, "argosy:model_loads_total", model="chat-a") == 4
    assert value(metrics, "argosy:model_unloads_total", model="chat-a") == 3
    assert value(metrics, "argosy:model_loads_total", model="chat-b") == 0
    assert value(metrics, "argosy:model_unloads_total", model="chat-b") == 0
    assert value(metrics, "argosy:model_loads_total", model="embed") == 1
    assert value(metrics, "argosy:num_models_loaded") == 2
    assert value(metrics, "argosy:num_requests_running", model="embed") is None  # no engine figures


# -- the routes -------------------------------------------------------------------------


def families(text: str) -> dict[str, Any]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_the_routes_serve_the_text_format_and_count_requests() -> None:
    app = build_app(model_registry(), ServerConfig())
    other = build_app(model_registry(), ServerConfig())  # a second app: its own registry
    assert app.state.metrics.registry is not other.state.metrics.registry
    with TestClient(app, raise_server_exceptions=False) as client:
        for index in range(5):
            client.post(
                "/v1/chat/completions",
                json={"model": f"nope-{index}", "messages": [{"role": "user", "content": "hi"}]},
            )
        response = client.get("/metrics")
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/plain; version=")
        found = families(response.text)
        requests = [s for s in found["argosy:http_requests"].samples if s.name.endswith("_total")]
        refused = {
            (s.labels["model"], s.labels["status"]): s.value
            for s in requests
            if s.labels["dialect"] == "openai"
        }
        assert refused == {("none", "404"): 5}
        assert "argosy:num_requests_running" in found and "argosy:kv_cache_usage_perc" in found
        assert client.get("/v1/metrics").text.startswith("# HELP")
    with TestClient(other) as client:
        assert "argosy:requests_rejected_total{" not in client.get("/metrics").text


def test_the_routes_are_in_the_openapi_document() -> None:
    document = build_app(model_registry(), ServerConfig()).openapi()
    for path in ("/metrics", "/v1/metrics"):
        ok = document["paths"][path]["get"]["responses"]["200"]
        assert set(ok["content"]) == {"text/plain"}


def test_server_metrics_expose_both_sources() -> None:
    metrics = ServerMetrics(model_registry())
    metrics.observe(generation())
    found = families(metrics.exposition().decode())
    assert found["argosy:prompt_tokens"].samples[0].value == 20
    assert found["argosy:model_loads"].type == "counter"
