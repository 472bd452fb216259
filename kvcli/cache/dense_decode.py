"""Decode attention over dense (f32, f16, bf16) or ggml q8_0 / q4_0 K and V on the CPU in one compiled pass
(numba): what attend_reference computes for one query token per sequence (`kvcli run`, the server's slots), in one
call a layer instead of a dozen torch ops with their fixed costs and an f32 copy of the keys and values read.

For each sequence b, KV head h and query head g of its group: scores q . k_t over positions t < lim[b], one
softmax (online, over chunks of CHUNK positions: the scratch stays small at any depth), the values summed.
Elements are read where they lie and widened to f32 where used (cpu_jit.to_f32). Each (sequence, head)
is computed alone, in the same order whatever shares the call: a sequence's bits are the same alone and in
a batch. Figures: benchmarks/README.md.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvcli.cache.cpu_jit import LANES, available, exp_f32, from_f32, jit, jit_reassociating, numba, prefetch, to_f32

CHUNK = 256  # positions scored at a time (the online softmax's step)
# With several threads the reference spreads its products over them and, past about this many positions read
# (all sequences together), beats this single-threaded kernel; on one thread the kernel is ahead at every depth
# measured (benchmarks/README.md).
THREADED_MAX_POSITIONS = 1024


@jit_reassociating
def _attend(qm, scale, kdat, vdat, lim, out):
    """qm (B, H, G, D) f32, the query, scores scaled by `scale`; kdat, vdat (B, H, n_ctx, W): a position's head vector
    as its store keeps it (chunk's types); lim (B,) int64: positions 0..lim[b]-1 are read -> out (B, H, G, D) f32."""
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
                kc = chunk(kb, c0, c, kbuf)
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
                vc = chunk(vb, c0, c, vbuf)
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


def chunk(rows, c0, c, buf):
    """Positions c0..c0+c-1 of rows (n_ctx, W) as the loops above read them: a dense store's as they lie (f32, f16 bits
    as uint16, bf16 bits as int16: widened where used), a ggml block store's dequantized into buf (CHUNK, D) f32, once
    for the G query heads that read them (widening their codes where used, G times over, ran 3-5x f16's time).
    q8_0's bytes come as int8 (f16 d, 32 int8 codes a block), q4_0's as uint8 (f16 d, 16 bytes: element j of the
    block in byte j's low nibble, j + 16 in its high one, d (u - 8)), both as torch's dequantize makes them."""
    raise NotImplementedError  # compiled only (the overload below)


if numba is not None:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic, overload

    def _block_codegen(q4: bool):
        """buf[bt, bcol : bcol + 32] = a block's 32 codes from rows[t, col:] as f32, times d (q8_0: 32 int8; q4_0: 16
        bytes, their low nibbles then their high ones, less 8) as LLVM vectors: numba's own loop over a block stays
        scalar at these strides. A row's bytes are contiguous (a store's data is), so col counts bytes."""

        def codegen(context, builder, sig, args):
            f32, i8, i32, i64 = ir.FloatType(), ir.IntType(8), ir.IntType(32), ir.IntType(64)
            rows, buf = (context.make_array(sig.args[j])(context, builder, args[j]) for j in (0, 3))
            t, col, bt, bcol, d = args[1], args[2], args[4], args[5], args[6]
            rs, bs = cgutils.unpack_tuple(builder, rows.strides, 2), cgutils.unpack_tuple(builder, buf.strides, 2)
            src = builder.add(builder.ptrtoint(rows.data, i64), builder.add(builder.mul(t, rs[0]), col))
            dst = builder.add(builder.ptrtoint(buf.data, i64),
                              builder.add(builder.mul(bt, bs[0]), builder.mul(bcol, ir.Constant(i64, 4))))
            n = 16 if q4 else 32
            codes = builder.load(builder.inttoptr(src, ir.VectorType(i8, n).as_pointer()), align=1)
            splat = builder.insert_element(ir.Constant(ir.VectorType(f32, n), None), d, ir.Constant(i32, 0))
            dv = builder.shuffle_vector(splat, splat, ir.Constant(ir.VectorType(i32, n), [0] * n))
            vf = ir.VectorType(f32, n)
            if q4:
                wide = builder.zext(codes, ir.VectorType(i32, n))
                eight = ir.Constant(ir.VectorType(i32, n), [8] * n)
                low = builder.sub(builder.and_(wide, ir.Constant(ir.VectorType(i32, n), [15] * n)), eight)
                high = builder.sub(builder.lshr(wide, ir.Constant(ir.VectorType(i32, n), [4] * n)), eight)
                parts = [low, high]
            else:
                parts = [builder.sext(codes, ir.VectorType(i32, n))]
            for j, part in enumerate(parts):
                at = builder.inttoptr(builder.add(dst, ir.Constant(i64, 4 * n * j)), vf.as_pointer())
                builder.store(builder.fmul(builder.sitofp(part, vf), dv), at, align=4)
            return context.get_dummy_value()

        return codegen

    @intrinsic
    def _widen_q8_0(typingctx, rows, t, col, buf, bt, bcol, d):
        return types.none(rows, types.int64, types.int64, buf, types.int64, types.int64, types.float32), \
            _block_codegen(q4=False)

    @intrinsic
    def _widen_q4_0(typingctx, rows, t, col, buf, bt, bcol, d):
        return types.none(rows, types.int64, types.int64, buf, types.int64, types.int64, types.float32), \
            _block_codegen(q4=True)

    @overload(chunk, inline="always")
    def _chunk(rows, c0, c, buf):
        if rows.dtype == types.int8:  # q8_0

            def q8_0(rows, c0, c, buf):
                for t in range(c):
                    for k in range(buf.shape[1] // 32):
                        o = 34 * k
                        d = to_f32(np.uint16((np.uint16(rows[c0 + t, o]) & 255)
                                             | ((np.uint16(rows[c0 + t, o + 1]) & 255) << 8)))
                        _widen_q8_0(rows, np.int64(c0 + t), np.int64(o + 2), buf, np.int64(t), np.int64(32 * k), d)
                return buf

            return q8_0
        if rows.dtype == types.uint8:  # q4_0

            def q4_0(rows, c0, c, buf):
                for t in range(c):
                    for k in range(buf.shape[1] // 32):
                        o = 18 * k
                        d = to_f32(np.uint16(np.uint16(rows[c0 + t, o]) | (np.uint16(rows[c0 + t, o + 1]) << 8)))
                        _widen_q4_0(rows, np.int64(c0 + t), np.int64(o + 2), buf, np.int64(t), np.int64(32 * k), d)
                return buf

            return q4_0

        def dense(rows, c0, c, buf):
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
_BLOCKS = {"q8_0": torch.int8, "q4_0": torch.uint8}  # ggml block stores read here: their bytes typed as chunk takes


def _element(store) -> torch.dtype | None:
    """The type a store's rows are read as (chunk), or None where this kernel reads none of it."""
    if store.name in _BLOCKS and getattr(store, "data", None) is not None:
        return _BLOCKS[store.name]
    return _BITS.get(getattr(store, "dtype", None))


def covers(store) -> bool:
    """A dense store whose head size the fixed-order sums take (a multiple of LANES), or a q8_0 / q4_0 one."""
    return _element(store) is not None and store.head_dim % LANES == 0


def attend(qm: torch.Tensor, cache, layer: int, lim: np.ndarray) -> torch.Tensor:
    """qm (B, Hkv, G, D) f32, the query (scores scaled by 1 / sqrt(D) here); lim (B,) int64: each sequence reads
    positions 0..lim-1 -> the attention output (B, Hkv, G, D) f32."""
    out = np.empty(qm.shape, np.float32)
    _attend(qm.contiguous().numpy(), np.float32(1 / math.sqrt(qm.shape[-1])), _bits(cache.k, layer),
            _bits(cache.v, layer), lim, out)
    return torch.from_numpy(out)


def _bits(store, layer: int) -> np.ndarray:
    """A layer's data (B, Hkv, n_ctx, W) of a store (or of a `rows` view of one) as the kernels' numpy array: f32,
    f16 / bf16 bits as uint16 / int16, q8_0's bytes as int8, q4_0's as uint8. Made once per layer and rows."""
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
    _attend(z, np.float32(1), k, v, np.ones(2, np.int64), np.empty_like(z))
    if cache.k.name in _BLOCKS or cache.v.name in _BLOCKS:
        return  # the block stores write their own way (put is dense's)
    new = np.zeros((2, 1, 2, D), np.float32)[:, :, :1]  # a batch's new rows are strided (one sequence's contiguous)
    for rows in (new, new[:1]):
        _put(k, v, rows, rows, np.zeros(len(rows), np.int64))


def _rows_like(store, D: int) -> np.ndarray:
    """Zeros (2, 1, 1, W) typed as the store's rows are read, for a head size D."""
    width = {torch.int8: D // 32 * 34, torch.uint8: D // 32 * 18}.get(_element(store), D)
    return np.zeros((2, 1, 1, width), torch.empty(0, dtype=_element(store)).numpy().dtype)
