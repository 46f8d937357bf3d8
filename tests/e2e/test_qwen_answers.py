"""The default model answers correctly: a greedy answer to a factual question, through each
dialect's official client, contains the fact (the real Qwen2.5-Coder-0.5B, its own Q4_K_M
weights; SmolLM2-135M answered this question with a loop of French place names)."""

from __future__ import annotations

import anthropic
import ollama
import openai

from tests.e2e.conftest import QWEN_SMALL
from tests.e2e.server import ServerProcess

QUESTION = "What is the capital of France? Answer in one sentence."


def test_openai_chat_answers_the_fact(qwen_server: ServerProcess) -> None:
    client = openai.OpenAI(
        base_url=f"{qwen_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120
    )
    reply = client.chat.completions.create(
        model=QWEN_SMALL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=32
    )
    assert "Paris" in (reply.choices[0].message.content or "")
    assert reply.choices[0].finish_reason == "stop"  # it ends its answer well inside the budget


def test_anthropic_messages_answers_the_fact(qwen_server: ServerProcess) -> None:
    client = anthropic.Anthropic(base_url=qwen_server.base_url, api_key="unused", max_retries=0)
    message = client.messages.create(
        model=QWEN_SMALL,
        max_tokens=32,
        extra_body={"temperature": 0},  # the SDK no longer takes it as an argument; the wire does
        messages=[{"role": "user", "content": "What is the capital of Japan? One sentence."}],
    )
    text = "".join(block.text for block in message.content if block.type == "text")
    assert "Tokyo" in text


def test_ollama_chat_answers_the_fact(qwen_server: ServerProcess) -> None:
    client = ollama.Client(host=qwen_server.base_url)
    reply = client.chat(
        model=QWEN_SMALL,
        messages=[{"role": "user", "content": "How many days are there in a week? Answer with a number."}],
        options={"temperature": 0, "num_predict": 16},
    )
    assert "7" in reply.message.content or "seven" in reply.message.content.lower()
