"""A client that stops reading its stream, against a real server over a real socket.

The slow client opens its socket with a tiny receive buffer and stops reading after the first
frame: the server's writes block once the buffers between them are full (the kernel's, kept
small here: on loopback the send buffer autotunes to megabytes, an hour of tokens at this
model's speed; and the event loop's 64 KiB), the stream's queue of unread outputs grows, and
past max_stream_buffer outputs the generation is stopped. Meanwhile
another client streams normally and must get exactly the text it gets alone, and the engine
must be idle again while the slow client still sleeps. When the slow client reads on, its
stream ends cleanly: the frames up to the cut, `finish_reason: "length"`, the degraded comment
naming `slow_reader`, `[DONE]`.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.faults.live import LiveServer

BUFFER = 8  # --max-stream-buffer: engine outputs left unread before the cut
SLOW_MAX_TOKENS = 1500


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    live = LiveServer(server_options={"max_stream_buffer": BUFFER}, send_buffer_bytes=4096).start()
    try:
        yield live
    finally:
        live.stop()


def open_slow_stream(server: LiveServer) -> socket.socket:
    """POST a long streaming chat on a socket whose receive buffer is as small as the kernel
    allows, and read only the response head."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect(("127.0.0.1", server.port))
    body = json.dumps(
        {
            "model": "smollm2",
            "messages": [{"role": "user", "content": "Write a very long story about the sea."}],
            "max_tokens": SLOW_MAX_TOKENS,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    sock.sendall(head + body)
    first = sock.recv(256)
    assert first.startswith(b"HTTP/1.1 200"), first
    return sock


def engine(http: httpx.Client) -> dict[str, int]:
    stats: dict[str, int] = http.get("/v1/argosy/engine").json()
    return stats


def stream_text(http: httpx.Client, prompt: str) -> str:
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 24,
        "temperature": 0,
        "stream": True,
        # scheduled alone, so its text cannot depend on the batch it would share (a greedy
        # near-tie may flip between one-row and two-row kernels on some CPUs)
        "batch_invariant": True,
    }
    text = []
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text.append(delta.get("content") or "")
    return "".join(text)


def test_a_slow_reader_is_cut_and_slows_no_one(server: LiveServer) -> None:
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        alone = stream_text(http, "Name three fruits.")
        sock = open_slow_stream(server)
        try:
            beside = stream_text(http, "Name three fruits.")  # while the slow stream is open
            deadline = time.monotonic() + 120
            while True:  # the slow request is stopped while its client still sleeps
                stats = engine(http)
                if stats["num_running"] == stats["num_waiting"] == 0:
                    break
                assert time.monotonic() < deadline, f"the slow reader's generation still runs: {stats}"
                time.sleep(0.2)
            assert stats["num_free_blocks"] == stats["num_total_blocks"]
            sock.settimeout(30)
            received = b""
            while chunk := sock.recv(65536):
                received += chunk
        finally:
            sock.close()
    assert beside == alone
    text = received.decode("utf-8", errors="replace")
    frames = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(frame) for frame in frames[:-1]]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and finishes.count("length") == 1
    contents = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert 0 < len(contents) < SLOW_MAX_TOKENS  # cut: what was buffered, not the whole budget
    assert ": x-argosy-degraded: slow_reader" in text
