"""Decode attention over dense (f32, f16, bf16) or ggml block (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl) K and V on the
CPU in one compiled pass (numba): what attend_reference computes for one query token per sequence (`kvcli run`, the
server's slots), with or without a recent window, in one call a layer instead of a dozen torch ops with their fixed
costs and an f32 copy of the keys and values read.

For each sequence b, KV head h and query head g of its group: scores q . k over the unmasked slots of the window (its
f16 rows) and the store's positions t < lim[b], one softmax, the values summed. The work of a (sequence, head) is cut
at multiples of SPLIT store positions (the last split taking the rest: SPLIT..2 SPLIT - 1 positions each; the window
read with the first), each an online softmax over chunks of CHUNK positions (FlashAttention's recurrence: the scratch
stays small at any depth) leaving a partial (maximum, sum, weighted values); the partials are merged in split order.
With -t N > 1 the (sequence, head, split) units run in N threads at once (numba's OpenMP threads, a run of units
each), at every depth. Elements are read where they lie and widened to f32 where used: a chunk's key or value row
once for up to 4 query heads (vectors.dense_key_scores / dense_value_sums), a block store's chunk into f32 once for
all of them (vectors.widen_*).

A unit is computed alone, by the same machine code whichever thread runs it (_run: one specialization, never inlined,
so that LLVM cannot compile it otherwise inside the one-thread and the threaded kernel), and a split's positions depend
on its sequence's lim only (not on the batch or the thread count): a sequence's bits are the same alone and in a batch,
at any thread count (the tests compare them bit for bit). A sequence that reads fewer than 2 SPLIT store positions is
one unit: one online softmax, as the single-pass kernel this one replaced ran (its products now vectors.dense_*: a key
or value row widened once for up to 4 query heads, ~1.3-1.5x the old loops' speed on one thread; other bits than
theirs, by the sums' order). Figures: benchmarks/README.md.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .compile import FAST, THREADED, VEC, available, jit, jit_reassociating, jit_threaded, numba, numba_threads
from .vectors import (dense_key_scores1, dense_key_scores2, dense_key_scores3, dense_key_scores4, dense_value_sums1,
                      dense_value_sums2, dense_value_sums3, dense_value_sums4, exp_f32, out_of_line, to_f32)
from ..layout import DENSE_KINDS, Kind

CHUNK = 256  # positions scored at a time (the online softmax's step)
SPLIT = 512  # store positions per unit of work (a multiple of CHUNK): one unit per (sequence, head) below 2 SPLIT
# Threads start only where a call reads at least this many (window slots + store positions) x KV heads: below it a
# parallel region (a few microseconds) costs more than it saves (the units run on the calling thread: the same bits).
PARALLEL_MIN = 1024
_Q4_0, _Q5_0, _IQ4_NL = Kind.Q4_0, Kind.Q5_0, Kind.IQ4_NL  # chunk's kinds, as globals numba reads


def _inlined(f):
    """jit_reassociating's flags, inlined by numba into its caller (_run): part of the one function both kernels run."""
    if numba is None:
        return f
    return numba.njit(cache=True, nogil=True, fastmath=FAST | {"reassoc"}, inline="always")(f)


