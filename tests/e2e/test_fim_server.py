"""Fill-in-the-middle on a model built here whose tokenizer has FIM tokens, and its use as the
satellite of SmolLM2 (which has none).

The test model: SmolLM2's tokenizer plus StarCoder's four FIM tokens, and a two-layer Llama
with random weights (float32, served in float32). Its completions are checked against
transformers' greedy generate on the prompt laid out by hand, so the FIM prompt is exactly
`<fim_prefix>P<fim_suffix>S<fim_middle>`; the FIM end marker stops a generation.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.e2e.server import ServerProcess, models_server
from tests.e2e.tiny_causal import write_tiny_causal_lm

pytestmark = pytest.mark.e2e

FIM_TOKENS = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<fim_pad>"]
PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def coder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-coder")
    write_tiny_causal_lm(folder, "llama", seed=7, special_tokens=FIM_TOKENS)
    return folder


@pytest.fixture(scope="module")
def server(coder_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    toml = f"""
[[model]]
id = "smollm2"
source = "smollm2"
quantization = "none"
compile = "off"
satellite = "coder"

[[model]]
id = "coder"
source = "{coder_dir}"
quantization = "none"
compile = "off"
"""
    flags = ["--dtype", "float32"]
    with models_server(tmp_path_factory.mktemp("fim"), toml, extra_flags=flags) as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0, timeout=120)


def expected(
    coder_dir: Path, prefix: str, suffix: str, max_tokens: int, mode: str = "psm"
) -> tuple[list[int], list[int], str]:
    """(the FIM prompt, the greedy tokens up to a stop, their text) by transformers; `mode`
    "spm" lays it out suffix first, as StarCoder learnt it: <fim_prefix><fim_suffix>S<fim_middle>P."""
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    tokenizer = Tokenizer.from_file(str(coder_dir / "tokenizer.json"))
    special = {t: tokenizer.token_to_id(t) for t in FIM_TOKENS}
    prefix_ids = tokenizer.encode(prefix, add_special_tokens=False).ids
    suffix_ids = tokenizer.encode(suffix, add_special_tokens=False).ids
    if mode == "spm":
        prompt = [
            special["<fim_prefix>"],
            special["<fim_suffix>"],
            *suffix_ids,
            special["<fim_middle>"],
            *prefix_ids,
        ]
    else:
        prompt = [
            special["<fim_prefix>"],
            *prefix_ids,
            special["<fim_suffix>"],
            *suffix_ids,
            special["<fim_middle>"],
        ]
    model = LlamaForCausalLM.from_pretrained(coder_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)[
            0, len(prompt) :
        ]
    stops = {
        special["<fim_pad>"],
        tokenizer.token_to_id("<|im_end|>"),
        tokenizer.token_to_id("<|endoftext|>"),
    }
    tokens = []
    for token in out.tolist():
        if token in stops:
            break
        tokens.append(token)
    return prompt, tokens, tokenizer.decode(tokens, skip_special_tokens=False)


def test_models_say_which_fill_in_the_middle(server: ServerProcess) -> None:
    caps = {m["id"]: m["capabilities"] for m in httpx.get(f"{server.base_url}/v1/models").json()["data"]}
    httpx.post(f"{server.base_url}/v1/completions", json={"model": "coder", "prompt": "x", "max_tokens": 1})
    caps = {m["id"]: m["capabilities"] for m in httpx.get(f"{server.base_url}/v1/models").json()["data"]}
    assert caps["coder"]["fill_in_the_middle"] is True and caps["smollm2"]["fill_in_the_middle"] is False


def test_fim_completion_matches_transformers(client: openai.OpenAI, coder_dir: Path) -> None:
    prompt, tokens, text = expected(coder_dir, PREFIX, SUFFIX, 12)
    completion = client.completions.create(
        model="coder", prompt=PREFIX, suffix=SUFFIX, max_tokens=12, temperature=0
    )
    assert completion.usage.prompt_tokens == len(prompt)
    assert completion.choices[0].text == text
    assert completion.usage.completion_tokens == min(12, len(tokens) + 1)
    assert completion.choices[0].finish_reason == ("length" if len(tokens) == 12 else "stop")


def test_fim_mode_spm_is_honoured_by_a_starcoder_model(server: ServerProcess, coder_dir: Path) -> None:
    prompt, _, text = expected(coder_dir, PREFIX, SUFFIX, 8, mode="spm")
    assert text != expected(coder_dir, PREFIX, SUFFIX, 8)[2]  # the layouts tell apart
    response = httpx.post(
        f"{server.base_url}/v1/completions",
        json={
            "model": "coder",
            "prompt": PREFIX,
            "suffix": SUFFIX,
            "max_tokens": 8,
            "temperature": 0,
            "fim_mode": "spm",
        },
        timeout=120,
    )
    assert "x-argosy-degraded" not in response.headers  # StarCoder's tokens were trained on both layouts
    completion = response.json()
    assert completion["usage"]["prompt_tokens"] == len(prompt) and completion["choices"][0]["text"] == text


def test_the_fim_end_marker_stops(client: openai.OpenAI, coder_dir: Path) -> None:
    from tokenizers import Tokenizer

    pad = Tokenizer.from_file(str(coder_dir / "tokenizer.json")).token_to_id("<fim_pad>")
    completion = client.completions.create(
        model="coder", prompt=PREFIX, suffix=SUFFIX, max_tokens=12, temperature=0, logit_bias={str(pad): 100}
    )
    assert completion.choices[0].finish_reason == "stop" and completion.choices[0].text == ""
    plain = client.completions.create(
        model="coder", prompt=PREFIX, max_tokens=3, temperature=0, logit_bias={str(pad): 100}
    )
    assert plain.usage.completion_tokens == 3  # without suffix <fim_pad> is just a token


def test_a_satellite_serves_its_models_fim(
    client: openai.OpenAI, server: ServerProcess, coder_dir: Path
) -> None:
    _, _, text = expected(coder_dir, PREFIX, SUFFIX, 8)
    completion = client.completions.create(
        model="smollm2", prompt=PREFIX, suffix=SUFFIX, max_tokens=8, temperature=0
    )
    assert completion.model == "smollm2" and completion.choices[0].text == text  # the model asked for
    assert (completion.model_extra or {})["fim"] == {"served_by": "coder"}  # and the one that served
    chat = client.completions.create(
        model="smollm2", prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert chat.model == "smollm2"  # without suffix: the model itself
    ollama = httpx.post(
        f"{server.base_url}/api/generate",
        json={
            "model": "smollm2",
            "prompt": PREFIX,
            "suffix": SUFFIX,
            "stream": False,
            "options": {"temperature": 0, "num_predict": 8},
        },
        timeout=120,
    ).json()
    assert ollama["model"] == "smollm2" and ollama["response"] == text
    assert ollama["fim"] == {"served_by": "coder"}


def test_fim_refusals(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="coder", prompt=[1, 2, 3], suffix="x", max_tokens=2)
    assert caught.value.body["param"] == "suffix"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="coder", prompt="x", suffix="y", echo=True, max_tokens=2)
    assert caught.value.body["param"] == "echo"  # type: ignore[index]
