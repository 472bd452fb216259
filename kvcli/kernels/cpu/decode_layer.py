"""One decode token through one Llama block in one compiled call (numba): the common CPU case, a single sequence, every
matrix in ggml_tiles' form and a dense K/V cache read by attention.py's kernel.

A decode step runs ~15 Python-level ops a layer (norms, products, RoPE, the cache's write and attention, SwiGLU,
residuals); each is a few microseconds hot but 15-30 in a step's caches, cold from the weights streaming through
them, ~30% of a small model's token (benchmarks/README.md). Here the same compiled functions run in the same order
on the same operands (the norm's pass, ggml_tiles' product, rope.rotate, quantize's dense write, attention's
_attend, swiglu), so a token's bits equal the op-by-op path's (tests/test_decode_layer.py).
"""

from __future__ import annotations

import numpy as np

from . import ggml_tiles
from . import attention_rotated
from .attention import PARALLEL_MIN, _attend, _attend_threaded
from .compile import jit
from .norm import norm
from .quantize import _put_dense, _q8_0_blocks
from .rope import rotate
from .swiglu import swiglu


@jit
def _product(kind, tiles, x, threads):
    """x (M, K) -> x W.T (M, N): ggml_tiles' product in this many threads (1: the calling one)."""
    y = np.empty((x.shape[0], tiles.shape[0] * ggml_tiles.TILE_ROWS), np.float32)
    if threads > 1:
        ggml_tiles._threaded(kind, tiles, x, y, threads)
    else:
        ggml_tiles._one(kind, tiles, x, y)
    return y


PARTS = 3  # a matrix's forms stacked along N at most (q, k, v of different types: kvcli/weights.py Concat)


@jit
def _stacked(kinds, parts, x, threads):
    """x (M, K) -> x W.T (M, N) for W stacked from up to PARTS tiled forms (parts: their tiles, a unit tuple; no
    rows where unused), each part's product into its columns, as Concat's torch.cat puts them."""
    n = 0
    for i in range(PARTS):
        n += parts[i].shape[0] * ggml_tiles.TILE_ROWS
    y = np.empty((x.shape[0], n), np.float32)
    at = 0
    for i in range(PARTS):
        if parts[i].shape[0]:
            part = _product(kinds[i], parts[i], x, threads)
            y[:, at : at + part.shape[1]] = part
            at += part.shape[1]
    return y


@jit
def front(h, attn_norm, eps, kinds, wqkv, bqkv, sqk, rot, neox, heads):
    """h (T, n_embd), T tokens of one batch row (rot (1, T, D/2) theirs) -> the block's normed input x (T, n_embd)
    and their q, k and v, rotated: (1, T, H + 2 Hkv, D). sqk: (H + Hkv) D multipliers of q and k where the cache keeps
    keys scaled (kvcli/cache/key_scale.py), else 0 elements."""
    H, Hkv, D = heads[0], heads[1], heads[2]
    x = norm(h, attn_norm, eps)
    qkv = _stacked(kinds[0], wqkv, x, heads[3])  # (T, (H + 2 Hkv) D)
    if bqkv.shape[0]:
        for t in range(qkv.shape[0]):
            qkv[t] += bqkv
    q4 = qkv.reshape(1, h.shape[0], H + 2 * Hkv, D)
    rotate(q4[:, :, : H + Hkv], rot, neox)
    if sqk.shape[0]:  # after RoPE, as KVCache.attention: the same bits
        for t in range(qkv.shape[0]):
            for j in range(sqk.shape[0]):
                qkv[t, j] *= sqk[j]
    return x, q4


@jit
def back(h, o, ffn_norm, eps, kinds, wo, wgu, wdown, threads):
    """After attention's o (T, H D): the o product, the residual, the feed-forward and its residual -> (T, n_embd)."""
    h = h + _stacked(kinds[1], wo, o, threads)
    x = norm(h, ffn_norm, eps)
    return h + _stacked(kinds[3], wdown, swiglu(_stacked(kinds[2], wgu, x, threads)), threads)


