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


# The real model of the box (Qwen2.5-Coder-0.5B-Instruct Q4_K_M, registry name
# qwen2.5-coder-0.5b): one server for the whole e2e session, shared by every module whose
# behaviour depends on a real model (tool calls, FIM, factual answers). Its own weights
# (quantization auto: the file's blocks), eager steps (a compile costs minutes).
QWEN_SMALL = "qwen2.5-coder-0.5b"


@pytest.fixture(scope="session")
def qwen_server() -> Iterator[ServerProcess]:
    process = ServerProcess(
        model=QWEN_SMALL, quantization="auto", compile="off", max_model_len=4096, kv_cache_memory="128M"
    ).start()
    try:
        yield process
    finally:
        process.stop()
