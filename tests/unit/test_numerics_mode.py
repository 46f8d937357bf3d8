"""--numerics: auto (the default) is invariant where the weights are quantized and the invariant
kernels run, else fast; invariant asked for where it cannot run is refused with the reason;
batch_invariant is a no-op in an invariant engine."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from argosy.errors import ModelLoadError
from argosy.models.build import resolve_numerics
from argosy.models.gguf_quant import INT4_FILE
from argosy.ops.quantized_linear import invariant_qlinear


def source(tmp_path: Path, q4_blocks: bool) -> SimpleNamespace:
    if q4_blocks:
        (tmp_path / INT4_FILE).write_bytes(b"")
    return SimpleNamespace(weights_dir=tmp_path)


needs_kernels = pytest.mark.skipif(
    not invariant_qlinear(torch.bfloat16), reason="the invariant kernels need a C++ compiler"
)


@needs_kernels
def test_auto_is_invariant_for_a_gguf_with_q4_blocks_with_bf16_storage_on_any_cpu(tmp_path: Path) -> None:
    src = source(tmp_path, q4_blocks=True)
    assert resolve_numerics("auto", "auto", "cpu", "auto", src) == (True, torch.bfloat16)  # type: ignore[arg-type]
    assert resolve_numerics("auto", "bfloat16", "cpu", "int4", src) == (True, torch.bfloat16)  # type: ignore[arg-type]


@needs_kernels
def test_auto_keeps_float_weights_fast(tmp_path: Path) -> None:
    src = source(tmp_path, q4_blocks=False)
    invariant, _ = resolve_numerics("auto", "auto", "cpu", "auto", src)  # type: ignore[arg-type]
    assert not invariant  # no Q4 blocks: auto keeps the float weights, so fast numerics
    assert resolve_numerics("auto", "bfloat16", "cpu", "int8", src) == (True, torch.bfloat16)  # type: ignore[arg-type]
    (tmp_path / "q4").mkdir()
    q4 = source(tmp_path / "q4", q4_blocks=True)
    assert resolve_numerics("auto", "float32", "cpu", "auto", q4) == (False, torch.float32)  # type: ignore[arg-type]
    assert resolve_numerics("auto", "bfloat16", "cpu", "none", q4) == (False, torch.bfloat16)  # type: ignore[arg-type]
    assert resolve_numerics("fast", "auto", "cpu", "auto", q4)[0] is False  # type: ignore[arg-type]


@needs_kernels
def test_invariant_where_it_cannot_run_is_refused_with_the_reason(tmp_path: Path) -> None:
    src = source(tmp_path, q4_blocks=True)
    with pytest.raises(ModelLoadError, match="quantized kernels: use --quantization auto, int4 or int8"):
        resolve_numerics("invariant", "auto", "cpu", "none", src)  # type: ignore[arg-type]
    with pytest.raises(ModelLoadError, match="bfloat16: use --dtype bfloat16 or auto"):
        resolve_numerics("invariant", "float32", "cpu", "auto", src)  # type: ignore[arg-type]
    # on CUDA the layers are invariant as they are (ops/triton_kernels.py): accepted, and none of
    # the CPU invariant machinery (its kernels, the float32 stream) is asked for
    assert resolve_numerics("invariant", "bfloat16", "cuda", "auto", src) == (False, torch.bfloat16)  # type: ignore[arg-type]
