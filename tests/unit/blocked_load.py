"""A model that never loads, for tests of the HTTP edge without a model."""

from __future__ import annotations

import threading
from typing import Any

from argosy.config import ModelSpec
from argosy.errors import ModelLoadError


class BlockedLoad:
    """A load_fn that waits until the test releases it, then fails (so nothing ever loads):
    a request that reaches the model waits its load timeout and gets 503 "loading"."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.calls: list[str] = []

    def __call__(self, spec: ModelSpec) -> Any:
        self.calls.append(spec.id)
        self.released.wait(10)
        raise ModelLoadError("no such file")
