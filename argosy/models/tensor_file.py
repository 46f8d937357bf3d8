"""A safetensors file's tensors read one at a time, when asked for.

`load_file` maps the whole file and hands out tensors over the mapping: every page read stays
in the process's RSS until the last tensor is dropped. The converted GGUF's codes file is read
once, packed tensor by tensor into the kernels' own layout, and the codes are then garbage: read
whole, the 1.5B's 2.2 GB of int8 codes sat beside its 1 GB of packed weights (start-up peak
3.7 GB against 1.5 GB once loaded). Read here with `pread`, a tensor's bytes live only as long
as the tensor does.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType

import torch
from safetensors import safe_open


class TensorFile(Mapping[str, torch.Tensor]):
    """name -> tensor, each read from the file on access (a fresh tensor each time). Use it as a
    context manager, or close() it, to let the file go."""

    def __init__(self, path: Path | str) -> None:
        self._file = safe_open(str(path), framework="pt", backend="pread")
        self._names = frozenset(self._file.keys())

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return self._file.get_tensor(name)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._names))

    def __len__(self) -> int:
        return len(self._names)

    def close(self) -> None:
        self._file.__exit__(None, None, None)

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()
