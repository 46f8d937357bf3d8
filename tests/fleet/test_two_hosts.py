"""Two hosts: a second network namespace joined to this one by a veth pair (10.200.0.1/24 here,
10.200.0.2/24 there, no default route), a Ray head started here and a Ray node there with
`ray start`, and `argosy fleet --address` as the head over both: a request runs on the remote
node. Every process stays inside the suite's private PID namespace, which ends them all."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.e2e.server import ServerProcess
from tests.fleet.conftest import mode

pytestmark = pytest.mark.e2e
HERE, THERE = "10.200.0.1", "10.200.0.2"
RAY = str(Path(sys.executable).with_name("ray"))
ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def run(*command: str) -> None:
    subprocess.run(
        command, check=True, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=180
    )


@pytest.fixture(scope="module")
def two_hosts() -> Iterator[str]:
    other = subprocess.Popen(["unshare", "--net", "sleep", "3600"])  # the second host's network
    try:
        time.sleep(0.2)
        there = ["nsenter", f"--net=/proc/{other.pid}/ns/net"]
        run(
            "ip",
            "link",
            "add",
            "argosy-v0",
            "type",
            "veth",
            "peer",
            "name",
            "argosy-v1",
            "netns",
            str(other.pid),
        )
        run("ip", "addr", "add", f"{HERE}/24", "dev", "argosy-v0")
        run("ip", "link", "set", "argosy-v0", "up")
        run(*there, "ip", "link", "set", "lo", "up")
        run(*there, "ip", "addr", "add", f"{THERE}/24", "dev", "argosy-v1")
        run(*there, "ip", "link", "set", "argosy-v1", "up")
        common = ["--num-cpus", "1", "--disable-usage-stats"]
        run(
            RAY, "start", "--head", f"--node-ip-address={HERE}", "--port=6379", "--include-dashboard=false",
            f"--temp-dir={tempfile.mkdtemp(prefix='ray-a-', dir='/tmp')}", *common,
        )  # fmt: skip
        run(
            *there, RAY, "start", f"--address={HERE}:6379", f"--node-ip-address={THERE}",
            f"--temp-dir={tempfile.mkdtemp(prefix='ray-b-', dir='/tmp')}", *common,
        )  # fmt: skip
        yield f"{HERE}:6379"
    finally:
        other.kill()  # the Ray processes end with the suite's PID namespace (never `ray stop`)


def test_a_request_runs_on_the_remote_node(two_hosts: str) -> None:
    flags = ["--address", two_hosts, "--node-ip-address", HERE, "--nodes", "2", "--placement", "round-robin"]
    server = ServerProcess(command="fleet", extra_flags=flags, **mode()).start()  # type: ignore[arg-type]
    try:
        nodes = httpx.get(f"{server.base_url}/health", timeout=10).json()["nodes"]["smollm2"]
        assert sorted(n["name"].split("#")[0] for n in nodes) == [HERE, THERE] and all(n["up"] for n in nodes)
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        for _ in range(2):  # in turn: one on each host
            answer = client.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8
            )
            assert answer.choices[0].message.content
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
        remote = re.search(
            rf'argosy:fleet_placements_total\{{model="smollm2",node="{re.escape(THERE)}#\d",policy="round-robin"\}} (\S+)',
            metrics,
        )
        assert remote is not None and float(remote.group(1)) >= 1, metrics
    finally:
        server.stop()