@jit
def _rest(h, q4, ffn_norm, eps, kinds, wo, wgu, wdown, heads, kdat, vdat, kfmt, ktab, vfmt, vtab, wkv, wmask, extra,
          pos, scale):
    """Attention of each token m (sequence m of the stores) through its position pos[m] (written), then `back` -> the
    block's output (M, n_embd)."""
    H, Hkv, D, threads = heads[0], heads[1], heads[2], heads[3]
    M = q4.shape[1]
    qm = q4[0, :, :H].copy().reshape(M, Hkv, H // Hkv, D)
    out = np.empty_like(qm)
    lim = pos + 1
    if threads > 1:
        _attend_threaded(qm, scale, kdat, vdat, kfmt, ktab, vfmt, vtab, wkv, wmask, extra, lim, out, threads,
                         PARALLEL_MIN)
    else:
        _attend(qm, scale, kdat, vdat, kfmt, ktab, vfmt, vtab, wkv, wmask, extra, lim, out)
    return back(h, out.reshape(M, H * D), ffn_norm, eps, kinds, wo, wgu, wdown, threads)


@jit
def layer(h, attn_norm, ffn_norm, eps, kinds, wqkv, bqkv, sqk, wo, wgu, wdown, rot, neox, heads, kdat, vdat, kfmt,
          ktab, vfmt, vtab, wkv, wmask, extra, pos, scale):
    """h (M, n_embd) f32, the residual stream of M sequences' decode tokens, sequence m's at position pos[m] ((M,)
    int64; M = 1: one sequence, or a server step's rows) -> the block's output (M, n_embd), over dense stores. The four
    matrices (qkv, o, gate/up, down) as _stacked takes them, kinds (4, PARTS) their parts' TILE_TYPES indices; bqkv
    (H + 2 Hkv) D or 0 elements, sqk `front`'s; rot (1, M, D/2) complex64; heads (H, Hkv, D, threads); kdat, vdat
    (M, Hkv, n_ctx, D) the layer's stores, kfmt .. vtab their layouts and wkv, wmask, extra attention's empty window and extra
    (kvcli/kernels/cpu/attention.py)."""
    H, Hkv = heads[0], heads[1]
    x, q4 = front(h, attn_norm, eps, kinds, wqkv, bqkv, sqk, rot, neox, heads)
    _put_dense(kdat, q4[0, :, H : H + Hkv], vdat, q4[0, :, H + Hkv :], np.arange(h.shape[0]), pos)
    return _rest(h, q4, ffn_norm, eps, kinds, wo, wgu, wdown, heads, kdat, vdat, kfmt, ktab, vfmt, vtab, wkv, wmask,
                 extra, pos, scale)


@jit
def layer_q8_0(h, attn_norm, ffn_norm, eps, kinds, wqkv, bqkv, sqk, wo, wgu, wdown, rot, neox, heads, kdat, vdat,
               kfmt, ktab, vfmt, vtab, wkv, wmask, extra, pos, scale, kraw, vraw):
    """`layer` over q8_0 stores: k and v quantized into kraw, vraw (M, Hkv, n_ctx, row bytes) uint8 at pos[m] (the
    bytes kdat, vdat read as int8) as the store's compiled quantizer makes them."""
    H, Hkv = heads[0], heads[1]
    x, q4 = front(h, attn_norm, eps, kinds, wqkv, bqkv, sqk, rot, neox, heads)
    for m in range(h.shape[0]):
        p = pos[m]
        if not (0 <= p < kraw.shape[2] and p < vraw.shape[2] and m < kraw.shape[0] and m < vraw.shape[0]):
            raise IndexError("a q8_0 write outside its store")  # no bounds checks in compiled code
        _q8_0_blocks(q4[:, m : m + 1, H : H + Hkv], kraw[m : m + 1, :, p : p + 1])
        _q8_0_blocks(q4[:, m : m + 1, H + Hkv :], vraw[m : m + 1, :, p : p + 1])
    return _rest(h, q4, ffn_norm, eps, kinds, wo, wgu, wdown, heads, kdat, vdat, kfmt, ktab, vfmt, vtab, wkv, wmask,
                 extra, pos, scale)


@jit
def layer_window(h, attn_norm, ffn_norm, eps, kinds, wqkv, bqkv, sqk, wo, wgu, wdown, rot, neox, heads, scale,
                 ring_k, ring_v, slot, sgn, kdat, ksc, ksink, koff, vdat, vsc, vsink, voff, wkv, wmask, kmean, kneox, ktab, lim,
                 fmt, mid):
    """`layer` over rotated stores with a window (q4_hadamard, tq: attention_rotated.py's kernel): k and v into the
    window's ring (ring_k, ring_v (1, Hkv, N, D) f16 bits) at `slot` as its compiled pass writes them, then that
    kernel over the stores below lim and the ring's unmasked slots (its arguments from sgn on, as its `attend`
    passes them)."""
    H, Hkv, D, threads = heads[0], heads[1], heads[2], heads[3]
    x, q4 = front(h, attn_norm, eps, kinds, wqkv, bqkv, sqk, rot, neox, heads)
    _put_dense(ring_k, q4[0, :, H : H + Hkv], ring_v, q4[0, :, H + Hkv :], np.zeros(1, np.int64),
               np.full(1, slot, np.int64))
    qm = q4[0, 0, :H].copy().reshape(1, Hkv, H // Hkv, D)
    out = np.empty_like(qm)
    if threads > 1 and Hkv > 1:
        attention_rotated._attend_threaded(qm, scale, sgn, kdat, ksc, ksink, koff, vdat, vsc, vsink, voff, wkv, wmask,
                                           kmean, kneox, ktab, lim, fmt, mid, out)
    else:
        attention_rotated._attend(qm, scale, sgn, kdat, ksc, ksink, koff, vdat, vsc, vsink, voff, wkv, wmask, kmean,
                                  kneox, ktab, lim, fmt, mid, out)
    return back(h, out.reshape(1, H * D), ffn_norm, eps, kinds, wo, wgu, wdown, threads)
