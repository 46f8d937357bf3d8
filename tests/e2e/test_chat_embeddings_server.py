"""Embeddings from the chat model, on the session's real server (SmolLM2 as `smollm2-test`,
bf16 weights, eager steps), through the official `openai` and `ollama` clients.

The vectors are the mean of the model's last hidden states (after the final norm) over the
input's tokens (raw text, no chat template), L2-normalised: checked against transformers'
float32 base model on the same dequantized weights (cosine >= 0.9995: bf16 measured 0.99989
and 0.99995 on two texts), then shape, norm, usage, a close pair scoring above an unrelated
one, the same vectors through both dialects, and bad inputs refused in each dialect's shape.
"""

from __future__ import annotations

import httpx
import numpy as np
import ollama
import openai
import pytest
import torch

from tests.e2e.server import ServerProcess
from tests.openai_schema import validate

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "smollm2-test"
DIMENSIONS = 576  # SmolLM2-135M's hidden size
TEXTS = [
    "The cat sat on the mat.",
    "A kitten was sitting on the rug.",
    "Quarterly revenue grew by eight percent in the third quarter.",
]


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[int]], np.ndarray]:
    """(token ids, vectors) of TEXTS from transformers: float32 base model, mean, normalised."""
    transformers = pytest.importorskip("transformers")
    from argosy.models.loader import resolve_model
    from tests.hf_reference import hf_model

    source = resolve_model("smollm2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(source.weights_dir)
    model = hf_model(source, base=True)
    ids = [tokenizer(text).input_ids for text in TEXTS]
    with torch.inference_mode():
        rows = [model(torch.tensor([i])).last_hidden_state[0].mean(dim=0) for i in ids]
    return ids, torch.nn.functional.normalize(torch.stack(rows), dim=1).numpy()


@pytest.fixture(scope="module")
def ollama_client(server: ServerProcess) -> ollama.Client:
    return ollama.Client(host=server.base_url, timeout=300)


def test_openai_embeddings_of_a_chat_model_equal_transformers(
    client: openai.OpenAI, reference: tuple[list[list[int]], np.ndarray]
) -> None:
    ids, expected = reference
    response = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks base64
    assert [d.index for d in response.data] == [0, 1, 2] and response.model == MODEL
    vectors = np.array([d.embedding for d in response.data], dtype=np.float32)
    assert vectors.shape == (3, DIMENSIONS)
    assert np.abs(np.linalg.norm(vectors, axis=1) - 1).max() <= 1e-5
    cosine = (vectors * expected).sum(axis=1)
    assert cosine.min() >= 0.9995, cosine
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(len(i) for i in ids)
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2]  # a close pair above an unrelated one
    single = client.embeddings.create(model=MODEL, input=TEXTS[2], encoding_format="float")
    assert single.usage.prompt_tokens == len(ids[2])
    assert float(np.array(single.data[0].embedding) @ expected[2]) >= 0.9995


def test_ollama_embed_gives_the_same_vectors(
    ollama_client: ollama.Client, client: openai.OpenAI, http: httpx.Client
) -> None:
    embedded = ollama_client.embed(model=MODEL, input=TEXTS)
    ours = np.array(embedded.embeddings)
    theirs = np.array([d.embedding for d in client.embeddings.create(model=MODEL, input=TEXTS).data])
    assert ours.shape == (3, DIMENSIONS)
    # bf16 steps: a batch of other shape moves the last bits (one text alone: 0.999988 measured)
    assert (ours * theirs).sum(axis=1).min() >= 0.9999
    assert (
        embedded.prompt_eval_count == client.embeddings.create(model=MODEL, input=TEXTS).usage.prompt_tokens
    )
    short = ollama_client.embed(model=MODEL, input=TEXTS[0], dimensions=64)
    assert len(short.embeddings[0]) == 64
    assert np.linalg.norm(short.embeddings[0]) == pytest.approx(1.0, abs=1e-5)
    raw = http.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS[:2]})
    validate("CreateEmbeddingResponse", raw.json())  # OpenAI's own schema of the answer
    old = http.post("/api/embeddings", json={"model": f"{MODEL}:latest", "prompt": TEXTS[1]})
    assert old.status_code == 200, old.text
    assert float(np.array(old.json()["embedding"]) @ ours[1]) >= 0.9999


