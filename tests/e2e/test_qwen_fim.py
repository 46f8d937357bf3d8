"""Fill-in-the-middle on the real default model, Qwen2.5-Coder-0.5B-Instruct (Q4_K_M), through
the official `openai` and `ollama` clients, and as the FIM satellite of SmolLM2.

Five small Python functions, each a prefix (signature + docstring, and the start of the body)
and a suffix (the return line, or the rest of the file): the middle the model writes, put
between them, is code that `compile()` accepts and that does what the docstring says. All
requests are greedy and sent at once (one batch): ~10 s once the shared `qwen_server` is up,
and ~17 s for the satellite server (its models load on their first request).

Measured on this model: its FIM is weak at knowing where a gap ends — after a one-line gap it
goes on writing the next function — so the one-line cases stop at a blank line (`stop:
["\\n\\n"]`, what editors send); a gap whose suffix holds the rest of the body ends at the FIM
end marker by itself, which the ollama case pins (no stop string, done_reason "stop" well
before num_predict). transformers' greedy generate on the same GGUF runs on past the gap the
same way (checked by hand on `add`): it is the model, not the prompt.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest

from tests.e2e.conftest import QWEN_SMALL
from tests.e2e.server import ServerProcess, models_server

pytestmark = pytest.mark.e2e


@dataclass(frozen=True)
class Gap:
    name: str
    prefix: str
    suffix: str
    check: Callable[[Callable[..., Any]], bool]  # the filled function does what it says


GAPS = (
    Gap(
        "add",
        'def add(a: int, b: int) -> int:\n    """Return the sum of a and b."""\n    return ',
        "\n",
        lambda f: f(2, 3) == 5,
    ),
    Gap(
        "is_even",
        'def is_even(n: int) -> bool:\n    """Return True when n is divisible by 2."""\n    return ',
        "\n",
        lambda f: f(4) is True and f(7) is False,
    ),
    Gap(
        "reverse",
        'def reverse(s: str) -> str:\n    """Return the string s reversed."""\n    return ',
        "\n",
        lambda f: f("abc") == "cba",
    ),
    Gap(
        "mean",
        'def mean(xs: list[float]) -> float:\n    """The arithmetic mean of xs."""\n    total = ',
        "\n    return total / len(xs)\n",
        lambda f: f([1.0, 2.0, 6.0]) == 3.0,
    ),
    Gap(
        "word_count",
        'def word_count(text: str) -> int:\n    """The number of words in text."""\n    words = ',
        "\n    return len(words)\n",
        lambda f: f("one two  three") == 3,
    ),
)
MEAN = GAPS[3]


def filled(gap: Gap, middle: str) -> Callable[..., Any]:
    """The function the prefix, the middle and the suffix define (compile() must accept it)."""
    code = compile(gap.prefix + middle + gap.suffix, f"<{gap.name}>", "exec")
    namespace: dict[str, Any] = {}
    exec(code, namespace)  # a five-line function, as the test's own check needs it
    function: Callable[..., Any] = namespace[gap.name]
    return function


@dataclass
class Answers:
    completions: dict[str, openai.types.Completion]
    streamed: list[dict[str, Any]]
    ollama: ollama.GenerateResponse
    default_sampling: dict[str, Any]
    modes: dict[str, str | None]  # fim_mode -> x-argosy-degraded


def _stream_chunks(base_url: str, body: dict[str, Any], request_id: str) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream(
        "POST", f"{base_url}/v1/completions", json=body, headers={"x-request-id": request_id}, timeout=120
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line.removeprefix("data: ")))
    return chunks


def _sampling_header(base_url: str, body: dict[str, Any]) -> dict[str, Any]:
    """The effective sampling a streamed request runs (x-argosy-sampling), read from its
    headers; closing the stream then cancels the generation."""
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as response:
        sampling: dict[str, Any] = json.loads(response.headers["x-argosy-sampling"])
    return sampling


def _degraded(base_url: str, body: dict[str, Any]) -> str | None:
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.headers.get("x-argosy-degraded")


@pytest.fixture(scope="module")
def answers(qwen_server: ServerProcess) -> Answers:
    """Every request of the module's checks on the real model, sent at once."""
    base_url = qwen_server.base_url
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=120)
    ollama_client = ollama.Client(host=base_url, timeout=120)
    add = GAPS[0]
    with ThreadPoolExecutor(max_workers=10) as pool:
        completions: dict[str, Future[openai.types.Completion]] = {
            gap.name: pool.submit(
                client.completions.create,
                model=QWEN_SMALL,
                prompt=gap.prefix,
                suffix=gap.suffix,
                max_tokens=32,
                temperature=0,
                stop=["\n\n"],
                extra_headers={"x-request-id": f"qwen-fim-{gap.name}"},
            )
            for gap in GAPS
        }
        streamed = pool.submit(
            _stream_chunks,
            base_url,
            {
                "model": QWEN_SMALL,
                "prompt": add.prefix,
                "suffix": add.suffix,
                "max_tokens": 4,
                "temperature": 0,
                "stream": True,
            },
            "qwen-fim-stream",
        )
        generated = pool.submit(
            ollama_client.generate,
            model=QWEN_SMALL,
            prompt=MEAN.prefix,
            suffix=MEAN.suffix,
            options={"temperature": 0, "num_predict": 48},
        )
        default_sampling = pool.submit(
            _sampling_header,
            base_url,
            {"model": QWEN_SMALL, "prompt": add.prefix, "suffix": add.suffix, "stream": True},
        )
        modes = {
            mode: pool.submit(
                _degraded,
                base_url,
                {
                    "model": QWEN_SMALL,
                    "prompt": add.prefix,
                    "suffix": "\n",
                    "max_tokens": 1,
                    "fim_mode": mode,
                },
            )
            for mode in ("psm", "spm")
        }
        return Answers(
            completions={name: future.result() for name, future in completions.items()},
            streamed=streamed.result(),
            ollama=generated.result(),
            default_sampling=default_sampling.result(),
            modes={mode: future.result() for mode, future in modes.items()},
        )


