"""The session store on a full disk, with a real server and real SQLite.

The server's --data-dir is a small tmpfs of its own (mounted here: the test needs root and
permission to mount, and is skipped without them). Filling it with a ballast file makes the
disk genuinely full. Expected (SPEC §5, issue 13): a stored response that cannot be kept is
refused with 507 naming storage, never a 500 and never a response that claims to be stored;
a plain chat completion (whose recording is incidental) is still served; reads keep working;
the server stays up; once the disk has room again, writes succeed; and every response stored
before is still there, unchanged.

A read-only disk cannot be made so under a running server (a remount read-only is refused
while the server holds the database open for writing); tests/unit/test_sessions_storage.py
gives the store SQLite's own read-only failure instead.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import ServerProcess

DISK_BYTES = 8 << 20  # room for the database, its WAL, and the first responses
MAX_ATTEMPTS = 60  # writes until the WAL's spare room is used up and SQLite reports the disk full


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def small_disk() -> Iterator[Path]:
    mount_point = Path(tempfile.mkdtemp(prefix="argosy-small-disk-"))
    try:
        _mount("-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(mount_point))
    except (OSError, subprocess.SubprocessError) as exc:
        mount_point.rmdir()
        pytest.skip(f"cannot mount a tmpfs here ({exc}); the storage fault test needs it")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False, timeout=30)
        shutil.rmtree(mount_point, ignore_errors=True)


@pytest.fixture(scope="module")
def server(small_disk: Path) -> Iterator[ServerProcess]:
    process = ServerProcess(data_dir=small_disk / "data").start()
    try:
        yield process
    finally:
        process.stop()


def fill(disk: Path) -> Path:
    """Write a ballast file until the disk is full (ENOSPC)."""
    ballast = disk / "ballast"
    chunk = b"\0" * (64 << 10)
    with ballast.open("wb") as out:
        try:
            while True:
                out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return ballast


def store(http: httpx.Client, text: str) -> httpx.Response:
    body = {"model": "smollm2", "input": text, "max_output_tokens": 16, "temperature": 0}
    return http.post("/v1/responses", json=body)


def assert_storage_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["type"] == "server_error"
    assert "session store" in error["message"]


def chat(http: httpx.Client) -> httpx.Response:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
    return http.post("/v1/chat/completions", json=body)


def test_full_then_read_only_disk(server: ServerProcess, small_disk: Path) -> None:
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        kept = {}
        for i in range(3):
            response = store(http, f"Count to {i + 2}.")
            assert response.status_code == 200, response.text
            kept[response.json()["id"]] = response.json()

        # -- full disk: writes go on while the WAL has spare room, then 507 -------------------
        ballast = fill(small_disk)
        statuses = []
        for attempt in range(MAX_ATTEMPTS):
            response = store(http, f"Name a colour ({attempt}).")
            statuses.append(response.status_code)
            assert response.status_code in (200, 507), response.text
            if response.status_code == 200:
                kept[response.json()["id"]] = response.json()
            else:
                assert_storage_error(response, 507, "storage_full")
                break
        assert statuses[-1] == 507, f"the disk never filled: {statuses}"
        print(f"statuses once the disk was full: {statuses}")
        assert chat(http).status_code == 200  # served; only its (incidental) record is lost
        for response_id, body in kept.items():  # reads still work, every stored response is there
            got = http.get(f"/v1/responses/{response_id}")
            assert got.status_code == 200 and got.json()["output"] == body["output"]

        # -- room again: writes succeed ---------------------------------------------------------
        ballast.unlink()
        response = store(http, "Say yes.")
        assert response.status_code == 200, response.text
        kept[response.json()["id"]] = response.json()

        for response_id, body in kept.items():
            got = http.get(f"/v1/responses/{response_id}")
            assert got.status_code == 200 and got.json()["output"] == body["output"], response_id
        assert http.get("/health").status_code == 200
    assert server.process is not None and server.process.poll() is None
    assert " 500 " not in server.log_text()
