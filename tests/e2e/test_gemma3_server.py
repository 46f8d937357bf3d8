"""`argosy serve --model gemma3`: Gemma 3 270M (base, Q4_K_M) in the default mode, through the
openai client: completions, chat on the built-in Gemma turn format, and /v1/models saying what
it runs (its GGUF types per weight role, where its chat template came from)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.e2e.server import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma_server() -> Iterator[ServerProcess]:
    server = ServerProcess(model="gemma3", served_model_name="gemma3", quantization=None, compile=None)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(gemma_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gemma_server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_models_say_what_gemma_runs(client: openai.OpenAI) -> None:
    caps = client.models.retrieve("gemma3").model_extra["capabilities"]  # type: ignore[index]
    assert caps["architecture"] == "Gemma3ForCausalLM" and caps["quantization"] == "Q4_K_M"
    assert caps["chat_template_source"] == "built-in (gemma)"
    assert (
        caps["tensor_formats"]["self_attn.o_proj"] == "Q4_K"
        and caps["tensor_formats"]["embed_tokens"] == "Q8_0"
    )
    assert (
        caps["weights"].startswith(
            "the GGUF's codes at their own bits (4, 5, 6), int8 codes of the GGUF's other blocks"
        )
        and caps["deterministic"] is True
    )
    # the default mode compiles Gemma's decode step in the background (a warm cache may be done)
    assert caps["compile"] in ("compiling", "ready")


def test_a_completion_continues_code(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model="gemma3", prompt="def fibonacci(n):", max_tokens=24, temperature=0
    )
    assert "return" in reply.choices[0].text
    assert reply.usage is not None and reply.usage.completion_tokens == 24


def test_chat_uses_gemma_turns_and_stops_at_the_end_of_its_turn(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="gemma3",
        messages=[{"role": "user", "content": "Name one colour of the rainbow."}],
        max_tokens=48,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.message.content and "<start_of_turn>" not in choice.message.content
    assert choice.finish_reason in ("stop", "length")
