"""One real `argosy serve` (the default model, smollm2) for the whole e2e session."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.e2e.server import FULL_CONTEXT_KV, ServerProcess

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    # the e2e tests assume the model's whole context (8,192 tokens) fits the KV pool
    process = ServerProcess(served_model_name="smollm2-test", kv_cache_memory=FULL_CONTEXT_KV).start()
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="session")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as http_client:
        yield http_client
