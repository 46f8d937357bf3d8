"""`argosy fleet --nodes 2` on this machine (inside the loopback-only namespace): both nodes up
in /health and /metrics; seeded requests give the tokens and logprobs a local `argosy serve`
gives, through the OpenAI and Anthropic dialects; placement by affinity, prefix and load, seen
in the metrics; a node SIGKILLed mid-stream — its streams end with an error event, the others
complete, new requests are served, and the node comes back."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.e2e.server import ServerProcess

pytestmark = pytest.mark.e2e
MODEL = "smollm2"
PROMPTS = [
    "Name a fruit.",
    "What colour is the sky?",
    "Count to five.",
    "Write a short greeting.",
    "Say something about the sea.",
    "What is two plus two?",
    "Give me a word that rhymes with cat.",
    "Name a planet.",
    "What do bees make?",
    "Describe a cloud in a few words.",
]


def nodes(server: ServerProcess) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = httpx.get(f"{server.base_url}/health", timeout=10).json()["nodes"][MODEL]
    return found


def placements(server: ServerProcess) -> dict[str, int]:
    """policy -> requests placed by it, over both nodes (from /metrics)."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    counts: dict[str, int] = {}
    for policy, value in re.findall(
        r'argosy:fleet_placements_total\{[^}]*policy="([^"]+)"\} ([0-9.e+]+)', text
    ):
        counts[policy] = counts.get(policy, 0) + int(float(value))
    return counts


def test_both_nodes_are_up_in_health_and_metrics(fleet: ServerProcess) -> None:
    up = nodes(fleet)
    assert [n["name"] for n in up] == ["node0", "node1"] and all(n["up"] for n in up)
    assert len({n["pid"] for n in up}) == 2 and fleet.process is not None
    assert fleet.process.pid not in {n["pid"] for n in up}  # engines run in the nodes, not the head
    text = httpx.get(f"{fleet.base_url}/metrics", timeout=10).text
    assert 'argosy:fleet_node_up{model="smollm2",node="node0"} 1.0' in text


def chat(server: ServerProcess, prompt: str, seed: int) -> tuple[str | None, list[tuple[str, float]]]:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=24,
        temperature=0.9,
        seed=seed,
        logprobs=True,
    )
    choice = answer.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    return choice.message.content, [(t.token, t.logprob) for t in choice.logprobs.content]


def message(server: ServerProcess, prompt: str, seed: int) -> str:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="none")
    answer = client.messages.create(  # sampling as extra body fields (this SDK's signature has none)
        model=MODEL,
        max_tokens=24,
        messages=[{"role": "user", "content": prompt}],
        extra_body={"temperature": 0.9, "seed": seed},
    )
    return "".join(block.text for block in answer.content if block.type == "text")


def test_seeded_requests_give_the_local_servers_tokens(fleet: ServerProcess, local: ServerProcess) -> None:
    for seed, prompt in enumerate(PROMPTS):
        through_fleet = chat(fleet, prompt, seed)
        assert through_fleet == chat(local, prompt, seed), prompt  # text, tokens and logprobs
        assert through_fleet[0]
        assert message(fleet, prompt, seed) == message(local, prompt, seed), prompt


def test_placement_by_affinity_prefix_and_load_shows_in_metrics(fleet: ServerProcess) -> None:
    before = placements(fleet)
    client = openai.OpenAI(base_url=f"{fleet.base_url}/v1", api_key="none")
    system = "You are a terse assistant for a shipping company. " * 6  # several KV blocks
    ask = {"model": MODEL, "max_tokens": 4, "temperature": 0.0}
    client.chat.completions.create(messages=[{"role": "user", "content": "Fresh start 7319."}], **ask)  # type: ignore[call-overload]
    first = [{"role": "system", "content": system}, {"role": "user", "content": "Where is my parcel?"}]
    client.chat.completions.create(messages=first, **ask)  # type: ignore[call-overload]
    time.sleep(1.5)  # the head reads the nodes' cache summaries every 0.5 s
    again = [{"role": "system", "content": system}, {"role": "user", "content": "And my letter?"}]
    client.chat.completions.create(messages=again, **ask)  # type: ignore[call-overload]
    turn = client.responses.create(model=MODEL, input="Remember the word anchor.", max_output_tokens=8)
    client.responses.create(
        model=MODEL, input="Which word?", previous_response_id=turn.id, max_output_tokens=8, temperature=0.0
    )
    after = placements(fleet)
    grew = {policy: after.get(policy, 0) - before.get(policy, 0) for policy in after}
    assert grew.get("least-loaded", 0) >= 1, grew
    assert grew.get("prefix", 0) >= 1, grew
    assert grew.get("affinity", 0) >= 1, grew


def stream_chat(server: ServerProcess, prompt: str, first: threading.Event, result: dict[str, Any]) -> None:
    body = {
        "model": MODEL,
        # a system prompt of its own: no node caches its first block, so least-loaded spreads
        # the streams over both nodes (a shared cached prefix would put them all on one)
        "messages": [
            {"role": "system", "content": f"{prompt} You tell stories."},
            {"role": "user", "content": prompt},
        ],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0.0,
    }
    frames: list[Any] = []
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                frames.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
                choices = frames[-1].get("choices") if isinstance(frames[-1], dict) else None
                if choices and choices[0].get("delta", {}).get("content"):
                    first.set()  # tokens are flowing (a request not started yet would be re-placed)
    result["frames"] = frames


def test_a_node_killed_mid_stream(fleet: ServerProcess) -> None:
    results: list[dict[str, Any]] = [{} for _ in range(4)]
    started = [threading.Event() for _ in range(4)]
    threads = [
        threading.Thread(
            target=stream_chat, args=(fleet, f"Tell a long story number {i}.", started[i], results[i])
        )
        for i in range(4)
    ]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(120)
    victim = nodes(fleet)[0]
    assert victim["in_flight"] >= 1  # least-loaded spread the four over both nodes
    os.kill(victim["pid"], signal.SIGKILL)
    for thread in threads:
        thread.join(300)
    errored = completed = 0
    for result in results:
        frames = result["frames"]
        data = [f for f in frames if isinstance(f, dict)]
        if any("error" in f for f in data):  # its node died: an error event ends it, no [DONE]
            errored += 1
            assert "error" in data[-1] and "died" in data[-1]["error"]["message"] and frames[-1] != "[DONE]"
        else:
            finishes = [f["choices"][0].get("finish_reason") for f in data if f.get("choices")]
            assert "length" in finishes and frames[-1] == "[DONE]"
            completed += 1
    assert (errored, completed) == (victim["in_flight"], 4 - victim["in_flight"]) and completed >= 1
    # the head keeps serving: new requests go to the node that is up
    for seed in range(3):
        assert chat(fleet, PROMPTS[seed], seed)[0]
    deadline = time.monotonic() + 300
    while not all(n["up"] for n in nodes(fleet)):  # Ray restarts the node; it rejoins
        assert time.monotonic() < deadline, nodes(fleet)
        time.sleep(1)
    back = nodes(fleet)[0]
    assert back["restarts"] >= 1 and back["pid"] != victim["pid"]
    assert chat(fleet, PROMPTS[0], 0)[0]
