"""q4_hadamard decode attention on the CPU in one compiled pass (numba): the CPU's counterpart of
the Triton kernel, for one query token per sequence (`kvcli run`, the server's slots).

What it computes is attend_reference's result (kvcli/attention.py) for T = 1 over a q4_hadamard K
and V store (kvcli/cache/hadamard.py) and their recent window: for each sequence b, KV head h and
query head g of its group,
    s_t = q_rot . (d_t,blk (u_t - 8)) + q_rot . c_k   store position t < lim[b] past the sinks,
    s_t = q_rot . sink_t                              a sink (its rotated f16 copy),
    s_n = q . k_n                                     window slot n, unless masked[b, n],
one softmax over all of them, then the store's values summed in the rotated space (d (u - 8) + c_v,
or the sink) and the window's in the model's; the first rotated back and the two added.
Torch would spend ~100 ops a layer on this (unpacking, products, offsets, sinks, the window's part, the
softmax's cat and split), each with its fixed cost; here it is one call that reads the codes where
they lie (no dequantized copy). The products over the codes are LLVM vector code (_key_scores, _value_sums):
16 bytes of codes widened once for up to 4 query heads, their sums kept in registers over a block's 32
dimensions (keys) or over the positions (values); numba's own loops at these short strides kept the sums
in memory and ran ~3x slower.

Each (sequence, head) is computed alone, in the same order whatever else is in the batch, so a
sequence gets the same bits alone and beside others (the server's solo/concurrent equality).
Single-threaded and without the GIL; it reads a store at any depth (it beat the int4 GEMM path, threaded or
not, at every depth measured). Figures: benchmarks/README.md.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvcli.cache.cpu_jit import VEC, available, butterfly16, exp_f32, hadamard16, jit, jit_reassociating, numba, to_f32



CHUNK = VEC  # code bytes a vector step reads: 16 positions (keys) or 32 elements (values), two nibbles a byte


def _key_scores(kt, k, c, q, qsum, g0, dk, s, col):
    """Compiled only (_key_scores1.._key_scores4, a group of 1-4 query heads g0..): block k's part of the scores of
    2 CHUNK positions of a key tile kt (D, T / 2): with p_l = sum over the block's dimensions e = 32 k + i of
    q[g0 + g, e] times the low nibble of kt[e, CHUNK c + l] (high: h_l), s[g0 + g, col + CHUNK c + l] += d_l (p_l - 8
    qsum[g0 + g, k]) and s[g0 + g, col + T / 2 + CHUNK c + l] += d'_l (h_l - 8 qsum[g0 + g, k]), d and d' the
    positions' block-k scales in dk (T,) bf16 bits (int16), the tile's. The codes are widened once for the group;
    the sums stay in vector registers."""
    raise NotImplementedError


def _value_sums(vt, t0, t1, c, s, col_s, dlo, dhi, g0, acc, col):
    """Compiled only (_value_sums1.._value_sums4, a group of 1-4 query heads g0..): over positions t0 <= t < t1 of a
    value tile vt (n_pad, W / 2), with p = s[g0 + g, col_s + t] (the position's weight), acc[g0 + g, col + CHUNK c + l]
    += p dlo[t] (u - 8) for u the low nibble of vt[t, CHUNK c + l], and acc[g0 + g, col + W / 2 + CHUNK c + l] the
    high nibble's with dhi[t]; dlo, dhi (n_pad,) the blocks' scales, bf16 bits (int16). The sums stay in vector
    registers over the positions."""
    raise NotImplementedError


if numba is not None:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    from kvcli.cache.cpu_jit import FLOATS, INTS, ir_at, ir_fma, ir_load, ir_splat, ir_store, ir_sums_loop, ir_bf16

    _F32, _I8, _I32, _I64 = ir.FloatType(), ir.IntType(8), ir.IntType(32), ir.IntType(64)
    _BYTES = ir.VectorType(_I8, CHUNK)

    def _nibbles(builder, addr):
        """CHUNK code bytes at addr -> their low and high nibbles as f32 vectors."""
        wide = builder.zext(ir_load(builder, addr, _BYTES), INTS)
        return [builder.sitofp(builder.and_(wide, ir.Constant(INTS, [15] * CHUNK)), FLOATS),
                builder.sitofp(builder.lshr(wide, ir.Constant(INTS, [4] * CHUNK)), FLOATS)]

    def _sums_loop(builder, count, groups, step):
        """ir_sums_loop of a low and a high sum for each of `groups` query heads."""
        return ir_sums_loop(builder, count, 2 * groups, step)

    def _key_codegen(ng: int):
        def codegen(context, builder, sig, args):
            kt, q, qsum, dk, sc = (context.make_array(sig.args[j])(context, builder, args[j]) for j in (0, 3, 4, 6, 7))
            k, c, g0, col = args[1], args[2], args[5], args[8]
            col_c = builder.mul(c, ir.Constant(_I64, CHUNK))
            e0 = builder.mul(k, ir.Constant(_I64, 32))
            fma = ir_fma(builder)
            rows = [builder.add(g0, ir.Constant(_I64, g)) for g in range(ng)]

            def step(i, sums):
                e = builder.add(e0, i)
                lo, hi = _nibbles(builder, ir_at(builder, kt, e, col_c))
                out = []
                for g in range(ng):
                    qe = ir_splat(builder, ir_load(builder, ir_at(builder, q, rows[g], e), _F32))
                    out += [builder.call(fma, [qe, lo, sums[2 * g]]), builder.call(fma, [qe, hi, sums[2 * g + 1]])]
                return out

            sums = _sums_loop(builder, ir.Constant(_I64, 32), ng, step)
            half = cgutils.unpack_tuple(builder, kt.shape)[1]
            for j, at in enumerate((col_c, builder.add(half, col_c))):  # the low nibbles' positions, the high ones'
                d = ir_bf16(builder, ir_at(builder, dk, at))  # the positions' scales
                for g in range(ng):
                    qk = ir_load(builder, ir_at(builder, qsum, rows[g], k), _F32)
                    bias = builder.fmul(ir.Constant(_F32, 8.0), qk)
                    addr = ir_at(builder, sc, rows[g], builder.add(col, at))
                    p = builder.fsub(sums[2 * g + j], ir_splat(builder, bias))
                    ir_store(builder, builder.call(fma, [d, p, ir_load(builder, addr, FLOATS)]), addr)
            return context.get_dummy_value()

        return codegen

    def _bf16(builder, addr):
        """The bf16 (int16 bits) at addr as f32."""
        bits = builder.zext(ir_load(builder, addr, ir.IntType(16)), _I32)
        return builder.bitcast(builder.shl(bits, ir.Constant(_I32, 16)), _F32)

    def _value_codegen(ng: int):
        def codegen(context, builder, sig, args):
            vt, sc, dlo, dhi, acc = (context.make_array(sig.args[j])(context, builder, args[j])
                                     for j in (0, 4, 6, 7, 9))
            t0, t1, c, col_s, g0, col = (args[j] for j in (1, 2, 3, 5, 8, 10))
            byte = builder.mul(c, ir.Constant(_I64, CHUNK))
            fma = ir_fma(builder)
            rows = [builder.add(g0, ir.Constant(_I64, g)) for g in range(ng)]
            eight = ir.Constant(FLOATS, [8.0] * CHUNK)

            def step(i, sums):
                t = builder.add(t0, i)
                lo, hi = (builder.fsub(u, eight) for u in _nibbles(builder, ir_at(builder, vt, t, byte)))
                d = [_bf16(builder, ir_at(builder, a, t)) for a in (dlo, dhi)]
                out = []
                for g in range(ng):
                    p = ir_load(builder, ir_at(builder, sc, rows[g], builder.add(col_s, t)), _F32)
                    wl, wh = (ir_splat(builder, builder.fmul(p, x)) for x in d)
                    out += [builder.call(fma, [wl, lo, sums[2 * g]]), builder.call(fma, [wh, hi, sums[2 * g + 1]])]
                return out

            sums = _sums_loop(builder, builder.sub(t1, t0), ng, step)
            half = cgutils.unpack_tuple(builder, vt.shape)[1]
            for g in range(ng):
                for j, at in enumerate((builder.add(col, byte), builder.add(builder.add(col, half), byte))):
                    addr = ir_at(builder, acc, rows[g], at)
                    ir_store(builder, builder.fadd(ir_load(builder, addr, FLOATS), sums[2 * g + j]), addr)
            return context.get_dummy_value()

        return codegen

    def _key_intrinsic(ng: int):
        def typer(typingctx, kt, k, c, q, qsum, g0, dk, s, col):
            return (types.none(kt, types.int64, types.int64, q, qsum, types.int64, dk, s, types.int64),
                    _key_codegen(ng))

        return intrinsic(typer)

    def _value_intrinsic(ng: int):
        def typer(typingctx, vt, t0, t1, c, s, col_s, dlo, dhi, g0, acc, col):
            return (types.none(vt, types.int64, types.int64, types.int64, s, types.int64, dlo, dhi, types.int64, acc,
                               types.int64), _value_codegen(ng))

        return intrinsic(typer)

    _key_scores1, _key_scores2, _key_scores3, _key_scores4 = (_key_intrinsic(g) for g in (1, 2, 3, 4))
    _value_sums1, _value_sums2, _value_sums3, _value_sums4 = (_value_intrinsic(g) for g in (1, 2, 3, 4))


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


@jit_reassociating
def _attend(qm, scale, sgn, kdat, ksc, ksink, koff, vdat, vsc, vsink, voff, wkv, wmask, lim, out):
    """qm (B, H, G, D) f32: the query in the model's space, its scores scaled by `scale`; sgn (D,) f32: the first
    row of the rotation R = H diag(s) / sqrt(D) (hadamard.rotation), s / sqrt(D), so that R x = H (sgn x) and
    R^T y = sgn (H y); kdat (B, H, n_pad / T, D, T / 2) uint8 key tiles, vdat (B, H, D / W, n_pad, W / 2) value
    tiles, ksc/vsc (B, H, D / 32, n_pad) int16 (bf16 bits); ksink/vsink (B, H, S, D) rotated sinks, f16 bits
    (uint16); koff/voff (B, H, D) f32 offsets; wkv (B, 2 H, N, D) f16 bits, the window's slots (K's heads, then
    V's), wmask (B, N) bool (True: not read); lim (B,) int64: store positions 0..lim[b]-1 are read.
    -> out (B, H, G, D) f32 in the model's space. The rotations are done here, row by row (fast Walsh-Hadamard
    transforms, D log D additions where a product with R took D^2 multiply-adds), so that a row's bits do not depend
    on how many others share the call (a batched matmul's blocking does)."""
    B, H, G, D = qm.shape
    T2 = kdat.shape[4]
    T = 2 * T2
    NV, W2 = vdat.shape[2], vdat.shape[4]
    W = 2 * W2
    NB = D // 32
    S = ksink.shape[2]
    N = wkv.shape[2]
    n_max = 0
    for b in range(B):
        n_max = max(n_max, lim[b])
    s = np.empty((G, N + n_max + T), np.float32)  # scores: window slots, then store positions (whole tiles)
    qsum = np.empty((G, NB), np.float32)
    qoff = np.empty(G, np.float32)
    qs = np.empty((G, D), np.float32)  # the scaled query
    qb = np.empty((G, D), np.float32)  # ... rotated into the stores' space
    sink = np.empty((S, D), np.float32)  # a head's sinks (keys, then values) widened
    acc = np.empty((G, D), np.float32)
    accw = np.empty((G, D), np.float32)
    win = np.empty((N, D), np.float32)  # a head's window keys, then values, widened
    psum = np.empty(G, np.float32)
    for b in range(B):
        n = lim[b]
        m0 = min(S, n)  # sinks among the read positions
        nt = (n + T - 1) // T
        for h in range(H):
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
                kt = kdat[b, h, i]  # (D, T / 2)
                col = np.int64(N + T * i)
                for k in range(NB):
                    dk = ksc[b, h, k, T * i : T * i + T]
                    for c in range(T2 // CHUNK):
                        g0 = 0
                        while g0 < G:  # a group of query heads at a time
                            r = G - g0
                            if r >= 4:
                                _key_scores4(kt, np.int64(k), np.int64(c), qb, qsum, np.int64(g0), dk, s, col)
                            elif r == 3:
                                _key_scores3(kt, np.int64(k), np.int64(c), qb, qsum, np.int64(g0), dk, s, col)
                            elif r == 2:
                                _key_scores2(kt, np.int64(k), np.int64(c), qb, qsum, np.int64(g0), dk, s, col)
                            else:
                                _key_scores1(kt, np.int64(k), np.int64(c), qb, qsum, np.int64(g0), dk, s, col)
                            g0 += min(r, 4)
            for t in range(m0):  # the sinks: their f16 copies, no offset
                for e in range(D):
                    sink[t, e] = to_f32(ksink[b, h, t, e])
            for g in range(G):
                for t in range(m0):
                    a = np.float32(0)
                    for e in range(D):
                        a += qb[g, e] * sink[t, e]
                    s[g, N + t] = a
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
            accw[:, :] = 0
            acc[:, :] = 0
            for w in range(N):
                for e in range(D):
                    win[w, e] = to_f32(wkv[b, H + h, w, e])
            for g in range(G):
                for w in range(N):
                    p = s[g, w]
                    if p != 0:
                        for e in range(D):
                            accw[g, e] += p * win[w, e]
            for i in range(NV):
                vt = vdat[b, h, i]  # (n_pad, W / 2)
                # elements W i + j and W i + W / 2 + j: their blocks' scales
                dlo, dhi = vsc[b, h, (W * i) // 32], vsc[b, h, (W * i + W2) // 32]
                for c in range(W2 // CHUNK):
                    g0 = 0
                    while g0 < G:
                        r = G - g0
                        if r >= 4:
                            _value_sums4(vt, m0, n, np.int64(c), s, np.int64(N), dlo, dhi, np.int64(g0), acc,
                                         np.int64(W * i))
                        elif r == 3:
                            _value_sums3(vt, m0, n, np.int64(c), s, np.int64(N), dlo, dhi, np.int64(g0), acc,
                                         np.int64(W * i))
                        elif r == 2:
                            _value_sums2(vt, m0, n, np.int64(c), s, np.int64(N), dlo, dhi, np.int64(g0), acc,
                                         np.int64(W * i))
                        else:
                            _value_sums1(vt, m0, n, np.int64(c), s, np.int64(N), dlo, dhi, np.int64(g0), acc,
                                         np.int64(W * i))
                        g0 += min(r, 4)
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


def _np(t: torch.Tensor) -> np.ndarray:
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def attend(q: torch.Tensor, scale: float, cache, layer: int, lim: np.ndarray,
           window: tuple[np.ndarray, np.ndarray] | None) -> torch.Tensor:
    """q (B, Hkv, G, D) f32, the query in the model's space, its scores scaled by `scale`; lim (B,) int64: each
    sequence reads store positions 0..lim-1; window: (kv (B, 2 Hkv, N, D) f16 bits (uint16), K's heads then V's,
    masked (B, N) bool) or None -> the attention output (B, Hkv, G, D) f32 in the model's space."""
    B, H, G, D = q.shape
    if window is None:
        window = np.zeros((B, 2 * H, 0, D), np.uint16), np.zeros((B, 0), np.bool_)
    out = np.empty((B, H, G, D), np.float32)
    kd, ks, ksink, ko, sgn = _views(cache.k, layer)
    vd, vs, vsink, vo, _ = _views(cache.v, layer)
    _attend(q.contiguous().numpy(), np.float32(scale), sgn, kd, ks, ksink, ko, vd, vs, vsink, vo, *window, lim, out)
    return torch.from_numpy(out)


def _views(store, layer: int) -> tuple:
    """A layer's codes, scales, sinks (f16 bits) and offsets of a store (or of a `rows` view of one), and the rotation's
    first row, as numpy views, made once."""
    def parts():
        return (store.data[layer], store.scale[layer], store.sink[layer].view(torch.uint16), store.offset[layer, :, 0],
                store.rot_first_row)

    return store.kernel_arrays("q4_hadamard", layer, parts, _np)


def decode(q: torch.Tensor, cache, layer: int, pos: int | torch.Tensor, recent) -> torch.Tensor:
    """attend_reference's result (B, 1, H * D) for q (B, 1, H, D) at pos (an int, or (B,) each sequence's own)
    with the cache's window `recent` (kvcli.attention.Recent) or None, at any depth (it reads fewer bytes a position
    than the store's int4 GEMM path, and beat it at every depth measured, -t 1 and 2: benchmarks/README.md)."""
    B, _, H, D = q.shape
    Hkv = cache.k.n_heads
    # as attend_reference: the store below lim (per sequence), the window above it
    rows = torch.is_tensor(pos)
    if recent is None:
        lim = (pos + 1).numpy() if rows else np.full(B, pos + 1, np.int64)
        window = None
    elif recent.masked is not None:  # the ring as it is (kv16), or k and v as given (a test's rows)
        kv = recent.kv16 if recent.kv16 is not None else torch.cat([recent.k, recent.v], 1).half()
        lim, window = recent.lim.view(B).numpy(), (kv.view(torch.uint16).numpy(), recent.masked.view(B, -1).numpy())
    else:  # one position for every row: the window is positions recent.start..pos (all read), widened from its f16
        lim = np.full(B, max(pos - recent.size + 1, recent.start), np.int64)
        kv = torch.cat([recent.k, recent.v], 1).half().view(torch.uint16)
        window = (kv.numpy(), np.zeros((B, kv.shape[2]), np.bool_))
    qm = q.reshape(B, Hkv, H // Hkv, D)  # (B, Hkv, G, D): T = 1
    return attend(qm, 1.0 / math.sqrt(D), cache, layer, lim, window).view(B, 1, H * D)


def warm_up(cache=None) -> None:
    """Load the kernel now (from numba's cache: ~0.3 s; compiled the first time: seconds), with the load,
    not in the first token's time. Tiny arrays of the same types as `attend` passes."""
    if numba is None:
        return
    f32 = np.float32
    z4, z5 = np.zeros((1, 1, 1, 32), f32), np.zeros((1, 1, 1, 32, 16), np.uint8)
    sinks, scales = np.zeros((1, 1, 1, 32), np.uint16), np.zeros((1, 1, 1, 32), np.int16)
    _attend(z4, f32(1), np.ones(32, f32), z5, scales, sinks, np.zeros((1, 1, 32), f32), z5.copy(), scales, sinks,
            np.zeros((1, 1, 32), f32), np.zeros((1, 2, 1, 32), np.uint16), np.zeros((1, 1), np.bool_),
            np.ones(1, np.int64), np.empty_like(z4))
