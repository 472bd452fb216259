"""Quantize-on-write: Triton kernels that write a cache store's rows straight from f32 K/V.

One program per head vector (b, t, h): it reads D f32 values and writes the row at position
pos + t of `data[layer]` (B, Hkv, n_ctx, row_bytes) uint8 in ggml's block layout
(ggml-common.h), or (B, Hkv, n_ctx, D) for the dense types. A block of 32 is handled as two
halves of 16 (elements j and j + 16 share a byte: ggml's nibble order). q4_hadamard's scale
search writes one code per element and the block scales (`quantize_codes`); the store packs
them into its tiles, where positions share bytes (a per-vector program would race on them);
tq4/tq3/tq2's scale search likewise (`quantize_tq`), the store packing its b-bit rows.

The launchers take tensors and a store's layout record (`kvcli.kernels.layout.KernelLayout`, read
by attribute: kind, block_bytes and field offsets, table): this package imports nothing from kvcli.
References, in the library: the stores' own PyTorch quantizers, reached through
`kvcli.cache.ggml_blocks.quantize_reference`, `kvcli.cache.hadamard.quantize_vectors` and
`kvcli.cache.turbo.search_scales`.
The kernels mirror their f32 arithmetic op for op (IEEE division via `div_rn`, no FMA
contraction on GPU: launched with enable_fp_fusion=False), so ggml types are byte-exact. q4_hadamard's scale is a least-squares refit whose 32-term sums torch orders
its own way: codes can differ on rare blocks where the f32 sum rounds across a bf16 boundary;
the squared error matches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# KIND codes (kvcli/kernels/layout.py): 0-2 dense f32/f16/bf16, 3 q8_0, 4 q4_0, 5 q4_1, 6 q5_0,
# 7 q5_1, 8 iq4_nl, 9 q4_hadamard (codes and scales; 10, its value tiles, only for reading),
# 11 / 12 tq keys / values (quantize_tq)
DENSE_KINDS = (0, 1, 2)
HADAMARD = 9

_tables: dict[tuple[tuple[float, ...], torch.device], torch.Tensor] = {}


def table(values: tuple[float, ...], device) -> torch.Tensor:
    """A layout's constant table (iq4_nl codebook, q4_hadamard scale grid) as f32 on `device`, cached;
    a one-element dummy where the layout has none (the kernels take a pointer either way)."""
    key = (values or (0.0,), torch.device(device))
    if key not in _tables:
        _tables[key] = torch.tensor(key[0], dtype=torch.float32, device=device)
    return _tables[key]


@triton.jit
def _div(a, b):
    """IEEE-rounded a / b of two equal-shaped f32 tensors (div_rn neither broadcasts nor takes floats)."""
    return tl.math.div_rn(a, b)


@triton.jit
def _div_c(a, c: tl.constexpr):
    """IEEE-rounded a / c for a constant c."""
    return tl.math.div_rn(a, tl.full(a.shape, c, tl.float32))


@triton.jit
def _inverse(d):
    """ggml's `id = d ? 1.0f/d : 0.0f` (the zero lanes divide by 1, not 0)."""
    return tl.where(d == 0.0, 0.0, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), tl.where(d == 0.0, 1.0, d)))


@triton.jit
def _rne(v):
    """Round half to even (torch.round) for |v| < 2^22: floor(v + 0.5), minus 1 on odd ties."""
    r = tl.floor(v + 0.5)
    odd_tie = ((r - v) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) == 1.0)
    return tl.where(odd_tie, r - 1.0, r)


@triton.jit
def _bf16_rne(v):
    """v rounded to the nearest bf16, ties to even (torch's f32 -> bf16), kept as f32."""
    u = v.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _round_away(v):
    """(int)roundf(v), halves away from zero: trunc(v) + trunc(2 (v - trunc(v))), as the reference."""
    t = v.to(tl.int32).to(tl.float32)
    return t + (2.0 * (v - t)).to(tl.int32).to(tl.float32)


@triton.jit
def _iq4_index(al, cb_ptr):
    """best_index_int8: the bracketing codebook pair (bucketize, right=True), nearer wins, ties up."""
    count = tl.zeros(al.shape, dtype=tl.int32)
    for k in tl.static_range(16):
        count += (al >= tl.load(cb_ptr + k)).to(tl.int32)
    hi = tl.minimum(tl.maximum(count, 1), 15)
    lo = hi - 1
    return tl.where(al - tl.load(cb_ptr + lo) < tl.load(cb_ptr + hi) - al, lo, hi)


