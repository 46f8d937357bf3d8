"""Importing argosy turns on torch's huge-page allocation (THP_MEM_ALLOC_ENABLE) before torch
reads it: a prefill's activations (tens of MB a layer, each freshly mapped) then fault in 2 MiB
at a time instead of 4 KiB (argosy/__init__.py has the measurement)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

PROBE = """
import resource, sys
import argosy  # before torch, as the CLI and the engine import it
import torch
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(1000, 17920).fill_(1.0)  # a 1,000-token prefill's gate/up output: 71.7 MB
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(min(faults))
"""


def faults_writing_71mb(env: dict[str, str]) -> int:
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages on this kernel"
)
def test_a_fresh_71mb_activation_faults_in_huge_pages_unless_turned_off() -> None:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    assert faults_writing_71mb(env) < 1_000  # 35 huge pages (and a few small ones)
    assert faults_writing_71mb({**env, "THP_MEM_ALLOC_ENABLE": "0"}) > 17_000  # 17,500 small pages
