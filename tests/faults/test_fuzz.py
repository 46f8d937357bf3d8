"""Fuzzing a real server (SmolLM2 and MiniLM) from its own OpenAPI document and OpenAI's.

The CI budget is FUZZ_EXAMPLES examples per operation and generation mode (a few minutes in
all); `make fuzz` runs the same with ARGOSY_FUZZ_EXAMPLES raised past 10,000 cases in total.
The verdict: no 5xx, no answer outside its documented schema or media type (tests/faults/fuzz.py).
The seed is fixed in CI; ARGOSY_FUZZ_SEED=random (what `make fuzz` sets) draws a fresh one, and
every run prints the seed it used. ARGOSY_FUZZ_PATHS (a regular expression) fuzzes only the
operations whose path it matches (e.g. "lora" for the LoRA routes).

The server serves a LoRA adapter (made by peft) and every case carries an admin key: the LoRA
routes read and check their bodies rather than refusing them all (403, no admin key), and a
chat body's llama.cpp `lora: [{id, scale}]` can name a real adapter (id 0) at any scale.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.server import SMOLLM2_AND_MINILM_TOML, ServerProcess, models_server
from tests.e2e.test_lora_server import save_adapters
from tests.faults.fuzz import FuzzReport, fuzz, openai_schema, own_schema

FUZZ_EXAMPLES = int(os.environ.get("ARGOSY_FUZZ_EXAMPLES", "24"))
# CI's runs are fixed (reproducible); `make fuzz` passes "random": a fresh seed each run, printed
# so that a finding can be replayed with ARGOSY_FUZZ_SEED=<it>.
_SEED_SETTING = os.environ.get("ARGOSY_FUZZ_SEED", "20261201")
FUZZ_SEED = secrets.randbits(32) if _SEED_SETTING == "random" else int(_SEED_SETTING)
FUZZ_PATHS = os.environ.get("ARGOSY_FUZZ_PATHS")  # None: every operation
# an admin key, sent with every case: it may also load and unload LoRA adapters
ADMIN_KEY = "sk-fuzz-admin"
HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}
MODELS = {
    "/completions": "smollm2",
    "/responses": "smollm2",
    "/messages": "smollm2",
    "/count_tokens": "smollm2",
    "/embeddings": "minilm",  # /v1/embeddings and Ollama's /api/embeddings
    "/api/chat": "smollm2",
    "/api/generate": "smollm2",
    "/api/show": "smollm2",
    "/api/embed": "minilm",
    "/rerank": "minilm",  # /v1/rerank, /rerank and /v2/rerank: cosine relevance
    "/score": "minilm",
    "/load_lora_adapter": "smollm2",
}


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    print(f"fuzz seed: {FUZZ_SEED}")  # first, so a run that breaks early still says it
    directory = tmp_path_factory.mktemp("fuzz")
    adapter = save_adapters(directory, {"fuzz-lora-adapter": 8})["fuzz-lora-adapter"]
    # a drawn max_tokens can ask for the whole context: each generation ends after 5 s
    # ("length"), so no case waits minutes on a client timeout
    flags = ["--request-timeout", "5", "--admin-key", ADMIN_KEY, "--lora", f"fuzz-lora-adapter={adapter}"]
    with models_server(directory, SMOLLM2_AND_MINILM_TOML, extra_flags=flags) as server:
        yield server


def stored_responses(base_url: str) -> list[str]:
    """Two real stored responses (one a background one), so id-taking routes see real ids."""
    ids = []
    for background in (False, True):
        body = {"model": "smollm2", "input": "Say hi.", "max_output_tokens": 16, "background": background}
        response = httpx.post(f"{base_url}/v1/responses", json=body, headers=HEADERS, timeout=120)
        assert response.status_code == 200, response.text
        ids.append(response.json()["id"])
    return ids


def assert_clean(report: FuzzReport, fuzz_server: ServerProcess) -> None:
    print(f"fuzz seed: {FUZZ_SEED} (replay: ARGOSY_FUZZ_SEED={FUZZ_SEED})")
    print(f"fuzz total: {report.summary()}")
    for refusal, count in report.refusals.most_common(15):
        print(f"fuzz refused (positive case) {count}x {refusal}")
    assert report.cases > 0
    listed = "\n".join(report.failures[:20])
    assert not report.failures, f"{len(report.failures)} failures, first ones:\n{listed}"
    assert fuzz_server.process is not None and fuzz_server.process.poll() is None  # still up
    assert httpx.get(f"{fuzz_server.base_url}/health", timeout=10).status_code == 200
    # the adapter is still served: no fuzzed case unloaded it, nor took its name
    adapters = httpx.get(f"{fuzz_server.base_url}/lora-adapters", headers=HEADERS, timeout=10).json()
    assert [adapter["name"] for adapter in adapters] == ["fuzz-lora-adapter"]


def test_fuzz_own_openapi_document(fuzz_server: ServerProcess) -> None:
    report = FuzzReport()
    base_url = fuzz_server.base_url
    ids = stored_responses(base_url)
    fuzz(
        own_schema(base_url, HEADERS),
        base_url,
        report,
        examples=FUZZ_EXAMPLES,
        seed=FUZZ_SEED,
        path_parameters={"response_id": ids},
        models=MODELS,
        headers=HEADERS,
        only=FUZZ_PATHS,
    )
    assert_clean(report, fuzz_server)


def test_fuzz_openai_published_spec(fuzz_server: ServerProcess) -> None:
    report = FuzzReport()
    base_url = fuzz_server.base_url
    ids = stored_responses(base_url)
    fuzz(
        openai_schema(),
        f"{base_url}/v1",
        report,
        examples=FUZZ_EXAMPLES,
        seed=FUZZ_SEED,
        path_parameters={"response_id": ids, "model": ["smollm2", "minilm"]},
        models=MODELS,
        headers=HEADERS,
        only=FUZZ_PATHS,
    )
    assert_clean(report, fuzz_server)
