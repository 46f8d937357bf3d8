"""Sessions benchmark: a conversation continued through `previous_response_id` vs the same
conversation re-sent in full through chat completions on a server without a prefix cache.

    python bench/sessions.py                    # 10 turns x 3 conversations (seeded)
    python bench/sessions.py --turns 10 --conversations 1 --output-tokens 64

Side A: `argosy serve` (prefix cache on); each turn is a streamed `/v1/responses` request
continuing the previous response, so only the new turn is sent. Side B: `argosy serve
--no-prefix-cache`; each turn re-sends the whole conversation (the same user turns, and side
A's answers as the assistant turns) to a streamed `/v1/chat/completions`. The servers run one
after the other (never both on the same cores). Per turn, side by side: prompt tokens, the
tokens actually prefilled (prompt - cached) and the time to first token (request sent -> first
text delta), averaged over the conversations; then the totals and the ratio of mean TTFT at
the last turn (the target is >= 3x at turn 10).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e.server import ServerProcess  # noqa: E402

MODEL = "bench"
SUBJECTS = [
    "lighthouses",
    "volcanoes",
    "honey bees",
    "the printing press",
    "glaciers",
    "coral reefs",
    "steam trains",
    "the moon",
    "octopuses",
    "bread baking",
    "sailing ships",
    "desert plants",
]
ASKS = [
    "Tell me about {s}: how they came to be, what they are made of, and why people care about them.",
    "Now describe {s} as a child would see them for the first time, with sounds, colours and smells.",
    "What are three surprising facts about {s} that most people do not know? Explain each one.",
    "Write a short story in which {s} save a small town from a winter storm, with a happy ending.",
]


@dataclass
class TurnResult:
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    text: str = ""

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def user_turns(seed: int, num_turns: int) -> list[str]:
    rng = random.Random(seed)
    return [rng.choice(ASKS).format(s=rng.choice(SUBJECTS)) for _ in range(num_turns)]


def sse_data(response: httpx.Response) -> Any:
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line.removeprefix("data: "))


def responses_turn(
    http: httpx.Client, text: str, previous: str | None, max_tokens: int
) -> tuple[str, TurnResult]:
    body = {
        "model": MODEL,
        "input": text,
        "previous_response_id": previous,
        "max_output_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    sent = time.perf_counter()
    ttft = None
    with http.stream("POST", "/v1/responses", json=body) as response:
        response.raise_for_status()
        for event in sse_data(response):
            if event["type"] == "response.output_text.delta" and ttft is None:
                ttft = time.perf_counter() - sent
            if event["type"] in ("response.completed", "response.incomplete"):
                final = event["response"]
    usage = final["usage"]
    text_out = "".join(part["text"] for item in final["output"] for part in item.get("content", []))
    result = TurnResult(
        usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"], ttft or 0.0, text_out
    )
    return final["id"], result


def chat_turn(http: httpx.Client, messages: list[dict[str, str]], max_tokens: int) -> TurnResult:
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    ttft = None
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for chunk in sse_data(response):
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content") and ttft is None:
                ttft = time.perf_counter() - sent
            if chunk.get("usage"):
                usage = chunk["usage"]
    return TurnResult(usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], ttft or 0.0)


def start(flags: list[str]) -> ServerProcess:
    return ServerProcess(served_model_name=MODEL, extra_flags=flags).start()  # its own temporary data dir


def run_responses(
    conversations: list[list[str]], max_tokens: int, flags: list[str]
) -> list[list[TurnResult]]:
    server = start(flags)
    try:
        with httpx.Client(base_url=server.base_url, timeout=600) as http:
            responses_turn(http, "Say hello.", None, 4)  # warm-up
            results = []
            for turns in conversations:
                previous, per_turn = None, []
                for text in turns:
                    previous, result = responses_turn(http, text, previous, max_tokens)
                    per_turn.append(result)
                results.append(per_turn)
            return results
    finally:
        server.stop()


def run_chat(
    conversations: list[list[str]], answers: list[list[str]], max_tokens: int, flags: list[str]
) -> list[list[TurnResult]]:
    server = start(["--no-prefix-cache", *flags])
    try:
        with httpx.Client(base_url=server.base_url, timeout=600) as http:
            chat_turn(http, [{"role": "user", "content": "Say hello."}], 4)  # warm-up
            results = []
            for turns, said in zip(conversations, answers, strict=True):
                messages: list[dict[str, str]] = []
                per_turn = []
                for text, answer in zip(turns, said, strict=True):
                    messages.append({"role": "user", "content": text})
                    per_turn.append(chat_turn(http, messages, max_tokens))
                    messages.append({"role": "assistant", "content": answer})
                results.append(per_turn)
            return results
    finally:
        server.stop()


def mean_at(results: list[list[TurnResult]], turn: int, value: str) -> float:
    return statistics.fmean(getattr(per_turn[turn], value) for per_turn in results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-flags", default="", help="extra flags for both servers")
    args = parser.parse_args()
    flags = args.server_flags.split()
    conversations = [user_turns(args.seed + i, args.turns) for i in range(args.conversations)]
    responses = run_responses(conversations, args.output_tokens, flags)
    answers = [[r.text for r in per_turn] for per_turn in responses]
    chat = run_chat(conversations, answers, args.output_tokens, flags)

    print(
        "turn  responses: prompt prefill ttft_ms  |  chat (no prefix cache): prompt prefill ttft_ms",
        flush=True,
    )
    for turn in range(args.turns):
        print(
            f"{turn + 1:>4}  {mean_at(responses, turn, 'prompt_tokens'):>17.0f} "
            f"{mean_at(responses, turn, 'prefill_tokens'):>7.0f} {mean_at(responses, turn, 'ttft_s') * 1000:>7.0f}"
            f"  |  {mean_at(chat, turn, 'prompt_tokens'):>30.0f} {mean_at(chat, turn, 'prefill_tokens'):>7.0f} "
            f"{mean_at(chat, turn, 'ttft_s') * 1000:>7.0f}",
            flush=True,
        )
    for label, results in (("responses", responses), ("chat_no_prefix_cache", chat)):
        total = sum(r.prefill_tokens for per_turn in results for r in per_turn) / len(results)
        print(f"sessions {label} prefill_tokens_total {total:.0f} per conversation", flush=True)
    last = args.turns - 1
    ratio = mean_at(chat, last, "ttft_s") / mean_at(responses, last, "ttft_s")
    print(
        f"sessions ttft_ratio_turn_{args.turns} {ratio:.1f}x (chat re-sent / previous_response_id)",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
