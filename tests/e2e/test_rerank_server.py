"""Rerank and score through a real server: `/v1/rerank`, `/rerank`, `/v2/rerank`, `/v1/score`.

One server for the module: all-MiniLM-L6-v2 (loaded at start-up: relevance is the cosine of
the embeddings), a tiny random cross-encoder folder written here (its kind, rerank, inferred
from the folder) and SmolLM2 (a chat model, never loaded: the registry refuses it for these
routes before loading anything). No official client exists for these routes (vLLM's, Jina's
and llama.cpp's are plain HTTP), so httpx sends what those clients send; Cohere's client
too when it is installed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.server import ServerProcess, models_server
from tests.e2e.tiny_causal import write_tiny_causal_lm
from tests.unit.test_rerank_model import write_tiny_cross_encoder

pytestmark = [pytest.mark.e2e]

QUERY = "What is the capital of France?"
DOCUMENTS = [
    "The cat sits on the mat.",
    "Berlin is the capital of Germany.",
    "Paris is the capital of France.",
    "Bananas are rich in potassium.",
    "France is a country in Western Europe.",
]
MODELS_TOML = """
[[model]]
id = "minilm"
source = "minilm"

[[model]]
id = "tiny-reranker"
source = "{reranker}"

[[model]]
id = "tiny-judge"
source = "{judge}"
quantization = "none"
compile = "off"
max_model_len = 512

[[model]]
id = "smollm2"
source = "smollm2"
quantization = "none"
compile = "off"
max_model_len = 512
"""


@pytest.fixture(scope="module")
def reranker_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-reranker")
    write_tiny_cross_encoder(folder)
    return folder


@pytest.fixture(scope="module")
def judge_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 causal LM named as a reranker, with SmolLM2's tokenizer (which has
    single 'yes' and 'no' tokens): served as a yes/no judge, as Qwen3-Reranker is."""
    folder = tmp_path_factory.mktemp("judge") / "tiny-qwen3-reranker"
    folder.mkdir()
    write_tiny_causal_lm(folder, "qwen3", seed=5, head_dim=16)
    return folder


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, reranker_folder: Path, judge_folder: Path
) -> Iterator[ServerProcess]:
    toml = MODELS_TOML.format(reranker=reranker_folder, judge=judge_folder)
    # float32: the judge is compared with transformers' float32 (the chat models' dtype)
    with models_server(
        tmp_path_factory.mktemp("rerank"), toml, extra_flags=["--dtype", "float32"]
    ) as process:
        yield process


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def post(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_rerank_scores_are_the_cosine_of_the_embeddings(http: httpx.Client) -> None:
    body = {"model": "minilm", "query": QUERY, "documents": DOCUMENTS}
    answer = post(http, "/v1/rerank", body)
    vectors = [
        d["embedding"]
        for d in post(http, "/v1/embeddings", {"model": "minilm", "input": [QUERY, *DOCUMENTS]})["data"]
    ]
    expected = [cosine(vectors[0], v) for v in vectors[1:]]
    results = answer["results"]
    assert sorted(r["index"] for r in results) == list(range(len(DOCUMENTS)))
    for result in results:
        assert abs(result["relevance_score"] - expected[result["index"]]) < 1e-5
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}  # Jina's default: returned
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    assert results[0]["index"] == 2  # "Paris is the capital of France."
    assert answer["model"] == "minilm" and answer["id"].startswith("rerank-")
    assert answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > len(DOCUMENTS)


def test_jina_shape_objects_top_n_and_the_bare_path(http: httpx.Client) -> None:
    body = {
        "model": "minilm",
        "query": QUERY,
        "documents": [{"text": d} for d in DOCUMENTS],
        "top_n": 2,
    }
    for path in ("/v1/rerank", "/rerank"):
        results = post(http, path, body)["results"]
        assert [r["index"] for r in results][:1] == [2] and len(results) == 2
        assert results[0]["document"] == {"text": DOCUMENTS[2]}
    plain = post(http, "/v1/rerank", body | {"return_documents": False})["results"]
    assert all("document" not in r for r in plain)


