"""LoRA adapters on a real server, through the real clients: adapters made by peft on SmolLM2's
own weights, served from `--lora` and loaded / unloaded at run time by an admin key.

Each adapter is a model id of its own (/v1/models: `parent` and `root`; /lora-adapters:
llama.cpp's listing) that OpenAI chat, Anthropic messages and Ollama chat all serve, with the
same greedy text; llama.cpp's per-request `lora: [{id, scale}]` picks the same adapter by id;
a concurrent batch mixing the base and two adapters gives each request its solo text; the
prefix cache keeps an adapter's blocks apart from the base's, another scale's and a reloaded
file's; an adapter evicted from its slot (--max-loras 2) and read again gives the same text;
refusals (no admin key, a corrupt file, a rank above --max-lora-rank, a missing path, a taken
name, an unknown one) are 4xx naming their cause, each dialect's 404 in its own shape.

The server runs quantization "auto" (int4 on the invariant kernels) rather than the e2e
suite's bf16: there a row's bits do not depend on its neighbours nor on a prefix-cache hit, so
texts compare exactly whatever else ran first or beside.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
import torch

from argosy.models.loader import resolve_model
from tests.e2e.server import ServerProcess
from tests.unit.conftest import TinyModel
from tests.unit.test_lora import ATTENTION, make_adapter

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BASE = "smollm2"
ADMIN_KEY = "sk-lora-admin"
USER_KEY = "sk-lora-user"
MAX_RANK = 16  # --max-lora-rank: the rank-32 adapter is refused
ASK = [{"role": "user", "content": "Name three colors."}]
MAX_TOKENS = 16


def save_adapters(root: Path, ranks: dict[str, int]) -> dict[str, Path]:
    """Peft adapters of SmolLM2's attention, one per name (`ranks`: its rank; the seed its
    position), with random A and B (std 0.3: the greedy text changes from the first tokens)."""
    from transformers import AutoModelForCausalLM

    source = resolve_model(BASE)
    reference = AutoModelForCausalLM.from_pretrained(source.weights_dir, dtype=torch.float32).eval()
    smollm2 = TinyModel("llama", reference, source, source.weights_dir)  # make_adapter reads .reference
    return {
        name: make_adapter(smollm2, root / name, ATTENTION, seed=seed, rank=rank)
        for seed, (name, rank) in enumerate(ranks.items(), start=1)
    }


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """tint and shade served from the start, third loaded at run time, wide (rank 32) refused,
    and corrupt: tint's config with random bytes for its weights."""
    root = tmp_path_factory.mktemp("adapters")
    folders = save_adapters(root, {"tint": 8, "shade": 8, "third": 8, "wide": 2 * MAX_RANK})
    corrupt = root / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_bytes((folders["tint"] / "adapter_config.json").read_bytes())
    (corrupt / "adapter_model.safetensors").write_bytes(random.Random(0).randbytes(4096))
    return folders | {"corrupt": corrupt}


@pytest.fixture(scope="module")
def server(adapters: dict[str, Path]) -> Iterator[ServerProcess]:
    flags = ["--lora", f"tint={adapters['tint']}", "--lora", f"shade={adapters['shade']}"]
    flags += ["--admin-key", ADMIN_KEY, "--api-key", USER_KEY]
    flags += ["--max-lora-rank", str(MAX_RANK), "--max-loras", "2"]
    started = ServerProcess(quantization="auto", compile="off", extra_flags=flags).start()
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=USER_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {USER_KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=120) as user:
        yield user


@pytest.fixture(scope="module")
def admin(server: ServerProcess) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=120) as admin_client:
        yield admin_client


def chat(client: openai.OpenAI, model: str, messages: list[dict[str, str]] = ASK) -> Any:
    return client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
    )


def chat_text(client: openai.OpenAI, model: str, messages: list[dict[str, str]] = ASK) -> str:
    text = chat(client, model, messages).choices[0].message.content
    assert text, model
    return str(text)


def cached_tokens(reply: Any) -> int:
    details = reply.usage.prompt_tokens_details
    return int(details.cached_tokens or 0) if details is not None else 0


def raw_chat(http: httpx.Client, **fields: Any) -> httpx.Response:
    body = {"model": BASE, "messages": ASK, "max_tokens": MAX_TOKENS, "temperature": 0, **fields}
    return http.post("/v1/chat/completions", json=body)


def model_ids(client: openai.OpenAI) -> list[str]:
    return [model.id for model in client.models.list().data]


