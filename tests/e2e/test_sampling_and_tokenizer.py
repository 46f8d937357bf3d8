"""What a generation ran with, said on every answer, and vLLM's tokenizer routes, against a
real server.

One server serves SmolLM2 twice (bf16 eager): `smollm2` with no sampling defaults of its own
(what it runs with unsent is what /v1/models advertises) and `tuned`, whose models.toml
`[model.sampling]` sets operator defaults that differ from the fallbacks. Every dialect's
generation, streamed or not, carries `x-argosy-sampling` (compact JSON); OpenAI chat and
completion objects and chunks carry `system_fingerprint`, and a second short-lived server with
another `--quantization` has another one. /tokenize counts what /v1/completions and
/v1/chat/completions count as prompt tokens, and /detokenize gives the text back.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.e2e.server import ServerProcess, models_server

MODELS_TOML = """
[[model]]
id = "smollm2"
source = "smollm2"
quantization = "none"
compile = "off"
max_model_len = 256

[[model]]
id = "tuned"
source = "smollm2"
quantization = "none"
compile = "off"
max_model_len = 256
[model.sampling]
temperature = 0.3
top_k = 5
max_tokens = 12
repetition_penalty = 1.1
"""
CONTEXT = 256  # small: a request with no max_tokens may run to the context's end
SAMPLING_KEYS = {
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "max_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with models_server(tmp_path_factory.mktemp("sampling"), MODELS_TOML) as started:
        yield started


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=300) as client:
        yield client


def sampling_of(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200
    header = response.headers["x-argosy-sampling"]
    assert " " not in header  # compact JSON
    sampling: dict[str, Any] = json.loads(header)
    assert set(sampling) >= SAMPLING_KEYS
    return sampling


def generate(
    http: httpx.Client, path: str, body: dict[str, Any], *, stream: bool, headers_only: bool = False
) -> tuple[dict[str, Any], list[str]]:
    """(the sampling header, the answer's body lines) of one generation, streamed or not;
    `headers_only`: a stream is left as soon as its headers came (nothing sent limits its
    length, and the header is all the test reads)."""
    if not stream:
        response = http.post(path, json=body)
        assert response.status_code == 200, response.text
        return sampling_of(response), [response.text]
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        sampling = sampling_of(response)
        lines = [] if headers_only else [line for line in response.iter_lines() if line]
    return sampling, lines


# each dialect's generation route, a body sending temperature 0.6, seed 7 and 5 tokens at most
DIALECTS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"messages": QUESTION, "temperature": 0.6, "seed": 7, "max_tokens": 5}),
    "completions": (
        "/v1/completions",
        {"prompt": "Paris is", "temperature": 0.6, "seed": 7, "max_tokens": 5},
    ),
    "responses": (
        "/v1/responses",
        {"input": "Hi", "temperature": 0.6, "seed": 7, "max_output_tokens": 5, "store": False},
    ),
    "anthropic": ("/v1/messages", {"messages": QUESTION, "temperature": 0.6, "seed": 7, "max_tokens": 5}),
    "ollama chat": (
        "/api/chat",
        {"messages": QUESTION, "stream": False, "options": {"temperature": 0.6, "seed": 7, "num_predict": 5}},
    ),
    "ollama generate": (
        "/api/generate",
        {"prompt": "Paris is", "stream": False, "options": {"temperature": 0.6, "seed": 7, "num_predict": 5}},
    ),
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_every_dialect_says_what_it_sent(http: httpx.Client, dialect: str, stream: bool) -> None:
    path, body = DIALECTS[dialect]
    sampling, _ = generate(http, path, {"model": "smollm2", **body}, stream=stream)
    assert (sampling["temperature"], sampling["seed"], sampling["max_tokens"]) == (0.6, 7, 5)
    assert "seeds" not in sampling


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_every_dialect_says_the_defaults_it_ran_with(http: httpx.Client, dialect: str, stream: bool) -> None:
    """Nothing sent: the model's advertised defaults, a drawn seed; on the tuned model its
    operator defaults (max_tokens 12 where the dialect leaves the limit to the server)."""
    path, sent = DIALECTS[dialect]
    body = {key: value for key, value in sent.items() if key not in ("temperature", "seed", "options")}
    if dialect == "anthropic":
        body["max_tokens"] = 5  # required by the dialect
    else:
        body.pop("max_tokens", None)
        body.pop("max_output_tokens", None)
    advertised = http.get("/v1/models/smollm2").json()["capabilities"]["sampling_defaults"]
    sampling, _ = generate(http, path, {"model": "smollm2", **body}, stream=stream, headers_only=True)
    for key, value in advertised.items():
        assert sampling[key] == value, key
    assert isinstance(sampling["seed"], int) and not isinstance(sampling["seed"], bool)
    tuned, _ = generate(http, path, {"model": "tuned", **body}, stream=stream, headers_only=True)
    assert (tuned["temperature"], tuned["top_k"], tuned["repetition_penalty"]) == (0.3, 5, 1.1)
    assert (tuned["temperature"], tuned["top_k"]) != (sampling["temperature"], sampling["top_k"])
    if dialect == "anthropic":
        assert tuned["max_tokens"] == 5
    elif dialect == "completions":
        assert tuned["max_tokens"] == 16  # OpenAI's default for the legacy route, sent as the request's
    else:
        assert tuned["max_tokens"] == 12


def test_the_limit_used_is_the_room_left_when_nobody_sets_one(http: httpx.Client) -> None:
    response = http.post(
        "/v1/chat/completions", json={"model": "smollm2", "messages": QUESTION, "temperature": 0}
    )
    sampling = sampling_of(response)
    assert sampling["max_tokens"] == CONTEXT - response.json()["usage"]["prompt_tokens"]
    assert sampling["seed"] is None and sampling["temperature"] == 0.0  # greedy: no seed is used
    tuned = http.post(
        "/v1/chat/completions", json={"model": "tuned", "messages": QUESTION, "temperature": 0.9}
    )
    assert (sampling_of(tuned)["temperature"], sampling_of(tuned)["max_tokens"]) == (0.9, 12)
    assert tuned.json()["usage"]["completion_tokens"] <= 12


def test_each_unseeded_request_draws_its_own_seed_and_n_choices_list_theirs(http: httpx.Client) -> None:
    body = {"model": "smollm2", "prompt": "Paris is", "max_tokens": 2}
    seeds = {sampling_of(http.post("/v1/completions", json=body))["seed"] for _ in range(3)}
    assert len(seeds) == 3
    sampling = sampling_of(http.post("/v1/completions", json={**body, "n": 3, "seed": 100}))
    assert sampling["seeds"] == [100, 101, 102]
    drawn = sampling_of(http.post("/v1/chat/completions", json={**body, "messages": QUESTION, "n": 2}))
    assert len(set(drawn["seeds"])) == 2 and drawn["seed"] == drawn["seeds"][0]


def test_a_background_response_says_it_too(http: httpx.Client) -> None:
    body = {"model": "tuned", "input": "Hi", "background": True, "max_output_tokens": 3}
    response = http.post("/v1/responses", json=body)
    assert sampling_of(response)["temperature"] == 0.3
    response_id = response.json()["id"]
    for _ in range(600):
        if http.get(f"/v1/responses/{response_id}").json()["status"] not in ("queued", "in_progress"):
            break
        time.sleep(0.1)
    assert http.get(f"/v1/responses/{response_id}").json()["status"] == "incomplete"  # 3 tokens: length


def test_the_openai_client_reads_it(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    raw = client.chat.completions.with_raw_response.create(
        model="tuned", messages=QUESTION, max_tokens=3, top_p=0.5
    )
    sampling = json.loads(raw.headers["x-argosy-sampling"])
    # top_p sent: the request's level supplies the whole truncation (top_k off, SPEC §3 rule 1)
    assert (sampling["top_p"], sampling["top_k"], sampling["temperature"]) == (0.5, 0, 0.3)
    assert raw.parse().system_fingerprint == fingerprint_of(server, "tuned")
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
    message = claude.messages.with_raw_response.create(
        # this client no longer sends sampling fields itself; the API still honours them
        model="smollm2",
        max_tokens=3,
        messages=QUESTION,
        extra_body={"temperature": 0.2, "seed": 5},
    )
    sampling = json.loads(message.headers["x-argosy-sampling"])
    assert (sampling["temperature"], sampling["seed"]) == (0.2, 5)


# -- system_fingerprint ----------------------------------------------------------------------------


def fingerprint_of(server: ServerProcess, model: str = "smollm2") -> str:
    response = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": model, "messages": QUESTION, "max_tokens": 1},
        timeout=300,
    )
    fingerprint: str = response.json()["system_fingerprint"]
    return fingerprint


def test_the_fingerprint_is_on_every_openai_object_and_stable(
    server: ServerProcess, http: httpx.Client
) -> None:
    fingerprint = fingerprint_of(server)
    assert fingerprint.startswith("fp_") and len(fingerprint) == 13
    assert fingerprint_of(server, "tuned") != fingerprint  # another model id
    for path, body in [DIALECTS["chat"], DIALECTS["completions"]]:
        whole = http.post(path, json={"model": "smollm2", **body}).json()
        assert whole["system_fingerprint"] == fingerprint
        _, lines = generate(http, path, {"model": "smollm2", **body}, stream=True)
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert chunks and all(chunk["system_fingerprint"] == fingerprint for chunk in chunks)
    assert fingerprint_of(server) == fingerprint


def test_another_quantization_has_another_fingerprint(server: ServerProcess) -> None:
    other = ServerProcess(model="smollm2", quantization="int8", compile="off", startup_timeout_s=300).start()
    try:
        assert fingerprint_of(other).startswith("fp_")
        assert fingerprint_of(other) != fingerprint_of(server)
    finally:
        other.stop()


# -- tokenizer routes ------------------------------------------------------------------------------

PROMPT = "The capital of France is Paris. Ünïcödé and emoji 🚀 too."


def test_tokenize_a_prompt_counts_what_completions_counts(http: httpx.Client) -> None:
    tokenized = http.post("/tokenize", json={"model": "smollm2", "prompt": PROMPT, "return_token_strs": True})
    assert tokenized.status_code == 200, tokenized.text
    body = tokenized.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert (
        body["count"] == len(body["tokens"]) == len(body["token_strs"]) and body["max_model_len"] == CONTEXT
    )
    completion = http.post("/v1/completions", json={"model": "smollm2", "prompt": PROMPT, "max_tokens": 1})
    assert completion.json()["usage"]["prompt_tokens"] == body["count"]
    default_model = http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert default_model["tokens"] == body["tokens"] and default_model["token_strs"] is None


def test_tokenize_messages_counts_what_chat_counts(http: httpx.Client) -> None:
    conversations = [
        QUESTION,
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another one?"},
        ],
    ]
    for messages in conversations:
        tokenized = http.post("/tokenize", json={"model": "smollm2", "messages": messages}).json()
        chat = http.post(
            "/v1/chat/completions", json={"model": "smollm2", "messages": messages, "max_tokens": 1}
        )
        assert chat.json()["usage"]["prompt_tokens"] == tokenized["count"]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    with_tools = {"model": "smollm2", "messages": QUESTION, "tools": tools}
    tokenized = http.post("/tokenize", json=with_tools).json()
    chat = http.post("/v1/chat/completions", json={**with_tools, "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == tokenized["count"]
    assert tokenized["count"] > http.post("/tokenize", json={"messages": QUESTION}).json()["count"]
    continued = [*QUESTION, {"role": "assistant", "content": "The capital is"}]
    open_turn = {"messages": continued, "add_generation_prompt": False, "continue_final_message": True}
    tokens = http.post("/tokenize", json=open_turn).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": tokens}).json()["prompt"].endswith("The capital is")


def test_detokenize_round_trips(http: httpx.Client) -> None:
    bare = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"]
    assert http.post("/detokenize", json={"model": "smollm2", "tokens": bare}).json() == {"prompt": PROMPT}
    chat_tokens = http.post("/tokenize", json={"messages": QUESTION}).json()["tokens"]
    text = http.post("/detokenize", json={"tokens": chat_tokens}).json()["prompt"]
    assert "What is the capital of France?" in text and "<|im_start|>" in text  # special tokens kept
    assert (
        http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
        == chat_tokens
    )


def test_tokenizer_info(http: httpx.Client) -> None:
    info = http.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert info["model"] == "smollm2" and info["model_max_length"] == CONTEXT
    assert info["vocab_size"] == 49152
    assert info["eos_token"] == "<|im_end|>" and info["eos_token_id"] == 2
    assert "<|im_start|>" in info["chat_template"]
    assert http.get("/tokenizer_info", params={"model": "tuned"}).json()["model"] == "tuned"


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "param"),
    [
        ("POST", "/tokenize", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
        ("POST", "/detokenize", {"model": "gpt-9", "tokens": [1]}, 404, "model"),
        ("GET", "/tokenizer_info?model=gpt-9", None, 404, "model"),
        ("POST", "/tokenize", {"model": "smollm2"}, 400, "prompt"),
        ("POST", "/tokenize", {"prompt": "hi", "messages": QUESTION}, 400, "messages"),
        ("POST", "/detokenize", {"tokens": [1, 49152]}, 400, "tokens[1]"),
        ("POST", "/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ],
)
def test_refusals_in_openai_shape(
    http: httpx.Client, method: str, path: str, body: Any, status: int, param: str
) -> None:
    response = http.request(method, path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
