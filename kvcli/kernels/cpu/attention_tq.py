"""tq4/tq3/tq2 decode attention on the CPU through torch's int4 GEMM: attend_reference's result (kvcli/attention.py)
for one query token per sequence over a tq K and V store (kvcli/cache/turbo.py) and their recent window, computed
from the packed codes as they lie (no dequantized copy of the store).

Decode (a few query rows on the CPU) with a uniform codebook, L[u] = u - mid, reads the codes as
they lie: the packed rows are widened back to nibble tiles holding u with a few int32 bit operations
over the chunk's bytes (no floats; none for b = 4), then torch's int4 GEMM takes the tiles with scale
1 and zero point 8 - mid, so that its (nibble - 8) s + z is L[u]: scores d_t (q . L[u_t]) per head
(d applied to the GEMM's output, exact in f32, where a head is one block; else the GEMM's groups
carry d, over nibbles u + 8 - 2^(b-1) with zero point d (2^(b-1) - mid)), weighted sums
sum_t p_t d_t L[u_t] per head with x = p d; the offset and the sinks are added outside.

For each sequence b, KV head h and query head g of its group (q_rot = R q / sqrt(D), q in the model's space):
    s_t = d_t (q_rot . L[u_t]) + q_rot . c_k        store position t < lim[b] past the sinks (bf16 GEMM, f32 sums),
    s_t = q_rot . sink_t                            a sink (its rotated f16 copy), in f32,
    s_n = q . k_n / sqrt(D)                         window slot n unless masked[b, n] (model space, f32),
one softmax over the window and the store together, then the store's values summed in the rotated space
(the GEMM's sum_t p_t d_t L[u_t], + c_v sum of the non-sink weights, + the sinks' f16 weighted in f32) and
rotated back (@ R), plus the window's values weighted in the model's space.

Each sequence reads its own store positions only, and gets the same bits alone and beside others (the server's
solo/concurrent equality): consecutive sequences of one depth are read together (elementwise ops, per-row softmax
and sums, an int4 GEMM per head: per row the same arithmetic whatever the batch), the others apart (a softmax or
a sum over a batch's longest row would differ: their blocking depends on the length); the small f32 products
(the rotations, the window's, the sinks') are BLAS calls made per sequence (a batched one's blocking depends on
the batch). Not across thread counts: BLAS may split those otherwise with more threads.

Precision: the GEMM takes q and x = p d in bf16 and gives its sums in bf16 (f32 inside): each score good to
about 2^-9 of the largest, so the output to about 2^-9 x the largest |score| x the largest output (measured: up
to 0.7 of that; tests/test_turbo.py). As the int4 GEMM path was before it became a kernel; SmolLM2's decode
logits are within KL 2e-5 of the reference's.

Torch ops only (nothing to compile). Per layer and token, one sequence of SmolLM2's shape (3 KV heads, D = 64):
about 45 computing calls for tq3 (35 for tq4; plus some 90 views), 6 of them int4 GEMMs: one per head for the
scores, one per (head, scale block) for the weighted sums. A further sequence of the same depth adds ~25.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

from .int4_tiles import mm, unpack_rows

GROUP = 64  # value positions packed together (kvcli/cache/turbo.py GROUP): the weighted sums' K is whole groups

# ---- unpacking the format's b-bit rows (kvcli/cache/turbo.py pack_rows / unpack_rows: the same bits) ----
# ---- what is made once per shape, not per call ----
_UNITS: dict[tuple, torch.Tensor] = {}
_LOCAL = threading.local()  # each thread's scratch (a server may decode on several)


def _units(zero: float, groups: int, N: int, along_n: bool = False) -> torch.Tensor:
    """(groups, N, 2) bf16: scale 1 and zero point `zero` (exact in bf16), for GEMMs whose scale is applied
    outside (values: x carries p d; keys of one block: d multiplies the scores). Made once per (zero, N) with room
    for more groups (along_n: once per zero, one group, room for more N), sliced per call."""
    key = (zero, None if along_n else N)
    have = _UNITS.get(key)
    if have is None or (have.shape[1] if along_n else have.shape[0]) < (N if along_n else groups):
        size = max(N if along_n else groups, 2 * (0 if have is None else (have.shape[1] if along_n else have.shape[0])))
        one = torch.tensor([1.0, zero], dtype=torch.bfloat16)
        have = _UNITS[key] = one.expand(1, size, 2).contiguous() if along_n else one.expand(size, N, 2).contiguous()
    return have[:, :N] if along_n else have[:groups]


def _scratch(numel: int) -> torch.Tensor:
    """A bf16 buffer of at least numel elements, this thread's, kept between calls: the value GEMM's x, rewritten
    in full every call (no allocation per layer and token)."""
    x = getattr(_LOCAL, "x", None)
    if x is None or x.numel() < numel:
        x = _LOCAL.x = torch.empty(max(numel, 2 * (0 if x is None else x.numel())), dtype=torch.bfloat16)
    return x[:numel]


def _rowwise(op, R: int, shape: tuple, *args: torch.Tensor, last: torch.Tensor | None = None) -> torch.Tensor:
    """A small f32 product (a BLAS call) made per sequence: out (shape, R sequences' rows along dim 0) row block r
    = op(args[0]'s block r, args[1]'s block r, .., last), the args' dim 0 holding the R sequences' blocks in turn.
    (One call over all would block its sums by the batch: a row would get other bits beside others than alone.)"""
    tail = () if last is None else (last,)
    if R == 1:
        return op(*args, *tail)
    out = torch.empty(shape)
    for blocks in zip(out.chunk(R), *(a.chunk(R) for a in args)):
        op(*blocks[1:], *tail, out=blocks[0])
    return out


def _rows(tensors, rows: slice) -> tuple:
    """A store's tensors (B, H, ...) for sequences `rows` as (R H, ...) views."""
    if rows.stop - rows.start == 1:
        return tuple(t[rows.start] for t in tensors)
    if rows.stop - rows.start != tensors[0].shape[0]:
        tensors = tuple(t[rows] for t in tensors)
    return tuple(t.flatten(0, 1) for t in tensors)


# ---- the products, for R sequences of the same depth n: (R H, ...), sequence-major ----
def _scores(layout, qr: torch.Tensor, R: int, tensors, rows: slice, n: int) -> torch.Tensor:
    """qr (R H, G, D) f32 in the store's space against store positions 0..n-1 (n >= 1) of sequences `rows` ->
    (R H, G, n) f32, offset q . c included, the sinks from their f16 copies."""
    data, scale, sinks, offset = _rows(tensors, rows)  # (R H, ...)
    RH, G, D = qr.shape
    T, bs, bits = layout.tile, layout.scale_block, layout.bits
    nb, mid = D // bs, -layout.table[0]
    nt = -(-n // T)
    N = nt * T
    S = sinks.shape[1]
    # q . sink_t for every sink the store has (a fixed shape: the same bits at any n), and q . c, in f32
    qsc = _rowwise(torch.bmm, R, (RH, G, S + 1), qr, torch.cat([sinks.float(), offset.unsqueeze(1)], 1).mT)
    d = scale[..., :N]  # (R H, nb, N) bf16
    qb = qr.to(torch.bfloat16)
    if nb == 1:  # a scale per position: unit scales in the GEMM on the codes as stored, d on its output
        tiles = unpack_rows(data[:, :nt], bits)  # (R H, nt, D, T / 2)
        unit = _units(8 - mid, 1, N, along_n=True)  # one group: K = D
        s = torch.stack([mm(x, w.view(N, D // 2), unit, bs) for x, w in zip(qb, tiles)])  # (R H, G, N) bf16
        s = torch.addcmul(qsc[..., S:], s[..., :n], d[..., :n])  # q . c + (q . L[u]) d, in f32
    else:  # the GEMM's groups carry d over nibbles u + 8 - 2^(b-1), zero point d (2^(b-1) - mid)
        zero = (1 << (bits - 1)) - mid
        tiles = unpack_rows(data[:, :nt], bits, 8 - (1 << (bits - 1)))
        sz = torch.stack([d, d * zero], -1)  # (R H, nb, N, 2)
        s = torch.stack([mm(x, w.view(N, D // 2), z, bs) for x, w, z in zip(qb, tiles, sz)])
        s = torch.add(s[..., :n], qsc[..., S:])
    m = min(S, n)
    if m:
        s[..., :m] = qsc[..., :m]
    return s


def _weighted_sum(layout, p: torch.Tensor, R: int, tensors, rows: slice) -> torch.Tensor:
    """p (R H, G, n) f32, the weights of store positions 0..n-1 of sequences `rows` -> sum_t p_t v_t (R H, G, D) f32
    in the store's space: the GEMM's sum over the codes past the sinks, + c times their weights' sum, + the sinks'
    f16 copies."""
    data, scale, sinks, offset = _rows(tensors, rows)
    RH, G, n = p.shape
    D = offset.shape[-1]
    W, bs, bits = layout.tile, layout.scale_block, layout.bits
    nb, mid = D // bs, -layout.table[0]
    ng = -(-n // GROUP)
    K = ng * GROUP
    d = scale[..., :K]  # (R H, nb, K) bf16
    m = min(sinks.shape[1], n)  # the sinks come from f16 below: no weight from their codes
    if bs % W == 0:  # each block whole tiles: x = p d, one GEMM per head and block
        planes = unpack_rows(data[:, :, :ng], bits).reshape(RH, D // W, K, W // 2)  # the GEMM's (N / T, K, T / 2)
        x = _scratch(RH * nb * G * K).view(RH, nb, G, K)
        torch.mul(p[:, None], d[..., None, :n], out=x[..., :n])
        if m:
            x[..., :m] = 0
        if n < K:
            x[..., n:] = 0
        unit = _units(8 - mid, ng, bs)
        tb = bs // W  # tiles per block
        out = torch.stack([mm(xh[j], wh[j * tb : (j + 1) * tb].reshape(bs, K // 2), unit, GROUP)
                           for xh, wh in zip(x, planes) for j in range(nb)])  # (R H nb, G, bs)
        out = out.view(RH, nb, G, bs).transpose(1, 2).reshape(RH, G, D)
    else:  # blocks narrower than a tile: per-tile GEMMs with each block's scales in x, the diagonal kept
        zero = (1 << (bits - 1)) - mid
        planes = unpack_rows(data[:, :, :ng], bits, 8 - (1 << (bits - 1))).reshape(RH * (D // W), K, W // 2)
        nt, per = D // W, W // bs  # tiles per head, blocks per tile
        x = _scratch(RH * nt * G * per * K).view(RH, nt, G, per, K)
        torch.mul(p[:, None, :, None], d[..., :n].unflatten(1, (nt, 1, per)), out=x[..., :n])
        if m:
            x[..., :m] = 0
        if n < K:
            x[..., n:] = 0
        unit = _units(zero, K // bs, W)
        out = torch.stack([mm(xi.view(per * G, K), w.reshape(W, K // 2), unit, bs)
                           for xi, w in zip(x.flatten(0, 1), planes)])  # (R H nt, G per, W)
        # row (g, c) of tile i summed with block per i + c's scales: keep its own bs columns
        out = out.view(RH, nt, G, per, per, bs).diagonal(dim1=3, dim2=4)  # (R H, nt, G, bs, per)
        out = out.permute(0, 2, 1, 4, 3).reshape(RH, G, D)
    out = torch.addcmul(out, p[..., m:].sum(-1, keepdim=True), offset.unsqueeze(1))  # + c sum_t p_t, in f32
    if m:
        out = _rowwise(torch.baddbmm, R, out.shape, out, p[..., :m], sinks[:, :m].float())
    return out


def _run(qm: torch.Tensor, R: int, k, v, rows: slice, n: int, kv, masked, extra=None) -> torch.Tensor:
    """Sequences `rows` (R of them), each reading store positions 0..n-1: qm (R H, G, D) f32, scaled, in the model's
    space; k, v the operands; kv (R, 2 H, N, D) f16 and masked (R, 1, 1, N) bool their window, or None; extra
    (R H, G, >= n) f32 added to the store's scores, or None -> (R H, G, D) f32 in the model's space."""
    RH, G, D = qm.shape
    H = RH // R
    parts = []
    if kv is not None:
        kv = kv.float()
        N = kv.shape[2]
        kw, vw = (kv[0, :H], kv[0, H:]) if R == 1 else (kv[:, :H].flatten(0, 1), kv[:, H:].flatten(0, 1))  # (R H, N, D)
        ws = _rowwise(torch.bmm, R, (RH, G, N), qm, kw.mT)
        ws = ws.masked_fill_(masked[0], -math.inf) if R == 1 else ws.view(R, H, G, N).masked_fill_(masked, -math.inf)
        parts.append(ws.view(RH, G, N))
    if n:
        qr = _rowwise(torch.mm, R, (RH * G, D), qm.view(RH * G, D), last=k.rotation.mT)  # into K's space: x R^T
        s = _scores(k.layout, qr.view(RH, G, D), R, k.tensors, rows, n)
        parts.append(s if extra is None else s.add_(extra[..., :n]))
    p = torch.softmax(parts[0] if len(parts) == 1 else torch.cat(parts, -1), -1)
    if not n:
        return _rowwise(torch.bmm, R, (RH, G, D), p, vw)
    o = _weighted_sum(v.layout, p[..., p.shape[-1] - n :], R, v.tensors, rows).view(RH * G, D)  # in V's space
    if kv is None:  # out of V's space: x = r R
        return _rowwise(torch.mm, R, (RH * G, D), o, last=v.rotation).view(RH, G, D)
    pv = _rowwise(torch.bmm, R, (RH, G, D), p[..., : kv.shape[2]], vw).view(RH * G, D)  # the window's, model space
    return _rowwise(torch.addmm, R, (RH * G, D), pv, o, last=v.rotation).view(RH, G, D)


def attend(q: torch.Tensor, k, v, lim: np.ndarray, window, extra: np.ndarray | None = None) -> torch.Tensor:
    """kvcli/kernels/layout.py's decode signature: q (B, Hkv, G, D) f32 in the model's space, k and v Operands of a
    tq K and V store layer (packed codes, bf16 scales, f16 sinks, f32 offsets; the rotation R), lim (B,) int64,
    window a DecodeWindow or None, extra None or (B, Hkv, G, P) f32 added to the store's scores -> (B, Hkv, G, D) f32
    in the model's space. Consecutive sequences of the same depth are read together, each reading its own positions
    only."""
    B, H, G, D = q.shape
    qm = (q * (1.0 / math.sqrt(D))).view(B * H, G, D)
    kv = masked = None
    if window is not None:
        kv = torch.from_numpy(window.kv).view(torch.float16)  # (B, 2 H, N, D)
        masked = torch.from_numpy(window.masked).view(B, 1, 1, -1)
    ex = None if extra is None else torch.from_numpy(extra).view(B * H, G, -1)
    if B == 1 or (lim == lim[0]).all():
        return _run(qm, B, k, v, slice(0, B), int(lim[0]), kv, masked, ex).view(B, H, G, D)
    outs, b0 = [], 0
    for b in range(1, B + 1):
        if b == B or lim[b] != lim[b0]:
            rows = slice(b0, b)
            outs.append(_run(qm[b0 * H : b * H], b - b0, k, v, rows, int(lim[b0]), None if kv is None else kv[rows],
                             None if kv is None else masked[rows], None if ex is None else ex[b0 * H : b * H]))
            b0 = b
    return torch.cat(outs).view(B, H, G, D)


def warm_up(k_layout=None, v_layout=None) -> None:
    """Nothing to compile: torch's ops only (the kernel table's warm-up asks every CPU kernel module)."""
