"""Decode's products on the CPU: a few rows of x times an Int4 form (or an Int8's Int4 parts) through AVX512-BF16
dot products, in one compiled pass (numba; the inner block written as LLVM vectors, which numba's own loops do not
make of 4-bit codes).

torch's int4 GEMV widens every code to f32 and spends an f32 FMA per row on each; rows cost it nearly as much as
the first. Here a chunk of a tile (16 bytes of two columns: 64 codes) becomes bf16 once for every row, as 128 + q
(exact: 0x4300 | q), and each row takes it in two bf16 dot instructions (vdpbf16ps: 32 products each, f32 sums
kept in registers over a 32-column block); then, per block, y += s (x . (128 + q)) + (z - 136 s) sum x, which is
x . ((q - 8) s + z). x is rounded to bf16 as torch's GEMV rounds it; y is f32 (torch's is bf16). The codes stream
from memory, so each block asks for the bytes PREFETCH ahead. Every row is computed in the same order whatever
shares the call: a row's bits are the same alone and beside others (the server's slots). Figures:
benchmarks/README.md.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from kvcli.cache.cpu_jit import available, bf16_from_f32, jit, numba, to_f32

__all__ = ["MAX_ROWS", "Operands", "available", "covers", "warm_up"]

CHUNK = 16  # bytes of a tile row unpacked at a time: 16 codes of its first half and 16 of its second
GROUP = 32  # columns per scale (Int4's)
MAX_ROWS = 8  # rows of x per call: two f32 vectors of sums each stay in registers
PREFETCH = 2048  # bytes ahead in a form's codes that a block asks for (1-8 KB measured: 2 KB the best here)
TILES_AT_ONCE = 32  # Int8's parts: 32 tiles' rows of y (<= 64 KB) are summed over every part before the next
ROWS = {m: 1 << (m - 1).bit_length() for m in range(1, MAX_ROWS + 1)}  # padded to the compiled counts


def covers(tile: int | None) -> bool:
    """Tiles whose half rows split into whole chunks (T = 32, 64: AVX2's and AVX-512's layouts)."""
    return available() and tile is not None and (tile // 2) % CHUNK == 0


if numba is not None:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def _block(typingctx, tiles, p, i, g, x, sz, xsum, y):
        """y[m, T i + n] += s (x[m] . q) + (z - 8 s) xsum[m, g] over block g's columns k (32 g <= k < 32 g + 32)
        for every row n of tile i: q its codes, s and z its scale and zero point. Per chunk of CHUNK bytes of a
        tile row (its rows c.. in the low nibbles, T / 2 + c.. in the high ones), each row of x keeps its two
        vectors of sums in registers over the block's 32 columns.
        Part p of a form whose K columns come in P parts of Kp (Int8's; Int4: one); each tile row and each row of sz
        contiguous (a narrowed form's are views), the rest C-contiguous: tiles (P, NT,
        Kp, T / 2) uint8; x a tuple of M (P, Kp / 2) int32 rows, bf16 pairs; sz (P, Kp / 32, N_pad) int32, bf16 s
        (low half) and z (high half); xsum (M, P, Kp / 32) f32, each block's sum of x; y (M, N_pad) f32."""
        if not isinstance(x, types.UniTuple):
            return None
        M = x.count

        def codegen(context, builder, sig, args):
            f32, i8, i16, i32, i64 = ir.FloatType(), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
            vb, vf, vi = ir.VectorType(i8, CHUNK), ir.VectorType(f32, CHUNK), ir.VectorType(i32, CHUNK)
            pairs = ir.VectorType(i8, 2 * CHUNK)
            words = ir.VectorType(i16, 2 * CHUNK)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fma.v{CHUNK}f32")
            # acc + the sums of bf16 pairs: lane l += a[2 l] b[2 l] + a[2 l + 1] b[2 l + 1] (AVX512-BF16's vdpbf16ps)
            dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf, vi, vi]),
                                                 "llvm.x86.avx512bf16.dpbf16ps.512")
            c64 = lambda v: ir.Constant(i64, v)  # noqa: E731
            t, sza, xsa, ya = (context.make_array(sig.args[j])(context, builder, args[j]) for j in (0, 5, 6, 7))
            P, _, K, T2 = cgutils.unpack_tuple(builder, t.shape, 4)
            n_pad = cgutils.unpack_tuple(builder, ya.shape, 2)[1]
            G = builder.udiv(K, c64(GROUP))
            ip, ig, g = args[1], args[2], args[3]
            k0 = builder.mul(g, c64(GROUP))
            sP, sNT, sK, _ = cgutils.unpack_tuple(builder, t.strides, 4)  # bytes (a narrowed form's tiles are a view)
            # byte (p, i, k0, 0)
            row0 = builder.add(builder.add(builder.mul(ip, sP), builder.mul(ig, sNT)), builder.mul(k0, sK))
            zP, zG, _ = cgutils.unpack_tuple(builder, sza.strides, 3)
            z_row = builder.udiv(builder.add(builder.mul(ip, zP), builder.mul(g, zG)), c64(4))  # sz[p, g, 0], int32s
            n0 = builder.mul(ig, builder.mul(T2, c64(2)))  # the tile's first row
            xk = builder.add(builder.mul(ip, builder.udiv(K, c64(2))), builder.udiv(k0, c64(2)))
            xs = [builder.gep(context.make_array(sig.args[4].dtype)(context, builder, a).data, [xk])
                  for a in cgutils.unpack_tuple(builder, args[4], M)]  # x[m]'s pair (k0, k0 + 1) of part p
            pg = builder.add(builder.mul(ip, G), g)  # block g of part p
            lane0 = ir.Constant(vi, [0] * CHUNK)

            def splat(v, ty):
                v = builder.insert_element(ir.Constant(ty, None), v, ir.Constant(i32, 0))
                return builder.shuffle_vector(v, v, lane0)

            def vec(ptr, at, ty):
                return builder.bitcast(builder.gep(ptr, [at]), ty.as_pointer())

            zip_ = ir.Constant(ir.VectorType(i32, 2 * CHUNK), [j for l in range(CHUNK) for j in (l, CHUNK + l)])
            low, four = ir.Constant(pairs, [15] * 2 * CHUNK), ir.Constant(pairs, [4] * 2 * CHUNK)
            bias = ir.Constant(words, [0x4300] * 2 * CHUNK)  # bf16 128 + q for a code q: 0x4300 | q
            # the memory ahead, asked for now: the codes stream from DRAM, which this loop alone does not keep busy
            prefetch = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), [i8.as_pointer(), i32, i32, i32]), "llvm.prefetch")
            read, keep, data = ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)
            for k in range(0, GROUP, 2):  # this block's bytes PREFETCH further on: a line per pair of columns (T = 64)
                at = builder.add(builder.add(row0, builder.mul(c64(k), sK)), c64(PREFETCH))
                builder.call(prefetch, [builder.gep(t.data, [at]), read, keep, data])
            for j in range(0, 64, 16):  # the next tile's scales of this block (4 lines for T = 64)
                at = builder.add(builder.add(z_row, builder.mul(T2, c64(2))), builder.add(n0, c64(j)))
                line = builder.bitcast(builder.gep(sza.data, [at]), i8.as_pointer())
                builder.call(prefetch, [line, read, keep, data])
            with cgutils.for_range(builder, builder.udiv(T2, c64(CHUNK))) as loop:
                c = builder.mul(loop.index, c64(CHUNK))
                acc = [[ir.Constant(vf, [0.0] * CHUNK)] * 2 for _ in range(M)]
                for k in range(0, GROUP, 2):
                    at = builder.add(builder.add(row0, builder.mul(c64(k), sK)), c)
                    b0 = builder.load(vec(t.data, at, vb), align=1)
                    b1 = builder.load(vec(t.data, builder.add(at, sK), vb), align=1)
                    b = builder.shuffle_vector(b0, b1, zip_)  # bytes of columns k, k + 1 of each row, side by side
                    codes = [builder.bitcast(builder.or_(builder.zext(h, words), bias), vi)
                             for h in (builder.and_(b, low), builder.lshr(b, four))]
                    for m in range(M):  # x[m]'s bf16 pair (k0 + k, k0 + k + 1), loaded here (not all held)
                        xv = splat(builder.load(builder.gep(xs[m], [c64(k // 2)])), vi)
                        acc[m] = [builder.call(dot, [acc[m][h], xv, codes[h]]) for h in (0, 1)]
                for h in (0, 1):
                    n = builder.add(builder.add(n0, c), builder.mul(c64(h), T2))  # rows n.. of W
                    pair = builder.load(vec(sza.data, builder.add(z_row, n), vi), align=4)
                    scale = builder.bitcast(builder.shl(pair, ir.Constant(vi, [16] * CHUNK)), vf)
                    zero = builder.bitcast(builder.and_(pair, ir.Constant(vi, [-65536] * CHUNK)), vf)
                    # x . (q - 8) s + z = s (x . (128 + q)) + (z - 136 s) sum x
                    offset = builder.call(fma, [ir.Constant(vf, [-136.0] * CHUNK), scale, zero])
                    for m in range(M):
                        at = builder.add(builder.mul(c64(m), builder.mul(P, G)), pg)  # xsum[m, p, g]
                        sx = splat(builder.load(builder.gep(xsa.data, [at])), vf)
                        yp = vec(ya.data, builder.add(builder.mul(c64(m), n_pad), n), vf)
                        out = builder.call(fma, [acc[m][h], scale, builder.load(yp, align=4)])
                        builder.store(builder.call(fma, [sx, offset, out]), yp, align=4)
            return context.get_dummy_value()

        return types.none(tiles, p, i, g, x, sz, xsum, y), codegen


@jit
def _gemv(tiles, sz, x, doubled, xb, pairs, xsum, y):
    """y (rows, N_pad) f32 = x W.T, TILES_AT_ONCE tiles at a time (their rows of y stay in cache over every part,
    and each part's bytes of them are read in one run).
    tiles (P, NT, Kp, T / 2) uint8, byte (p, i, k, j) holding the codes of column Kp p + k of W's rows T i + j (low
    nibble) and T i + j + T / 2 (high); sz (P, Kp / 32, N_pad) int32, bf16 bits of each block's scale s (low half)
    and zero point z (high), W = (q - 8) s + z; x (M, K) f32, M <= rows. doubled (Int8's parts): part p's columns
    are x's Kp / 2 columns of it twice (K = P Kp / 2), else x's Kp of it. Scratch: xb (rows, P Kp) int16, x as the
    kernel reads it (bf16; rows past M zero); pairs, a tuple of its rows as (P, Kp / 2) int32 (bf16 pairs); xsum
    (rows, P, Kp / 32) f32, each block's sum."""
    M = x.shape[0]
    rows, P, G = xsum.shape
    Kp = G * GROUP
    C = Kp // 2 if doubled else Kp
    for m in range(rows):
        for p in range(P):
            for g in range(G):
                a = np.float32(0)
                for k in range(GROUP * g, GROUP * g + GROUP):
                    v = bf16_from_f32(x[m, C * p + k % C]) if m < M else np.uint16(0)
                    xb[m, Kp * p + k] = v
                    a += to_f32(np.int16(v))
                xsum[m, p, g] = a
    y[:, :] = 0
    NT = tiles.shape[1]
    for i0 in range(0, NT, TILES_AT_ONCE):
        for p in range(P):
            for i in range(i0, min(i0 + TILES_AT_ONCE, NT)):
                for g in range(G):
                    _block(tiles, p, i, g, pairs, sz, xsum, y)


_scratch = threading.local()


def _buffers(rows: int, P: int, Kp: int):
    """This thread's scratch for _gemv (xb, pairs, xsum), made once per shape."""
    cache = _scratch.__dict__.setdefault("by_shape", {})
    key = (rows, P, Kp)
    if key not in cache:
        xb = np.zeros((rows, P * Kp), np.int16)
        pairs = tuple(xb.view(np.int32).reshape(rows, P, Kp // 2))
        cache[key] = xb, pairs, np.zeros((rows, P, Kp // GROUP), np.float32)
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
        """x (M, K) f32 contiguous, M <= MAX_ROWS -> x W.T (M, N_pad) f32, x rounded to bf16 (as torch's int4 GEMV
        rounds it); the rows padded to 1, 2, 4 or 8 (a compiled kernel each)."""
        M = x.shape[0]
        rows, (P, _, Kp, _) = ROWS[M], self.tiles.shape
        xb, pairs, xsum = _buffers(rows, P, Kp)
        y = np.empty((rows, self.n_pad), np.float32)
        _gemv(self.tiles, self.sz, x.numpy(), self.doubled, xb, pairs, xsum, y)
        return torch.from_numpy(y)[:M]


def warm_up(rows: int = MAX_ROWS) -> None:
    """Load (or compile, the first time on a machine: a second or so each) the kernels for 1..rows rows now."""
    tile = 64
    for doubled in (False, True):  # Int4's forms and Int8's
        ops = Operands(torch.zeros(1, tile, GROUP, dtype=torch.uint8), torch.zeros(1, 2, tile, 2, dtype=torch.bfloat16),
                       tile, doubled)
        for m in sorted({ROWS[r] for r in range(1, rows + 1)}):
            ops.matmul(torch.zeros(m, GROUP if doubled else 2 * GROUP))
