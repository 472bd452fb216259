"""Decode attention over the rotated types (q4_hadamard, tq4/tq3/tq2) on the CPU in one compiled pass (numba): the
CPU's counterpart of the Triton kernel, for one query token per sequence (`kvcli run`, the server's slots).

What it computes is attend_reference's result (kvcli/attention.py) for T = 1 over a rotated K and V store
(kvcli/cache/hadamard.py, kvcli/cache/turbo.py; K and V may be of different such types) and their recent window:
for each sequence b, KV head h and query head g of its group,
    s_t = q_rot . (d_t,blk (u_t - mid)) + q_rot . c_k   store position t < lim[b] past the sinks,
    s_t = q_rot . sink_t                                a sink (its rotated f16 copy),
    s_t += q . R(t) m                                    keys stored less their turning mean (kvcli/cache/key_bias.py),
    s_n = q . k_n                                       window slot n, unless masked[b, n],
one softmax over all of them, then the store's values summed in the rotated space (d (u - mid) + c_v,
or the sink) and the window's in the model's; the first rotated back and the two added. mid is 8 for
q4_hadamard and tq4, 4 for tq3, 1.5 for tq2 (their uniform codebooks).
Torch would spend ~100 ops a layer on this (unpacking, products, offsets, sinks, the window's part, the
softmax's cat and split), each with its fixed cost; here it is one call that reads the codes where
they lie (no dequantized copy; tq3's and tq2's packed bits widened to nibbles one key tile or group of 64 value
positions at a time, in a scratch tile). The products over the codes are LLVM vector code (vectors.py:
nibble_key_scores, nibble_value_sums, table_scores): 16 bytes of codes widened once for up to 4 query heads, their
sums kept in registers over a block's 32 dimensions (keys) or over the positions (values); numba's own loops at
these short strides kept the sums in memory and ran several times slower (benchmarks/README.md).

Each (sequence, head) is computed alone, in the same order whatever else is in the batch and whichever thread
runs it, so a sequence gets the same bits alone and beside others (the server's solo/concurrent equality) and at
any -t. Without the GIL; with -t N > 1 the (sequence, head) units go to numba's OpenMP threads. Figures:
benchmarks/README.md."""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from kvcli.kernels.layout import Kind

from .attention import no_extra
from .compile import THREADED, VEC, available, jit, jit_reassociating, jit_threaded, numba, numba_threads
from .vectors import (butterfly16, exp_f32, hadamard16, nibble_key_scores1, nibble_key_scores2, nibble_key_scores3,
                      nibble_key_scores4, nibble_value_sums1, nibble_value_sums2, nibble_value_sums3, nibble_value_sums4,
                      out_of_line, table_scores1, table_scores2, table_scores3, table_scores4, to_f32,
                      TABLE_LANES)



CHUNK_BYTES = VEC  # code bytes a vector step reads (vectors.py's nibble products): 16 positions (keys) or 32 elements (values)


@jit
def _walsh_hadamard(x):
    """x (D,) f32, D a power of two >= 16 <- H x in place (Sylvester's H, unnormalised): butterflies at distances 16,
    32, .. over whole vectors, the four shorter ones inside each 16 (cpu_jit.hadamard16)."""
    D = x.shape[0]
    for i in range(0, D, 16):
        hadamard16(x, i)
    d = 16
    while d < D:
        for i in range(0, D, 2 * d):
            for j in range(i, i + d, 16):
                butterfly16(x, j, d)
        d *= 2


