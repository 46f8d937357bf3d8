"""x in the invariant kernels' fine form (csrc/iq_rows.h: a 15-bit code per value, held as two
bytes, for the output head): every path gives the scalar reference's bits at any row count and
alone, for the int8 forms (q8_linear: full-range and narrow codes, per 32 and per 16, with and
without minimums) and the codes held at their bits (kq_linear); the packed forms equal the int8
form; and the result is ~100x closer to the exact product than the 8-bit form's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from argosy.ops.native import load_invariant_ops, load_native_ops
from argosy.ops.packed_codes import PackedCodes
from argosy.ops.quantized_linear import (
    BlockCodes,
    Int8Linear,
    code_range,
    invariant_q4_layout,
    invariant_q8_layout,
)
from tests.unit.test_invariant_kernels import q4_dense, q4_weight
from tests.unit.test_packed_codes import FORMATS, ROW_COUNTS, bits, kquant, rows

pytestmark = pytest.mark.skipif(not load_native_ops(), reason="no C++ compiler for the native kernels")


@pytest.fixture(autouse=True)
def built() -> None:
    assert load_invariant_ops(), "the invariant kernels did not build (see the log)"


@pytest.fixture
def paths() -> Iterator[list[str]]:
    yield list(torch.ops.argosy_iq.paths())
    torch.ops.argosy_iq.set_path("auto")


def int8_weight(n: int, k: int, seed: int, lo: int, hi: int, group: int, mins: bool) -> BlockCodes:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(lo, hi + 1, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=gen) * 0.01 + 1e-4
    m = -(torch.rand(n, k // 32, generator=gen) * 0.2) if mins else None
    return BlockCodes(codes, scales, m)


def q8(x: torch.Tensor, weight: BlockCodes, n: int, fine: bool, out_float32: bool = True) -> torch.Tensor:
    layout = invariant_q8_layout(weight.codes, weight.scales, weight.mins)
    return torch.ops.argosy_iq.q8_linear(x, *layout, n, out_float32, *code_range(weight.codes), fine)


def exact(x: torch.Tensor, weight: BlockCodes) -> torch.Tensor:
    n, k = weight.codes.shape
    w = (weight.codes.double().view(n, -1, weight.group) * weight.scales.double()[..., None]).view(n, k)
    if weight.mins is not None:
        w = (w.view(n, -1, 32) + weight.mins.double()[..., None]).view(n, k)
    return x.double() @ w.T


INT8_FORMS = {  # name: (code range, weight group, minimums): the AVX2 sign path and its biased sums
    "q8_0": (-127, 127, 32, False),
    "narrow": (-16, 15, 32, False),
    "per16": (-32, 31, 16, False),
    "mins": (0, 31, 32, True),
    "per16-full-mins": (-127, 127, 16, True),
}


@pytest.mark.parametrize("form", list(INT8_FORMS))
@pytest.mark.parametrize("extreme", [False, True])
def test_q8_fine_is_the_same_bits_on_every_path(paths: list[str], form: str, extreme: bool) -> None:
    lo, hi, group, mins = INT8_FORMS[form]
    n, k = 48, 512
    weight = int8_weight(n, k, seed=len(form), lo=lo, hi=hi, group=group, mins=mins)
    if extreme:
        weight.codes.copy_(torch.where(torch.rand(n, k) < 0.5, lo, hi).to(torch.int8))
    x = rows(max(ROW_COUNTS), k, seed=11, extreme=extreme)
    torch.ops.argosy_iq.set_path("scalar")
    reference = q8(x, weight, n, fine=True)
    assert extreme or not torch.equal(reference, q8(x, weight, n, fine=False))  # +-1 rounds alike
    for path in paths:
        torch.ops.argosy_iq.set_path(path)
        for count in ROW_COUNTS:
            assert torch.equal(bits(q8(x[:count], weight, n, True)), bits(reference[:count])), (path, count)
        alone = torch.cat([q8(x[i : i + 1], weight, n, True) for i in range(x.shape[0])])
        assert torch.equal(bits(alone), bits(reference)), path
        assert torch.equal(bits(q8(x, weight, n, True, out_float32=False)), bits(reference.bfloat16())), path


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_fine_equals_the_int8_fine_reference(paths: list[str], fmt: str) -> None:
    n, k = 48, 512
    weight, super_scales = kquant(fmt, n, k, seed=len(fmt))
    kq = PackedCodes.of(weight.codes, weight.scales, weight.mins, super_scales, *code_range(weight.codes))
    assert kq is not None
    x = rows(max(ROW_COUNTS), k, seed=5)
    torch.ops.argosy_iq.set_path("scalar")
    reference = q8(x, weight, n, fine=True)
    for path in paths:
        torch.ops.argosy_iq.set_path(path)
        for count in [*ROW_COUNTS, 16, 17, 40]:  # AMX from 16 rows
            xs = rows(count, k, seed=count) if count > x.shape[0] else x[:count]
            want = reference[:count] if count <= x.shape[0] else None
            got = kq.linear(xs, n, True, fine=True)
            if want is None:
                torch.ops.argosy_iq.set_path("scalar")
                want = q8(xs, weight, n, fine=True)
                torch.ops.argosy_iq.set_path(path)
            assert torch.equal(bits(got), bits(want)), (path, count)


def test_fine_is_far_closer_to_the_exact_product() -> None:
    n, k = 64, 1024
    weight = int8_weight(n, k, seed=1, lo=-127, hi=127, group=32, mins=False)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(2))
    want = exact(x, weight)
    plain = (q8(x, weight, n, fine=False).double() - want).abs().max().item()
    fine = (q8(x, weight, n, fine=True).double() - want).abs().max().item()
    assert fine < plain / 50, (fine, plain)


def test_the_output_head_takes_the_fine_form() -> None:
    n, k = 64, 256
    codes = torch.randint(-127, 128, (n, k), generator=torch.Generator().manual_seed(3))
    codes[:, ::32] = 127  # each group's largest code is 127: Q8_0-style codes give it back exactly
    weight = codes.float() / 128
    head = Int8Linear(weight, None, torch.bfloat16, invariant=True, float_output=True, fine=True)
    body = Int8Linear(weight, None, torch.bfloat16, invariant=True, float_output=True)
    assert head.fine and not body.fine
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(4)).bfloat16()
    want = x.double() @ weight.double().T
    assert (head(x).double() - want).abs().max() < (body(x).double() - want).abs().max() / 50


def test_q4_fine_is_the_same_bits_on_every_path(paths: list[str]) -> None:
    n, k = 48, 512
    codes, d, m = q4_weight(n, k, seed=9)
    layout = invariant_q4_layout(codes, d, m)
    x = rows(max(ROW_COUNTS), k, seed=13)

    def q4(xs: torch.Tensor, fine: bool, out_float32: bool = True) -> torch.Tensor:
        return torch.ops.argosy_iq.q4_linear(xs, *layout, n, out_float32, fine)

    torch.ops.argosy_iq.set_path("scalar")
    reference = q4(x, fine=True)
    want = x.double() @ q4_dense(codes, d, m).double().T
    assert (reference.double() - want).abs().max() < (q4(x, fine=False).double() - want).abs().max() / 50
    for path in paths:
        torch.ops.argosy_iq.set_path(path)
        for count in [*ROW_COUNTS, 16, 17]:
            xs = x[:count] if count <= x.shape[0] else rows(count, k, seed=count)
            got = q4(xs, True)
            if count > x.shape[0]:
                torch.ops.argosy_iq.set_path("scalar")
                expected = q4(xs, True)
                torch.ops.argosy_iq.set_path(path)
            else:
                expected = reference[:count]
            assert torch.equal(bits(got), bits(expected)), (path, count)
        alone = torch.cat([q4(x[i : i + 1], True) for i in range(x.shape[0])])
        assert torch.equal(bits(alone), bits(reference)), path
