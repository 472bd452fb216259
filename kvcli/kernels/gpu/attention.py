"""Attention over the packed cache: flash-decoding (T = 1) and prefill (T > 1) Triton kernels.

One kernel serves both. A program owns one (batch, KV head), a block of BLOCK_M query rows of
that head's group and one split of the key positions; rows are r = t * G + g (G query heads
per KV head, GQA without repeating K/V), row r sits at position pos + r // G and sees keys
j <= pos + r // G. K and V tiles (BLOCK_N positions x D) are read as stored, packed ggml
blocks or dense f16/bf16/f32, dequantized in registers, and folded into an online softmax
(FlashAttention's recurrence, base 2). Decode splits the positions across programs
(flash-decoding) and a second kernel merges the splits' (max, sum, output); prefill uses one
split. Each store comes as its tensors and its layout record (`StoreTensors`; the record is
kvcli.kernels.layout.KernelLayout, read by attribute): the KIND, block bytes and field offsets
are constexprs. q4_hadamard: q arrives rotated (the caller maps it into K's space and the
output back out of V's), the codes are read from the store's int4 tiles of TILE positions
(keys) or elements (values) with its bf16 scales, the first NSINK positions from the f16 sink
tensor, and the per-head offset is added after dequantization. tq4/tq3/tq2 likewise, their b-bit codes
unpacked from pack_rows' rows in registers (kvcli/cache/turbo.py) and looked up in the codebook table.
With a recent window (kvcli/cache/window.py) the row at position i reads the store below
max(i - N + 1, window start) and the window's f32 K/V (the caller maps them into the stores' spaces)
from there to i, as kvcli.attention.attend_reference with a Recent; decode's last split reads the window.

This package imports nothing from kvcli. Reference: `kvcli.attention.attend_reference`, the
library's PyTorch path (kvcli.attention.attend_triton launches this with a cache's tensors).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .quantize import DENSE_KINDS, table

LOG2E = 1.4426950408889634


class StoreTensors(NamedTuple):
    """One layer of a K or V store, as the kernel reads it. data: (B, Hkv, n_ctx, D or row bytes),
    or a rotated type's codes (B, Hkv, tiles...); rotated types (q4_hadamard, tq) only: scale
    (B, Hkv, D / block, n_pad) bf16, sink (B, Hkv, n_sink, D) f16, offset (B, Hkv, D) f32."""

    layout: object  # kvcli.kernels.layout.KernelLayout: kind, block_bytes, *_offset, table, n_sink, tile
    data: torch.Tensor
    scale: torch.Tensor | None = None
    sink: torch.Tensor | None = None
    offset: torch.Tensor | None = None


@triton.jit
def _tq_code(ptr, at, idx, shift, mask, S: tl.constexpr, RB: tl.constexpr, BITS: tl.constexpr):
    """The BITS-bit codes of packed row idx (0..S-1) of the S rows pack_rows packed together
    (kvcli/cache/turbo.py), at bytes at + row * RB, in the nibble at `shift`: 4 bits as they lie; 2 and 3
    bits: the low two in field idx // (S / 2) of row idx % (S / 2), the third in bit idx // (S / 4) of row
    S / 2 + idx % (S / 4)."""
    if BITS == 4:
        u = (tl.load(ptr + at + idx * RB, mask=mask, other=0).to(tl.int32) >> shift) & 15
    else:
        HS: tl.constexpr = S // 2
        lo = tl.load(ptr + at + (idx % HS) * RB, mask=mask, other=0).to(tl.int32)
        u = (lo >> (shift + 2 * (idx // HS))) & 3
        if BITS == 3:
            QS: tl.constexpr = S // 4
            hi = tl.load(ptr + at + (HS + idx % QS) * RB, mask=mask, other=0).to(tl.int32)
            u = u | (((hi >> (shift + idx // QS)) & 1) << 2)
    return u


@triton.jit
def _load_tile(ptr, ptr16, rows, nmask, e, offs_n, tab_ptr, sink_ptr, s_sink_n, off_ptr, npad,
               KIND: tl.constexpr, D: tl.constexpr, BB: tl.constexpr, DO: tl.constexpr, MO: tl.constexpr,
               QH: tl.constexpr, QS: tl.constexpr, TILE: tl.constexpr, NSINK: tl.constexpr,
               BITS: tl.constexpr, BS: tl.constexpr):
    """(BLOCK_N, DP) f32: positions offs_n of one (b, head); rows = their offsets (elements or bytes).
    ggml blocks: BB bytes, fp16 d at byte DO, fp16 m at MO, fifth bits at QH, nibbles at QS.
    q4_hadamard (KIND 9 keys, 10 values): rows = the head's base byte, ptr16 = its bf16 scales
    (D / 32, npad), TILE positions (keys) or elements (values) per tile, as kvcli/cache/hadamard.py.
    tq (KIND 11 keys, 12 values): the same tiles with BITS-bit codes packed by rows, a bf16 scale per BS
    elements, the codebook at tab_ptr, as kvcli/cache/turbo.py.

    One constexpr if/elif chain and a single return: the compiler sees only the taken branch."""
    emask = e < D
    m2 = nmask[:, None] & emask[None, :]
    blk = e // 32
    jw = e % 32
    if KIND <= 2:  # dense f32 / f16 / bf16
        x = tl.load(ptr + rows[:, None] + e[None, :], mask=m2, other=0.0).to(tl.float32)
    elif KIND == 3:  # q8_0: fp16 d, 32 x int8
        at = rows[:, None] + (blk * BB)[None, :]
        d = tl.load(ptr16 + (at + DO) // 2, mask=m2, other=0.0).to(tl.float32)
        qv = tl.load(ptr + at + QS + jw[None, :], mask=m2, other=0).to(tl.int8, bitcast=True)
        x = qv.to(tl.float32) * d
    elif KIND == 5 or KIND == 7:  # q4_1 / q5_1: fp16 d, fp16 m, [4 bytes qh], nibbles
        at = rows[:, None] + (blk * BB)[None, :]
        d = tl.load(ptr16 + (at + DO) // 2, mask=m2, other=0.0).to(tl.float32)
        mn = tl.load(ptr16 + (at + MO) // 2, mask=m2, other=0.0).to(tl.float32)
        byte = tl.load(ptr + at + QS + (jw % 16)[None, :], mask=m2, other=0).to(tl.int32)
        q = (byte >> ((jw // 16) * 4)[None, :]) & 15
        if KIND == 7:
            qh = tl.load(ptr + at + QH + (jw // 8)[None, :], mask=m2, other=0).to(tl.int32)
            q = q | (((qh >> (jw % 8)[None, :]) & 1) << 4)
        x = d * q.to(tl.float32) + mn
    elif KIND == 9 or KIND == 10:  # q4_hadamard: codes in int4 GEMM tiles, bf16 scales, offset, f16 sinks
        n = offs_n[:, None]
        HALF: tl.constexpr = TILE // 2
        if KIND == 9:  # keys: byte (n // T, e, n % (T / 2)), high nibble for n % T >= T / 2
            at = rows[:, None] + (n // TILE) * (D * HALF) + e[None, :] * HALF + n % HALF
            shift = ((n % TILE) // HALF) * 4
        else:  # values, tiles of W = TILE elements: byte (e // W, n, e % W % (W / 2)), high for e % W >= W / 2
            ew = e[None, :] % TILE
            at = rows[:, None] + (e[None, :] // TILE) * (npad * HALF) + n * HALF + ew % HALF
            shift = (ew // HALF) * 4
        byte = tl.load(ptr + at, mask=m2, other=0).to(tl.int32)
        q = (byte >> shift) & 15
        d = tl.load(ptr16 + blk[None, :] * npad + n, mask=m2, other=0.0).to(tl.float32)
        x = d * (q.to(tl.float32) - 8.0) + tl.load(off_ptr + e, mask=emask, other=0.0)[None, :]
        is_sink = offs_n < NSINK
        sink = tl.load(sink_ptr + n * s_sink_n + e[None, :], mask=m2 & is_sink[:, None], other=0.0)
        x = tl.where(is_sink[:, None], sink.to(tl.float32), x)
    elif KIND == 11 or KIND == 12:  # tq: b-bit codes packed by rows, bf16 scales, codebook, offset, f16 sinks
        n = offs_n[:, None]
        HALF: tl.constexpr = TILE // 2  # bytes per packed row
        if KIND == 11:  # keys: byte (n // T, row, n % (T / 2)) of (npad / T, BITS D / 4, T / 2); rows pack elements
            at = rows[:, None] + (n // TILE) * (BITS * D // 4 * HALF) + n % HALF
            u = _tq_code(ptr, at, e[None, :], ((n % TILE) // HALF) * 4, m2, D, HALF, BITS)
        else:  # values: byte (e // W, n // 64, row, e % W % (W / 2)) of (D / W, npad / 64, 16 BITS, W / 2);
            # rows pack positions
            ew = e[None, :] % TILE
            at = (rows[:, None] + (e[None, :] // TILE) * (npad * BITS // 4 * HALF) + (n // 64) * (16 * BITS * HALF)
                  + ew % HALF)
            u = _tq_code(ptr, at, n % 64, (ew // HALF) * 4, m2, 64, HALF, BITS)
        d = tl.load(ptr16 + (e // BS)[None, :] * npad + n, mask=m2, other=0.0).to(tl.float32)
        x = tl.load(tab_ptr + u) * d + tl.load(off_ptr + e, mask=emask, other=0.0)[None, :]
        is_sink = offs_n < NSINK
        sink = tl.load(sink_ptr + n * s_sink_n + e[None, :], mask=m2 & is_sink[:, None], other=0.0)
        x = tl.where(is_sink[:, None], sink.to(tl.float32), x)
    else:  # q4_0, q5_0, iq4_nl: fp16 d, [4 bytes qh], nibbles
        at = rows[:, None] + (blk * BB)[None, :]
        d = tl.load(ptr16 + (at + DO) // 2, mask=m2, other=0.0).to(tl.float32)
        byte = tl.load(ptr + at + QS + (jw % 16)[None, :], mask=m2, other=0).to(tl.int32)
        q = (byte >> ((jw // 16) * 4)[None, :]) & 15
        if KIND == 6:
            qh = tl.load(ptr + at + QH + (jw // 8)[None, :], mask=m2, other=0).to(tl.int32)
            q = q | (((qh >> (jw % 8)[None, :]) & 1) << 4)
            x = d * (q.to(tl.float32) - 16.0)
        elif KIND == 8:
            x = d * tl.load(tab_ptr + q)
        else:
            x = d * (q.to(tl.float32) - 8.0)
    return x


@triton.jit
def _fold(q, k, v, visible, m_i, l_i, acc, extra):
    """One tile of keys k and values v (BLOCK_N, DP) into the online softmax (m_i, l_i, acc) of the rows q; extra
    (BLOCK_M, BLOCK_N) or 0: added to the scores."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") + extra  # (BLOCK_M, BLOCK_N)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def _attn_kernel(q_ptr, sq_b, sq_h, sq_r,
                 k_ptr, k16_ptr, sk_b, sk_h, sk_n, ks_ptr, sks_b, sks_h, sks_n, ko_ptr, sko_b, sko_h,
                 skd_b, skd_h, k_npad,
                 v_ptr, v16_ptr, sv_b, sv_h, sv_n, vs_ptr, svs_b, svs_h, svs_n, vo_ptr, svo_b, svo_h,
                 svd_b, svd_h, v_npad,
                 ktab_ptr, vtab_ptr, o_ptr, ml_ptr, Hkv, M, G, pos, n_keys, split_len, S,
                 kw_ptr, vw_ptr, sw_b, sw_h, sw_n, w_start, w_size, qb_ptr, tb_ptr,
                 KK: tl.constexpr, KBB: tl.constexpr, KDO: tl.constexpr, KMO: tl.constexpr, KQH: tl.constexpr,
                 KQS: tl.constexpr, KT: tl.constexpr, KNS: tl.constexpr, KBITS: tl.constexpr, KBS: tl.constexpr,
                 VK: tl.constexpr, VBB: tl.constexpr, VDO: tl.constexpr, VMO: tl.constexpr, VQH: tl.constexpr,
                 VQS: tl.constexpr, VT: tl.constexpr, VNS: tl.constexpr, VBITS: tl.constexpr, VBS: tl.constexpr,
                 WINDOW: tl.constexpr, KEY_BIAS: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """K's (KK, KBB, ...) and V's (VK, ...) layout constants: _load_tile's KIND, BB, DO, MO, QH, QS, TILE, NSINK,
    BITS, BS. WINDOW: K and V of positions w_start.. in f32 (kw, vw: (B, Hkv, n, D), strides sw_*, already in
    the stores' spaces); the row at position i reads the store below lim_i = max(i - w_size + 1, w_start) and
    the window from lim_i to i (the recent window, kvcli/cache/window.py); without one lim_i = i + 1.
    KEY_BIAS: keys stored less their bias (kvcli/cache/key_bias.py): each store score gets qb_r . tb[p], qb (B, Hkv,
    M, D) laid out and scaled as q, tb (n_ctx, D) f32 the RoPE table's rows (cos, sin of each pair in turn)."""
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = (pid_bh // Hkv).to(tl.int64)
    h = (pid_bh % Hkv).to(tl.int64)
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = r < M
    e = tl.arange(0, DP)
    q_pos = pos + r // G  # (BLOCK_M,)
    q = tl.load(q_ptr + b * sq_b + h * sq_h + r[:, None] * sq_r + e[None, :],
                mask=rmask[:, None] & (e < D)[None, :], other=0.0)  # pre-scaled by log2(e) / sqrt(D)
    if KEY_BIAS:  # laid out and scaled as q
        qb = tl.load(qb_ptr + b * sq_b + h * sq_h + r[:, None] * sq_r + e[None, :],
                     mask=rmask[:, None] & (e < D)[None, :], other=0.0)
    start = pid_s * split_len
    last_pos = pos + (tl.minimum(pid_m * BLOCK_M + BLOCK_M, M) - 1) // G  # causal: no key past it
    if WINDOW:  # the store below each row's lim (non-decreasing in the row: the last row's bounds the block)
        lim = tl.maximum(q_pos - w_size + 1, w_start)
        store_end = tl.maximum(last_pos - w_size + 1, w_start)
    else:
        lim = q_pos + 1
        store_end = last_pos + 1
    end = tl.minimum(tl.minimum(start + split_len, n_keys), store_end)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: fully masked rows give p = 0, not NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DP], tl.float32)
    k_base = b * sk_b + h * sk_h
    v_base = b * sv_b + h * sv_h
    for n0 in tl.range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        k = _load_tile(k_ptr, k16_ptr + b * skd_b + h * skd_h, k_base + offs_n.to(tl.int64) * sk_n, nmask, e,
                       offs_n, ktab_ptr, ks_ptr + b * sks_b + h * sks_h, sks_n, ko_ptr + b * sko_b + h * sko_h,
                       k_npad, KK, D, KBB, KDO, KMO, KQH, KQS, KT, KNS, KBITS, KBS)
        v = _load_tile(v_ptr, v16_ptr + b * svd_b + h * svd_h, v_base + offs_n.to(tl.int64) * sv_n, nmask, e,
                       offs_n, vtab_ptr, vs_ptr + b * svs_b + h * svs_h, svs_n, vo_ptr + b * svo_b + h * svo_h,
                       v_npad, VK, D, VBB, VDO, VMO, VQH, VQS, VT, VNS, VBITS, VBS)
        visible = nmask[None, :] & (offs_n[None, :] < lim[:, None])
        if KEY_BIAS:
            tb = tl.load(tb_ptr + offs_n.to(tl.int64)[:, None] * D + e[None, :],
                         mask=nmask[:, None] & (e < D)[None, :], other=0.0)  # (BLOCK_N, DP)
            m_i, l_i, acc = _fold(q, k, v, visible, m_i, l_i, acc, tl.dot(qb, tl.trans(tb), input_precision="ieee"))
        else:
            m_i, l_i, acc = _fold(q, k, v, visible, m_i, l_i, acc, 0.0)
    if WINDOW:  # the last split also reads the window: positions lim of the first row .. last_pos, dense f32
        w_lo = tl.maximum(pos + (pid_m * BLOCK_M) // G - w_size + 1, w_start)
        w_end = tl.where(pid_s == S - 1, last_pos + 1, w_lo)  # other splits: an empty range
        w_base = b * sw_b + h * sw_h
        for n0 in tl.range(w_lo, w_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            nmask = offs_n < w_end
            at = w_base + (offs_n - w_start).to(tl.int64) * sw_n
            k = _load_tile(kw_ptr, kw_ptr, at, nmask, e, offs_n, ktab_ptr, kw_ptr, 0, kw_ptr, 0,
                           0, D, 0, 0, 0, 0, 0, 0, 0, 4, 32)
            v = _load_tile(vw_ptr, vw_ptr, at, nmask, e, offs_n, vtab_ptr, vw_ptr, 0, vw_ptr, 0,
                           0, D, 0, 0, 0, 0, 0, 0, 0, 4, 32)
            visible = nmask[None, :] & (offs_n[None, :] >= lim[:, None]) & (offs_n[None, :] <= q_pos[:, None])
            m_i, l_i, acc = _fold(q, k, v, visible, m_i, l_i, acc, 0.0)
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    # o: (B, Hkv, S, M, DP) contiguous; ml: (B, Hkv, S, M, 2) = (max, sum) of each split
    row = (pid_bh * S + pid_s).to(tl.int64) * M + r
    tl.store(o_ptr + row[:, None] * DP + e[None, :], out, mask=rmask[:, None])
    tl.store(ml_ptr + row * 2, m_i, mask=rmask)
    tl.store(ml_ptr + row * 2 + 1, l_i, mask=rmask)


@triton.jit
def _split_reduce_kernel(o_ptr, ml_ptr, out_ptr, M, S, SP: tl.constexpr, DP: tl.constexpr):
    """Merge the splits of one (b, head, row): weights 2^(m_s - max m) l_s over the normalized outputs."""
    pid_bh = tl.program_id(0)
    r = tl.program_id(1)
    s = tl.arange(0, SP)
    e = tl.arange(0, DP)
    row = (pid_bh * S + s).to(tl.int64) * M + r  # (SP,)
    smask = s < S
    m = tl.load(ml_ptr + row * 2, mask=smask, other=float("-inf"))
    l = tl.load(ml_ptr + row * 2 + 1, mask=smask, other=0.0)
    w = tl.exp2(m - tl.max(m, 0)) * l
    o = tl.load(o_ptr + row[:, None] * DP + e[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(out_ptr + (pid_bh.to(tl.int64) * M + r) * DP + e, out)


def _store_args(st: StoreTensors):
    """Pointer and stride arguments of one store's layer: data, fp16 view (rotated types: bf16 scales),
    sink, offset, the scales' strides and padded length."""
    data = st.data
    if st.scale is not None:  # q4_hadamard, tq
        scale, sink, off = st.scale, st.sink, st.offset
        return (data, scale, data.stride(0), data.stride(1), 0, sink, sink.stride(0), sink.stride(1), sink.stride(2),
                off, off.stride(0), off.stride(1), scale.stride(0), scale.stride(1), scale.shape[-1])
    data16 = data if st.layout.kind in DENSE_KINDS else data.view(torch.float16)
    unused = (data, 0, 0, 0, data, 0, 0, 0, 0, 0)
    return (data, data16, data.stride(0), data.stride(1), data.stride(2)) + unused


# Tiles are loaded unpipelined (num_stages=1). On an H200 at D = 128, Triton's default 3 stages ran tq out of shared
# memory (264 KiB asked, 227 the limit); with one stage tq4 read a 32k cache in 0.42 ms, against 2.71 ms for f16
# and 4.38 for q4_hadamard with three (benchmarks/README.md, GPU): one stage for every type, to be timed again.
NUM_STAGES = 1


def _constexprs(p: str, layout) -> dict:
    """One store's layout constants as the kernel's constexpr arguments, p = "K" (KK, KBB, ...) or "V"."""
    return {p + "K": layout.kind, p + "BB": layout.block_bytes, p + "DO": layout.d_offset, p + "MO": layout.m_offset,
            p + "QH": layout.qh_offset, p + "QS": layout.qs_offset, p + "T": layout.tile, p + "NS": layout.n_sink,
            p + "BITS": layout.bits, p + "BS": layout.scale_block}


class Window(NamedTuple):
    """A batch's recent window (kvcli.attention.Recent) in the stores' spaces: k and v (B, Hkv, n, D) f32
    of positions start..start+n-1; the query at position i reads max(i - size + 1, start)..i from here."""

    k: torch.Tensor
    v: torch.Tensor
    start: int
    size: int


def attend_kernel(q: torch.Tensor, k: StoreTensors, v: StoreTensors, pos: int, num_splits: int | None = None,
                  block_n: int | None = None, window: Window | None = None,
                  key_bias: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """q (B, T, H, D) f32 at positions pos..pos+T-1, in K's storage space -> (B, T, H, D) f32 in V's.

    Runs wherever triton runs (CUDA, or CPU tensors under TRITON_INTERPRET=1). T = 1 is
    flash-decoding with `num_splits` splits (default: enough programs to fill the GPU) over the
    store's positions; the window, if any, is read by the last split. key_bias: keys stored less their bias
    (kvcli/cache/key_bias.py), (uw (B, Hkv, T*G, D) f32 in the model's space, rows r = t * G + g, unscaled;
    table (n_ctx, D) f32): uw_r . table[p] added to each store score.
    """
    B, T, H, D = q.shape
    Hkv = k.data.shape[1]
    G = H // Hkv
    M = T * G
    DP = triton.next_power_of_2(D)
    # rows r = t * G + g of each KV head: (B, Hkv, T*G, D); scale folded with log2(e) for exp2
    qg = q.float().reshape(B, T, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, M, D)
    qg = (qg * (LOG2E / math.sqrt(D))).contiguous()
    qb, tb = (qg, qg) if key_bias is None else ((key_bias[0] * (LOG2E / math.sqrt(D))).contiguous(),
                                                key_bias[1].contiguous())
    assert qb.stride() == qg.stride()
    # positions read from the store: below the last row's limit (all of them up to it without a window)
    n_keys = pos + T if window is None else max(pos + T - window.size, window.start)
    if window is None:
        wk = wv = q  # unused pointers
        w_args = (0, 0, 0, 0, 0)
    else:
        wk, wv = window.k.float().contiguous(), window.v.float().contiguous()
        assert wk.shape == wv.shape and wk.shape[2] == pos + T - window.start
        w_args = (wk.stride(0), wk.stride(1), wk.stride(2), window.start, window.size)
    if T == 1:
        block_m = max(16, triton.next_power_of_2(M))
        block_n = block_n or 64
        n_blocks = triton.cdiv(max(n_keys, 1), block_n)
        if num_splits is None:
            sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
            num_splits = triton.cdiv(2 * sms, B * Hkv)
        num_splits = max(1, min(num_splits, n_blocks))
    else:
        block_m = 64 if M >= 64 else max(16, triton.next_power_of_2(M))
        block_n = block_n or 32
        num_splits = 1
    split_len = triton.cdiv(triton.cdiv(max(n_keys, 1), num_splits), block_n) * block_n
    S = triton.cdiv(max(n_keys, 1), split_len)
    o = torch.empty(B, Hkv, S, M, DP, device=q.device, dtype=torch.float32)
    ml = torch.empty(B, Hkv, S, M, 2, device=q.device, dtype=torch.float32)
    grid = (B * Hkv, triton.cdiv(M, block_m), S)
    _attn_kernel[grid](qg, qg.stride(0), qg.stride(1), qg.stride(2), *_store_args(k), *_store_args(v),
                       table(k.layout.table, q.device), table(v.layout.table, q.device),
                       o, ml, Hkv, M, G, pos, n_keys, split_len, S, wk, wv, *w_args, qb, tb,
                       **_constexprs("K", k.layout), **_constexprs("V", v.layout), WINDOW=window is not None,
                       KEY_BIAS=key_bias is not None,
                       D=D, DP=DP, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4,
                       num_stages=NUM_STAGES)
    if S == 1:
        out = o[:, :, 0]
    else:
        out = torch.empty(B, Hkv, M, DP, device=q.device, dtype=torch.float32)
        _split_reduce_kernel[(B * Hkv, M)](o, ml, out, M, S, SP=triton.next_power_of_2(S), DP=DP)
    # (B, Hkv, T, G, D) -> (B, T, H, D)
    return out[..., :D].reshape(B, Hkv, T, G, D).permute(0, 2, 1, 3, 4).reshape(B, T, H, D)