def test_cohere_v2_shape(http: httpx.Client) -> None:
    body = {"model": "minilm", "query": QUERY, "documents": DOCUMENTS, "top_n": 3, "max_tokens_per_doc": 4096}
    answer = post(http, "/v2/rerank", body)
    assert set(answer) == {"id", "results", "meta"}
    assert answer["meta"]["billed_units"] == {"search_units": 1}
    assert [set(r) for r in answer["results"]] == [{"index", "relevance_score"}] * 3
    assert answer["results"][0]["index"] == 2
    # a document cut to its first 2 tokens scores as that text does
    cut = post(
        http, "/v2/rerank", body | {"documents": ["Paris is the capital of France."], "max_tokens_per_doc": 2}
    )
    short = post(http, "/v2/rerank", body | {"documents": ["Paris is"]})
    assert abs(cut["results"][0]["relevance_score"] - short["results"][0]["relevance_score"]) < 1e-6


def test_cohere_client_when_installed(server: ServerProcess) -> None:
    cohere = pytest.importorskip("cohere")
    client = cohere.ClientV2(api_key="unused", base_url=server.base_url)
    answer = client.rerank(model="minilm", query=QUERY, documents=DOCUMENTS, top_n=2)
    assert [r.index for r in answer.results][0] == 2 and len(answer.results) == 2


def test_score_one_to_one_one_to_many_and_pairwise(http: httpx.Client) -> None:
    ranked = post(http, "/v1/rerank", {"model": "minilm", "query": QUERY, "documents": DOCUMENTS})
    by_index = {r["index"]: r["relevance_score"] for r in ranked["results"]}
    many = post(http, "/v1/score", {"model": "minilm", "text_1": QUERY, "text_2": DOCUMENTS})
    assert many["object"] == "list" and many["model"] == "minilm" and isinstance(many["created"], int)
    assert [d["index"] for d in many["data"]] == list(range(len(DOCUMENTS)))
    assert all(d["object"] == "score" for d in many["data"])
    assert [d["score"] for d in many["data"]] == pytest.approx([by_index[i] for i in range(5)], abs=1e-6)
    pairwise = post(http, "/v1/score", {"model": "minilm", "text_1": [QUERY] * 5, "text_2": DOCUMENTS})
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(
        [d["score"] for d in many["data"]], abs=1e-6
    )
    mixed = post(http, "/v1/score", {"model": "minilm", "text_1": DOCUMENTS[:2], "text_2": DOCUMENTS[2:4]})
    one = post(http, "/v1/score", {"model": "minilm", "text_1": DOCUMENTS[1], "text_2": DOCUMENTS[3]})
    assert len(one["data"]) == 1 and abs(one["data"][0]["score"] - mixed["data"][1]["score"]) < 1e-6
    assert many["usage"]["total_tokens"] > 0


def encoder_forwards(http: httpx.Client, model: str) -> float:
    text = http.get("/metrics").text
    match = re.search(rf'^argosy:encoder_forwards_total{{model="{model}"}} (\S+)$', text, re.MULTILINE)
    assert match is not None, text[-2000:]
    return float(match.group(1))


def test_64_documents_are_one_batched_pass(http: httpx.Client) -> None:
    documents = [f"Document number {i} talks about {DOCUMENTS[i % 5].lower()}" for i in range(64)]
    for model in ("minilm", "tiny-reranker"):
        post(http, "/v1/rerank", {"model": model, "query": QUERY, "documents": ["loads it"]})
        before = encoder_forwards(http, model)
        answer = post(http, "/v1/rerank", {"model": model, "query": QUERY, "documents": documents})
        assert len(answer["results"]) == 64
        assert encoder_forwards(http, model) == before + 1


def test_a_cross_encoder_folder_serves_rerank(http: httpx.Client, reranker_folder: Path) -> None:
    from sentence_transformers import CrossEncoder

    answer = post(
        http,
        "/v1/rerank",
        {
            "model": "tiny-reranker",
            "query": "paris",
            "documents": ["paris is the capital of france", "a cat sat on the mat", "the quick brown fox"],
        },
    )
    expected = CrossEncoder(str(reranker_folder), device="cpu").predict(
        [("paris", d["document"]["text"]) for d in answer["results"]]
    )
    assert [r["relevance_score"] for r in answer["results"]] == pytest.approx(list(expected), abs=1e-4)
    listed = http.get("/v1/models/tiny-reranker").json()
    assert listed["capabilities"]["kind"] == "rerank"