@_inlined
def _scores(q, scale, kc, c, s, mx, total, acc, vpf, vat, ex, x0):
    """The online softmax's step over c keys kc (c, D) (f32, or a dense store's rows as they lie): s[g, :c] = the
    weights e^(score - max) of q (G, D) . kc * scale (+ ex[g, x0 + t] where x0 >= 0: the store's positions x0..
    of keys stored less their bias), the running maximum mx (G,) and sum total (G,) brought up to them, acc (G, D)
    rescaled to the new maximum. vpf (n, VW): the rows whose values come next, asked for from row vat on, a row with
    each key row (a new stream: the CPU's own prefetcher would meet it cold)."""
    G, D = acc.shape
    g0 = 0
    while g0 < G:  # the products: a row widened once for up to 4 query heads (vectors.dense_key_scores)
        r = G - g0
        npf = c if g0 == 0 else 0  # the values' rows asked for once, a row with each key row
        if r >= 4:
            dense_key_scores4(kc, c, q, g0, s, scale, vpf, vat, npf)
        elif r == 3:
            dense_key_scores3(kc, c, q, g0, s, scale, vpf, vat, npf)
        elif r == 2:
            dense_key_scores2(kc, c, q, g0, s, scale, vpf, vat, npf)
        else:
            dense_key_scores1(kc, c, q, g0, s, scale, vpf, vat, npf)
        g0 += min(r, 4)
    if x0 >= 0 and ex.shape[1] > 0:
        for g in range(G):
            for t in range(c):
                s[g, t] += ex[g, x0 + t]
    for g in range(G):  # FlashAttention's recurrence: rescale what came before to the new maximum
        m = mx[g]
        for t in range(c):
            m = max(m, s[g, t])
        a = np.float32(0)
        for t in range(c):
            s[g, t] = exp_f32(s[g, t] - m)
            a += s[g, t]
        r = exp_f32(mx[g] - m)  # 0 at a unit's first step (mx = -inf)
        total[g] = total[g] * r + a
        for e in range(D):
            acc[g, e] *= r
        mx[g] = m


@_inlined
def _sums(s, vc, c, acc, kpf, kat):
    """acc[g] += sum over t < c of s[g, t] vc[t] (vc (c, D): f32, or a dense store's rows as they lie), VEC columns
    at a time, the sums in registers over the rows (vectors.dense_value_sums). kpf (n, KW): the keys read next, asked
    for from row kat on, a row with each value row."""
    G, D = acc.shape
    for col in range(0, D, VEC):
        g0 = 0
        while g0 < G:
            r = G - g0
            npf = c if col == 0 and g0 == 0 else 0  # the next keys' rows asked for once, with the first columns
            if r >= 4:
                dense_value_sums4(vc, c, s, g0, acc, col, kpf, kat, npf)
            elif r == 3:
                dense_value_sums3(vc, c, s, g0, acc, col, kpf, kat, npf)
            elif r == 2:
                dense_value_sums2(vc, c, s, g0, acc, col, kpf, kat, npf)
            else:
                dense_value_sums1(vc, c, s, g0, acc, col, kpf, kat, npf)
            g0 += min(r, 4)


@jit_reassociating
def _run(lo, hi, units, qm, scale, kdat, vdat, kfmt, ktab, vfmt, vtab, wkv, wmask, extra, pacc, pmax):
    """Units lo..hi-1 of `units` (_plan's), one after the other, each into its partial: pacc[u] (G, D) the values
    weighted by e^(score - max), pmax[u] (2, G) the maximum score and the sum of the weights. Unit (b, h, p0, p1) reads
    store positions p0..p1-1 of head h of sequence b, and where p0 = 0 the window's unmasked slots first (the
    reference's order). The other arguments are _attend's. Its own scratch: a thread's. Never inlined: the one-thread
    and the threaded kernel run the same machine code."""
    out_of_line()
    B, H, G, D = qm.shape
    N = wkv.shape[2]
    s = np.empty((G, max(CHUNK, N)), np.float32)  # the weights of a chunk (or of the window)
    kbuf, vbuf = np.empty((CHUNK, D), np.float32), np.empty((CHUNK, D), np.float32)  # block stores' chunks
    slots = np.empty((2 * N, D), np.float32)
    wk, wv = slots[:N], slots[N:]  # the window's read slots
    for u in range(lo, hi):
        b, h, p0, p1 = units[u, 0], units[u, 1], units[u, 2], units[u, 3]
        q, kb, vb, ex = qm[b, h], kdat[b, h], vdat[b, h], extra[b, h]
        # the next unit's keys, asked for while this one's values are summed (position p0 + i here, p0' + i there)
        kn, kat = kb, p0
        if u + 1 < hi:
            kn, kat = kdat[units[u + 1, 0], units[u + 1, 1]], units[u + 1, 2]
        acc, mx, total = pacc[u], pmax[u, 0], pmax[u, 1]  # summed where they are kept
        mx[:] = -np.inf
        total[:] = 0
        acc[:, :] = 0
        if p0 == 0 and N > 0:
            c = 0
            for w in range(N):
                if not wmask[b, w]:
                    for e in range(D):
                        wk[c, e] = to_f32(wkv[b, h, w, e])
                        wv[c, e] = to_f32(wkv[b, H + h, w, e])
                    c += 1
            if c > 0:  # the store's first values and keys asked for meanwhile
                _scores(q, scale, wk, c, s, mx, total, acc, vb, p0, ex, -1)
                _sums(s, wv, c, acc, kb, p0)
        for c0 in range(p0, p1, CHUNK):
            c = min(CHUNK, p1 - c0)
            _scores(q, scale, chunk(kb, c0, c, kbuf, kfmt, ktab), c, s, mx, total, acc, vb, c0, ex, c0)
            _sums(s, chunk(vb, c0, c, vbuf, vfmt, vtab), c, acc, kn, kat + c0 - p0)


