"""Decode attention over dense (f32, f16, bf16) or ggml block (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl) K and V on the
CPU in one compiled pass (numba): what attend_reference computes for one query token per sequence (`kvcli run`, the
server's slots), in one call a layer instead of a dozen torch ops with their fixed costs and an f32 copy of the keys
and values read.

For each sequence b, KV head h and query head g of its group: scores q . k_t over positions t < lim[b], one
softmax (online, over chunks of CHUNK positions: the scratch stays small at any depth), the values summed.
Elements are read where they lie and widened to f32 where used (cpu_jit.to_f32). Each (sequence, head)
is computed alone, in the same order whatever shares the call: a sequence's bits are the same alone and in
a batch. Figures: benchmarks/README.md.
"""

from __future__ import annotations

import math
import platform

import numpy as np
import torch

from kvcli.cache.cpu_jit import LANES, available, exp_f32, from_f32, jit, jit_reassociating, numba, prefetch, to_f32
from kvcli.kernel_layout import Kind

CHUNK = 256  # positions scored at a time (the online softmax's step)
# With several threads the reference spreads its products over them and, past about this many positions read
# (all sequences together), beats this single-threaded kernel; on one thread the kernel is ahead at every depth
# measured (benchmarks/README.md).
THREADED_MAX_POSITIONS = 1024
_Q4_0, _Q5_0, _IQ4_NL = Kind.Q4_0, Kind.Q5_0, Kind.IQ4_NL  # chunk's kinds, as globals numba reads


