"""The tokenizer routes, the x-argosy-sampling header and system_fingerprint, over the app and
a real tiny engine (random weights) whose tokenizer is a small word-level vocabulary with a
BOS and a ChatML-like chat template: /tokenize counts what /v1/completions and
/v1/chat/completions count, /detokenize round-trips, and every generation says the sampling
it ran with (header and request events) — the e2e file does the same against SmolLM2."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from starlette.testclient import TestClient
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from argosy.api.app import build_app
from argosy.api.wire import SAMPLING_HEADER
from argosy.config import EngineConfig, ModelSpec, OperatorSampling, ServerConfig
from argosy.core.events import EventBus, RequestEvent
from argosy.core.registry import ModelRegistry
from argosy.core.service import ModelService, ServiceOptions, system_fingerprint
from argosy.engine.async_engine import AsyncEngine
from argosy.engine.llm_engine import LLMEngine
from argosy.engine.outputs import ModelDescription
from argosy.sampling_params import SamplingParams

WORDS = ["hello", "world", "the", "cat", "sat", "on", "mat", "user", "assistant", "system", "hi", "a"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}"
)
OPERATOR = OperatorSampling(temperature=0.5, top_k=7, max_tokens=6)


def word_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="a"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "<|im_start|>", "<|im_end|>")])
    return tokenizer


@pytest.fixture
def events() -> list[RequestEvent]:
    return []


@pytest.fixture
def client(tiny_llama, events: list[RequestEvent]) -> Iterator[TestClient]:  # type: ignore[no-untyped-def]
    tokenizer = word_tokenizer()
    source = replace(
        tiny_llama.source,
        tokenizer=tokenizer,
        chat_template=TEMPLATE,
        bos_token="<s>",
        bos_token_id=tokenizer.token_to_id("<s>"),
        eos_token="<|im_end|>",
        eos_token_ids=[tokenizer.token_to_id("<|im_end|>")],
        add_bos_token=True,
    )
    config = EngineConfig(
        model="tiny",
        dtype="float32",
        kv_cache_memory=1 << 22,
        block_size=16,
        compile="off",
        max_model_len=128,
    )
    engines: list[AsyncEngine] = []

    def load(spec: ModelSpec) -> ModelService:
        engine = AsyncEngine(LLMEngine(config, source=source))
        engines.append(engine)
        options = ServiceOptions(operator_sampling=spec.sampling or OperatorSampling())
        return ModelService(spec.id, engine, options)

    specs = [ModelSpec("tiny", "tiny"), ModelSpec("tuned", "tiny", sampling=OPERATOR)]
    registry = ModelRegistry(specs, load)
    app = build_app(registry, ServerConfig(), events=EventBus([events.append]))
    with TestClient(app) as test_client:
        yield test_client
    for engine in engines:
        engine.shutdown()


def test_tokenize_a_prompt_counts_what_completions_counts(client: TestClient) -> None:
    tokenized = client.post("/tokenize", json={"prompt": "hello world the cat", "return_token_strs": True})
    assert tokenized.status_code == 200, tokenized.text
    body = tokenized.json()
    assert body == {
        "count": 5,
        "max_model_len": 128,
        "tokens": [12, 0, 1, 2, 3],  # the BOS, as the model's tokenizer config asks
        "token_strs": ["<s>", "hello", "world", "the", "cat"],
    }
    completion = client.post("/v1/completions", json={"prompt": "hello world the cat", "max_tokens": 2})
    assert completion.json()["usage"]["prompt_tokens"] == body["count"]
    bare = client.post(
        "/tokenize", json={"prompt": "hello world the cat", "add_special_tokens": False}
    ).json()
    assert bare["tokens"] == [0, 1, 2, 3] and bare["token_strs"] is None


def test_tokenize_messages_counts_what_chat_counts(client: TestClient) -> None:
    messages = [
        {"role": "system", "content": "the cat"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    body = client.post("/tokenize", json={"messages": messages}).json()
    # <|im_start|> system the cat <|im_end|> <|im_start|> user hi <|im_end|> <|im_start|> assistant
    assert body["tokens"] == [13, 9, 2, 3, 14, 13, 7, 10, 14, 13, 8]
    chat = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == body["count"] == 11
    with_bos = client.post("/tokenize", json={"messages": messages, "add_special_tokens": True}).json()
    assert with_bos["tokens"] == [12, *body["tokens"]]
    no_turn = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert no_turn["tokens"] == body["tokens"][:-2]


def test_detokenize_round_trips(client: TestClient) -> None:
    tokens = client.post("/tokenize", json={"prompt": "the cat sat on the mat"}).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": tokens}).json() == {
        "prompt": "<s> the cat sat on the mat"
    }
    bare = client.post("/tokenize", json={"prompt": "the cat sat", "add_special_tokens": False}).json()
    assert client.post("/detokenize", json={"tokens": bare["tokens"]}).json() == {"prompt": "the cat sat"}


def error_of(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": [{"type": "nope"}]}]},
            "messages[0].content[0].type",
        ),
        (
            "/tokenize",
            {"messages": [{"role": "assistant", "content": "hi"}], "continue_final_message": True},
            "continue_final_message",
        ),
        ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/detokenize", {}, "tokens"),
        ("/detokenize", {"tokens": [1, -2]}, "tokens[1]"),
        ("/detokenize", {"tokens": [1, 2, 999, 1000]}, "tokens[2]"),
        ("/detokenize", {"tokens": [2**40, 2**70]}, "tokens[0]"),
        ("/detokenize", {"tokens": ["1"]}, "tokens[0]"),
    ],
)
def test_bad_fields_are_400s_naming_them(
    client: TestClient, path: str, body: dict[str, Any], param: str
) -> None:
    error = error_of(client.post(path, json=body), 400)
    assert error["param"] == param, error


def test_an_out_of_vocabulary_id_is_named_in_the_message(client: TestClient) -> None:
    error = error_of(client.post("/detokenize", json={"tokens": [1, 2, 999, 1000]}), 400)
    assert "999, 1000" in error["message"] and "15 tokens" in error["message"]


def test_an_unknown_model_is_a_404_on_every_tokenizer_route(client: TestClient) -> None:
    for response in (
        client.post("/tokenize", json={"model": "nope", "prompt": "hi"}),
        client.post("/detokenize", json={"model": "nope", "tokens": [1]}),
        client.get("/tokenizer_info", params={"model": "nope"}),
    ):
        error = error_of(response, 404)
        assert error["param"] == "model" and error["code"] == "model_not_found"


def test_tokenizer_info(client: TestClient, events: list[RequestEvent]) -> None:
    info = client.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert info["model"] == "tiny" and info["model_max_length"] == 128
    assert (info["bos_token"], info["bos_token_id"], info["add_bos_token"]) == ("<s>", 12, True)
    assert (info["eos_token"], info["eos_token_id"], info["eos_token_ids"]) == ("<|im_end|>", 14, [14])
    assert info["vocab_size"] == 15
    assert info["added_tokens_decoder"]["13"]["content"] == "<|im_start|>"
    assert info["added_tokens_decoder"]["13"]["special"] is True
    assert info["chat_template"] == TEMPLATE
    assert client.get("/tokenizer_info", params={"model": "tuned"}).json()["model"] == "tuned"
    finished = [e for e in events if e.kind == "finished" and e.route == "GET /tokenizer_info"]
    assert finished and finished[0].model_id == "tiny" and finished[0].status == 200


def test_the_routes_are_in_the_openapi_document(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert "requestBody" in paths["/tokenize"]["post"]
    assert "requestBody" in paths["/detokenize"]["post"]
    assert [p["name"] for p in paths["/tokenizer_info"]["get"]["parameters"]] == ["model"]


# -- x-argosy-sampling -----------------------------------------------------------------------------


def sampling_of(response: Any) -> dict[str, Any]:
    header = response.headers[SAMPLING_HEADER]
    assert header == header.strip() and " " not in header  # compact JSON
    sampling: dict[str, Any] = json.loads(header)
    return sampling


def test_the_header_says_the_sampling_the_request_ran_with(
    client: TestClient, events: list[RequestEvent]
) -> None:
    sent = {"temperature": 0.8, "top_p": 0.9, "seed": 42, "presence_penalty": 0.5, "frequency_penalty": 0.25}
    response = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, **sent})
    assert sampling_of(response) == {
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": 0,  # the request set top_p: its level supplies all of the truncation
        "min_p": 0.0,
        "seed": 42,
        "max_tokens": 3,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "repetition_penalty": 1.0,
    }
    finished = [e for e in events if e.kind == "finished" and e.route == "POST /v1/completions"]
    assert finished[-1].sampling == sampling_of(response)


def test_defaults_a_drawn_seed_and_the_room_left(client: TestClient) -> None:
    """Nothing sent: the fallbacks (chat: max_tokens is the room left in the context)."""
    messages = [{"role": "user", "content": "hi"}]
    response = client.post("/v1/chat/completions", json={"messages": messages})
    sampling = sampling_of(response)
    assert (sampling["temperature"], sampling["top_k"], sampling["top_p"]) == (1.0, 40, 1.0)
    assert isinstance(sampling["seed"], int)
    assert sampling["max_tokens"] == 128 - response.json()["usage"]["prompt_tokens"]
    other = sampling_of(client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}))
    assert other["seed"] != sampling["seed"]  # drawn per request
    greedy = sampling_of(client.post("/v1/chat/completions", json={"messages": messages, "temperature": 0}))
    assert greedy["seed"] is None and greedy["top_k"] == 0


def test_operator_defaults_of_the_model(client: TestClient) -> None:
    messages = [{"role": "user", "content": "hi"}]
    sampling = sampling_of(client.post("/v1/chat/completions", json={"model": "tuned", "messages": messages}))
    assert (sampling["temperature"], sampling["top_k"], sampling["max_tokens"]) == (0.5, 7, 6)
    sent = {"model": "tuned", "messages": messages, "temperature": 1.5, "max_tokens": 2}
    sampling = sampling_of(client.post("/v1/chat/completions", json=sent))
    assert (sampling["temperature"], sampling["top_k"], sampling["max_tokens"]) == (1.5, 7, 2)


def test_streams_and_n_choices(client: TestClient) -> None:
    body = {"prompt": "hi", "max_tokens": 2, "n": 3, "seed": 10, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        sampling = sampling_of(response)
        frames = [line for line in response.iter_lines() if line.startswith("data: {")]
    assert (sampling["seed"], sampling["seeds"]) == (10, [10, 11, 12])
    assert all(json.loads(f[6:])["system_fingerprint"].startswith("fp_") for f in frames)
    messages = [{"role": "user", "content": "hi"}]
    with client.stream(
        "POST", "/v1/chat/completions", json={"messages": messages, "stream": True}
    ) as response:
        assert "seeds" not in sampling_of(response)


def test_every_dialect_carries_the_header(client: TestClient) -> None:
    messages = [{"role": "user", "content": "hi"}]
    for path, body in [
        ("/v1/messages", {"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0.3}),
        (
            "/api/chat",
            {"model": "tiny", "messages": messages, "stream": False, "options": {"temperature": 0.3}},
        ),
        (
            "/api/generate",
            {"model": "tiny", "prompt": "hi", "stream": False, "options": {"temperature": 0.3}},
        ),
    ]:
        response = client.post(path, json=body)
        assert response.status_code == 200, (path, response.text)
        assert sampling_of(response)["temperature"] == 0.3, path


# -- system_fingerprint --------------------------------------------------------------------------


def test_chat_and_completions_carry_one_fingerprint(client: TestClient) -> None:
    messages = [{"role": "user", "content": "hi"}]
    first = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    second = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).json()
    assert first["system_fingerprint"] == second["system_fingerprint"]
    assert first["system_fingerprint"].startswith("fp_") and len(first["system_fingerprint"]) == 13


def test_the_fingerprint_follows_the_numerics() -> None:
    description = ModelDescription(
        name="smollm2",
        architecture="LlamaForCausalLM",
        dtype="bfloat16",
        context_length=8192,
        vocab_size=49152,
        tokenizer=word_tokenizer(),
        chat_template=None,
        bos_token=None,
        eos_token=None,
        bos_token_id=None,
        eos_token_ids=(),
        add_bos_token=False,
        generation_config={},
        quantization="Q4_1",
        weights="bfloat16 (oneDNN-packed)",
        compiled_decode=False,
        memory_bytes=1,
        kernels="native",
    )
    base = system_fingerprint("smollm2", description)
    assert base == system_fingerprint("smollm2", replace(description, memory_bytes=2, context_length=10))
    others = {
        system_fingerprint("smollm2", replace(description, weights="int8 (per channel)")),
        system_fingerprint("smollm2", replace(description, compiled_decode=True)),
        system_fingerprint("smollm2", replace(description, kernels="python")),
        system_fingerprint("other", description),
    }
    assert base not in others and len(others) == 4


def test_effective_sampling_of_params() -> None:
    params = SamplingParams(max_tokens=5, temperature=0.7, top_k=3, seed=9)
    assert params.effective() == {
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": 3,
        "min_p": 0.0,
        "seed": 9,
        "max_tokens": 5,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
    }
