"""The fleet's tests start Ray, which at start-up reaches for outside addresses: they run only
inside a loopback-only network namespace (`make fleet-test`, part of `make test`, starts them
there), and refuse to run where any other network interface exists."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.server import ServerProcess

# the test's own veth links (the two-namespace set-up) are allowed besides lo
OWN_LINKS = ("lo", "argosy-v")


def interfaces() -> list[str]:
    lines = Path("/proc/self/net/dev").read_text().splitlines()[2:]
    return [line.split(":")[0].strip() for line in lines]


@pytest.fixture(scope="session", autouse=True)
def loopback_only() -> None:
    others = [name for name in interfaces() if not name.startswith(OWN_LINKS)]
    if others:
        pytest.exit(
            f"refusing to start Ray with network interfaces {others}: run `make fleet-test` "
            "(a loopback-only network namespace)",
            returncode=3,
        )


def mode(**options: object) -> dict[str, object]:
    """Both servers in the same mode: the default model and numerics (invariant int4), eager."""
    return {"quantization": None, "compile": "off", "threads": 1, "startup_timeout_s": 900, **options}


def ray_processes() -> list[str]:
    """Ray's daemons running in this (private) PID namespace."""
    names = []
    for status in Path("/proc").glob("[0-9]*/comm"):
        try:
            name = status.read_text().strip()
        except OSError:
            continue
        if name in ("raylet", "gcs_server") or name.startswith("ray::"):
            names.append(name)
    return names


@pytest.fixture(scope="module")
def fleet() -> Iterator[ServerProcess]:
    server = ServerProcess(command="fleet", extra_flags=["--nodes", "2"], **mode()).start()  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.stop()
    # a head stopped by SIGTERM drains, exits 0 and stops the Ray instance it started
    assert server.process is not None and server.process.returncode == 0, server.log_text()[-3000:]
    deadline = time.monotonic() + 15
    while ray_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray_processes() == []


@pytest.fixture(scope="session")
def local() -> Iterator[ServerProcess]:
    server = ServerProcess(**mode()).start()  # type: ignore[arg-type]
    try:
        yield server
    finally:
        server.stop()