@jit
def _unpack(packed, bits, codes):
    """packed (b S / 4, C) uint8: S rows of codes squeezed to b = 2 or 3 bits (kvcli/cache/turbo.py pack_rows: key
    tiles, S = D element rows; value groups, S = 64 positions) -> codes (S, C) uint8, one code per nibble as
    q4_hadamard's tiles hold them: row r's two bits from packed row r % (S / 2) at bit 2 (r // (S / 2)) of each
    nibble, b = 3: its third from row S / 2 + r % (S / 4) at bit r // (S / 4). Eight bytes at a time (C % 8 == 0),
    in runs of whole rows that share their shifts (a quarter of the rows for b = 3, a half for b = 2): loops LLVM
    vectorizes, where a loop per row (C / 8 = 2-4 words) ran scalar (tq3's decode at depth 4096: 3-9% faster)."""
    S, w = codes.shape[0], codes.shape[1] // 8  # rows, and 8-byte words a row
    half, quarter = S // 2, S // 4
    src = packed.reshape(packed.shape[0] * packed.shape[1]).view(np.uint64)
    dst = codes.reshape(S * codes.shape[1]).view(np.uint64)
    two, one = np.uint64(0x3333333333333333), np.uint64(0x1111111111111111)
    if bits == 2:
        for q in range(2):  # rows q S / 2 + r: row r's bits 2 q
            sh, out = np.uint64(2 * q), q * half * w
            for j in range(half * w):
                dst[out + j] = (src[j] >> sh) & two
        return
    for k in range(4):  # rows k S / 4 + r: bits 2 (k // 2) of row (k % 2) S / 4 + r, and bit k of row S / 2 + r
        sh, hk = np.uint64(2 * (k // 2)), np.uint64(k)
        lo, hi, out = (k % 2) * quarter * w, half * w, k * quarter * w
        for j in range(quarter * w):
            dst[out + j] = ((src[lo + j] >> sh) & two) | (((src[hi + j] >> hk) & one) << np.uint64(2))


@jit
def _key_scores(kt, k, c, qb, qsum, dk, s, col, mid):
    """nibble_key_scores for every query head of the group, 4 at a time."""
    G = qb.shape[0]
    g0 = 0
    while g0 < G:
        r = G - g0
        if r >= 4:
            nibble_key_scores4(kt, k, c, qb, qsum, np.int64(g0), dk, s, col, mid)
        elif r == 3:
            nibble_key_scores3(kt, k, c, qb, qsum, np.int64(g0), dk, s, col, mid)
        elif r == 2:
            nibble_key_scores2(kt, k, c, qb, qsum, np.int64(g0), dk, s, col, mid)
        else:
            nibble_key_scores1(kt, k, c, qb, qsum, np.int64(g0), dk, s, col, mid)
        g0 += min(r, 4)


@jit
def _value_sums(vt, t0, t1, c, s, col_s, dlo, dhi, acc, col, mid):
    """nibble_value_sums for every query head of the group, 4 at a time."""
    G = acc.shape[0]
    g0 = 0
    while g0 < G:
        r = G - g0
        if r >= 4:
            nibble_value_sums4(vt, t0, t1, c, s, col_s, dlo, dhi, np.int64(g0), acc, col, mid)
        elif r == 3:
            nibble_value_sums3(vt, t0, t1, c, s, col_s, dlo, dhi, np.int64(g0), acc, col, mid)
        elif r == 2:
            nibble_value_sums2(vt, t0, t1, c, s, col_s, dlo, dhi, np.int64(g0), acc, col, mid)
        else:
            nibble_value_sums1(vt, t0, t1, c, s, col_s, dlo, dhi, np.int64(g0), acc, col, mid)
        g0 += min(r, 4)


@jit_reassociating
def _head(b, h, qm, scale, sgn, kdat, ksc, ksink, koff, vdat, vsc, vsink, voff, wkv, wmask, kmean, neox, ktab, lim, fmt, mid,
          out):
    """One sequence b and KV head h of _attend (its arguments), with scratch of its own. Never inlined: one machine
    code whether a thread or the calling one runs it (the same bits at any thread count)."""
    out_of_line()
    G, D = qm.shape[2], qm.shape[3]
    T2 = kdat.shape[4]
    T = 2 * T2
    NV, W2 = vdat.shape[2], vdat.shape[4]
    W = 2 * W2
    kbits, kblk, vbits, vblk = fmt[0], fmt[1], fmt[2], fmt[3]
    kmid, vmid = mid[0], mid[1]
    NB = D // 32
    S = ksink.shape[2]
    N = wkv.shape[2]
    n = lim[b]
    m0 = min(S, n)  # sinks among the read positions
    nt = (n + T - 1) // T
    s = np.empty((G, N + nt * T), np.float32)  # scores: window slots, then store positions (whole tiles)
    qsum = np.empty((G, NB), np.float32)
    qoff = np.empty(G, np.float32)
    qs = np.empty((G, D), np.float32)  # the scaled query
    qb = np.empty((G, D), np.float32)  # ... rotated into the stores' space
    sink = np.empty((S, D), np.float32)  # the head's sinks (keys, then values) widened
    acc = np.zeros((G, D), np.float32)
    accw = np.zeros((G, D), np.float32)
    win = np.empty((N, D), np.float32)  # the head's window keys, then values, widened
    psum = np.empty(G, np.float32)
    kn = np.empty((D, T2), np.uint8)  # a key tile's codes, one a nibble (b < 4)
    vn = np.empty((64, W2), np.uint8)  # a value group's (b < 4)
    for g in range(G):  # qb = R q
        for e in range(D):
            qs[g, e] = qm[b, h, g, e] * scale
            qb[g, e] = qs[g, e] * sgn[e]
        _walsh_hadamard(qb[g])
    # ---- scores ----
    for w in range(N):
        for e in range(D):
            win[w, e] = to_f32(wkv[b, h, w, e])
    for g in range(G):
        for w in range(N):
            if wmask[b, w]:
                s[g, w] = -np.inf
            else:
                a = np.float32(0)
                for e in range(D):
                    a += qs[g, e] * win[w, e]
                s[g, w] = a
        a = np.float32(0)
        for e in range(D):
            a += qb[g, e] * koff[b, h, e]
        qoff[g] = a
        for k in range(NB):
            a = np.float32(0)
            for e in range(32 * k, 32 * k + 32):
                a += qb[g, e]
            qsum[g, k] = a
    for g in range(G):
        for j in range(N, N + T * nt):
            s[g, j] = qoff[g]
    for i in range(nt):  # key tile i: positions T i .. T i + T - 1
        kt = kdat[b, h, i]  # (D, T / 2), or (b D / 4, T / 2) packed
        if kbits < 4:
            _unpack(kt, kbits, kn)
            kt = kn
        col = np.int64(N + T * i)
        for k in range(NB):
            dk = ksc[b, h, (32 * k) // kblk, T * i : T * i + T]
            for c in range(T2 // CHUNK_BYTES):
                _key_scores(kt, np.int64(k), np.int64(c), qb, qsum, dk, s, col, kmid)
    for t in range(m0):  # the sinks: their f16 copies, no offset
        for e in range(D):
            sink[t, e] = to_f32(ksink[b, h, t, e])
    for g in range(G):
        for t in range(m0):
            a = np.float32(0)
            for e in range(D):
                a += qb[g, e] * sink[t, e]
            s[g, N + t] = a
    if kmean.shape[2] > 0:  # keys stored less their turning mean: q . R(p) m back (kvcli/cache/key_bias.py)
        kq = np.empty((G, D), np.float32)  # (u_0, w_0, u_1, w_1, ..) per head: q's pairs against m's
        m = kmean[b, h]
        P = D // 2
        for g in range(G):
            for j in range(P):
                a, c = (j, j + P) if neox else (2 * j, 2 * j + 1)
                kq[g, 2 * j] = qs[g, a] * m[a] + qs[g, c] * m[c]
                kq[g, 2 * j + 1] = qs[g, c] * m[a] - qs[g, a] * m[c]
        for i in range((n + TABLE_LANES - 1) // TABLE_LANES):  # the columns past n add to scores no one reads
            g0 = 0
            while g0 < G:
                r = G - g0
                if r >= 4:
                    table_scores4(ktab, np.int64(i), kq, np.int64(g0), s, np.int64(N))
                elif r == 3:
                    table_scores3(ktab, np.int64(i), kq, np.int64(g0), s, np.int64(N))
                elif r == 2:
                    table_scores2(ktab, np.int64(i), kq, np.int64(g0), s, np.int64(N))
                else:
                    table_scores1(ktab, np.int64(i), kq, np.int64(g0), s, np.int64(N))
                g0 += min(r, 4)
    # ---- softmax (unnormalised; divided at the end) ----
    for g in range(G):
        mx = np.float32(-np.inf)
        for j in range(N + n):
            mx = max(mx, s[g, j])
        for j in range(N + n):
            s[g, j] = exp_f32(s[g, j] - mx)
        a = np.float32(0)
        for j in range(N + n):
            a += s[g, j]
        psum[g] = a
    # ---- weighted sums ----
    for w in range(N):
        for e in range(D):
            win[w, e] = to_f32(wkv[b, qm.shape[1] + h, w, e])
    for g in range(G):
        for w in range(N):
            p = s[g, w]
            if p != 0:
                for e in range(D):
                    accw[g, e] += p * win[w, e]
    for i in range(NV):
        # elements W i + j and W i + W / 2 + j: their blocks' scales
        lo_blk, hi_blk = (W * i) // vblk, (W * i + W2) // vblk
        if vbits == 4:
            vt = vdat[b, h, i]  # (n_pad, W / 2)
            for c in range(W2 // CHUNK_BYTES):
                _value_sums(vt, m0, n, np.int64(c), s, np.int64(N), vsc[b, h, lo_blk], vsc[b, h, hi_blk], acc,
                            np.int64(W * i), vmid)
            continue
        for gi in range((n + 63) // 64):  # groups of 64 positions, each unpacked once
            t0, t1 = max(m0 - 64 * gi, 0), min(n - 64 * gi, 64)
            if t0 >= t1:
                continue
            _unpack(vdat[b, h, i, 16 * vbits * gi : 16 * vbits * (gi + 1)], vbits, vn)
            p0 = 64 * gi
            for c in range(W2 // CHUNK_BYTES):
                _value_sums(vn, np.int64(t0), np.int64(t1), np.int64(c), s, np.int64(N + p0),
                            vsc[b, h, lo_blk, p0 : p0 + 64], vsc[b, h, hi_blk, p0 : p0 + 64], acc, np.int64(W * i), vmid)
    for t in range(m0):
        for e in range(D):
            sink[t, e] = to_f32(vsink[b, h, t, e])
    for g in range(G):
        past = np.float32(0)  # the weight past the sinks carries the offset
        for j in range(N + m0, N + n):
            past += s[g, j]
        for t in range(m0):
            p = s[g, N + t]
            for e in range(D):
                acc[g, e] += p * sink[t, e]
        for e in range(D):
            acc[g, e] += past * voff[b, h, e]
        inv = np.float32(1) / psum[g]
        _walsh_hadamard(acc[g])  # back from the rotated space: x = R^T x_rot
        for e in range(D):
            out[b, h, g, e] = (accw[g, e] + acc[g, e] * sgn[e]) * inv


@jit
def _attend(qm, scale, sgn, kdat, ksc, ksink, koff, vdat, vsc, vsink, voff, wkv, wmask, kmean, neox, ktab, lim, fmt, mid,
            out):
    """qm (B, H, G, D) f32: the query in the model's space, its scores scaled by `scale`; sgn (D,) f32: the first
    row of the rotation R = H diag(s) / sqrt(D) (hadamard.rotation), s / sqrt(D), so that R x = H (sgn x) and
    R^T y = sgn (H y); kdat (B, H, n_pad / T, D b / 4, T / 2) uint8 key tiles (b = 4: q4_hadamard's, one code a
    nibble; else packed, kvcli/cache/turbo.py), vdat (B, H, D / W, n_pad b / 4, W / 2) value tiles (b < 4: groups of
    64 positions packed in 16 b rows); ksc/vsc (B, H, D / block, n_pad) int16 (bf16 bits); ksink/vsink (B, H, S, D)
    rotated sinks, f16 bits (uint16); koff/voff (B, H, D) f32 offsets; wkv (B, 2 H, N, D) f16 bits, the window's
    slots (K's heads, then V's), wmask (B, N) bool (True: not read); kmean (B, H, D or 0) f32, neox bool and ktab
    (n_ctx / 16 + 1, D, 16) f32: keys stored less their turning mean m (RoPE's pairs (j, j + D / 2) where neox, else
    (2 j, 2 j + 1)), q . R(p) m (q's pairs against m's, then against ktab[p // 16, :, p % 16], the table's (cos_j,
    sin_j) at p) added to store position p's score (D = 0: nothing); lim (B,) int64: store positions 0..lim[b]-1 are read; fmt (4,) int64: K's bits b and elements per
    scale, V's; mid (2,) f32: a K (V) code u stands for d (u - mid[0]) (d (u - mid[1])).
    -> out (B, H, G, D) f32 in the model's space. The rotations are done here, row by row (fast Walsh-Hadamard
    transforms, D log D additions where a product with R took D^2 multiply-adds), so that a row's bits do not depend
    on how many others share the call (a batched matmul's blocking does). On the calling thread."""
    B, H = qm.shape[0], qm.shape[1]
    for bh in range(B * H):
        _head(bh // H, bh % H, qm, scale, sgn, kdat, ksc, ksink, koff, vdat, vsc, vsink, voff, wkv, wmask, kmean, neox,
              ktab, lim, fmt, mid, out)


@jit_threaded
def _attend_threaded(qm, scale, sgn, kdat, ksc, ksink, koff, vdat, vsc, vsink, voff, wkv, wmask, kmean, neox, ktab,
                     lim, fmt, mid, out):
    """_attend with its (sequence, head) units in numba's OpenMP threads."""
    B, H = qm.shape[0], qm.shape[1]
    for bh in numba.prange(B * H):
        _head(bh // H, bh % H, qm, scale, sgn, kdat, ksc, ksink, koff, vdat, vsc, vsink, voff, wkv, wmask, kmean, neox,
              ktab, lim, fmt, mid, out)


READS_KEY_MEAN = True  # attend takes keys stored less their turning mean as KeyBias.operands, added in the pass


@functools.cache
def formats(k_layout, v_layout) -> tuple[np.ndarray, np.ndarray]:
    """_attend's fmt and mid of a K and V layout pair: q4_hadamard's (4 bits, 32 per scale, u - 8) or tq's (its
    bits and scale block, its uniform codebook's u - mid). Made once per pair (not per layer and token); read only."""
    fmt, mid = [], []
    for lay in (k_layout, v_layout):
        tq = lay.kind in (Kind.TQ_KEYS, Kind.TQ_VALUES)
        fmt += [lay.bits, lay.scale_block] if tq else [4, 32]
        mid.append(-lay.table[0] if tq else 8.0)
    return np.array(fmt, np.int64), np.array(mid, np.float32)


def _values_5d(vd: np.ndarray) -> np.ndarray:
    """tq's value planes (B, H, D / W, n_pad / 64, 16 b, W / 2) as (B, H, D / W, n_pad b / 4, W / 2); q4_hadamard's
    as they are."""
    return vd.reshape(*vd.shape[:3], -1, vd.shape[-1]) if vd.ndim == 6 else vd


def attend(q: torch.Tensor, k, v, lim: np.ndarray, window, key_mean=None) -> torch.Tensor:
    """kvcli/layout.py's decode signature: q (B, Hkv, G, D) f32 in the model's space, k and v Operands of a rotated
    K and V store layer (q4_hadamard or tq: codes, bf16 scales, f16 sinks, f32 offsets; R's first row), lim (B,)
    int64, window a DecodeWindow or None, key_mean None or (m (B, Hkv, D) f32, neox, table (n_ctx / 16 + 1, D, 16) f32):
    keys stored less their turning mean (numpy, as _attend takes them) -> (B, Hkv, G, D) f32 in the model's space. In torch's thread count (-t N), a
    (sequence, head) a thread, where numba has OpenMP threads."""
    B, H, G, D = q.shape
    kv, masked = (np.zeros((B, 2 * H, 0, D), np.uint16), np.zeros((B, 0), np.bool_)) if window is None else window
    out = np.empty((B, H, G, D), np.float32)
    kd, ks, ksink, ko = k.arrays
    vd, vs, vsink, vo = v.arrays
    kmean, neox, ktab = (_NO_MEAN, False, _NO_TABLE) if key_mean is None else key_mean
    args = (q.contiguous().numpy(), np.float32(1 / math.sqrt(D)), k.signs, kd, ks, ksink, ko, _values_5d(vd), vs,
            vsink, vo, np.ascontiguousarray(kv), np.ascontiguousarray(masked), kmean, neox, ktab, lim,
            *formats(k.layout, v.layout), out)
    threads = torch.get_num_threads()
    if threads > 1 and THREADED and B * H > 1:
        numba_threads(threads)
        _attend_threaded(*args)
    else:
        _attend(*args)
    return torch.from_numpy(out)


_NO_TABLE = np.zeros((0, 0, TABLE_LANES), np.float32)
_NO_MEAN = np.zeros((0, 0, 0), np.float32)


def warm_up(k_layout=None, v_layout=None) -> None:
    """Load the kernels now (from numba's cache: ~0.3 s; compiled the first time: seconds), with the load,
    not in the first token's time: tiny arrays of the types `attend` passes, the threaded kernel too where it runs
    (its threads started)."""
    if numba is None:
        return
    f32 = np.float32
    z4, z5 = np.zeros((1, 2, 1, 32), f32), np.zeros((1, 2, 1, 32, 16), np.uint8)
    sinks, scales = np.zeros((1, 2, 1, 32), np.uint16), np.zeros((1, 2, 1, 32), np.int16)
    args = (z4, f32(1), np.ones(32, f32), z5, scales, sinks, np.zeros((1, 2, 32), f32), z5.copy(), scales, sinks,
            np.zeros((1, 2, 32), f32), np.zeros((1, 4, 1, 32), np.uint16), np.zeros((1, 1), np.bool_),
            _NO_MEAN, False, _NO_TABLE, np.ones(1, np.int64), np.array([4, 32, 4, 32], np.int64),
            np.array([8, 8], f32), np.empty_like(z4))
    _attend(*args)
    threads = torch.get_num_threads()
    if THREADED and threads > 1:
        numba_threads(threads)
        _attend_threaded(*args)