@pytest.mark.parametrize("gap", GAPS, ids=[gap.name for gap in GAPS])
def test_the_middle_compiles_and_does_what_the_docstring_says(answers: Answers, gap: Gap) -> None:
    completion = answers.completions[gap.name]
    middle = completion.choices[0].text
    assert middle.strip(), completion
    assert completion.choices[0].finish_reason == "stop", middle  # a blank line or the FIM end
    assert gap.check(filled(gap, middle)), middle
    assert completion.model == QWEN_SMALL
    assert (completion.model_extra or {})["fim"] == {"served_by": QWEN_SMALL}


def test_ollama_generate_fills_the_gap_and_stops_at_the_fim_end_marker(answers: Answers) -> None:
    response = answers.ollama
    assert response.model == QWEN_SMALL
    assert MEAN.check(filled(MEAN, response.response or "")), response.response
    # no stop string was sent: the model's FIM end token ended it, long before num_predict
    assert response.done_reason == "stop" and (response.eval_count or 0) < 48, response


def test_a_streamed_fim_answer_names_the_model_that_served_it(answers: Answers) -> None:
    chunks = answers.streamed
    assert chunks and all(chunk["model"] == QWEN_SMALL for chunk in chunks)
    finish = [chunk for chunk in chunks if chunk["choices"][0]["finish_reason"] is not None]
    assert len(finish) == 1 and finish[0]["fim"] == {"served_by": QWEN_SMALL}
    # greedy, as the non-streamed request for the same gap: the same answer, cut at 4 tokens
    text = "".join(chunk["choices"][0]["text"] for chunk in chunks)
    whole = answers.completions[GAPS[0].name].choices[0].text
    assert text and (whole.startswith(text) or text.startswith(whole)), (text, whole)


def test_fim_defaults_to_128_tokens_and_honours_only_the_layout_qwen_knows(answers: Answers) -> None:
    assert answers.default_sampling["max_tokens"] == 128  # no max_tokens: the FIM default, not 16
    # Qwen2.5-Coder was trained on prefix-suffix-middle only: "spm" is served as psm, and says so
    assert answers.modes == {"psm": None, "spm": "fim_mode"}


def _access_lines(server: ServerProcess, request_id: str) -> list[str]:
    deadline = time.monotonic() + 5
    while True:
        lines = [line for line in server.log_text().splitlines() if f"request_id={request_id}" in line]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)


def test_the_access_log_tags_fim_and_stream(answers: Answers, qwen_server: ServerProcess) -> None:
    (line,) = _access_lines(qwen_server, "qwen-fim-add")
    assert f"POST /v1/completions (fim) model={QWEN_SMALL} " in line and "finish=stop" in line
    (line,) = _access_lines(qwen_server, "qwen-fim-stream")
    assert f"POST /v1/completions (fim) (stream) model={QWEN_SMALL} " in line


# -- SmolLM2 (no FIM tokens) with the 0.5B as its FIM satellite ---------------------------------


SATELLITE_TOML = f"""
[[model]]
id = "smollm2"
source = "smollm2"
quantization = "none"
compile = "off"
max_model_len = 1024
satellite = "coder"

[[model]]
id = "coder"
source = "{QWEN_SMALL}"
quantization = "auto"
compile = "off"
max_model_len = 2048
"""


@pytest.fixture(scope="module")
def satellite_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory: Path = tmp_path_factory.mktemp("satellite")
    with models_server(directory, SATELLITE_TOML, kv_cache_memory="96M") as process:
        yield process


def test_smollm2s_suffix_requests_are_filled_by_its_satellite(satellite_server: ServerProcess) -> None:
    base_url = satellite_server.base_url
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=120)
    gap = GAPS[0]
    completion = client.completions.create(
        model="smollm2",
        prompt=gap.prefix,
        suffix=gap.suffix,
        max_tokens=16,
        temperature=0,
        stop=["\n\n"],
        extra_headers={"x-request-id": "satellite-fim"},
    )
    assert completion.model == "smollm2"  # the model asked for ...
    assert (completion.model_extra or {})["fim"] == {"served_by": "coder"}  # ... and who served it
    assert gap.check(filled(gap, completion.choices[0].text)), completion.choices[0].text
    (line,) = _access_lines(satellite_server, "satellite-fim")
    assert "POST /v1/completions (fim) model=coder " in line

    ollama_client = ollama.Client(host=base_url, timeout=120, headers={"x-request-id": "satellite-ollama"})
    response = ollama_client.generate(
        model="smollm2", prompt=MEAN.prefix, suffix=MEAN.suffix, options={"temperature": 0, "num_predict": 48}
    )
    assert response.model == "smollm2" and response.done_reason == "stop"
    assert MEAN.check(filled(MEAN, response.response or "")), response.response
    (line,) = _access_lines(satellite_server, "satellite-ollama")
    assert "POST /api/generate (fim) model=coder " in line
