"""Weight-only quantized linear layers for CPU: int4 (group 32) and int8 (per channel).

Int4Linear takes a GGUF Q4_0/Q4_1 weight's own codes, scales and minimums (no requantizing):
torch's int4 kernel computes w = (code - 8) * scale + zero per group of 32 along K, so
scale = d and zero = m + 8 d reproduce the file's d * code + m. The codes are bit-exact; the
scale and zero are held in the activation dtype (bfloat16 rounds the file's fp16 d and m).
Int8Linear quantizes any float weight symmetrically per output channel (on the invariant
kernels: per group of 32, as Q8_0), or takes a GGUF block format's own int8 codes, scales and
minimums (BlockCodes: Q8_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, exactly their values).

In bfloat16, where the native ops are built with AMX (argosy/ops/csrc/qlinear.cpp), both
also hold their codes in that op's tiled layout: its exact dot products unpack a weight once
for up to 16 rows, where torch's int4 kernel unpacks it once a row, so a step of 8 rows costs
~1.4x one row instead of ~2.6x (and ~0.4x the bf16 GEMM). Both keep torch's layout too,
for one row, where torch's kernels are faster (a one-row decode step 10.7-11.0 vs 12.0-13.0 ms
with the native int4 kernel, ad-hoc engine probe).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from argosy.ops.native import load_invariant_ops, load_native_ops
from argosy.ops.packed_codes import (
    GROUP_SIZE,
    PackedCodes,
    PackedForm,
    SuperScales,
    exactly_half,
    packed_form,
    scale_form,
)
from argosy.ops.packed_codes import TILE as _TILE


def invariant_qlinear(dtype: torch.dtype) -> bool:
    """True when the invariant quantized kernels (csrc/iq_linear.cpp) serve this activation
    dtype here: then every quantized layer runs them for every number of rows."""
    return dtype in (torch.bfloat16, torch.float32) and load_invariant_ops()


def native_qlinear(dtype: torch.dtype) -> bool:
    """True when the (AMX) native quantized kernels serve this activation dtype here."""
    return dtype == torch.bfloat16 and load_native_ops() and bool(torch.ops.argosy_ext.qlinear_available())


def _native_shape_ok(out_features: int, in_features: int) -> bool:
    return out_features % _TILE == 0 and in_features % GROUP_SIZE == 0


def q4_tiles(
    codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes uint8 [N, K/2] (even column in the low nibble), d and m [N, K/32] -> the native
    op's layout: codes [N/16, K/32, 16 pairs, 16 outputs], d and m float16 [N/16, K/32, 16]
    (GGUF holds them in float16: exact)."""
    n, half_k = codes.shape
    groups = 2 * half_k // GROUP_SIZE
    tiles = codes.view(n // _TILE, _TILE, groups, GROUP_SIZE // 2).permute(0, 2, 3, 1).contiguous()

    def per_tile(t: torch.Tensor) -> torch.Tensor:
        return t.half().reshape(n // _TILE, _TILE, groups).transpose(1, 2).contiguous()

    return tiles, per_tile(d), per_tile(m)


def q8_tiles(codes: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> the native op's layout [N/16, K/2 pairs, 16 outputs, 2]."""
    n, k = codes.shape
    return codes.view(n // _TILE, _TILE, k // 2, 2).transpose(1, 2).contiguous()


def invariant_q4_layout(
    codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes uint8 [N, K/2] (even column in the low nibble), d and m [N, K/32] -> the invariant
    kernel's layout (csrc/iq_linear.cpp): codes [N/16, K/32, 4, 16, 4] where byte [t, g, c, i, b]
    holds k = 32g+8c+b in its low nibble and k + 4 in its high one (output 16t+i), and d and m
    float16 [N/16, K/32, 16] (GGUF holds them in float16: exact)."""
    n, half_k = codes.shape
    groups = 2 * half_k // GROUP_SIZE
    q = torch.stack([codes & 0x0F, codes >> 4], dim=-1).view(n, 2 * half_k)
    # k = 32g + 8c + 4h + b -> [t, i, g, c, h, b]
    q = q.view(n // _TILE, _TILE, groups, 4, 2, 4)
    packed = q[:, :, :, :, 0, :] | (q[:, :, :, :, 1, :] << 4)  # [t, i, g, c, b]
    tiles = packed.permute(0, 2, 3, 1, 4).contiguous()

    def per_tile(t: torch.Tensor) -> torch.Tensor:
        return t.half().reshape(n // _TILE, _TILE, groups).transpose(1, 2).contiguous()

    return tiles, per_tile(d), per_tile(m)


def q8_group_codes(
    rows: Callable[[int, int], torch.Tensor], n: int, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [N, K] and float16 scales [N, K/32] of a weight, per group of 32 along K as
    GGUF's Q8_0 quantizes: d = fp16(max |w| / 127), q = round(w / d) within [-127, 127] (a group
    too small for a float16 scale: zeros). `rows(start, stop)` gives the weight's rows in float
    (read a few thousand at a time: a float32 copy of a whole output head would add ~110 MB to
    the load's peak memory). A Q8_0 weight's float32 values give its own codes and scales back
    exactly: each group's largest code is +-127, so max |w| / 127 is its float16 d."""
    codes = torch.empty(n, k, dtype=torch.int8)
    scales = torch.empty(n, k // GROUP_SIZE, dtype=torch.float16)
    for start in range(0, n, 4096):
        stop = min(n, start + 4096)
        w = rows(start, stop).float().view(stop - start, k // GROUP_SIZE, GROUP_SIZE)
        d = (w.abs().amax(dim=-1) / 127.0).half()
        divisor = d.float()[..., None]
        q = torch.where(divisor > 0, w / divisor.clamp(min=1e-30), 0.0)  # w / d: exact for Q8_0's codes
        codes[start:stop] = torch.round(q).clamp(-127, 127).to(torch.int8).view(stop - start, k)
        scales[start:stop] = d
    return codes, scales


@dataclass
class BlockCodes:
    """A weight as int8 codes times a float32 scale per G weights along K (G = 32 or 16), plus
    a float32 minimum per 32 where the format has one: what q8_linear computes with. Every GGUF
    block format from Q8_0 to Q6_K holds its values so exactly (argosy/models/gguf_quant.py)."""

    codes: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N, K/G]
    mins: torch.Tensor | None = None  # float32 [N, K/32]
    super_scales: SuperScales | None = None  # a K-quant's own scales (the packed form's)

    @property
    def group(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    def form(self) -> tuple[object, ...]:
        """What must agree for parts to be held as one: the group, mins or not, the scales'
        own form (K-quant integer scales of one type, or none)."""
        sc = self.super_scales
        return (self.group, self.mins is not None, None if sc is None else (sc.sc.dtype, sc.mn is not None))

    @staticmethod
    def cat(parts: list[BlockCodes]) -> BlockCodes:
        """Parts of a fused layer stacked along N, in one form: scales per 16 if any part has
        them (a per-32 scale is the same for both halves), zero mins for parts without; the
        K-quants' own scales kept where every part has them in one form."""
        if len(parts) == 1:
            return parts[0]
        group = min(part.group for part in parts)
        scales = [p.scales.float().repeat_interleave(p.group // group, dim=1) for p in parts]
        with_mins = any(p.mins is not None for p in parts)
        mins = [
            p.mins.float()
            if p.mins is not None
            else torch.zeros(p.codes.shape[0], p.codes.shape[1] // GROUP_SIZE)
            for p in parts
        ]
        same = all(p.form() == parts[0].form() for p in parts)
        supers = [p.super_scales for p in parts if p.super_scales is not None]
        return BlockCodes(
            torch.cat([p.codes for p in parts]),
            torch.cat(scales),
            torch.cat(mins) if with_mins else None,
            SuperScales.cat(supers) if same and len(supers) == len(parts) else None,
        )


def code_range(codes: torch.Tensor) -> tuple[int, int]:
    """The smallest and largest int8 code (one pass: aminmax reads 168 MB of Gemma 3's head in
    ~20 ms, `(codes == -128).any()` in ~300): q8_linear's AVX2 path sums the byte products of a
    narrow range in int16. Codes of -128 are refused (ValueError: the AVX2 path negates codes)."""
    lo, hi = (int(v) for v in torch.aminmax(codes))
    if lo == -128:
        raise ValueError("int8 codes of -128 are outside the kernels' [-127, 127]")
    return lo, hi


def invariant_q8_layout(
    codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """int8 codes [N, K], scales [N, K/G] (G = 32 or 16) and mins [N, K/32] (or None) -> the
    invariant kernel's layout: codes [N/16, K/4, 16, 4], the scales [N/16, K/G, 16] and the mins
    [N/16, K/32, 16], in float16 where every scale and min is exactly a float16 (Q8_0, Q5_0,
    Q5_1: the file's own values, half the bytes a step reads), else float32 (the K-quants'
    d * sc). Codes of -128 are refused (ValueError: the AVX2 path negates codes)."""
    n, k = codes.shape
    code_range(codes)
    tiles = codes.view(n // _TILE, _TILE, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    half = exactly_half(scales) and (mins is None or exactly_half(mins))
    dtype = torch.float16 if half else torch.float32

    def per_tile(t: torch.Tensor) -> torch.Tensor:
        return t.float().to(dtype).reshape(n // _TILE, _TILE, -1).transpose(1, 2).contiguous()

    return tiles, per_tile(scales), None if mins is None else per_tile(mins)


class Int4Linear(nn.Module):
    def __init__(
        self,
        codes: torch.Tensor,
        d: torch.Tensor,
        m: torch.Tensor,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        invariant: bool = False,
    ) -> None:
        """codes: uint8 [N, K/2] (even column in the low nibble); d, m: float32 [N, K/32].
        `invariant`: the invariant kernels for every row count, where they build. `fine` (set
        after building, as on Int8Linear): x in the kernels' fine form."""
        super().__init__()
        n, half_k = codes.shape
        self.in_features, self.out_features = 2 * half_k, n
        self.invariant = invariant and invariant_qlinear(dtype) and _native_shape_ok(n, 2 * half_k)
        self.fine = False
        self.native = not self.invariant and native_qlinear(dtype) and _native_shape_ok(n, 2 * half_k)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        if self.invariant:  # the one form, for every number of rows
            iq_codes, iq_scales, iq_mins = invariant_q4_layout(codes, d, m)
            self.register_buffer("iq_codes", iq_codes)
            self.register_buffer("iq_scales", iq_scales)
            self.register_buffer("iq_mins", iq_mins)
            return
        if self.native:
            tiles, scales, mins = q4_tiles(codes, d, m)
            self.register_buffer("tiles", tiles)
            self.register_buffer("tile_scales", scales)
            self.register_buffer("tile_mins", mins)
        unpacked = torch.stack([codes & 0x0F, codes >> 4], dim=-1).view(n, 2 * half_k).to(torch.int32)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpacked, 1))
        scales_and_zeros = torch.stack([d, m + 8.0 * d], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.invariant:
            out = torch.ops.argosy_iq.q4_linear(
                x2.contiguous(),
                self.iq_codes,
                self.iq_scales,
                self.iq_mins,
                self.out_features,
                False,
                self.fine,
            )
        elif self.native and x2.shape[0] > 1:
            out = torch.ops.argosy_ext.q4_linear(
                x2.contiguous(), self.tiles, self.tile_scales, self.tile_mins, self.out_features
            )
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2, self.packed, GROUP_SIZE, self.scales_and_zeros
            )
        out = out.view(*shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


PACKED_BUFFERS = ("nib", "high", "scales", "scale_d", "mins", "min_d")


class Int8Linear(nn.Module):
    def __init__(
        self,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        invariant: bool = False,
        float_output: bool = False,
        weight_rows: Callable[[int, int], torch.Tensor] | None = None,
        blocks: BlockCodes | None = None,
        fine: bool = False,
    ) -> None:
        """`invariant`: the invariant kernels for every row count, where they build, with
        Q8_0-style scales per group of 32 (`q8_group_codes`; else int8 per output channel);
        `float_output`: then the result in float32 whatever `dtype` (an output head: logits
        kept in fp32 through log-softmax); `fine`: the invariant kernels take x in their fine
        form (15-bit codes, 1/128 of the 8-bit form's rounding error: csrc/iq_rows.h), for the
        layer whose rounding costs the most accuracy (the output head); `weight_rows(start, stop)`: the weight's rows as
        the file holds them (float32 from a GGUF: its own Q8_0 codes come back exactly), where
        `weight` may have been rounded to `dtype`; `blocks`: the weight's own codes (a GGUF
        block format), for the invariant kernels only (then `weight` may be None)."""
        super().__init__()
        if blocks is not None:
            assert invariant and invariant_qlinear(dtype), "a weight's own codes need the invariant kernels"
        if weight is not None:
            self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        else:
            assert blocks is not None
            self.out_features, self.in_features = int(blocks.codes.shape[0]), int(blocks.codes.shape[1])
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(dtype), requires_grad=False)
        self.invariant = (
            invariant and invariant_qlinear(dtype) and _native_shape_ok(self.out_features, self.in_features)
        )
        self.float_output = float_output and self.invariant
        self.fine = fine and self.invariant
        self.own_codes = blocks is not None  # a file's own codes, not a quantization of ours
        self.packed: PackedForm | None = None  # the codes held at their bits (kq_* buffers)
        if self.invariant:  # the one form, for every number of rows
            if blocks is None:
                assert weight is not None
                rows = weight_rows or (lambda start, stop: weight.detach()[start:stop])
                blocks = BlockCodes(*q8_group_codes(rows, self.out_features, self.in_features))
            self.code_lo, self.code_hi = code_range(blocks.codes)
            self.group = blocks.group
            self.native = False
            # at the file's bits where a kernel serves the form (csrc/iq_packed.cpp: the same bits)
            packed = PackedCodes.of(
                blocks.codes, blocks.scales, blocks.mins, blocks.super_scales, self.code_lo, self.code_hi
            )
            if packed is not None:
                self.packed = packed.form
                for name in PACKED_BUFFERS:
                    self.register_buffer(f"kq_{name}", getattr(packed, name))
                return
            iq_codes, iq_scales, iq_mins = invariant_q8_layout(blocks.codes, blocks.scales, blocks.mins)
            self.register_buffer("iq_codes", iq_codes)
            self.register_buffer("iq_scales", iq_scales)  # float16 where exact, else float32
            self.register_buffer("iq_mins", iq_mins)  # as the scales, or None
            return
        assert weight is not None
        codes = torch.empty(weight.shape, dtype=torch.int8)
        scales = torch.empty(self.out_features)
        # a few thousand rows at a time: a float32 copy of a whole output head (49k x 576)
        # would add ~340 MB of temporaries to the server's peak memory at load
        for start in range(0, self.out_features, 4096):
            w = weight.detach()[start : start + 4096].float()
            part = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
            codes[start : start + 4096] = torch.round(w / part[:, None]).clamp(-127, 127).to(torch.int8)
            scales[start : start + 4096] = part
        self.register_buffer("weight_int8", codes)
        self.register_buffer("scales", scales.to(dtype))
        self.native = native_qlinear(dtype) and _native_shape_ok(self.out_features, self.in_features)
        if self.native:
            self.register_buffer("tiles", q8_tiles(codes))
            self.register_buffer("tile_scales", scales)  # float32

    def first_outputs(self, n: int) -> Int8Linear:
        """This layer's first n outputs (a multiple of 16, the kernels' tile) as a layer of its
        own, on views of these buffers (no copy); for the invariant forms, whose buffers are
        held per tile of 16 outputs."""
        assert self.invariant and n % _TILE == 0 and 0 < n <= self.out_features
        part = copy.copy(self)
        part._parameters = {
            name: None if p is None else nn.Parameter(p[:n], requires_grad=False)
            for name, p in self._parameters.items()
        }
        part._buffers = {name: None if b is None else b[: n // _TILE] for name, b in self._buffers.items()}
        part._modules = dict(self._modules)
        part.out_features = n
        return part

    def _kq_linear(
        self, x2: torch.Tensor, swiglu: bool = False, add: torch.Tensor | None = None
    ) -> torch.Tensor:
        assert self.packed is not None
        out: torch.Tensor = torch.ops.argosy_iq.kq_linear(
            x2.contiguous(),
            self.kq_nib,
            self.kq_high,
            self.kq_scales,
            self.kq_scale_d,
            self.kq_mins,
            self.kq_min_d,
            self.packed.bits,
            self.packed.bias,
            self.out_features,
            self.float_output,
            self.fine,
            swiglu,
            add,
        )
        return out

    def swiglu(self, x: torch.Tensor) -> torch.Tensor | None:
        """SwiGLU of this gate_up projection's halves, computed with it (kq_linear's swiglu form:
        each gate tile beside its up tile, no [rows, 2I] tensor written and read again): the
        bits argosy_iq.swiglu gives on forward(x). None where the form does not serve (codes not
        held packed, a bias, x not float32)."""
        if self.packed is None or self.bias is not None or self.out_features % 32 or x.dtype != torch.float32:
            return None
        out = self._kq_linear(x.reshape(-1, self.in_features), swiglu=True)
        return out.view(*x.shape[:-1], self.out_features // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        added = False
        if self.packed is not None:
            # a float32 output takes the bias as the kernel stores it (the same bits as adding it after)
            added = self.bias is not None and (self.float_output or x2.dtype == torch.float32)
            out = self._kq_linear(x2, add=self.bias.float() if added and self.bias is not None else None)
        elif self.invariant:
            out = torch.ops.argosy_iq.q8_linear(
                x2.contiguous(),
                self.iq_codes,
                self.iq_scales,
                self.iq_mins,
                self.out_features,
                self.float_output,
                self.code_lo,
                self.code_hi,
                self.fine,
            )
        elif self.native and x2.shape[0] > 1:
            out = torch.ops.argosy_ext.q8_linear(
                x2.contiguous(), self.tiles, self.tile_scales, self.out_features
            )
        else:
            # x in the layer's dtype: torch's kernel takes one dtype, and the invariant mode's
            # float32 stream reaches a layer its kernels could not take (a 300-row head)
            scales = cast(torch.Tensor, self.scales)
            out = torch.ops.aten._weight_int8pack_mm(x2.to(scales.dtype), self.weight_int8, scales)
        out = out.view(*shape[:-1], self.out_features)
        return out if self.bias is None or added else out + self.bias


def packed_bits(blocks: BlockCodes) -> int:
    """The bits a weight's codes are held at: 4, 5 or 6 where a packed kernel serves its form
    (PackedCodes), else 8."""
    lo, hi = code_range(blocks.codes)
    form_name = scale_form(blocks.scales, blocks.mins, blocks.super_scales)
    form = packed_form(lo, hi, GROUP_SIZE // blocks.group, blocks.mins is not None, form_name)
    return 8 if form is None else form.bits


class CodesEmbedding(nn.Module):
    """A tied embedding read from its output head's invariant codes (or an untied one from its
    own, `owned`), int8 or packed: row n is
    s[n, k / G] * q[n, k] (+ m[n, k / 32]) in float32, as the gguf package dequantizes a GGUF
    block format, so the table's tokens come out as the file holds them (a bf16 table rounds
    them to 8 bits), and the float copy of the table goes (57 MB for SmolLM2). Only where the
    codes give the weights back exactly (`codes_are_exact`)."""

    def __init__(self, head: Int8Linear, owned: bool = False) -> None:
        """`owned`: the codes are the table's own (an untied embedding's), not a head's."""
        super().__init__()
        assert head.invariant
        self.head = [head]  # not a submodule: the head owns the buffers
        if owned:
            self.table = head
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        head = self.head[0]
        if head.packed is not None:
            buffers = (getattr(head, f"kq_{name}") for name in PACKED_BUFFERS)
            rows = PackedCodes(head.packed, *buffers).values(input_ids.reshape(-1))
            return rows.reshape(*input_ids.shape, self.embedding_dim)
        all_codes, all_scales = cast(torch.Tensor, head.iq_codes), cast(torch.Tensor, head.iq_scales)
        ids, k, group = input_ids.reshape(-1), self.embedding_dim, head.group
        tile, lane = ids // _TILE, ids % _TILE
        codes = all_codes[tile, :, lane, :].reshape(-1, k // group, group)
        rows = codes.float() * all_scales[tile, :, lane].float()[..., None]
        if head.iq_mins is not None:
            mins = cast(torch.Tensor, head.iq_mins)[tile, :, lane].float()
            rows = rows.reshape(-1, k // GROUP_SIZE, GROUP_SIZE) + mins[..., None]
        return rows.reshape(*input_ids.shape, k)


def codes_are_exact(head: Int8Linear, weight_rows: Callable[[int, int], torch.Tensor]) -> bool:
    """Whether the head's codes times its scales equal its weights as the file holds them."""
    embedding = CodesEmbedding(head)
    for start in range(0, head.out_features, 4096):
        stop = min(start + 4096, head.out_features)
        if not torch.equal(embedding(torch.arange(start, stop)), weight_rows(start, stop).float()):
            return False
    return True
