"""The command line against the e2e session's server: `argosy run` through a pseudo-terminal
(a streamed answer, /set, /fork, /save, /load, /bye), its one-shot and piped forms, and list,
ps, show and sessions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest

from tests.e2e.server import REPO_ROOT, ServerProcess

pytestmark = pytest.mark.e2e
MODEL = "smollm2-test"


def argosy(server: ServerProcess, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    host = [] if args[0] == "sessions" else ["--host", f"{server.host}:{server.port}"]  # sessions: the store
    return subprocess.run(
        [sys.executable, "-m", "argosy", *args, *host],
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )


def test_run_interactive_in_a_terminal(server: ServerProcess, tmp_path: Path) -> None:
    child = pexpect.spawn(
        sys.executable,
        ["-m", "argosy", "run", MODEL, "--host", f"{server.host}:{server.port}"],
        cwd=str(REPO_ROOT),
        encoding="utf-8",
        timeout=120,
        dimensions=(40, 120),
    )
    child.expect(f"{MODEL} at http://.* /\\? for help")
    child.expect_exact(">>> ")
    child.sendline("/set temperature 0")
    child.expect_exact("Set parameter 'temperature' to '0.0'")
    child.expect_exact(">>> ")
    child.sendline("/set max_tokens 12")
    child.expect_exact(">>> ")
    child.sendline("What is the capital of France?")
    child.expect_exact(">>> ")
    first = child.before.strip()
    assert len(first) > 3 and "error" not in first  # the streamed answer, ended by a new prompt
    child.sendline('"""Now say it')
    child.expect_exact("... ")
    child.sendline('in two words."""')
    child.expect_exact(">>> ")
    child.sendline("/show")
    child.expect("2 turns")
    child.expect_exact(">>> ")
    saved = tmp_path / "chat.json"
    child.sendline(f"/save {saved}")
    child.expect_exact("Saved 2 turns")
    child.sendline("/fork 1")
    child.expect_exact("Forked at turn 1: a new conversation of 1 turns.")
    child.sendline("/fork 9")
    child.expect_exact("error: there are 1 turns")
    child.sendline(f"/load {saved}")
    child.expect_exact("Loaded 2 turns")
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    conversation = json.loads(saved.read_text())
    assert conversation["options"] == {"temperature": 0.0, "max_tokens": 12}
    assert [m["role"] for m in conversation["messages"]] == ["user", "assistant", "user", "assistant"]
    assert conversation["messages"][2]["content"] == "Now say it\nin two words."


def test_run_once_and_piped(server: ServerProcess) -> None:
    once = argosy(server, "run", MODEL, "Name", "a", "colour.", "--max-tokens", "16")
    assert once.returncode == 0 and once.stdout.strip(), once.stderr
    piped = argosy(
        server, "run", MODEL, "Summarise in one sentence:", stdin="Paris is the capital of France."
    )
    assert piped.returncode == 0 and piped.stdout.strip(), piped.stderr
    unknown = argosy(server, "run", "smollm3-test", "hi")
    assert unknown.returncode == 1 and "did you mean smollm2-test" in unknown.stderr


def test_list_ps_show(server: ServerProcess) -> None:
    listed = argosy(server, "list")
    assert (
        listed.returncode == 0
        and "smollm2 " in listed.stdout
        and f"Served at {server.base_url}" in listed.stdout
    )
    ps = argosy(server, "ps")
    assert ps.returncode == 0 and MODEL in ps.stdout and "MEMORY" in ps.stdout
    shown = argosy(server, "show", MODEL)
    assert shown.returncode == 0, shown.stderr
    for part in ("Model", "context length", "Capabilities", "completion", "tools", "Parameters", "Template"):
        assert part in shown.stdout, shown.stdout


def test_sessions_list_show_fork_delete(server: ServerProcess) -> None:
    assert argosy(server, "run", MODEL, "Hello there.", "--max-tokens", "8").returncode == 0
    assert server.data_dir is not None
    data_dir = ["--data-dir", str(server.data_dir)]
    listed = argosy(server, "sessions", "list", *data_dir)
    assert listed.returncode == 0 and "chat.completion" in listed.stdout, listed.stdout + listed.stderr
    session_id = listed.stdout.splitlines()[1].split()[0]
    shown = argosy(server, "sessions", "show", session_id, *data_dir)
    assert shown.returncode == 0 and "Hello there." in shown.stdout
    forked = argosy(server, "sessions", "fork", session_id, "1", *data_dir)
    assert forked.returncode == 0 and f"forked {session_id} at event 1" in forked.stdout
    child = forked.stdout.split()[-1]
    assert argosy(server, "sessions", "delete", child, *data_dir).returncode == 0
    gone = argosy(server, "sessions", "show", child, *data_dir)
    assert gone.returncode == 1 and "no session" in gone.stderr
