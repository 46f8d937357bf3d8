"""--device and the GPU memory budget: names, what this machine has, the KV cache's share."""

from __future__ import annotations

import pytest
import torch

from argosy.cli import main
from argosy.config import EngineConfig
from argosy.errors import InvalidRequestError, ModelLoadError
from argosy.ops import devices
from argosy.ops.devices import activation_reserve, check_device_name, kv_cache_budget, resolve_device


@pytest.mark.parametrize("name", ["cpu", "auto", "cuda", "cuda:0", "cuda:12"])
def test_device_names_that_parse(name: str) -> None:
    check_device_name(name)


@pytest.mark.parametrize("name", ["gpu", "cuda:", "cuda:x", "CUDA", "mps", "cpu:0", ""])
def test_other_names_are_refused_naming_the_forms(name: str) -> None:
    with pytest.raises(InvalidRequestError, match="cpu, cuda, cuda:N or auto"):
        check_device_name(name)
    with pytest.raises(InvalidRequestError):
        EngineConfig(device=name)


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.01])
def test_a_gpu_memory_fraction_outside_0_1_is_refused(fraction: float) -> None:
    with pytest.raises(InvalidRequestError, match="gpu_memory_fraction"):
        EngineConfig(gpu_memory_fraction=fraction)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_cuda_auto_is_the_cpu_and_cuda_says_why() -> None:
    assert resolve_device("auto") == "cpu"
    assert resolve_device("cpu") == "cpu"
    with pytest.raises(ModelLoadError) as raised:
        resolve_device("cuda")
    why = raised.value.message
    assert why.startswith("cuda: ")
    assert ("no CUDA support" in why) if torch.version.cuda is None else ("no NVIDIA GPU" in why)


def test_an_index_past_the_last_gpu_names_the_ones_there(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices.torch.version, "cuda", "12.8")
    monkeypatch.setattr(devices.torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == "cuda:1"
    assert resolve_device("cuda") == "cuda:0"
    with pytest.raises(
        ModelLoadError, match=r"cuda:2 asked for, but this machine has 2 GPU\(s\): cuda:0, cuda:1"
    ):
        resolve_device("cuda:2")
    monkeypatch.setattr(devices.torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ModelLoadError, match="no NVIDIA GPU is visible"):
        resolve_device("cuda")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_serve_on_a_missing_gpu_stops_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--device", "cuda"])
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("argosy: error: --device: cuda: ")


def test_the_kv_cache_takes_what_the_fraction_leaves() -> None:
    gib = 2**30
    # 100 GiB GPU, 10 GiB in use (weights, another process), 85%: 85 - 10 - 1 reserve
    assert kv_cache_budget(100 * gib, 90 * gib, 0.85, 1 * gib) == 74 * gib
    assert kv_cache_budget(100 * gib, 10 * gib, 0.85, 1 * gib) < 0  # the GPU is taken


def test_the_activation_reserve_grows_with_the_step() -> None:
    small = activation_reserve(64, 1, 576, 1536, 49152)
    assert small == devices.MIN_ACTIVATION_RESERVE
    big = activation_reserve(8192, 256, 4096, 14336, 128256)
    assert big == 2 * 8192 * 4 * (4 * 4096 + 3 * 14336) + 2 * 256 * 128256 * 4


def test_too_little_gpu_memory_names_the_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    gib = 2**30
    monkeypatch.setattr(devices.torch.cuda, "mem_get_info", lambda device: (2 * gib, 80 * gib))
    with pytest.raises(ModelLoadError) as raised:
        devices.gpu_kv_cache_bytes("cuda:0", 0.85, gib, 1 << 20, "smollm2")
    assert raised.value.message.startswith("smollm2: no room for a KV cache on cuda:0")
    assert "78.00 GiB in use" in raised.value.message
    error = devices.out_of_memory("smollm2", "cuda:0", 3 * gib)
    assert error.message == (
        "smollm2: out of GPU memory loading its weights on cuda:0: they need 3.00 GiB, 2.00 GiB of 80.00 GiB is free"
    )


def test_a_rope_table_is_copied_once_per_device_and_kept(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    """A CUDA graph reads the device copy it was captured with: rope() on host positions must not
    move the model's table off the device (which freed that copy), nor copy it again."""
    model = tiny_llama.engine().model
    host = model.inv_freq
    meta = torch.device("meta")
    first = model.table_on("inv_freq", host, meta)
    model.rope(torch.arange(4), torch.float32)  # a host step in between
    assert model.table_on("inv_freq", host, meta) is first and first.device == meta
    assert model.inv_freq is host and host.device.type == "cpu"
    assert model.table_on("inv_freq", host, host.device) is host
    cos, _ = model.rope(torch.arange(4, device=meta), torch.float32)
    assert cos.device == meta