def test_each_adapter_is_listed_as_a_model_with_its_base_as_parent(
    client: openai.OpenAI, http: httpx.Client, adapters: dict[str, Path]
) -> None:
    listed = {model.id: model.model_extra or {} for model in client.models.list().data}
    assert list(listed) == [BASE, "tint", "shade"]
    assert "parent" not in listed[BASE]
    for name in ("tint", "shade"):
        assert (listed[name]["parent"], listed[name]["root"]) == (BASE, str(adapters[name]))
        assert listed[name]["capabilities"]["lora_adapter"] is True
        retrieved = client.models.retrieve(name)
        assert retrieved.id == name
        assert (retrieved.model_extra or {})["parent"] == BASE

    by_llama_cpp = http.get("/lora-adapters")
    assert by_llama_cpp.status_code == 200
    assert by_llama_cpp.json() == [
        {"name": name, "id": i, "path": str(adapters[name]), "rank": 8, "format": "peft", "scale": 1.0}
        for i, name in enumerate(("tint", "shade"))
    ]


def test_an_adapter_is_served_by_every_dialect_with_the_same_text(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    base = chat_text(client, BASE)
    reply = chat(client, "tint")
    tint = reply.choices[0].message.content
    assert reply.model == "tint"
    assert tint and tint != base
    assert chat_text(client, "tint") == tint  # greedy: the same text again (a prefix-cache hit now)
    shade = chat_text(client, "shade")
    assert shade not in (base, tint)

    claude = anthropic.Anthropic(base_url=server.base_url, api_key=USER_KEY, max_retries=0, timeout=120)
    message = claude.messages.create(
        model="tint",
        messages=ASK,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        extra_body={"temperature": 0},
    )
    assert message.model == "tint"
    assert message.content[0].type == "text" and message.content[0].text == tint

    llama = ollama.Client(host=server.base_url, headers={"Authorization": f"Bearer {USER_KEY}"}, timeout=120)
    answer = llama.chat(model="tint", messages=ASK, options={"temperature": 0, "num_predict": MAX_TOKENS})
    assert answer.model == "tint"
    assert answer.message.content == tint


def test_llama_cpp_per_request_lora_picks_an_adapter_by_id(client: openai.OpenAI, http: httpx.Client) -> None:
    ids = {adapter["name"]: adapter["id"] for adapter in http.get("/lora-adapters").json()}
    tint_id = ids["tint"]

    def text(response: httpx.Response) -> str:
        assert response.status_code == 200, response.text
        return str(response.json()["choices"][0]["message"]["content"])

    # ASK ran with tint before (the previous test): scale 1 is tint, and reads tint's cached blocks
    by_id = raw_chat(http, lora=[{"id": tint_id, "scale": 1.0}])
    assert text(by_id) == chat_text(client, "tint")
    assert by_id.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert text(raw_chat(http, lora=[{"id": tint_id, "scale": 0}])) == chat_text(client, BASE)
    # another scale's KV is not tint's: its own prefix-cache root (nothing cached yet), and a
    # scale so small that its product vanishes in float32 rounding gives the base's text
    scaled = raw_chat(http, lora=[{"id": tint_id, "scale": 1e-30}])
    assert scaled.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert text(scaled) == chat_text(client, BASE)

    unknown = raw_chat(http, lora=[{"id": max(ids.values()) + 7, "scale": 1.0}])
    assert unknown.status_code == 400
    assert unknown.json()["error"]["param"] == "lora[0].id"
    both = raw_chat(http, lora=[{"id": ids["tint"], "scale": 1.0}, {"id": ids["shade"], "scale": 0.5}])
    assert both.status_code == 400
    assert both.json()["error"]["param"] == "lora"


def test_a_batch_mixing_the_base_and_two_adapters_gives_each_its_solo_text(client: openai.OpenAI) -> None:
    # prompts no other test asks: the batch's prompts are prefix-cache misses, prefilled side by side
    prompts = [
        [{"role": "user", "content": "Describe a lighthouse at night."}],
        [{"role": "user", "content": "Give me a recipe for soup."}],
    ]
    requests = [(model, messages) for model in (BASE, "tint", "shade") for messages in prompts]
    with ThreadPoolExecutor(len(requests)) as pool:
        batched = list(pool.map(lambda request: chat_text(client, *request), requests))
    solo = [chat_text(client, model, messages) for model, messages in requests]
    assert batched == solo
    assert len(set(solo)) == len(solo)  # six different texts: each row ran with its own adapter


def test_an_admin_loads_and_unloads_an_adapter_at_run_time(
    client: openai.OpenAI, http: httpx.Client, admin: httpx.Client, adapters: dict[str, Path]
) -> None:
    question = [{"role": "user", "content": "Which animals live in the sea?"}]
    tint, shade = chat_text(client, "tint", question), chat_text(client, "shade", question)
    chat(client, BASE, question)
    assert cached_tokens(chat(client, BASE, question)) > 0  # the base has this prompt's blocks

    body = {"lora_name": "third", "lora_path": str(adapters["third"])}
    loaded = admin.post("/v1/load_lora_adapter", json=body)
    assert loaded.status_code == 200, loaded.text
    assert loaded.json() == {
        "status": "loaded",
        "model": BASE,
        "name": "third",
        "id": 2,  # ids in load order: tint 0, shade 1
        "path": str(adapters["third"]),
        "rank": 8,
        "format": "peft",
    }
    assert model_ids(client) == [BASE, "tint", "shade", "third"]
    assert (client.models.retrieve("third").model_extra or {})["root"] == str(adapters["third"])
    assert "third" in [adapter["name"] for adapter in http.get("/lora-adapters").json()]

    # its prefix-cache root is its own: the base's blocks of this prompt are not its
    first = chat(client, "third", question)
    third = first.choices[0].message.content
    assert first.model == "third" and third and third not in (tint, shade)
    assert cached_tokens(first) == 0
    again = chat(client, "third", question)
    assert again.choices[0].message.content == third and cached_tokens(again) > 0
    # two slots (--max-loras 2) for three adapters: the least recently used gave way to third and
    # is read from its file again on use, with the same text
    assert (chat_text(client, "tint", question), chat_text(client, "shade", question)) == (tint, shade)

    assert admin.post("/v1/load_lora_adapter", json=body).status_code == 409  # the name is taken
    unloaded = admin.post("/v1/unload_lora_adapter", json={"lora_name": "third"})
    assert unloaded.status_code == 200, unloaded.text
    assert unloaded.json() == {"status": "unloaded", "lora_name": "third", "model": BASE}
    assert model_ids(client) == [BASE, "tint", "shade"]
    with pytest.raises(openai.NotFoundError) as gone:
        chat(client, "third", question)
    assert gone.value.status_code == 404
    assert gone.value.body["code"] == "model_not_found"  # type: ignore[index]

    # loaded again from the same file: the same text, from a fresh cache root (a file may change)
    assert admin.post("/v1/load_lora_adapter", json=body).status_code == 200
    reloaded = chat(client, "third", question)
    assert reloaded.choices[0].message.content == third and cached_tokens(reloaded) == 0
    assert admin.post("/v1/unload_lora_adapter", json={"lora_name": "third"}).status_code == 200


def test_refused_loads_and_unloads_name_their_cause(
    server: ServerProcess, http: httpx.Client, admin: httpx.Client, adapters: dict[str, Path]
) -> None:
    def load(who: httpx.Client, name: str, path: str | Path, **extra: str) -> httpx.Response:
        return who.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **extra})

    def error(response: httpx.Response, status: int) -> dict[str, Any]:
        assert response.status_code == status, response.text
        return dict(response.json()["error"])

    # an --api-key is not an admin key; no key at all is not a key
    assert error(load(http, "extra", adapters["third"]), 403)["code"] == "admin_key_required"
    unload = http.post("/v1/unload_lora_adapter", json={"lora_name": "tint"})
    assert error(unload, 403)["code"] == "admin_key_required"
    anonymous = httpx.post(
        f"{server.base_url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/"}
    )
    assert anonymous.status_code == 401

    corrupt = error(load(admin, "extra", adapters["corrupt"]), 400)
    assert corrupt["param"] == "lora_path"
    assert str(adapters["corrupt"] / "adapter_model.safetensors") in corrupt["message"]
    wide = error(load(admin, "extra", adapters["wide"]), 400)
    assert wide["param"] == "lora_path" and "--max-lora-rank" in wide["message"]
    missing = error(load(admin, "extra", adapters["tint"].parent / "no-such-adapter"), 400)
    assert missing["param"] == "lora_path" and "does not exist" in missing["message"]
    too_long = error(load(admin, "extra", "T\u0335o\u0336" * 100), 400)  # found by `make fuzz` (a 500 then)
    assert too_long["param"] == "lora_path" and "File name too long" in too_long["message"]
    assert error(load(admin, "extra", adapters["third"], model="no-such-model"), 404)["param"] == "model"
    for taken in ("tint", BASE):
        assert error(load(admin, taken, adapters["third"]), 409)["param"] == "lora_name"
    assert (
        error(admin.post("/v1/unload_lora_adapter", json={"lora_name": "extra"}), 404)["param"] == "lora_name"
    )

    # nothing refused was added, nor taken away
    assert [adapter["name"] for adapter in http.get("/lora-adapters").json()] == ["tint", "shade"]


def test_an_unknown_adapter_is_404_in_each_dialects_shape(http: httpx.Client) -> None:
    name = "no-such-adapter"
    openai_404 = http.post("/v1/chat/completions", json={"model": name, "messages": ASK, "max_tokens": 4})
    assert openai_404.status_code == 404
    assert openai_404.json()["error"]["code"] == "model_not_found"
    assert openai_404.json()["error"]["param"] == "model"

    anthropic_404 = http.post("/v1/messages", json={"model": name, "messages": ASK, "max_tokens": 4})
    assert anthropic_404.status_code == 404
    assert anthropic_404.json()["type"] == "error"
    assert anthropic_404.json()["error"]["type"] == "not_found_error"

    ollama_404 = http.post("/api/chat", json={"model": name, "messages": ASK, "stream": False})
    assert ollama_404.status_code == 404
    assert list(ollama_404.json()) == ["error"]
    assert f'model "{name}" not found' in ollama_404.json()["error"]