@jit_reassociating
def _attend(qm, scale, kdat, vdat, kfmt, ktab, vfmt, vtab, lim, out):
    """qm (B, H, G, D) f32, the query, scores scaled by `scale`; kdat, vdat (B, H, n_ctx, W): a position's head vector
    as its store keeps it (chunk's types); kfmt, ktab, vfmt, vtab: their block layouts (_layout); lim (B,) int64:
    positions 0..lim[b]-1 are read -> out (B, H, G, D) f32."""
    B, H, G, D = qm.shape
    KW, VW = kdat.shape[3], vdat.shape[3]
    s = np.empty((G, CHUNK), np.float32)
    acc = np.empty((G, D), np.float32)
    mx = np.empty(G, np.float32)
    total = np.empty(G, np.float32)
    kbuf, vbuf = np.empty((CHUNK, D), np.float32), np.empty((CHUNK, D), np.float32)  # block stores' chunks
    for b in range(B):
        n = lim[b]
        for h in range(H):
            acc[:, :] = 0
            mx[:] = -np.inf
            total[:] = 0
            q, kb, vb = qm[b, h], kdat[b, h], vdat[b, h]
            # the next head's keys, asked for while this one's values are summed (a new stream: the CPU's own
            # prefetcher would meet it cold); the values are asked for while the keys are scored
            kn = kdat[b, h + 1] if h + 1 < H else kdat[b + 1, 0] if b + 1 < B else kb
            for c0 in range(0, n, CHUNK):
                c = min(CHUNK, n - c0)
                kc = chunk(kb, c0, c, kbuf, kfmt, ktab)
                # each row widened where it is used, G times (cheaper than an f32 copy of the chunk stored and reread)
                for t in range(c):
                    prefetch(vb, (c0 + t) * VW)
                    for g in range(G):
                        a = np.float32(0)
                        for e in range(D):
                            a += q[g, e] * to_f32(kc[t, e])
                        s[g, t] = a * scale
                for g in range(G):  # FlashAttention's recurrence: rescale what came before to the new maximum
                    m = mx[g]
                    for t in range(c):
                        m = max(m, s[g, t])
                    a = np.float32(0)
                    for t in range(c):
                        s[g, t] = exp_f32(s[g, t] - m)
                        a += s[g, t]
                    r = exp_f32(mx[g] - m)  # 0 at the first chunk (mx = -inf)
                    total[g] = total[g] * r + a
                    for e in range(D):
                        acc[g, e] *= r
                    mx[g] = m
                vc = chunk(vb, c0, c, vbuf, vfmt, vtab)
                for t in range(c):
                    prefetch(kn, (c0 + t) * KW)
                    for g in range(G):
                        p = s[g, t]
                        for e in range(D):
                            acc[g, e] += p * to_f32(vc[t, e])
            for g in range(G):
                inv = np.float32(1) / total[g]
                for e in range(D):
                    out[b, h, g, e] = acc[g, e] * inv


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
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic, overload

    def _block_codegen(kind: str):
        """buf[bt, bcol : bcol + 32] = a block's 32 codes from rows[t, col:] as f32 (kind "q8_0": 32 int8 times d;
        "nibbles": 16 bytes, their low nibbles then their high ones, each with its fifth bit from qh, as d (u - bias)
        + m; "iq4_nl": the nibbles looked up in its int8 codebook by one byte shuffle, times d) as LLVM vectors:
        numba's own loop over a block stays scalar at these strides. A row's bytes are contiguous (a store's data
        is), so col counts bytes."""

        def codegen(context, builder, sig, args):
            f32, i8, i32, i64 = ir.FloatType(), ir.IntType(8), ir.IntType(32), ir.IntType(64)
            rows, buf = (context.make_array(sig.args[j])(context, builder, args[j]) for j in (0, 3))
            t, col, bt, bcol, d = args[1], args[2], args[4], args[5], args[6]
            rs, bs = cgutils.unpack_tuple(builder, rows.strides, 2), cgutils.unpack_tuple(builder, buf.strides, 2)
            src = builder.add(builder.ptrtoint(rows.data, i64), builder.add(builder.mul(t, rs[0]), col))
            dst = builder.add(builder.ptrtoint(buf.data, i64),
                              builder.add(builder.mul(bt, bs[0]), builder.mul(bcol, ir.Constant(i64, 4))))
            n = 32 if kind == "q8_0" else 16
            vi, vf = ir.VectorType(i32, n), ir.VectorType(f32, n)

            def splat(x, ty):
                v = builder.insert_element(ir.Constant(ty, None), x, ir.Constant(i32, 0))
                return builder.shuffle_vector(v, v, ir.Constant(vi, [0] * n))

            def const(v):
                return ir.Constant(vi, v if isinstance(v, list) else [v] * n)

            codes = builder.load(builder.inttoptr(src, ir.VectorType(i8, n).as_pointer()), align=1)
            dv = splat(d, vf)
            if kind == "q8_0":
                parts = [builder.fmul(builder.sitofp(builder.sext(codes, vi), vf), dv)]
            elif kind == "iq4_nl":  # pshufb: byte l of the table at each nibble
                vb = ir.VectorType(i8, n)
                shuffle = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vb, [vb, vb]),
                                                         "llvm.x86.ssse3.pshuf.b.128")
                table = builder.load(builder.bitcast(context.make_array(sig.args[7])(context, builder, args[7]).data,
                                                     vb.as_pointer()), align=1)
                low = builder.and_(codes, ir.Constant(vb, [15] * n))
                high = builder.lshr(codes, ir.Constant(vb, [4] * n))
                parts = [builder.fmul(builder.sitofp(builder.sext(builder.call(shuffle, [table, h]), vi), vf), dv)
                         for h in (low, high)]
            else:
                m, bias, qh = args[7], builder.trunc(args[8], i32), splat(builder.trunc(args[9], i32), vi)
                wide = builder.zext(codes, vi)
                halves = [builder.and_(wide, const(15)), builder.lshr(wide, const(4))]
                mv, bv = splat(m, vf), splat(bias, vi)
                fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fma.v{n}f32")
                parts = []
                for j, h in enumerate(halves):  # element 16 j + l takes bit 16 j + l of qh as its bit 4
                    fifth = builder.shl(builder.and_(builder.lshr(qh, const(list(range(16 * j, 16 * j + n)))),
                                                     const(1)), const(4))
                    u = builder.sitofp(builder.sub(builder.or_(h, fifth), bv), vf)
                    parts.append(builder.call(fma, [dv, u, mv]))
            for j, part in enumerate(parts):
                at = builder.inttoptr(builder.add(dst, ir.Constant(i64, 4 * n * j)), vf.as_pointer())
                builder.store(part, at, align=4)
            return context.get_dummy_value()

        return codegen

    @intrinsic
    def _widen_q8_0(typingctx, rows, t, col, buf, bt, bcol, d):
        return types.none(rows, types.int64, types.int64, buf, types.int64, types.int64, types.float32), \
            _block_codegen("q8_0")

    @intrinsic
    def _widen_iq4_nl(typingctx, rows, t, col, buf, bt, bcol, d, tab):
        return types.none(rows, types.int64, types.int64, buf, types.int64, types.int64, types.float32, tab), \
            _block_codegen("iq4_nl")

    @intrinsic
    def _widen_nibbles(typingctx, rows, t, col, buf, bt, bcol, d, m, bias, qh):
        return types.none(rows, types.int64, types.int64, buf, types.int64, types.int64, types.float32,
                          types.float32, types.int64, types.int64), _block_codegen("nibbles")

    @overload(chunk, inline="always")
    def _chunk(rows, c0, c, buf, fmt, tab):
        if rows.dtype == types.int8:  # q8_0

            def q8_0(rows, c0, c, buf, fmt, tab):
                for t in range(c):
                    for k in range(buf.shape[1] // 32):
                        o = 34 * k
                        d = to_f32(np.uint16((np.uint16(rows[c0 + t, o]) & 255)
                                             | ((np.uint16(rows[c0 + t, o + 1]) & 255) << 8)))
                        _widen_q8_0(rows, np.int64(c0 + t), np.int64(o + 2), buf, np.int64(t), np.int64(32 * k), d)
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
                            _widen_iq4_nl(rows, np.int64(c0 + t), np.int64(o + qs_at), buf, np.int64(t),
                                          np.int64(32 * k), d, tab)
                        else:
                            _widen_nibbles(rows, np.int64(c0 + t), np.int64(o + qs_at), buf, np.int64(t),
                                           np.int64(32 * k), d, m, np.int64(bias), qh)
                return buf

            return nibbles

        def dense(rows, c0, c, buf, fmt, tab):
            return rows[c0:]

        return dense


@jit
def _put(kdat, vdat, knew, vnew, pos):
    """knew, vnew (B, 1, H, D) f32 -> kdat, vdat (B, H, n_ctx, D) (as in _attend) at position pos[b] of sequence b."""
    B, _, H, D = knew.shape
    for b in range(B):
        p = pos[b]
        for h in range(H):
            for e in range(D):
                kdat[b, h, p, e] = from_f32(knew[b, 0, h, e], kdat[b, h, p, e])
                vdat[b, h, p, e] = from_f32(vnew[b, 0, h, e], vdat[b, h, p, e])


_BITS = {torch.float32: torch.float32, torch.float16: torch.uint16, torch.bfloat16: torch.int16}
# ggml block stores read here: their bytes typed as chunk takes (iq4_nl's codebook is looked up by an x86 byte
# shuffle, SSSE3's: every x86-64 CPU with AVX has it; elsewhere the reference reads that type)
_BLOCKS = {"q8_0": torch.int8, "q4_0": torch.uint8, "q4_1": torch.uint8, "q5_0": torch.uint8, "q5_1": torch.uint8}
if platform.machine().lower() in ("x86_64", "amd64"):
    _BLOCKS["iq4_nl"] = torch.uint8
_NO_BLOCKS = np.zeros(5, np.int64), np.zeros(16, np.int8)  # a dense store's layout arguments (unread)
_LAYOUTS: dict[type, tuple[np.ndarray, np.ndarray]] = {}  # _layout's, per block store class


def _element(store) -> torch.dtype | None:
    """The type a store's rows are read as (chunk), or None where this kernel reads none of it."""
    if store.name in _BLOCKS and getattr(store, "data", None) is not None:
        return _BLOCKS[store.name]
    return _BITS.get(getattr(store, "dtype", None))


def _layout(store) -> tuple[np.ndarray, np.ndarray]:
    """chunk's fmt: (kind, block bytes, m's offset, qh's offset, the nibbles' offset) int64, 0 where the block has no
    such field (d lies at 0); and tab: the type's codebook (iq4_nl's, 16 int8; zeros where none)."""
    if store.name not in _BLOCKS:
        return _NO_BLOCKS
    if type(store) not in _LAYOUTS:  # asked every layer at decode; a block type's layout is its class's
        layout, table = store.kernel_layout(), np.zeros(16, np.int8)
        table[:len(layout.table)] = layout.table
        _LAYOUTS[type(store)] = (np.array([layout.kind, layout.block_bytes, layout.m_offset, layout.qh_offset,
                                           layout.qs_offset], np.int64), table)
    return _LAYOUTS[type(store)]


def covers(store) -> bool:
    """A dense store whose head size the fixed-order sums take (a multiple of LANES), or a ggml block one (_BLOCKS)."""
    return _element(store) is not None and store.head_dim % LANES == 0


def attend(qm: torch.Tensor, cache, layer: int, lim: np.ndarray) -> torch.Tensor:
    """qm (B, Hkv, G, D) f32, the query (scores scaled by 1 / sqrt(D) here); lim (B,) int64: each sequence reads
    positions 0..lim-1 -> the attention output (B, Hkv, G, D) f32."""
    out = np.empty(qm.shape, np.float32)
    _attend(qm.contiguous().numpy(), np.float32(1 / math.sqrt(qm.shape[-1])), _bits(cache.k, layer),
            _bits(cache.v, layer), *_layout(cache.k), *_layout(cache.v), lim, out)
    return torch.from_numpy(out)


def _bits(store, layer: int) -> np.ndarray:
    """A layer's data (B, Hkv, n_ctx, W) of a store (or of a `rows` view of one) as the kernels' numpy array: f32,
    f16 / bf16 bits as uint16 / int16, q8_0's bytes as int8, the other block types' as uint8. Made once per layer and
    rows."""
    def parts():
        return (store.data[layer].view(_element(store)),)

    return store.kernel_arrays("dense", layer, parts, torch.Tensor.numpy)[0]


def put(k_store, v_store, layer: int, k: torch.Tensor, v: torch.Tensor, pos: int | torch.Tensor) -> None:
    """Store.store_pair of one new token per sequence (k, v (B, 1, Hkv, D) f32, any strides) at pos, an int or
    (B,) each sequence's own, in one compiled pass: the bits torch's conversions give, without their dozen ops."""
    p = pos.numpy() if torch.is_tensor(pos) else np.full(k.shape[0], pos, np.int64)
    _put(_bits(k_store, layer), _bits(v_store, layer), k.numpy(), v.numpy(), p)


def put_rows(kbits: np.ndarray, vbits: np.ndarray, k: torch.Tensor, v: torch.Tensor, slots: list[int]) -> None:
    """k, v (B, 1, Hkv, D) f32 -> kbits, vbits (B, Hkv, n, D) f16 bits (any strides: a window's halves) at slot slots[b]
    of row b, rounded as torch's conversion."""
    _put(kbits, vbits, k.numpy(), v.numpy(), np.array(slots, np.int64))


def decode(q: torch.Tensor, cache, layer: int, pos: int | torch.Tensor, recent) -> torch.Tensor | None:
    """attend_reference's result (B, 1, H * D) for q (B, 1, H, D) at pos (an int, or (B,) each sequence's own);
    None with a window (`recent`: a dense pair keeps none unless asked, and then the reference reads it), and
    with several threads past THREADED_MAX_POSITIONS."""
    if recent is not None:
        return None
    B, _, H, D = q.shape
    Hkv = cache.k.n_heads
    lim = pos.numpy() + 1 if torch.is_tensor(pos) else np.full(B, pos + 1, np.int64)
    if torch.get_num_threads() > 1 and int(lim.sum()) > THREADED_MAX_POSITIONS:
        return None
    return attend(q.reshape(B, Hkv, H // Hkv, D), cache, layer, lim).view(B, 1, H * D)  # (B, Hkv, G, D): T = 1


def warm_up(cache) -> None:
    """Load the kernel for this cache's store types now (from numba's cache: a fraction of a second; compiled the
    first time: seconds), with the model, not in the first token's time."""
    if numba is None:
        return
    D = 32  # a head size every type takes: a row's bytes as its store keeps them
    k, v = (_rows_like(store, D) for store in (cache.k, cache.v))
    z = np.zeros((2, 1, 1, D), np.float32)
    _attend(z, np.float32(1), k, v, *_layout(cache.k), *_layout(cache.v), np.ones(2, np.int64), np.empty_like(z))
    if cache.k.name in _BLOCKS or cache.v.name in _BLOCKS:
        return  # the block stores write their own way (put is dense's)
    new = np.zeros((2, 1, 2, D), np.float32)[:, :, :1]  # a batch's new rows are strided (one sequence's contiguous)
    for rows in (new, new[:1]):
        _put(k, v, rows, rows, np.zeros(len(rows), np.int64))


def _rows_like(store, D: int) -> np.ndarray:
    """Zeros (2, 1, 1, W) typed as the store's rows are read, for a head size D."""
    width = D // 32 * store.block_bytes if store.name in _BLOCKS else D
    return np.zeros((2, 1, 1, width), torch.empty(0, dtype=_element(store)).numpy().dtype)
