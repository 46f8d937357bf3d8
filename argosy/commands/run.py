"""`argosy run [MODEL] [PROMPT]`: chat with a model from the terminal, as `ollama run` does.

With a prompt (or text piped in: `cat notes.txt | argosy run smollm2 "summarise"`) it prints
the streamed answer and exits. Without one it is an interactive chat: a line is a message,
`\"\"\"` opens and closes a multi-line one, and

    /set temperature 0.2     (also top_p, top_k, max_tokens, seed; /set system TEXT)
    /system TEXT             the system message
    /fork N                  continue from turn N (its first N exchanges) as a new conversation
    /save FILE, /load FILE   the conversation and settings as JSON
    /clear, /show, /?, /bye

Reasoning is printed dimmed (on a terminal) and tool calls as `[tool call] name(arguments)`.
When no server answers, one is started for the session (`argosy serve --model MODEL` on a
free port) and stopped at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx

from argosy.commands.models import CommandError, base_url, resolve_name, server_get

DIM, RESET = "\x1b[2m", "\x1b[0m"
HELP = """Commands:
  /set temperature|top_p|top_k|max_tokens|seed VALUE   set a sampling parameter
  /set system TEXT | /system TEXT                       set the system message
  /fork N          continue from turn N as a new conversation
  /save FILE       save the conversation and settings
  /load FILE       load them
  /clear           forget the conversation
  /show            the settings and the number of turns
  /bye             exit
Use \"\"\" to begin and end a multi-line message."""
_NUMERIC = {"temperature": float, "top_p": float, "top_k": int, "max_tokens": int, "seed": int}


@dataclass
class Conversation:
    model: str
    system: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def turns(self) -> int:
        return sum(1 for m in self.messages if m["role"] == "user")

    def request(self, stream: bool = True) -> dict[str, Any]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return {"model": self.model, "messages": system + self.messages, "stream": stream, **self.options}

    def fork(self, turn: int) -> None:
        if not 0 <= turn <= self.turns:
            raise CommandError(f"there are {self.turns} turns: fork at 0..{self.turns}")
        kept, users = [], 0
        for message in self.messages:
            if message["role"] == "user":
                users += 1
                if users > turn:
                    break
            kept.append(message)
        self.messages = kept

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "system": self.system,
            "options": self.options,
            "messages": self.messages,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Conversation:
        return cls(
            model=str(data["model"]),
            system=data.get("system"),
            options=dict(data.get("options") or {}),
            messages=list(data.get("messages") or []),
        )


