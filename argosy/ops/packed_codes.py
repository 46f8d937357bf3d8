"""A GGUF block format's codes held at the file's bits (csrc/iq_packed.cpp, argosy_iq::kq_linear).

A weight's int8 codes q (BlockCodes) are held as unsigned codes u = q + bias of 4, 5 or 6 bits:
the low 4 bits as iq_linear's Q4 layout (`nib`), the rest in bit planes (`high`), and its scales
in the file's own form: float16 where the format has them so (Q5_0, Q5_1), else the K-quants'
integer per weight group times a float16 per 256 weights (`SuperScales`). The kernel computes
exactly what q8_linear computes from the int8 codes and float32 scales (the same bits), reading
Q4_K at 4.6 bits a weight (file: 4.5), Q5_K / Q5_0 at 5.5 (file: 5.5), Q6_K at 6.6 (file: 6.6),
where the int8 form read 9-10.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZE = 32  # weights per scale (and minimum): a GGUF Q4/Q8 block
TILE = 16  # outputs a tile of the kernels' layouts


@dataclass
class SuperScales:
    """A K-quant's own scales: s = d * sc per weight group (G = 32 or 16) and, where the format
    has minimums, m = -(dmin * mn) per 32, d and dmin per 256 weights (exact in float32: the
    gguf package's products)."""

    sc: torch.Tensor  # uint8 (Q4_K, Q5_K) or int8 (Q6_K) [N, K/G]
    d: torch.Tensor  # float16 [N, K/256]
    mn: torch.Tensor | None = None  # uint8 [N, K/32]
    dmin: torch.Tensor | None = None  # float16 [N, K/256]

    @staticmethod
    def cat(parts: list[SuperScales]) -> SuperScales:
        def joined(arrays: list[torch.Tensor | None]) -> torch.Tensor | None:
            return None if any(a is None for a in arrays) else torch.cat(arrays)  # type: ignore[arg-type]

        sc, d = joined([p.sc for p in parts]), joined([p.d for p in parts])
        assert sc is not None and d is not None
        return SuperScales(sc, d, joined([p.mn for p in parts]), joined([p.dmin for p in parts]))


# the forms kq_linear has kernels for: (bits, weight groups to 32, minimums, scale form)
_KERNELS = {
    (4, 1, True, "u8"),  # Q4_K (and a Q5_K whose codes fit 4 bits)
    (5, 1, True, "u8"),  # Q5_K
    (6, 2, False, "i8"),  # Q6_K
    (5, 1, False, "half"),  # Q5_0
    (5, 1, True, "half"),  # Q5_1
}


@dataclass
class PackedForm:
    bits: int
    bias: int


def packed_form(
    code_lo: int, code_hi: int, h: int, has_mins: bool, scale_form: str | None
) -> PackedForm | None:
    """The fewest bits kq_linear serves for codes in [code_lo, code_hi] with this scale form
    ("half", "u8" or "i8"; None: float32 scales, which only the int8 form takes), or None."""
    if scale_form is None:
        return None
    bias = max(0, -code_lo)
    span = code_hi + bias
    for bits in (4, 5, 6):
        if span < (1 << bits) and (bits, h, has_mins, scale_form) in _KERNELS:
            return PackedForm(bits, bias)
    return None


def pack_planes(codes: torch.Tensor, form: PackedForm) -> tuple[torch.Tensor, torch.Tensor | None]:
    """int8 codes [N, K] -> (nib uint8 [N/16, K/32, 4, 16, 4], high uint8 [N/16, K/32, (bits-4)*64]
    or None), csrc/iq_packed.cpp's layout, a few thousand rows at a time (the temporaries of a
    whole 151k-row output head would take GBs)."""
    n, k = codes.shape
    groups = k // GROUP_SIZE
    nib = torch.empty(n // TILE, groups, 4, TILE, 4, dtype=torch.uint8)
    high = None if form.bits == 4 else torch.empty(n // TILE, groups, (form.bits - 4) * 64, dtype=torch.uint8)
    step = 4096
    for start in range(0, n, step):
        stop = min(n, start + step)
        tiles = slice(start // TILE, stop // TILE)
        u = (codes[start:stop].to(torch.int16) + form.bias).to(torch.uint8)
        t = (stop - start) // TILE
        low = (u & 0x0F).view(t, TILE, groups, 4, 2, 4)  # [t, i, g, c, half, b]
        nib[tiles] = (low[..., 0, :] | (low[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)
        if high is None:
            continue
        top = (u >> 4).view(t, TILE, groups, 8, 4).permute(0, 2, 3, 1, 4)  # [t, g, e, i, b]
        if form.bits == 5:  # bit e of byte [t, g, i, b]: line e's bit 4
            planes = torch.zeros(t, groups, TILE, 4, dtype=torch.uint8)
            for e in range(8):
                planes |= top[:, :, e] << e
        else:  # bits 2j, 2j+1 of byte [t, g, p, i, b]: line 4p + j's bits 4 and 5
            planes = torch.zeros(t, groups, 2, TILE, 4, dtype=torch.uint8)
            for e in range(8):
                planes[:, :, e // 4] |= top[:, :, e] << (2 * (e % 4))
        high[tiles] = planes.reshape(t, groups, -1)
    return nib, high


def per_tile(values: torch.Tensor) -> torch.Tensor:
    """[N, X] -> [N/16, X, 16]: the kernels' per-tile layout of per-row values."""
    n = values.shape[0]
    return values.reshape(n // TILE, TILE, -1).transpose(1, 2).contiguous()


def unpack_rows(
    nib: torch.Tensor, high: torch.Tensor | None, form: PackedForm, rows: torch.Tensor
) -> torch.Tensor:
    """The int8 codes [len(rows), K] of the given output rows (an embedding read from a tied
    head's packed codes)."""
    tile, lane = rows // TILE, rows % TILE
    bytes_ = nib[tile, :, :, lane, :]  # [n, G, 4 c, 4 b]
    u = torch.stack([bytes_ & 0x0F, bytes_ >> 4], dim=3)  # [n, G, c, half, b]: line e = 2c + half
    count, groups = u.shape[0], u.shape[1]
    u = u.reshape(count, groups, 8, 4)
    if high is not None:
        planes = high.view(high.shape[0], groups, form.bits - 4, TILE, 4)[tile, :, :, lane, :]  # [n, G, p, b]
        if form.bits == 5:
            top = torch.stack([(planes[:, :, 0] >> e) & 1 for e in range(8)], dim=2)
        else:
            top = torch.stack([(planes[:, :, e // 4] >> (2 * (e % 4))) & 3 for e in range(8)], dim=2)
        u = u | (top << 4)
    return (u.reshape(count, groups * GROUP_SIZE).to(torch.int16) - form.bias).to(torch.int8)


def exactly_half(t: torch.Tensor) -> bool:
    as_float = t.float()
    return bool(torch.equal(as_float.half().float(), as_float))


def scale_form(
    scales: torch.Tensor, mins: torch.Tensor | None, super_scales: SuperScales | None
) -> str | None:
    """The form a weight's scales are held in: a K-quant's own ("u8", "i8"), float16 where
    every scale (and min) is one ("half"), else None (float32: the int8 form only)."""
    if super_scales is not None:
        return "u8" if super_scales.sc.dtype == torch.uint8 else "i8"
    return "half" if exactly_half(scales) and (mins is None or exactly_half(mins)) else None


@dataclass
class PackedCodes:
    """A weight in kq_linear's form: its planes and its scales per tile (`of`)."""

    form: PackedForm
    nib: torch.Tensor
    high: torch.Tensor | None
    scales: torch.Tensor  # float16, or uint8 / int8 with scale_d
    scale_d: torch.Tensor | None
    mins: torch.Tensor | None
    min_d: torch.Tensor | None

    @staticmethod
    def of(
        codes: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None,
        super_scales: SuperScales | None,
        code_lo: int,
        code_hi: int,
    ) -> PackedCodes | None:
        """The packed form of a weight's int8 codes [N, K] and float32 scales [N, K/G] (mins
        [N, K/32]), in the K-quants' own scales where given; None where no kernel serves it
        (Q8_0's full range, float32 scales that are not a K-quant's)."""
        n, k = codes.shape
        h = GROUP_SIZE * scales.shape[1] // k
        form = packed_form(code_lo, code_hi, h, mins is not None, scale_form(scales, mins, super_scales))
        if form is None or n % TILE or k % GROUP_SIZE or (super_scales is not None and k % 256):
            return None
        nib, high = pack_planes(codes, form)
        if super_scales is None:
            return PackedCodes(
                form,
                nib,
                high,
                per_tile(scales.half()),
                None,
                None if mins is None else per_tile(mins.half()),
                None,
            )
        s = super_scales
        with_mins = mins is not None and s.mn is not None and s.dmin is not None
        return PackedCodes(
            form,
            nib,
            high,
            per_tile(s.sc),
            per_tile(s.d.half()),
            per_tile(s.mn) if with_mins and s.mn is not None else None,
            per_tile(s.dmin.half()) if with_mins and s.dmin is not None else None,
        )

    def linear(
        self,
        x: torch.Tensor,
        out_features: int,
        out_float32: bool,
        fine: bool = False,
        swiglu: bool = False,
        add: torch.Tensor | None = None,
    ) -> torch.Tensor:
        out: torch.Tensor = torch.ops.argosy_iq.kq_linear(
            x,
            self.nib,
            self.high,
            self.scales,
            self.scale_d,
            self.mins,
            self.min_d,
            self.form.bits,
            self.form.bias,
            out_features,
            out_float32,
            fine,
            swiglu,
            add,
        )
        return out

    def values(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 [len(rows), K]: the weights of these output rows, s * q (+ m), as the gguf
        package dequantizes them (a tied embedding read from its head)."""
        codes = unpack_rows(self.nib, self.high, self.form, rows).float()
        count, k = codes.shape
        tile, lane = rows // TILE, rows % TILE

        def row_values(values: torch.Tensor, d: torch.Tensor | None, negate: bool) -> torch.Tensor:
            v = values[tile, :, lane].float()  # [n, groups]
            if d is None:
                return v
            per_super = values.shape[1] // d.shape[1]
            product = d[tile, :, lane].float().repeat_interleave(per_super, dim=1) * v
            return -product if negate else product

        scales = row_values(self.scales, self.scale_d, False)
        out = codes.view(count, scales.shape[1], -1) * scales[..., None]
        if self.mins is not None:
            mins = row_values(self.mins, self.min_d, True)
            out = out.view(count, k // GROUP_SIZE, GROUP_SIZE) + mins[..., None]
        return out.reshape(count, k)