@triton.jit
def _quantize_kernel(x_ptr, sxb, sxt, sxh, dst_ptr, dst16_ptr, sdb, sdh, sdn, tab_ptr, pos, T, H,
                     KIND: tl.constexpr, NB: tl.constexpr, NBP: tl.constexpr, BB: tl.constexpr,
                     DO: tl.constexpr, MO: tl.constexpr, QH: tl.constexpr, QS: tl.constexpr, NG: tl.constexpr):
    """BB bytes per block; byte offsets DO of fp16 d, MO of fp16 m, QH of the fifth bits, QS of the
    nibbles (int8 values for q8_0). q4_hadamard (KIND 9) writes codes and f32 scales instead,
    trying the NG scales of its grid (tab_ptr)."""
    pid = tl.program_id(0)
    h = pid % H
    t = (pid // H) % T
    b = pid // (H * T)
    blk = tl.arange(0, NBP)  # (NBP,) blocks of the row
    j = tl.arange(0, 16)  # (16,) element of the half block
    bmask = blk < NB
    m2 = bmask[:, None]
    xrow = x_ptr + b.to(tl.int64) * sxb + t.to(tl.int64) * sxt + h.to(tl.int64) * sxh
    e_lo = blk[:, None] * 32 + j[None, :]  # (NBP, 16): elements j; e_lo + 16: elements j + 16
    x_lo = tl.load(xrow + e_lo, mask=m2, other=0.0)
    x_hi = tl.load(xrow + e_lo + 16, mask=m2, other=0.0)
    row = b.to(tl.int64) * sdb + h.to(tl.int64) * sdh + (pos + t).to(tl.int64) * sdn  # byte offset
    blk_at = row + blk * BB  # (NBP,) byte offset of each block
    amax = tl.maximum(tl.max(tl.abs(x_lo), 1), tl.max(tl.abs(x_hi), 1))  # (NBP,)
    if KIND == 3:  # q8_0: d = amax / 127, q = roundf(x / d)
        d = _div_c(amax, 127.0)
        idn = _inverse(d)[:, None]
        q_lo = _round_away(x_lo * idn).to(tl.int8)
        q_hi = _round_away(x_hi * idn).to(tl.int8)
        tl.store(dst16_ptr + (blk_at + DO) // 2, d.to(tl.float16), mask=bmask)
        tl.store(dst_ptr + blk_at[:, None] + QS + j[None, :], q_lo.to(tl.uint8, bitcast=True), mask=m2)
        tl.store(dst_ptr + blk_at[:, None] + QS + 16 + j[None, :], q_hi.to(tl.uint8, bitcast=True), mask=m2)
    elif KIND == 5 or KIND == 7:  # q4_1 / q5_1: d = (max - min) / (2^bits - 1), m = min
        lo = tl.minimum(tl.min(x_lo, 1), tl.min(x_hi, 1))
        hi = tl.maximum(tl.max(x_lo, 1), tl.max(x_hi, 1))
        QMAX: tl.constexpr = 15.0 if KIND == 5 else 31.0
        d = _div_c(hi - lo, QMAX)
        idn = _inverse(d)[:, None]
        q_lo = tl.minimum(tl.maximum((x_lo - lo[:, None]) * idn + 0.5, 0.0), QMAX).to(tl.uint8)
        q_hi = tl.minimum(tl.maximum((x_hi - lo[:, None]) * idn + 0.5, 0.0), QMAX).to(tl.uint8)
        tl.store(dst16_ptr + (blk_at + DO) // 2, d.to(tl.float16), mask=bmask)
        tl.store(dst16_ptr + (blk_at + MO) // 2, lo.to(tl.float16), mask=bmask)
        _store_q4_or_q5(dst_ptr, blk_at, j, q_lo, q_hi, bmask, QH, QS, KIND == 7)
    elif KIND == 8:  # iq4_nl: nearest codebook entry for x / (max / -127), then the weighted LSQ scale
        mx = _signed_absmax(x_lo, x_hi, amax, j)
        live = tl.abs(mx) >= 1e-15
        inv = tl.where(live, _inverse(_div_c(tl.where(live, mx, 1.0), -127.0)), 0.0)
        i_lo = _iq4_index(x_lo * inv[:, None], tab_ptr)  # (NBP, 16) codebook indices
        i_hi = _iq4_index(x_hi * inv[:, None], tab_ptr)
        v_lo = tl.load(tab_ptr + i_lo)
        v_hi = tl.load(tab_ptr + i_hi)
        wq_lo = (x_lo * x_lo) * v_lo  # weight w = x^2; C evaluates w*q*x as (w*q)*x
        wq_hi = (x_hi * x_hi) * v_hi
        sumqx = tl.zeros([NBP], dtype=tl.float32)
        sumq2 = tl.zeros([NBP], dtype=tl.float32)
        for half in tl.static_range(2):  # ggml's f32 sums in element order: pick term jj (a sum of one)
            for jj in tl.static_range(16):
                wq = wq_lo if half == 0 else wq_hi
                xv = x_lo if half == 0 else x_hi
                vv = v_lo if half == 0 else v_hi
                sel = j[None, :] == jj
                sumqx = sumqx + tl.sum(tl.where(sel, wq * xv, 0.0), 1)
                sumq2 = sumq2 + tl.sum(tl.where(sel, wq * vv, 0.0), 1)
        d = tl.where(live & (sumq2 > 0.0), _div(sumqx, tl.where(sumq2 > 0.0, sumq2, 1.0)), 0.0)
        i_lo = tl.where(live[:, None], i_lo, 0).to(tl.uint8)
        i_hi = tl.where(live[:, None], i_hi, 0).to(tl.uint8)
        tl.store(dst16_ptr + (blk_at + DO) // 2, d.to(tl.float16), mask=bmask)
        tl.store(dst_ptr + blk_at[:, None] + QS + j[None, :], i_lo | (i_hi << 4), mask=m2)
    elif KIND == 9:  # q4_hadamard: scales g * max / -8 over a grid, refit by least squares, kept as bf16
        # dst: codes (B, H, T, D) uint8, one per element; dst16: scales (B, H, T, D / 32) f32 (bf16 values)
        best_err = tl.full([NBP], float("inf"), tl.float32)
        best_g = tl.zeros([NBP], dtype=tl.float32)
        best_d = tl.zeros([NBP], dtype=tl.float32)
        mx = _signed_absmax(x_lo, x_hi, amax, j)
        for s in tl.static_range(NG):
            g = tl.load(tab_ptr + s)
            d0 = (mx * g) / -8.0
            dd = tl.broadcast_to(tl.where(d0 == 0.0, 1.0, d0)[:, None], [NBP, 16])
            q_lo = tl.minimum(tl.maximum(_rne(_div(x_lo, dd)), -8.0), 7.0)
            q_hi = tl.minimum(tl.maximum(_rne(_div(x_hi, dd)), -8.0), 7.0)
            num = tl.sum(q_lo * x_lo, 1) + tl.sum(q_hi * x_hi, 1)
            den = tl.maximum(tl.sum(q_lo * q_lo, 1) + tl.sum(q_hi * q_hi, 1), 1e-30)
            d = _bf16_rne(_div(num, den))
            r_lo = x_lo - d[:, None] * q_lo
            r_hi = x_hi - d[:, None] * q_hi
            err = tl.sum(r_lo * r_lo, 1) + tl.sum(r_hi * r_hi, 1)
            better = err < best_err  # argmin: the first candidate on ties
            best_err = tl.where(better, err, best_err)
            best_g = tl.where(better, g, best_g)
            best_d = tl.where(better, d, best_d)
        d0 = (mx * best_g) / -8.0
        dd = tl.broadcast_to(tl.where(d0 == 0.0, 1.0, d0)[:, None], [NBP, 16])
        q_lo = (tl.minimum(tl.maximum(_rne(_div(x_lo, dd)), -8.0), 7.0) + 8.0).to(tl.uint8)
        q_hi = (tl.minimum(tl.maximum(_rne(_div(x_hi, dd)), -8.0), 7.0) + 8.0).to(tl.uint8)
        tl.store(dst16_ptr + blk_at // 32, best_d, mask=bmask)
        tl.store(dst_ptr + blk_at[:, None] + j[None, :], q_lo, mask=m2)
        tl.store(dst_ptr + blk_at[:, None] + 16 + j[None, :], q_hi, mask=m2)
    else:  # q4_0 (KIND 4) / q5_0 (KIND 6): d = signed absmax / -2^(bits-1), q = x / d + 2^(bits-1) + 0.5
        mx = _signed_absmax(x_lo, x_hi, amax, j)
        HALF: tl.constexpr = 8.0 if KIND == 4 else 16.0
        d = _div_c(mx, -HALF)
        idn = _inverse(d)[:, None]
        q_lo = tl.minimum(tl.maximum(x_lo * idn + (HALF + 0.5), 0.0), 2.0 * HALF - 1.0).to(tl.uint8)
        q_hi = tl.minimum(tl.maximum(x_hi * idn + (HALF + 0.5), 0.0), 2.0 * HALF - 1.0).to(tl.uint8)
        tl.store(dst16_ptr + (blk_at + DO) // 2, d.to(tl.float16), mask=bmask)
        _store_q4_or_q5(dst_ptr, blk_at, j, q_lo, q_hi, bmask, QH, QS, KIND == 6)


@triton.jit
def _signed_absmax(x_lo, x_hi, amax, j):
    """(NBP,) the value of largest magnitude with its sign, the first one on ties (torch argmax)."""
    big = 99
    first = tl.minimum(tl.min(tl.where(tl.abs(x_lo) == amax[:, None], j[None, :], big), 1),
                       tl.min(tl.where(tl.abs(x_hi) == amax[:, None], j[None, :] + 16, big), 1))
    neg_inf = float("-inf")
    return tl.maximum(tl.max(tl.where(j[None, :] == first[:, None], x_lo, neg_inf), 1),
                      tl.max(tl.where(j[None, :] + 16 == first[:, None], x_hi, neg_inf), 1))


@triton.jit
def _store_q4_or_q5(dst_ptr, blk_at, j, q_lo, q_hi, bmask, QH: tl.constexpr, QS: tl.constexpr, HIGH: tl.constexpr):
    """Nibbles at byte QS (and for q5 the 4 qh bytes at QH: bit k of the LE uint32 = bit 4 of element k)."""
    m2 = bmask[:, None]
    if HIGH:
        b_lo = ((q_lo >> 4) & 1).to(tl.int32)
        b_hi = ((q_hi >> 4) & 1).to(tl.int32)
        jj = j[None, :]
        qh0 = tl.sum(tl.where(jj < 8, b_lo << jj, 0), 1)
        qh1 = tl.sum(tl.where(jj >= 8, b_lo << (jj - 8), 0), 1)
        qh2 = tl.sum(tl.where(jj < 8, b_hi << jj, 0), 1)
        qh3 = tl.sum(tl.where(jj >= 8, b_hi << (jj - 8), 0), 1)
        tl.store(dst_ptr + blk_at + QH, qh0.to(tl.uint8), mask=bmask)
        tl.store(dst_ptr + blk_at + QH + 1, qh1.to(tl.uint8), mask=bmask)
        tl.store(dst_ptr + blk_at + QH + 2, qh2.to(tl.uint8), mask=bmask)
        tl.store(dst_ptr + blk_at + QH + 3, qh3.to(tl.uint8), mask=bmask)
        tl.store(dst_ptr + blk_at[:, None] + QS + j[None, :], (q_lo & 15) | ((q_hi & 15) << 4), mask=m2)
    else:
        tl.store(dst_ptr + blk_at[:, None] + QS + j[None, :], q_lo | (q_hi << 4), mask=m2)


@triton.jit
def _store_dense_kernel(x_ptr, sxb, sxt, sxh, dst_ptr, sdb, sdh, sdn, pos, T, H, D: tl.constexpr,
                        DP: tl.constexpr, IS_BF16: tl.constexpr):
    pid = tl.program_id(0)
    h = pid % H
    t = (pid // H) % T
    b = pid // (H * T)
    e = tl.arange(0, DP)
    x = tl.load(x_ptr + b.to(tl.int64) * sxb + t.to(tl.int64) * sxt + h.to(tl.int64) * sxh + e, mask=e < D)
    row = b.to(tl.int64) * sdb + h.to(tl.int64) * sdh + (pos + t).to(tl.int64) * sdn
    if IS_BF16:  # round to nearest even by hand: the interpreter's f32 -> bf16 cast truncates
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        tl.store(dst_ptr + row + e, u.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=e < D)
    else:
        tl.store(dst_ptr + row + e, x.to(dst_ptr.dtype.element_ty), mask=e < D)


@triton.jit
def _tq_search(y, steps_ptr, lev_ptr, mid_ptr, NBP: tl.constexpr, BS: tl.constexpr, NG: tl.constexpr,
               NL: tl.constexpr, SIGNED: tl.constexpr, UNIFORM: tl.constexpr):
    """tq's scale search (kvcli.cache.turbo.search_scales) over blocks y (NBP, BS) -> codes (NBP, BS) int32 and
    scales (NBP,) f32 holding bf16 values: candidates d = step * m for the NG steps (m: max|y|, or SIGNED the
    block's largest element with its sign), codes for y / d (UNIFORM: round(y / d - L[0]), else the nearest
    of the NL levels by their midpoints), the least-squares scale for those codes rounded to bf16, the
    candidate of least squared error."""
    j = tl.arange(0, BS)
    amax = tl.max(tl.abs(y), 1)  # (NBP,)
    if SIGNED:  # the first element of largest magnitude (torch's argmax), with its sign
        first = tl.min(tl.where(tl.abs(y) == amax[:, None], j[None, :], BS), 1)
        m = tl.max(tl.where(j[None, :] == first[:, None], y, float("-inf")), 1)
    else:
        m = tl.maximum(amax, 1e-30)
    lo = tl.load(lev_ptr)
    best_err = tl.full([NBP], float("inf"), tl.float32)
    best_d = tl.zeros([NBP], dtype=tl.float32)
    best_u = tl.zeros([NBP, BS], dtype=tl.int32)
    for s in tl.static_range(NG):
        c = tl.load(steps_ptr + s) * m  # (NBP,) the candidate scale
        if SIGNED:
            c = tl.where(c == 0.0, 1.0, c)  # m = 0: y is 0 too
        z = _div(y, tl.broadcast_to(c[:, None], [NBP, BS]))
        if UNIFORM:  # levels L[0] + u: the nearest by rounding
            u = tl.minimum(tl.maximum(_rne(z - lo), 0.0), NL - 1.0)
            q = u + lo
            u = u.to(tl.int32)
        else:  # torch.bucketize over the midpoints: the count of midpoints below z
            u = tl.zeros([NBP, BS], dtype=tl.int32)
            for k in tl.static_range(NL - 1):
                u += (z > tl.load(mid_ptr + k)).to(tl.int32)
            q = tl.load(lev_ptr + u)
        qy = tl.sum(q * y, 1)
        qq = tl.maximum(tl.sum(q * q, 1), 1e-30)
        d = _bf16_rne(_div(qy, qq))  # the least-squares scale, as stored
        err = (d * qq - 2.0 * qy) * d  # |y - d q|^2 - |y|^2
        better = err < best_err  # argmin: the first candidate on ties
        best_err = tl.where(better, err, best_err)
        best_d = tl.where(better, d, best_d)
        best_u = tl.where(better[:, None], u, best_u)
    return best_u, best_d


@triton.jit
def _tq_codes_kernel(y_ptr, syb, syt, syh, u_ptr, d_ptr, steps_ptr, lev_ptr, mid_ptr, T, H,
                     NB: tl.constexpr, NBP: tl.constexpr, BS: tl.constexpr, NG: tl.constexpr, NL: tl.constexpr,
                     SIGNED: tl.constexpr, UNIFORM: tl.constexpr):
    """_tq_search, one program per vector (b, t, h) of NB blocks of BS. Writes codes u (B, T, H, D) uint8 and
    scales d (B, T, H, NB) f32 holding bf16 values, both contiguous."""
    pid = tl.program_id(0)
    h = pid % H
    t = (pid // H) % T
    b = pid // (H * T)
    blk = tl.arange(0, NBP)
    bmask = blk < NB
    m2 = bmask[:, None]
    e = blk[:, None] * BS + tl.arange(0, BS)[None, :]  # (NBP, BS)
    y = tl.load(y_ptr + b.to(tl.int64) * syb + t.to(tl.int64) * syt + h.to(tl.int64) * syh + e, mask=m2, other=0.0)
    u, d = _tq_search(y, steps_ptr, lev_ptr, mid_ptr, NBP, BS, NG, NL, SIGNED, UNIFORM)
    row = (b.to(tl.int64) * T + t) * H + h  # (B, T, H) row of the outputs
    tl.store(u_ptr + row * (NB * BS) + e, u.to(tl.uint8), mask=m2)
    tl.store(d_ptr + row * NB + blk, d, mask=bmask)


def _unit_stride_f32(x: torch.Tensor) -> torch.Tensor:
    """x as f32 with unit stride along the head dimension (the kernels index it so)."""
    x = x.float()
    return x if x.stride(-1) == 1 else x.contiguous()


def quantize_into(layout, x: torch.Tensor, dst: torch.Tensor, pos: int) -> None:
    """x (B, T, Hkv, D) f32 -> rows pos..pos+T-1 of dst (B, Hkv, n_ctx, row_bytes or D), in place.

    dst is a store's `data[layer]` of a dense or ggml block type; layout its KernelLayout.
    """
    B, T, H, D = x.shape
    x = _unit_stride_f32(x)
    assert dst.stride(-1) == 1 and dst.shape[0] == B and dst.shape[1] == H and pos + T <= dst.shape[2]
    grid = (B * T * H,)
    if layout.kind in DENSE_KINDS:
        _store_dense_kernel[grid](x, x.stride(0), x.stride(1), x.stride(2), dst, *dst.stride()[:3], pos, T, H,
                                  D=D, DP=triton.next_power_of_2(D), IS_BF16=layout.kind == 2)
        return
    assert layout.kind != HADAMARD, "q4_hadamard writes codes and scales: quantize_codes"
    nb, bb = D // 32, layout.block_bytes
    assert D % 32 == 0 and dst.shape[-1] == nb * bb and dst.stride(2) % 2 == 0
    # a fp16 view of the same bytes: every fp16 field sits at an even byte offset (block bytes are even)
    dst16 = dst.view(torch.float16)
    _quantize_kernel[grid](x, x.stride(0), x.stride(1), x.stride(2), dst, dst16, *dst.stride()[:3],
                           table(layout.table, x.device), pos, T, H,
                           KIND=layout.kind, NB=nb, NBP=triton.next_power_of_2(nb), BB=bb, DO=layout.d_offset,
                           MO=layout.m_offset, QH=layout.qh_offset, QS=layout.qs_offset, NG=0,
                           enable_fp_fusion=False)  # no FMA contraction: the reference rounds each op


def quantize_codes(layout, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_hadamard's scale search over layout.table: y (B, T, H, D) f32 -> codes (B, T, H, D) uint8
    (0..15) and scales (B, T, H, D / 32) f32 (bf16 values); the store lays them out (HadamardQ4Store.put)."""
    B, T, H, D = y.shape
    y = _unit_stride_f32(y)
    nb = D // 32
    codes = torch.empty(B, H, T, D, dtype=torch.uint8, device=y.device)
    scales = torch.empty(B, H, T, nb, dtype=torch.float32, device=y.device)
    _quantize_kernel[(B * T * H,)](y, y.stride(0), y.stride(1), y.stride(2), codes, scales, *codes.stride()[:3],
                                   table(layout.table, y.device), 0, T, H, KIND=HADAMARD, NB=nb,
                                   NBP=triton.next_power_of_2(nb), BB=32, DO=0, MO=0, QH=0, QS=0,
                                   NG=len(layout.table),
                                   enable_fp_fusion=False)
    return codes.transpose(1, 2), scales.transpose(1, 2)


def quantize_tq(layout, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tq's scale search (layout.steps over the codebook layout.table): y (B, T, H, D) f32 -> codes (B, T, H, D)
    uint8 (indices into the codebook) and scales (B, T, H, D / scale_block) f32 holding bf16 values; the store
    packs them into its b-bit rows (TurboStore.put: positions share bytes, a per-vector program would race)."""
    B, T, H, D = y.shape
    y = _unit_stride_f32(y)
    bs = layout.scale_block
    nb = D // bs
    steps, levels, mids, uniform = _codebook(layout, y.device)
    codes = torch.empty(B, T, H, D, dtype=torch.uint8, device=y.device)
    scales = torch.empty(B, T, H, nb, dtype=torch.float32, device=y.device)
    _tq_codes_kernel[(B * T * H,)](y, y.stride(0), y.stride(1), y.stride(2), codes, scales, steps, levels, mids,
                                   T, H, NB=nb, NBP=triton.next_power_of_2(nb), BS=bs, NG=len(layout.steps),
                                   NL=len(layout.table), SIGNED=layout.signed, UNIFORM=uniform,
                                   enable_fp_fusion=False)  # no FMA contraction: the reference rounds each op
    return codes, scales


def _codebook(layout, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """A tq layout's scale candidates, levels and level midpoints (f32, as the reference makes them) as
    tables on device, and whether the levels are a uniform grid L[0] + u."""
    levels = layout.table
    lv = torch.tensor(levels, dtype=torch.float32)
    mids = tuple(((lv[1:] + lv[:-1]) / 2).tolist())
    uniform = all(v - levels[0] == u for u, v in enumerate(levels))
    return table(layout.steps, device), table(levels, device), table(mids, device), uniform