def stream_answer(url: str, body: dict[str, Any], out: TextIO, color: bool) -> str:
    """POST the chat, print its deltas as they come; the answer's text."""
    text: list[str] = []
    in_reasoning = False
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        if response.status_code >= 400:
            response.read()
            try:
                raise CommandError(response.json()["error"]["message"])
            except (ValueError, KeyError, TypeError):
                raise CommandError(response.text[:300]) from None
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                if line.startswith("event: error"):
                    raise CommandError("the stream ended with an error")
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                delta = choice.get("delta") or {}
                if delta.get("reasoning_content"):
                    if not in_reasoning and color:
                        out.write(DIM)
                    in_reasoning = True
                    out.write(delta["reasoning_content"])
                if delta.get("content"):
                    if in_reasoning:
                        out.write(RESET + "\n\n" if color else "\n\n")
                        in_reasoning = False
                    text.append(delta["content"])
                    out.write(delta["content"])
                for call in delta.get("tool_calls") or []:
                    function = call.get("function") or {}
                    if function.get("name"):
                        out.write(f"\n[tool call] {function['name']}(")
                    out.write(function.get("arguments") or "")
                out.flush()
    if in_reasoning and color:
        out.write(RESET)
    out.write("\n")
    out.flush()
    return "".join(text)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def reachable_server(address: str | None, model: str | None, err: TextIO) -> Iterator[str]:
    """The server at `address`, or one started for this session when none answers."""
    url = base_url(address)
    try:
        server_get(url, "/health", timeout=2.0)
        yield url
        return
    except CommandError:
        if address is not None:
            raise
    port = _free_port()
    err.write(
        f"no server at {url}: starting one for this session on port {port} (model {model or 'smollm2'})…\n"
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "argosy", "serve", "--model", model or "smollm2", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise CommandError(
                    f"the server for this session exited ({process.returncode}): run `argosy serve` to see why"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=20)


def first_chat_model(url: str) -> str:
    for model in server_get(url, "/v1/models")["data"]:
        if model["capabilities"]["kind"] == "chat":
            return str(model["id"])
    raise CommandError(f"the server at {url} serves no chat model")


def cmd_run(
    address: str | None,
    model: str | None,
    prompt: list[str],
    options: dict[str, Any],
    stdin: TextIO,
    out: TextIO,
    err: TextIO,
) -> int:
    with reachable_server(address, model, err) as url:
        name = resolve_name(url, model)["id"] if model else first_chat_model(url)
        conversation = Conversation(model=name, options=dict(options))
        color = out.isatty()
        if prompt or not stdin.isatty():
            text = " ".join(prompt)
            if not stdin.isatty():
                piped = stdin.read()
                text = f"{text}\n\n{piped}" if text else piped
            conversation.messages.append({"role": "user", "content": text})
            stream_answer(url, conversation.request(), out, color)
            return 0
        return interactive(url, conversation, stdin, out, color)


def interactive(url: str, conversation: Conversation, stdin: TextIO, out: TextIO, color: bool) -> int:
    out.write(f"{conversation.model} at {url} — /? for help, /bye to leave\n")
    while True:
        try:
            message = read_message(stdin, out)
        except EOFError:
            out.write("\n")
            return 0
        if message is None:
            continue
        if message.startswith("/"):
            try:
                if command(message, conversation, out) == "bye":
                    return 0
            except CommandError as exc:
                out.write(f"error: {exc}\n")
            continue
        conversation.messages.append({"role": "user", "content": message})
        try:
            answer = stream_answer(url, conversation.request(), out, color)
        except CommandError as exc:
            conversation.messages.pop()
            out.write(f"error: {exc}\n")
            continue
        except KeyboardInterrupt:
            conversation.messages.pop()
            out.write("\n")
            continue
        conversation.messages.append({"role": "assistant", "content": answer})


def read_message(stdin: TextIO, out: TextIO) -> str | None:
    out.write(">>> ")
    out.flush()
    line = stdin.readline()
    if not line:
        raise EOFError
    line = line.rstrip("\n")
    if not line.startswith('"""'):
        return line.strip() or None
    parts = [line[3:]]
    while not parts[-1].endswith('"""'):
        out.write("... ")
        out.flush()
        more = stdin.readline()
        if not more:
            raise EOFError
        parts.append(more.rstrip("\n"))
    parts[-1] = parts[-1][:-3]
    return "\n".join(parts).strip() or None


def command(line: str, conversation: Conversation, out: TextIO) -> str | None:
    name, _, rest = line[1:].partition(" ")
    rest = rest.strip()
    if name in ("bye", "exit", "quit"):
        return "bye"
    if name in ("?", "help"):
        out.write(HELP + "\n")
    elif name == "set":
        key, _, value = rest.partition(" ")
        if key == "system":
            conversation.system = value.strip() or None
            out.write("Set system message.\n")
        elif key in _NUMERIC:
            try:
                conversation.options[key] = _NUMERIC[key](value)
            except ValueError:
                raise CommandError(f"{key} takes a number, not {value!r}") from None
            out.write(f"Set parameter '{key}' to '{conversation.options[key]}'\n")
        else:
            raise CommandError(f"unknown setting {key!r}: system, {', '.join(_NUMERIC)}")
    elif name == "system":
        conversation.system = rest or None
        out.write("Set system message.\n")
    elif name == "fork":
        try:
            turn = int(rest)
        except ValueError:
            raise CommandError("/fork takes a turn number") from None
        conversation.fork(turn)
        out.write(f"Forked at turn {turn}: a new conversation of {conversation.turns} turns.\n")
    elif name == "save":
        Path(rest).write_text(json.dumps(conversation.to_json(), ensure_ascii=False, indent=2))
        out.write(f"Saved {conversation.turns} turns to {rest}\n")
    elif name == "load":
        try:
            loaded = Conversation.from_json(json.loads(Path(rest).read_text()))
        except (OSError, ValueError, KeyError) as exc:
            raise CommandError(f"cannot load {rest}: {exc}") from None
        conversation.system, conversation.options, conversation.messages = (
            loaded.system,
            loaded.options,
            loaded.messages,
        )
        out.write(f"Loaded {conversation.turns} turns from {rest}\n")
    elif name == "clear":
        conversation.messages = []
        out.write("Cleared the conversation.\n")
    elif name == "show":
        out.write(f"model {conversation.model}, {conversation.turns} turns, system {conversation.system!r}, "
                  f"options {json.dumps(conversation.options)}\n")  # fmt: skip
    else:
        raise CommandError(f"unknown command /{name}: /? lists them")
    return None
