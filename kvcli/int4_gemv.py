"""Decode's products on the CPU: a few rows of x times an Int4 form (or an Int8's, its two 4-bit halves read
together as 8-bit codes) through AVX512-VNNI byte dot products, in one compiled pass (numba; the inner block written
as LLVM vectors, which numba's own loops do not make of 4-bit codes).

torch's int4 GEMV widens every code to f32 and spends an f32 FMA per row on each; rows cost it nearly as much as
the first. Here x is taken per 32 columns as integers xi = x / sx (sx = max |x| / 32512, so |xi| <= 127 * 256)
in two int8 limbs, xi = 256 hi + lo: 15-bit activations, finer than bf16's 8 bits where a block's values are
within 2^7 of its largest (one int8 limb, llama.cpp's q8 activations, turned a chat's answer: an outlier leaves
the rest of its block a few levels). Four columns of a tile (16 bytes each) become one vector of 16 rows' four
codes once for every row of x; each row takes it in one instruction a limb (vpdpbusd: 64 products of unsigned
codes by signed limbs, summed by four into int32 lanes kept in registers over a 32-column block); then, per
block, y += s sx (xi . q) + (z - 8 s) sx sum xi, which is (sx xi) . ((q - 8) s + z). The integer sums are exact,
y is f32. The codes stream from memory, so each block asks for the bytes PREFETCH ahead. Every row is computed in the
same order whatever shares the call: a row's bits are the same alone and beside others (the server's slots). At
-t N > 1 the tiles are split in N runs made at once (numba's OpenMP threads), each column by one thread as one thread
makes it: the same bits at any thread count. Figures: benchmarks/README.md.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from kvcli.cache.cpu_jit import RNE, THREADED, available, exact_jit, jit, jit_threaded, numba

__all__ = ["MAX_ROWS", "Operands", "available", "covers", "warm_up"]

CHUNK = 16  # bytes of a tile row unpacked at a time: 16 rows' codes in the low nibbles and 16 in the high
GROUP = 32  # columns per scale (Int4's)
MAX_ROWS = 8  # rows of x per call
GROUP_ROWS = 4  # rows a block is taken by at once: their 16 int32 vectors of sums stay in registers
PREFETCH = 2048  # bytes ahead in a form's codes that a block asks for (1-8 KB measured: 2 KB the best here)
TILES_AT_ONCE = 32  # Int8's parts: 32 tiles' rows of y (<= 64 KB) are summed over every part before the next
ROWS = {m: 1 << (m - 1).bit_length() for m in range(1, MAX_ROWS + 1)}  # padded to the compiled counts
X_RANGE = 127 * 256  # |x| of a block's largest element as integer limbs 256 hi + lo: hi = (xi + 128) >> 8 fits int8


def covers(tile: int | None) -> bool:
    """Tiles whose half rows split into whole chunks (T = 32, 64: AVX2's and AVX-512's layouts)."""
    return available() and tile is not None and (tile // 2) % CHUNK == 0


if numba is not None:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    def _codegen(M: int, wide: bool):
        """_block's code (wide: _block8's) for M rows of x."""

        def codegen(context, builder, sig, args):
            f32, i8, i32, i64 = ir.FloatType(), ir.IntType(8), ir.IntType(32), ir.IntType(64)
            vb, vf, vi = ir.VectorType(i8, CHUNK), ir.VectorType(f32, CHUNK), ir.VectorType(i32, CHUNK)
            quad = ir.VectorType(i8, 4 * CHUNK)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fma.v{CHUNK}f32")
            # acc + the sums of 4 products of unsigned by signed bytes: lane l += sum_c a[4 l + c] b[4 l + c] (VNNI)
            dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vi, [vi, vi, vi]),
                                                 "llvm.x86.avx512.vpdpbusd.512")
            c64 = lambda v: ir.Constant(i64, v)  # noqa: E731
            t, sza, xsa, ya = (context.make_array(sig.args[j])(context, builder, args[j]) for j in (0, 5, 6, 7))
            P, _, K, T2 = cgutils.unpack_tuple(builder, t.shape, 4)
            n_pad = cgutils.unpack_tuple(builder, ya.shape, 2)[1]
            G = builder.udiv(K, c64(GROUP))
            ip, ig, g = args[1], args[2], args[3]
            k0 = builder.mul(g, c64(GROUP))
            sP, sNT, sK, _ = cgutils.unpack_tuple(builder, t.strides, 4)  # bytes (a narrowed form's tiles are a view)

            def emit(sK, T2, fixed: bool):  # the block's code for tile rows sK bytes apart, T2 bytes wide
                # 4-bit codes at fixed strides: four columns' 128 bytes (both chunks) in two loads and one byte permute
                # where four loads and three shuffles were (one row's products -7 to -16%, four rows' -3%); one or two
                # rows unroll the two chunks (constant permutes), four keep the loop (unrolled, they ran slower) and
                # move the permute's index by the chunk. An Int8's two halves keep the four loads (faster there).
                unroll = fixed and M <= 2 and not wide
                # byte (p, i, k0, 0)
                row0 = builder.add(builder.add(builder.mul(ip, sP), builder.mul(ig, sNT)), builder.mul(k0, sK))
                # wide: the low halves' columns lie Kp / 2 further on, their block (scale d, zero 0) G / 2 further
                gs = builder.add(g, builder.udiv(G, c64(2))) if wide else g
                rows_l = builder.add(row0, builder.mul(builder.udiv(K, c64(2)), sK)) if wide else None
                zP, zG, _ = cgutils.unpack_tuple(builder, sza.strides, 3)
                z_row = builder.udiv(builder.add(builder.mul(ip, zP), builder.mul(gs, zG)), c64(4))  # sz[p, gs, 0], int32s
                n0 = builder.mul(ig, builder.mul(T2, c64(2)))  # the tile's first row
                xk = builder.add(builder.mul(ip, builder.udiv(K, c64(4))), builder.udiv(k0, c64(4)))
                xq = [builder.gep(context.make_array(sig.args[4].dtype)(context, builder, a).data, [xk])
                      for a in cgutils.unpack_tuple(builder, args[4], 2 * M)]  # x[m]'s limbs' columns k0.. of part p
                pg = builder.add(builder.mul(ip, G), g)  # block g of part p
                lane0 = ir.Constant(vi, [0] * CHUNK)

                def splat(v, ty):
                    v = builder.insert_element(ir.Constant(ty, None), v, ir.Constant(i32, 0))
                    return builder.shuffle_vector(v, v, lane0)

                def vec(ptr, at, ty):
                    return builder.bitcast(builder.gep(ptr, [at]), ty.as_pointer())

                # columns k..k + 3 of CHUNK rows, as loaded one after the other -> row l's four codes in lane l
                pair_up = ir.Constant(ir.VectorType(i32, 2 * CHUNK), list(range(2 * CHUNK)))
                lanes = ir.Constant(ir.VectorType(i32, 4 * CHUNK), [CHUNK * c + l for l in range(CHUNK) for c in range(4)])
                low, four = ir.Constant(quad, [15] * 4 * CHUNK), ir.Constant(quad, [4] * 4 * CHUNK)
                high = ir.Constant(quad, [0xF0] * 4 * CHUNK)

                # byte 4 l + j of a chunk's quad: column k + j of row c + l, at 32 j + c + l in columns k..k + 3's bytes
                picks = [32 * j + l for l in range(CHUNK) for j in range(4)]
                permute = cgutils.get_or_insert_function(builder.module, ir.FunctionType(quad, [quad] * 3),
                                                         "llvm.x86.avx512.vpermi2var.qi.512")
                every = ir.Constant(ir.VectorType(i32, 4 * CHUNK), [0] * 4 * CHUNK)

                def quads(first, c, k):  # four columns k.. from byte row `first` + c: (4 CHUNK,) i8, row l's in lane l
                    if fixed and not wide:  # four columns' 128 bytes (both chunks) in two loads, one byte permute
                        at = builder.add(first, builder.mul(c64(k), sK))
                        b = [builder.load(vec(t.data, builder.add(at, c64(64 * j)), quad), align=1) for j in range(2)]
                        if unroll:  # c a constant
                            return builder.shuffle_vector(b[0], b[1], ir.Constant(
                                ir.VectorType(i32, 4 * CHUNK), [p + c for p in picks]))
                        cb = builder.insert_element(ir.Constant(quad, None), builder.trunc(c, i8), ir.Constant(i32, 0))
                        index = builder.add(ir.Constant(quad, picks), builder.shuffle_vector(cb, cb, every))
                        return builder.call(permute, [b[0], index, b[1]])
                    at = builder.add(builder.add(first, builder.mul(c64(k), sK)), c)
                    b = [builder.load(vec(t.data, builder.add(at, builder.mul(c64(j), sK)), vb), align=1) for j in range(4)]
                    return builder.shuffle_vector(builder.shuffle_vector(b[0], b[1], pair_up),
                                                  builder.shuffle_vector(b[2], b[3], pair_up), lanes)

                # the memory ahead, asked for now: the codes stream from DRAM, which this loop alone does not keep busy
                prefetch = cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(ir.VoidType(), [i8.as_pointer(), i32, i32, i32]), "llvm.prefetch")
                read, keep, data = ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)
                # (wide: its 2 KB runs in order, which the CPU's own prefetcher follows; asking as well made one
                # row 10% slower)
                for k in range(0, GROUP, 2) if not wide else ():  # a line per pair of columns (T = 64)
                    at = builder.add(builder.add(row0, builder.mul(c64(k), sK)), c64(PREFETCH))
                    builder.call(prefetch, [builder.gep(t.data, [at]), read, keep, data])
                for j in range(0, 64, 16):  # the next tile's scales of this block (4 lines for T = 64)
                    at = builder.add(builder.add(z_row, builder.mul(T2, c64(2))), builder.add(n0, c64(j)))
                    line = builder.bitcast(builder.gep(sza.data, [at]), i8.as_pointer())
                    builder.call(prefetch, [line, read, keep, data])
                def chunk(c):  # rows c..c + CHUNK - 1 and T / 2 + c.. of the tile (c a constant where unrolled)
                    cv = c64(c) if unroll else c
                    acc = [[[ir.Constant(vi, [0] * CHUNK)] * 2 for _ in range(2)] for _ in range(M)]  # [m][limb][h]
                    for k in range(0, GROUP, 4):
                        b = quads(row0, c, k)
                        if wide:  # 16 h + l: the high halves' nibbles over the low halves'
                            bl = quads(rows_l, c, k)
                            b = [builder.or_(builder.shl(builder.and_(b, low), four), builder.and_(bl, low)),
                                 builder.or_(builder.and_(b, high), builder.lshr(bl, four))]
                        else:
                            b = [builder.and_(b, low), builder.and_(builder.lshr(b, four), low)]
                        codes = [builder.bitcast(h, vi) for h in b]
                        for m in range(M):  # x[m]'s limbs' int8 columns k0 + k..k0 + k + 3, loaded here (not all held)
                            for limb in (0, 1):
                                xv = splat(builder.load(builder.gep(xq[limb * M + m], [c64(k // 4)])), vi)
                                acc[m][limb] = [builder.call(dot, [acc[m][limb][h], codes[h], xv]) for h in (0, 1)]
                    for h in (0, 1):
                        n = builder.add(builder.add(n0, cv), builder.mul(c64(h), T2))  # rows n.. of W
                        pair = builder.load(vec(sza.data, builder.add(z_row, n), vi), align=4)
                        scale = builder.bitcast(builder.shl(pair, ir.Constant(vi, [16] * CHUNK)), vf)
                        zero = builder.bitcast(builder.and_(pair, ir.Constant(vi, [-65536] * CHUNK)), vf)
                        # x . ((q - bias) s + z) = s sx (xq . q) + (z - bias s) sx sum xq
                        bias = -128.0 if wide else -8.0
                        offset = builder.call(fma, [ir.Constant(vf, [bias] * CHUNK), scale, zero])
                        for m in range(M):
                            at = builder.mul(builder.add(builder.mul(c64(m), builder.mul(P, G)), pg), c64(2))  # xs[m, p, g]
                            sx = splat(builder.load(builder.gep(xsa.data, [at])), vf)
                            sq = splat(builder.load(builder.gep(xsa.data, [builder.add(at, c64(1))])), vf)
                            yp = vec(ya.data, builder.add(builder.mul(c64(m), n_pad), n), vf)
                            whole = builder.add(builder.shl(acc[m][0][h], ir.Constant(vi, [8] * CHUNK)), acc[m][1][h])
                            out = builder.call(fma, [builder.sitofp(whole, vf), builder.fmul(scale, sx),
                                                     builder.load(yp, align=4)])
                            builder.store(builder.call(fma, [sq, offset, out]), yp, align=4)

                if unroll:
                    for c in range(0, 32, CHUNK):
                        chunk(c)
                else:
                    with cgutils.for_range(builder, builder.udiv(T2, c64(CHUNK))) as loop:
                        chunk(builder.mul(loop.index, c64(CHUNK)))

            # T = 64 (AVX-512's tiles): constant strides fold into the loads' offsets (one base pointer, not one a
            # column kept in registers and spilled); other tiles take the general code
            fixed = builder.and_(builder.icmp_unsigned("==", sK, c64(32)), builder.icmp_unsigned("==", T2, c64(32)))
            with builder.if_else(fixed) as (then, otherwise):
                with then:
                    emit(c64(32), c64(32), True)
                with otherwise:
                    emit(sK, T2, False)
            return context.get_dummy_value()

        return codegen

    @intrinsic
    def _block(typingctx, tiles, p, i, g, x, sz, xs, y):
        """y[m, T i + n] += s sx[m] (xi[m] . q) + (z - 8 s) sx[m] sum xi[m] over block g's columns k
        (32 g <= k < 32 g + 32) for every row n of tile i: q its codes, s and z its scale and zero point; xi[m] the
        block of x[m] as integers (x ~ sx[m] xi[m], xi = 256 hi + lo). Per chunk of CHUNK bytes of a tile row (its
        rows c.. in the low nibbles, T / 2 + c.. in the high ones), four columns at a time become one vector of 16
        rows' 4 codes each, and each row of x takes it once a limb into int32 sums kept in registers over the
        block's 32 columns (256 (hi . q) + lo . q: below 2^24, exact as f32).
        Part p of a form whose K columns come in P parts of Kp (Int8's; Int4: one); each tile row and each row of sz
        contiguous (a narrowed form's are views), the rest C-contiguous: tiles (P, NT, Kp, T / 2) uint8; x a tuple
        of 2 M (P, Kp / 4) int32 rows, 4 int8 each: the M rows' hi, then their lo; sz (P, Kp / 32, N_pad) int32, bf16
        s (low half) and z (high half); xs (M, P, Kp / 32, 2) f32: each block's sx and sx sum xi; y (M, N_pad) f32."""
        if not isinstance(x, types.UniTuple):
            return None
        return types.none(tiles, p, i, g, x, sz, xs, y), _codegen(x.count // 2, wide=False)

    @intrinsic
    def _block8(typingctx, tiles, p, i, g, x, sz, xs, y):
        """_block over an Int8 part's 8-bit codes u = q + 128 = 16 h + l, rebuilt from its two halves (h in its
        first Kp / 2 columns, l in the next: block g of h pairs with block g + G / 2 of l, over the same columns of x):
        y[m, n] += d sx (xi . u) - 128 d sx sum xi, d the l block's scale. One vector of 16 rows' four 8-bit codes
        takes the place of two of 4-bit ones: each row of x makes half the byte products it made over the halves.
        The integer sums (below 2^28) are exact, rounded once to f32."""
        if not isinstance(x, types.UniTuple):
            return None
        return types.none(tiles, p, i, g, x, sz, xs, y), _codegen(x.count // 2, wide=True)


@exact_jit
def quantize_rows(x, doubled, xq, xs):
    """x (M, K) f32 -> xq (2, rows, P Kp) int8 and xs (rows, P, Kp / 32, 2) f32, what the kernel reads: each block of
    32 columns of x as integers xi = 256 hi + lo (|xi| <= 127 * 256; hi, lo int8 in xq[0], xq[1]) with a scale
    sx = max |x| / 32512 (xi = x (1 / sx) rounded to nearest even; all 0 where the block is), and (sx, sx sum xi);
    rows past M zero. doubled (Int8's parts): part p's columns are x's Kp / 2 columns of it twice (K = P Kp / 2),
    else x's Kp of it. Exact IEEE arithmetic (no fast-math): the tests reproduce it."""
    M = x.shape[0]
    rows, P, G, _ = xs.shape
    Kp = G * GROUP
    C = Kp // 2 if doubled else Kp
    for m in range(rows):
        for p in range(P):
            for g in range(G):
                k0 = Kp * p + GROUP * g
                amax = np.float32(0)
                if m < M:
                    for k in range(GROUP * g, GROUP * g + GROUP):
                        amax = max(amax, abs(x[m, C * p + k % C]))
                if amax == 0:
                    xq[:, m, k0 : k0 + GROUP] = 0
                    xs[m, p, g, 0] = 0
                    xs[m, p, g, 1] = 0
                    continue
                sx = amax / np.float32(X_RANGE)
                inv = np.float32(1) / sx
                total = 0
                for k in range(GROUP * g, GROUP * g + GROUP):
                    xi = min(max(np.int32((x[m, C * p + k % C] * inv + RNE) - RNE), -X_RANGE), X_RANGE)
                    hi = (xi + 128) >> 8
                    xq[0, m, k0 + k - GROUP * g] = hi
                    xq[1, m, k0 + k - GROUP * g] = xi - 256 * hi
                    total += xi
                xs[m, p, g, 0] = sx
                xs[m, p, g, 1] = sx * np.float32(total)


@jit
def _gemv(tiles, sz, x, doubled, xq, groups, xs, y):
    """y (rows, N_pad) f32 = x W.T, TILES_AT_ONCE tiles at a time (their rows of y stay in cache over every part,
    and each part's bytes of them are read in one run).
    tiles (P, NT, Kp, T / 2) uint8, byte (p, i, k, j) holding the codes of column Kp p + k of W's rows T i + j (low
    nibble) and T i + j + T / 2 (high); sz (P, Kp / 32, N_pad) int32, bf16 bits of each block's scale s (low half)
    and zero point z (high), W = (q - 8) s + z; x (M, K) f32, M <= rows. Scratch: xq (2, rows, P Kp) int8 and xs,
    quantize_rows'; groups: xq's rows by GROUP_ROWS, each a tuple of their limbs as (P, Kp / 4) int32 (the group's
    high limbs, then its low ones)."""
    quantize_rows(x, doubled, xq, xs)
    _span(tiles, sz, doubled, groups, xs, y, 0, tiles.shape[1])


# _gemv with the tiles split in `threads` runs at once (-t N), each of y's columns made by one thread as _gemv makes it
# (the same bits at any thread count); one kernel a count of rows: numba's threads take arrays, not _gemv's tuples,
# so each builds its groups from hi, lo = xq's limbs (2, rows, P, Kp / 4) int32.


@jit_threaded
def _threaded_1(tiles, sz, x, doubled, xq, hi, lo, xs, y, threads):
    quantize_rows(x, doubled, xq, xs)
    for t in numba.prange(threads):
        _span(tiles, sz, doubled, ((hi[0], lo[0]),), xs, y, *_run(tiles, t, threads))


@jit_threaded
def _threaded_2(tiles, sz, x, doubled, xq, hi, lo, xs, y, threads):
    quantize_rows(x, doubled, xq, xs)
    for t in numba.prange(threads):
        _span(tiles, sz, doubled, ((hi[0], hi[1], lo[0], lo[1]),), xs, y, *_run(tiles, t, threads))


@jit_threaded
def _threaded_4(tiles, sz, x, doubled, xq, hi, lo, xs, y, threads):
    quantize_rows(x, doubled, xq, xs)
    for t in numba.prange(threads):
        _span(tiles, sz, doubled, ((hi[0], hi[1], hi[2], hi[3], lo[0], lo[1], lo[2], lo[3]),), xs, y,
              *_run(tiles, t, threads))


@jit_threaded
def _threaded_8(tiles, sz, x, doubled, xq, hi, lo, xs, y, threads):
    quantize_rows(x, doubled, xq, xs)
    for t in numba.prange(threads):
        _span(tiles, sz, doubled, ((hi[0], hi[1], hi[2], hi[3], lo[0], lo[1], lo[2], lo[3]),
                                   (hi[4], hi[5], hi[6], hi[7], lo[4], lo[5], lo[6], lo[7])), xs, y,
              *_run(tiles, t, threads))


_THREADED = {1: _threaded_1, 2: _threaded_2, 4: _threaded_4, 8: _threaded_8}


@jit
def _run(tiles, t, threads):
    """Thread t's tiles of `threads` runs: lo, hi."""
    NT = tiles.shape[1]
    return NT * t // threads, NT * (t + 1) // threads


@jit
def _span(tiles, sz, doubled, groups, xs, y, lo, hi):
    """_gemv's products for tiles lo..hi (y's columns T lo .. T hi): each block is taken by one group of rows after the
    other while its bytes are at hand (a group's sums stay in registers; eight rows' would not)."""
    T = 2 * tiles.shape[3]
    y[:, T * lo : T * hi] = 0
    P = tiles.shape[0]
    G = xs.shape[2]
    for i0 in range(lo, hi, TILES_AT_ONCE):
        for p in range(P):
            for i in range(i0, min(i0 + TILES_AT_ONCE, hi)):
                if doubled:  # an Int8 part: its halves' blocks g and g + G / 2 as one block of 8-bit codes
                    for g in range(G // 2):
                        for r in range(len(groups)):
                            m = GROUP_ROWS * r
                            _block8(tiles, p, i, g, groups[r], sz, xs[m : m + GROUP_ROWS], y[m : m + GROUP_ROWS])
                else:
                    for g in range(G):
                        for r in range(len(groups)):
                            m = GROUP_ROWS * r
                            _block(tiles, p, i, g, groups[r], sz, xs[m : m + GROUP_ROWS], y[m : m + GROUP_ROWS])


_scratch = threading.local()


def _buffers(rows: int, P: int, Kp: int):
    """This thread's scratch for _gemv (xq, its rows' limbs as int32: by groups, and whole; xs), made once per shape."""
    cache = _scratch.__dict__.setdefault("by_shape", {})
    key = (rows, P, Kp)
    if key not in cache:
        xq = np.zeros((2, rows, P * Kp), np.int8)
        limbs = xq.view(np.int32).reshape(2, rows, P, Kp // 4)
        step = min(rows, GROUP_ROWS)
        groups = tuple(tuple(limbs[0, m : m + step]) + tuple(limbs[1, m : m + step]) for m in range(0, rows, step))
        cache[key] = xq, groups, (limbs[0], limbs[1]), np.zeros((rows, P, Kp // GROUP, 2), np.float32)
    return cache[key]


class Operands:
    """A form's codes and scales as the kernel reads them (numpy views, made once): packed (P, N_pad, Kp / 2) uint8
    and sz (P, Kp / 32, N_pad, 2) bf16 as Int4 keeps them (P = 1) or Int8 its parts (doubled: see _gemv)."""

    def __init__(self, packed: torch.Tensor, sz: torch.Tensor, tile: int, doubled: bool = False):
        P, self.n_pad, half = packed.shape
        self.tiles = packed.view(P, -1, 2 * half, tile // 2).numpy()
        self.sz = sz.view(torch.int32).squeeze(-1).numpy()
        self.doubled = doubled

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x (M, K) f32 contiguous, M <= MAX_ROWS -> x W.T (M, N_pad) f32, x quantized to int8 per 32 columns
        (quantize_rows); the rows padded to 1, 2, 4 or 8 (a compiled kernel each)."""
        M = x.shape[0]
        rows, (P, _, Kp, _) = ROWS[M], self.tiles.shape
        xq, groups, limbs, xs = _buffers(rows, P, Kp)
        y = np.empty((rows, self.n_pad), np.float32)
        threads = torch.get_num_threads()
        if threads > 1 and THREADED:  # -t N: the tiles in N runs at once
            if getattr(_scratch, "threads", 0) != threads:  # numba's count is per thread (and at most its default)
                numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
                _scratch.threads = threads
            _THREADED[rows](self.tiles, self.sz, x.numpy(), self.doubled, xq, *limbs, xs, y, threads)
        else:
            _gemv(self.tiles, self.sz, x.numpy(), self.doubled, xq, groups, xs, y)
        return torch.from_numpy(y)[:M]


def warm_up(rows: int = MAX_ROWS) -> None:
    """Load (or compile, the first time on a machine: a second or so each) the kernels for 1..rows rows now."""
    tile = 64
    for doubled in (False, True):  # Int4's forms and Int8's
        ops = Operands(torch.zeros(1, tile, GROUP, dtype=torch.uint8), torch.zeros(1, 2, tile, 2, dtype=torch.bfloat16),
                       tile, doubled)
        for m in sorted({ROWS[r] for r in range(1, rows + 1)}):
            ops.matmul(torch.zeros(m, GROUP if doubled else 2 * GROUP))