@jit
def _plan(lim, H, N, threads):
    """The units of a call (B = len(lim) sequences, H heads, a window of N slots), in one allocation:
    units (U, 4) int64 rows (b, h, p0, p1): sequence b's head h cut at multiples of SPLIT of its lim[b] store
        positions, the last unit taking the rest (SPLIT..2 SPLIT - 1 positions each: no short unit, whose successor
        would start cold, as a unit asks for the next one's keys while it reads its own); one unit below 2 SPLIT (or
        where the row reads only its window);
    first (B H + 1,): head (b, h)'s units are first[b H + h] .. first[b H + h + 1] - 1;
    runs (threads + 1,): thread i runs units runs[i] .. runs[i + 1] - 1, consecutive units of about equal cost (the
        positions they read, a first unit's window slots counted);
    work: their total cost."""
    B = lim.shape[0]
    U = 0
    for b in range(B):
        U += H * max(1, lim[b] // SPLIT)
    plan = np.empty(4 * U + B * H + threads + 2, np.int64)
    units, first, runs = plan[: 4 * U].reshape((U, 4)), plan[4 * U : 4 * U + B * H + 1], plan[4 * U + B * H + 1 :]
    u, work = 0, 0
    for b in range(B):
        n = lim[b]
        k = max(1, n // SPLIT)
        for h in range(H):
            first[b * H + h] = u
            for i in range(k):
                units[u, 0], units[u, 1], units[u, 2] = b, h, i * SPLIT
                units[u, 3] = n if i == k - 1 else (i + 1) * SPLIT
                u += 1
        work += H * (n + N)
    first[B * H] = U
    runs[0] = 0
    i, done = 0, 0
    for u in range(U):  # unit u to the thread its middle falls in
        cost = units[u, 3] - units[u, 2] + N * (units[u, 2] == 0)
        r = min(threads - 1, (2 * done + cost) * threads // (2 * max(work, 1)))
        while i < r:
            i += 1
            runs[i] = u
        done += cost
    while i < threads:
        i += 1
        runs[i] = U
    return units, first, runs, work


@jit_reassociating
def _merge(first, pacc, pmax, out):
    """out (B, H, G, D) f32 <- each head's partials (_run's) merged in split order: sum_u acc_u e^(max_u - m) /
    sum_u total_u e^(max_u - m), m their largest maximum; a head of one unit: acc / total (the single pass's result).
    Never inlined, as _run: one machine code for both kernels."""
    out_of_line()
    B, H, G, D = out.shape
    for bh in range(B * H):
        b, h = bh // H, bh % H
        u0, u1 = first[bh], first[bh + 1]
        if u1 - u0 == 1:
            for g in range(G):
                inv = np.float32(1) / pmax[u0, 1, g]
                for e in range(D):
                    out[b, h, g, e] = pacc[u0, g, e] * inv
            continue
        for g in range(G):
            m = np.float32(-np.inf)
            for u in range(u0, u1):
                m = max(m, pmax[u, 0, g])
            o = out[b, h, g]
            o[:] = 0
            total = np.float32(0)
            for u in range(u0, u1):
                r = exp_f32(pmax[u, 0, g] - m)
                total += pmax[u, 1, g] * r
                for e in range(D):
                    o[e] += pacc[u, g, e] * r
            inv = np.float32(1) / total
            for e in range(D):
                o[e] *= inv


@jit_reassociating
def _attend(qm, scale, kdat, vdat, kfmt, ktab, vfmt, vtab, wkv, wmask, extra, lim, out):
    """qm (B, H, G, D) f32, the query, scores scaled by `scale`; kdat, vdat (B, H, n_ctx, W): a position's head vector
    as its store keeps it (chunk's types); kfmt, ktab, vfmt, vtab: their block layouts (_layout); wkv (B, 2 H, N, D)
    uint16: the window's f16 rows (K's heads, then V's), wmask (B, N) bool: True where row b reads no slot; lim (B,)
    int64: store positions 0..lim[b]-1 are read; extra (B, H, G, P): added to the store's scores (P = 0: nothing)
    -> out (B, H, G, D) f32. On the calling thread."""
    B, H, G, D = qm.shape
    units, first, runs, work = _plan(lim, H, wkv.shape[2], 1)
    pacc, pmax = np.empty((units.shape[0], G, D), np.float32), np.empty((units.shape[0], 2, G), np.float32)
    # all units: 0..U-1, as int64 read from an array (a literal 0 would compile a _run of its own, not the threads')
    _run(first[0], first[-1], units, qm, scale, kdat, vdat, kfmt, ktab, vfmt, vtab, wkv, wmask, extra, pacc, pmax)
    _merge(first, pacc, pmax, out)


@jit_threaded
def _attend_threaded(qm, scale, kdat, vdat, kfmt, ktab, vfmt, vtab, wkv, wmask, extra, lim, out, threads, min_work):
    """_attend with the units in `threads` runs at once (numba's OpenMP threads), where the call reads at least
    min_work positions x heads (else on the calling thread: the same bits). The same compiled _run for every run."""
    B, H, G, D = qm.shape
    units, first, runs, work = _plan(lim, H, wkv.shape[2], threads)
    pacc, pmax = np.empty((units.shape[0], G, D), np.float32), np.empty((units.shape[0], 2, G), np.float32)
    if work < min_work or threads < 2:
        _run(first[0], first[-1], units, qm, scale, kdat, vdat, kfmt, ktab, vfmt, vtab, wkv, wmask, extra, pacc, pmax)
    else:
        for i in numba.prange(threads):  # the body one call: its scratch allocated there, a thread's own
            _run(runs[i], runs[i + 1], units, qm, scale, kdat, vdat, kfmt, ktab, vfmt, vtab, wkv, wmask, extra, pacc,
                 pmax)
    _merge(first, pacc, pmax, out)


def chunk(rows, c0, c, buf, fmt, tab):
    """Positions c0..c0+c-1 of rows (n_ctx, W) as the loops above read them: a dense store's as they lie (f32, f16 bits
    as uint16, bf16 bits as int16: widened where used), a ggml block store's dequantized into buf (CHUNK, D) f32, once
    for the G query heads that read them (widening their codes where used, G times over, ran 3-5x f16's time).
    q8_0's bytes come as int8 (f16 d, 32 int8 codes a block); the 4- and 5-bit types' as uint8, fmt (_layout) saying
    where a block's fields lie: f16 d, f16 m (q4_1, q5_1), 4 bytes of fifth bits (q5_0, q5_1: bit j of the little-
    endian uint32 is element j's), 16 bytes of nibbles (element j of the block in byte j's low nibble, j + 16 in its
    high one). A code u (0..15, 0..31 with its fifth bit) is d (u - 8) (q4_0), d (u - 16) (q5_0), d u + m (q4_1,
    q5_1), d tab[u] (iq4_nl: tab its int8 codebook), as torch's dequantize makes them (d u + m: one rounding, an
    fma)."""
    raise NotImplementedError  # compiled only (the overload below)


if numba is not None:
    from numba import types
    from numba.extending import overload

    from .vectors import widen_iq4_nl, widen_nibbles, widen_q8_0

    @overload(chunk, inline="always")
    def _chunk(rows, c0, c, buf, fmt, tab):
        if rows.dtype == types.int8:  # q8_0

            def q8_0(rows, c0, c, buf, fmt, tab):
                for t in range(c):
                    for k in range(buf.shape[1] // 32):
                        o = 34 * k
                        d = to_f32(np.uint16((np.uint16(rows[c0 + t, o]) & 255)
                                             | ((np.uint16(rows[c0 + t, o + 1]) & 255) << 8)))
                        widen_q8_0(rows, np.int64(c0 + t), np.int64(o + 2), buf, np.int64(t), np.int64(32 * k), d)
                return buf

            return q8_0
        if rows.dtype == types.uint8:  # the 4- and 5-bit types

            def nibbles(rows, c0, c, buf, fmt, tab):
                kind, size, m_at, qh_at, qs_at = fmt[0], fmt[1], fmt[2], fmt[3], fmt[4]
                bias = 8 * np.int64(kind == _Q4_0) + 16 * np.int64(kind == _Q5_0)  # u - bias: q4_0, q5_0
                for t in range(c):
                    r = rows[c0 + t]
                    for k in range(buf.shape[1] // 32):
                        o = size * k
                        d = to_f32(np.uint16(np.uint16(r[o]) | (np.uint16(r[o + 1]) << 8)))
                        # a field the type lacks reads as 0 (its offset 0 points at d): no branch, which numba's
                        # inlining warns about
                        a, b = o + m_at, o + qh_at
                        m = to_f32(np.uint16((np.uint16(r[a]) | (np.uint16(r[a + 1]) << 8)) * (m_at != 0)))
                        qh = (np.int64(r[b]) | (np.int64(r[b + 1]) << 8) | (np.int64(r[b + 2]) << 16)
                              | (np.int64(r[b + 3]) << 24)) * (qh_at != 0)
                        if kind == _IQ4_NL:
                            widen_iq4_nl(rows, np.int64(c0 + t), np.int64(o + qs_at), buf, np.int64(t),
                                         np.int64(32 * k), d, tab)
                        else:
                            widen_nibbles(rows, np.int64(c0 + t), np.int64(o + qs_at), buf, np.int64(t),
                                          np.int64(32 * k), d, m, np.int64(bias), qh)
                return buf

            return nibbles

        def dense(rows, c0, c, buf, fmt, tab):
            return rows[c0:]

        return dense


_NO_BLOCKS = np.zeros(5, np.int64), np.zeros(16, np.int8)  # a dense store's layout arguments (unread)
_LAYOUTS: dict = {}  # _layout's, per KernelLayout
_NO_WINDOW = np.zeros((1, 1, 0, 1), np.uint16), np.zeros((1, 0), np.bool_)  # a window of no slots (N = 0: unread)


def no_extra(q: torch.Tensor) -> np.ndarray:
    """extra's stand-in where the scores take nothing: (B, Hkv, G, 0) f32 (one compiled kernel for both)."""
    return np.zeros((*q.shape[:3], 0), np.float32)


def _layout(layout) -> tuple[np.ndarray, np.ndarray]:
    """chunk's fmt: (kind, block bytes, m's offset, qh's offset, the nibbles' offset) int64, 0 where the block has no
    such field (d lies at 0); and tab: the type's codebook (iq4_nl's, 16 int8; zeros where none)."""
    if layout.kind in DENSE_KINDS:
        return _NO_BLOCKS
    if layout not in _LAYOUTS:  # asked every layer at decode: made once per layout
        table = np.zeros(16, np.int8)
        table[:len(layout.table)] = layout.table
        _LAYOUTS[layout] = (np.array([layout.kind, layout.block_bytes, layout.m_offset, layout.qh_offset,
                                      layout.qs_offset], np.int64), table)
    return _LAYOUTS[layout]


def _rows(ops) -> np.ndarray:
    """A store layer's data as chunk reads it: q8_0's bytes as int8, the rest as they come (f32, f16 / bf16 bits as
    uint16 / int16, block bytes as uint8)."""
    data = ops.arrays[0]
    return data.view(np.int8) if ops.layout.kind == Kind.Q8_0 else data


def _window(window) -> tuple[np.ndarray, np.ndarray]:
    """A DecodeWindow's (kv, masked) as _attend reads them (C order: the ring and its mask are), or one of no slots."""
    if window is None:
        return _NO_WINDOW
    kv, masked = window
    return np.ascontiguousarray(kv), np.ascontiguousarray(masked)


def attend(q: torch.Tensor, k, v, lim: np.ndarray, window, extra: np.ndarray | None = None) -> torch.Tensor:
    """kvcli/kernels/layout.py's decode signature: q (B, Hkv, G, D) f32, k and v Operands of dense or ggml block
    stores, lim (B,) int64, window a DecodeWindow or None, extra None or (B, Hkv, G, P) f32 -> (B, Hkv, G, D) f32.
    In torch's thread count (-t N), numba's OpenMP threads where it has them."""
    out = np.empty(q.shape, np.float32)
    args = (q.contiguous().numpy(), np.float32(1 / math.sqrt(q.shape[-1])), _rows(k), _rows(v), *_layout(k.layout),
            *_layout(v.layout), *_window(window), no_extra(q) if extra is None else np.ascontiguousarray(extra),
            lim, out)
    threads = torch.get_num_threads()
    if threads > 1 and THREADED:
        _attend_threaded(*args, numba_threads(threads), PARALLEL_MIN)
    else:
        _attend(*args)
    return torch.from_numpy(out)


def warm_up(k_layout, v_layout) -> None:
    """Load the kernels for these layouts now (from numba's cache: a fraction of a second; compiled the first time:
    seconds each), with the model, not in the first token's time: the one-thread kernel and, where numba has OpenMP,
    the threaded one, its threads started. Tiny arrays of the types `attend` passes (a window's or none: the same)."""
    if numba is None:
        return
    D = 32  # a head size every type takes: a row's bytes as its store keeps them
    k, v = (_rows_like(lay, D) for lay in (k_layout, v_layout))
    z = np.zeros((2, 1, 1, D), np.float32)
    args = (z, np.float32(1), k, v, *_layout(k_layout), *_layout(v_layout), *_window(None), no_extra(z),
            np.ones(2, np.int64), np.empty_like(z))
    _attend(*args)
    if THREADED:  # with -t N > 1, its threads started too; at -t 1 loaded on one thread (no pool: its idle
        threads = torch.get_num_threads()  # threads would spin beside torch's)
        _attend_threaded(*args, numba_threads(threads), 0 if threads > 1 else 1 << 62)


_DENSE_DTYPES = {Kind.F32: np.float32, Kind.F16: np.uint16, Kind.BF16: np.int16}


def _rows_like(layout, D: int) -> np.ndarray:
    """Zeros (2, 1, 1, W) typed as a store of this layout's rows are read, for a head size D."""
    if layout.kind in DENSE_KINDS:
        return np.zeros((2, 1, 1, D), _DENSE_DTYPES[layout.kind])
    return np.zeros((2, 1, 1, D // 32 * layout.block_bytes), np.int8 if layout.kind == Kind.Q8_0 else np.uint8)