def test_a_causal_lm_reranker_scores_p_yes_as_transformers(http: httpx.Client, judge_folder: Path) -> None:
    """Qwen3-Reranker's way: P(yes) over yes/no at the judging prompt's last position, every
    document one batched prefill on the model's engine; equal to transformers' float32."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from argosy.core.judge_scorer import judge_prompt

    answer = post(http, "/v1/rerank", {"model": "tiny-judge", "query": QUERY, "documents": DOCUMENTS})
    tokenizer = Tokenizer.from_file(str(judge_folder / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(judge_folder, dtype=torch.float32).eval()
    yes, no = tokenizer.token_to_id("yes"), tokenizer.token_to_id("no")
    expected = []
    for document in DOCUMENTS:
        ids = tokenizer.encode(judge_prompt(QUERY, document), add_special_tokens=False).ids
        with torch.inference_mode():
            last = model(torch.tensor([ids])).logits[0, -1]
        expected.append(float(torch.softmax(last[[no, yes]], dim=0)[1]))
    scores = {r["index"]: r["relevance_score"] for r in answer["results"]}
    assert [scores[i] for i in range(len(DOCUMENTS))] == pytest.approx(expected, abs=1e-4)
    assert len(set(expected)) == len(expected)  # random weights, yet five distinct scores
    listed = http.get("/v1/models/tiny-judge").json()
    assert listed["capabilities"]["kind"] == "rerank"
    scored = post(http, "/v1/score", {"model": "tiny-judge", "text_1": QUERY, "text_2": DOCUMENTS[2]})
    assert scored["data"][0]["score"] == pytest.approx(expected[2], abs=1e-4)


def test_no_model_named_uses_a_scorer(http: httpx.Client) -> None:
    answer = post(http, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS[:2]})
    assert answer["model"] in ("minilm", "tiny-reranker", "tiny-judge")


@pytest.mark.parametrize(
    ("path", "body", "param", "status"),
    [
        ("/v1/rerank", {"model": "minilm", "query": QUERY, "documents": []}, "documents", 400),
        ("/v1/rerank", {"model": "minilm", "query": QUERY, "documents": ["x"] * 10_000}, "documents", 400),
        ("/v2/rerank", {"model": "minilm", "query": "", "documents": DOCUMENTS}, "query", 400),
        ("/v1/rerank", {"model": "minilm", "documents": DOCUMENTS}, "query", 400),
        ("/v1/rerank", {"model": "minilm", "query": QUERY, "documents": ["a", 7]}, "documents[1]", 400),
        ("/rerank", {"model": "minilm", "query": QUERY, "documents": [{"title": "x"}]}, "documents[0]", 400),
        (
            "/v1/rerank",
            {"model": "minilm", "query": QUERY, "documents": DOCUMENTS, "top_n": -1},
            "top_n",
            400,
        ),
        ("/v1/rerank", {"model": "no-such-model", "query": QUERY, "documents": DOCUMENTS}, "model", 404),
        ("/v1/rerank", {"model": "smollm2", "query": QUERY, "documents": DOCUMENTS}, "model", 400),
        ("/v1/score", {"model": "smollm2", "text_1": QUERY, "text_2": DOCUMENTS}, "model", 400),
        ("/v1/score", {"model": "minilm", "text_1": [QUERY] * 2, "text_2": DOCUMENTS}, "text_2", 400),
        ("/v1/score", {"model": "minilm", "text_1": QUERY, "text_2": []}, "text_2", 400),
        ("/v1/score", {"model": "minilm", "text_1": "", "text_2": DOCUMENTS}, "text_1", 400),
        ("/v1/score", {"model": "minilm", "text_1": QUERY, "text_2": ["x"] * 10_000}, "text_2", 400),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(
    http: httpx.Client, path: str, body: dict[str, Any], param: str, status: int
) -> None:
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    if body.get("model") == "smollm2":
        assert "smollm2" in error["message"] and "chat" in error["message"]


def test_openapi_documents_the_routes(http: httpx.Client) -> None:
    paths = http.get("/openapi.json").json()["paths"]
    for path in ("/v1/rerank", "/rerank", "/v2/rerank", "/v1/score"):
        operation = paths[path]["post"]
        assert "application/json" in operation["requestBody"]["content"]
        assert "4XX" in operation["responses"]
