"""Devices: what `--device` names (cpu, cuda, cuda:N, auto), whether this machine has it, and
how much GPU memory the KV cache gets.

A device that is not there stops start-up with one line saying why (a CPU-only torch build,
no GPU visible, an index past the last GPU), before anything loads.
"""

from __future__ import annotations

import re

import torch

from argosy.errors import InvalidRequestError, ModelLoadError

_NAME = re.compile(r"^(cpu|auto|cuda(:\d+)?)$")

# what a step needs beside the weights and the KV cache (activations, logits, the allocator's
# slack, CUDA graphs' pools), taken off the GPU memory budget before the KV cache is sized
MIN_ACTIVATION_RESERVE = 512 * 2**20


def check_device_name(name: str) -> None:
    if not _NAME.match(name):
        raise InvalidRequestError(f"device must be cpu, cuda, cuda:N or auto, got {name!r}", param="device")


def cuda_unavailable(index: int = 0) -> str | None:
    """Why `cuda:index` cannot run here; None when it can."""
    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA support; install a CUDA build of torch"
    count = torch.cuda.device_count()
    if count == 0:
        return "no NVIDIA GPU is visible to torch (torch.cuda.device_count() is 0; check the driver and CUDA_VISIBLE_DEVICES)"
    if index >= count:
        names = ", ".join(f"cuda:{i}" for i in range(count))
        return f"cuda:{index} asked for, but this machine has {count} GPU(s): {names}"
    return None


def resolve_device(name: str) -> str:
    """'auto' -> 'cuda:0' where torch sees a GPU, else 'cpu'; 'cuda' -> 'cuda:0'; a CUDA device
    that is not here raises with the reason."""
    check_device_name(name)
    if name == "cpu":
        return name
    if name == "auto":
        return "cuda:0" if torch.version.cuda is not None and torch.cuda.is_available() else "cpu"
    index = int(name.partition(":")[2] or 0)
    why = cuda_unavailable(index)
    if why is not None:
        raise ModelLoadError(f"{name}: {why}", param="device")
    return f"cuda:{index}"


def activation_reserve(
    max_num_batched_tokens: int, max_num_seqs: int, hidden: int, ffn: int, vocab: int
) -> int:
    """Bytes a step may need beside weights and KV: the widest activations of a full chunk
    (float32, a few live at once) and the logits of every running request."""
    per_token = 4 * (4 * hidden + 3 * ffn)
    return max(MIN_ACTIVATION_RESERVE, 2 * max_num_batched_tokens * per_token + 2 * max_num_seqs * vocab * 4)


def kv_cache_budget(total: int, free: int, fraction: float, reserve: int) -> int:
    """Bytes for the KV cache: the share of the GPU this engine may hold (fraction x total),
    less what is already in use on it (its weights, other processes) and the step's reserve."""
    return int(fraction * total) - (total - free) - reserve


def gpu_kv_cache_bytes(device: str, fraction: float, reserve: int, per_block: int, model: str) -> int:
    """The KV cache's bytes on `device` from its free memory now (the weights are loaded);
    too little for two blocks stops the load with the figures."""
    free, total = torch.cuda.mem_get_info(torch.device(device))
    budget = kv_cache_budget(total, free, fraction, reserve)
    if budget < 2 * per_block:
        raise ModelLoadError(
            f"{model}: no room for a KV cache on {device}: --gpu-memory-fraction {fraction} of "
            f"{_gib(total)} leaves {_gib(max(budget, 0))} after {_gib(total - free)} in use and "
            f"{_gib(reserve)} for activations (raise the fraction or free the GPU)"
        )
    return budget


def out_of_memory(model: str, device: str, needed: int) -> ModelLoadError:
    """The load's error when the weights do not fit: what they need and what was free."""
    free, total = torch.cuda.mem_get_info(torch.device(device))
    return ModelLoadError(
        f"{model}: out of GPU memory loading its weights on {device}: they need {_gib(needed)}, "
        f"{_gib(free)} of {_gib(total)} is free"
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