def test_truncation_as_ollama_does_it(ollama_client: ollama.Client) -> None:
    """Ollama truncates an input to its context (`options.num_ctx` here) unless truncate is false."""
    long_text = "word " * 300
    cut = ollama_client.embed(model=MODEL, input=long_text, options={"num_ctx": 128})
    assert cut.prompt_eval_count == 128 and len(cut.embeddings[0]) == DIMENSIONS
    with pytest.raises(ollama.ResponseError) as refused:
        ollama_client.embed(model=MODEL, input=["fine", long_text], truncate=False, options={"num_ctx": 128})
    assert refused.value.status_code == 400 and "context length" in refused.value.error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": ["ok", ""]}, "input[1]"),
        ({"input": "word " * 9000}, "input"),  # past the 8,192-token context
        ({"input": "x", "dimensions": 64}, "dimensions"),  # no Matryoshka shortening
    ],
)
def test_bad_openai_inputs_are_400s_naming_the_field(
    client: openai.OpenAI, body: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MODEL, **body)  # type: ignore[arg-type]
    assert refused.value.status_code == 400
    assert refused.value.body["param"] == param  # type: ignore[index]


def test_bad_ollama_inputs_are_400s_in_its_shape(http: httpx.Client) -> None:
    for body in ({"model": MODEL, "input": []}, {"model": MODEL, "input": [""]}):
        response = http.post("/api/embed", json=body)
        assert response.status_code == 400 and set(response.json()) == {"error"}, response.text
    long = http.post("/api/embed", json={"model": MODEL, "input": "word " * 9000, "truncate": False})
    assert long.status_code == 400 and "context length" in long.json()["error"]


def test_the_model_says_how_it_pools(client: openai.OpenAI, ollama_client: ollama.Client) -> None:
    capabilities = client.models.retrieve(MODEL).model_extra["capabilities"]  # type: ignore[index]
    assert capabilities["kind"] == "chat" and capabilities["embeddings"] is True
    assert capabilities["pooling"] == "mean" and capabilities["embedding_dimensions"] == DIMENSIONS
    shown = ollama_client.show(MODEL)
    assert shown.modelinfo is not None and shown.modelinfo["llama.embedding_length"] == DIMENSIONS


def test_a_qwen_gguf_embeds_through_ollama(qwen_server: ServerProcess) -> None:
    """The session's Qwen2.5-Coder GGUF (its Q4_K_M blocks, the invariant numerics) against
    transformers' float32 base model on the dequantized weights: measured 0.99977 or more."""
    transformers = pytest.importorskip("transformers")
    from argosy.models.loader import resolve_model
    from tests.e2e.conftest import QWEN_SMALL
    from tests.hf_reference import hf_model

    source = resolve_model(QWEN_SMALL)
    tokenizer = transformers.AutoTokenizer.from_pretrained(source.weights_dir)
    model = hf_model(source, base=True)
    texts = [TEXTS[0], "def add(a, b):\n    return a + b"]
    with torch.inference_mode():
        rows = [model(torch.tensor([tokenizer(t).input_ids])).last_hidden_state[0].mean(dim=0) for t in texts]
    expected = torch.nn.functional.normalize(torch.stack(rows), dim=1).numpy()
    embedded = ollama.Client(host=qwen_server.base_url, timeout=300).embed(model=QWEN_SMALL, input=texts)
    ours = np.array(embedded.embeddings)
    assert ours.shape == (2, model.config.hidden_size)
    assert (ours * expected).sum(axis=1).min() >= 0.999
    assert embedded.prompt_eval_count == sum(len(tokenizer(t).input_ids) for t in texts)
