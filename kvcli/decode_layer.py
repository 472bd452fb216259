"""A block's decode token in one compiled call (kvcli/kernels/cpu/decode_layer.py) where every part of it would run a
CPU kernel anyway: the op-by-op path's functions in its order, so its bits. Block.forward asks `plan` once per cache.

It applies to one sequence's token (B = T = 1) with every matrix of the block in ggml_tiles' form (FileTiles, or a
few stacked: Concat), the table's compiled norm, RoPE and SwiGLU chosen and no per-head norm (qwen3): one call where
the cache's decode is a compiled write (a dense type, q8_0; a rotated type's window) and a CPU attention kernel
(kvcli/attention.py decode_layer_stores, decode_layer_window), else two around the cache's own attention. Anything
else runs op by op.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def _compiled_parts() -> bool:
    """The choices for norm, RoPE, SwiGLU and the tiles' product are the compiled functions the layer calls."""
    from kvcli import rope, swiglu, weights

    return weights.compiled_decode_parts() and rope.compiled_on_cpu() and swiglu.compiled_on_cpu()


class DecodeLayer:
    """One block's decode over one cache: its fixed operands gathered once. A call is one compiled call where the cache
    is one the layer writes and reads itself (stores: kvcli/attention.py decode_layer_stores; window: the rotated
    types' window and kernel, decode_layer_window, at the steps that put nothing into the stores), else two around
    the cache's own `attention` (a window's flush, other types, the hidden state: any cache)."""

    def __init__(self, block, stores, window=None, sqk=None):
        from kvcli.kernels.cpu import attention as kernel, decode_layer
        from kvcli.kernels.cpu.decode_layer import PARTS
        from kvcli.kernels.cpu.vectors import TILE_TYPES

        c = block.c
        parts = [_parts(f) for f in (block.wqkv, block.wo, block.w_gate_up, block.w_down)]
        kinds = np.array([[TILE_TYPES.index(f.type) for f in p] + [-1] * (PARTS - len(p)) for p in parts], np.int64)
        tiles = [tuple(f.tiles for f in p) + (_NO_TILES,) * (PARTS - len(p)) for p in parts]
        bias = block.bqkv.numpy() if block.bqkv is not None else np.zeros(0, np.float32)
        norms, eps = (block.attn_norm.numpy(), block.ffn_norm.numpy()), np.float32(c.rms_eps)
        self.layer, self.neox, self.split = block.layer, c.rope_neox, (c.n_heads, c.n_kv_heads, c.n_kv_heads)
        self.heads = np.array([c.n_heads, c.n_kv_heads, c.head_dim, 1], np.int64)  # and the threads (at each call)
        # q and k multipliers where the cache keeps keys scaled (kvcli/cache/key_scale.py), for the calls that write and
        # read the cache themselves; the halves leave them to the cache's own attention
        sqk = _NO_SCALES if sqk is None else sqk.float().contiguous().view(-1).numpy()
        self.front = (norms[0], eps, kinds, tiles[0], bias, _NO_SCALES)  # `front`'s weights
        self.back = (norms[1], eps, kinds, tiles[1], tiles[2], tiles[3])  # `back`'s
        self.weights = (*norms, eps, kinds, tiles[0], bias, sqk, tiles[1], tiles[2], tiles[3])  # `layer`'s
        from kvcli.kernels.cpu import ggml_rows
        from kvcli.kernels.cpu.compile import THREADED, numba

        self.kernels = decode_layer  # the compiled functions, and how many threads they may run in
        self.threads, self.max_threads = ggml_rows._threads, numba.config.NUMBA_NUM_THREADS if THREADED else 1
        self.views, self.window = None, window
        self.scale = np.float32(1 / math.sqrt(c.head_dim))
        if stores is not None:
            self.views, layouts, q8_0 = stores
            G = c.n_heads // c.n_kv_heads
            self.reads = (*layouts, *kernel._NO_WINDOW, np.zeros((1, c.n_kv_heads, G, 0), np.float32))
            self.kernel = decode_layer.layer_q8_0 if q8_0 else decode_layer.layer
            self.pos = np.zeros(1, np.int64)  # a single sequence's position, as the kernel takes positions

    def rows(self, h: torch.Tensor, rows, pos: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """A server step of decode tokens only, token m for row m of `rows` (consecutive rows of the cache this plan
        is for: KVCache.rows) at position pos[m] ((M,) int64): h (1, M, n_embd), rot (M, D/2) -> (1, M, n_embd), in
        one call over the stores (plans made with rows=True)."""
        self.heads[3] = min(self.threads(), self.max_threads)
        return self._over_stores(h, rows, pos.numpy(), rot)

    def _over_stores(self, h: torch.Tensor, cache, pos: np.ndarray, rot: torch.Tensor) -> torch.Tensor:
        """The one call over the stores: h (1, M, n_embd), token m at pos[m] of row m of `cache` -> (1, M, n_embd)."""
        M = h.shape[1]
        kdat, vdat, *raw = self.views(cache, self.layer)
        out = self.kernel(h.view(M, -1).numpy(), *self.weights, rot.numpy()[None], self.neox, self.heads, kdat, vdat,
                          *self.reads, pos, self.scale, *raw)
        return torch.from_numpy(out).view(1, M, -1)

    def __call__(self, h: torch.Tensor, cache, pos: int, rot: torch.Tensor) -> torch.Tensor:
        """h (1, T, n_embd) f32 at positions pos.. (one sequence's, T = 1 where the plan is for a cache; else any rows
        the cache's attention takes: a server step's, pos its own), rot (T, D/2) their rotations -> the block's output
        (1, T, n_embd)."""
        decode_layer, T = self.kernels, h.shape[1]
        threads = self.heads[3] = min(self.threads(), self.max_threads)
        if self.views is not None:
            self.pos[0] = pos
            return self._over_stores(h, cache, self.pos, rot)
        h1, r = h.view(T, -1).numpy(), rot.numpy()[None]
        if self.window is not None and pos > 0:  # (a sequence's first token starts its keys' mean: the cache's path)
            reads = self.window(cache, self.layer, pos)
            if reads is not None:
                out = decode_layer.layer_window(h1, *self.weights, r, self.neox, self.heads, self.scale, *reads)
                return torch.from_numpy(out).view(1, 1, -1)
        x, qkv = decode_layer.front(h1, *self.front, r, self.neox, self.heads)
        q, k, v = torch.from_numpy(qkv).split(self.split, 2)  # (1, T, H, D), (1, T, Hkv, D) x 2
        o = cache.attention(self.layer, q, k, v, torch.from_numpy(x).view(1, T, -1), pos)  # (1, T, H D)
        out = decode_layer.back(h1, o.reshape(T, -1).contiguous().numpy(), *self.back, threads)
        return torch.from_numpy(out).view(1, T, -1)


_NO_TILES = np.zeros((0, 8), np.uint8)  # an unused part: no rows (read-only, as the forms' tiles are)
_NO_TILES.setflags(write=False)
_NO_SCALES = np.zeros(0, np.float32)  # keys as they come


def _parts(form) -> list:
    """A matrix's tiled forms in the order they are stacked (one, or a Concat's), [] where it has another form."""
    from kvcli.kernels.cpu.decode_layer import PARTS
    from kvcli.weights import Concat, FileTiles

    parts = form.parts if type(form) is Concat else [form]
    return parts if len(parts) <= PARTS and all(type(p) is FileTiles for p in parts) else []


ROWS = 16  # tokens up to which a batch row runs through the compiled halves: the tiles' product kernel's (weights.py
# FILE_GEMV_ROWS), the op-by-op path's for as many rows, so the same bits


def plan(block, cache=None, rows: bool = False) -> DecodeLayer | None:
    """The compiled decode layer of `block` over `cache` (None: over any cache, the two halves only), or None where
    its tokens run op by op (module docstring); rows: for DecodeLayer.rows over rows of `cache` (a server's slots),
    over the stores only."""
    from kvcli.attention import decode_layer_stores, decode_layer_window

    if block.qk_norm is not None or not all(_parts(f) for f in block.forms().values()):
        return None
    if block.attn_norm.device.type != "cpu" or not _compiled_parts():
        return None
    if cache is None:
        return DecodeLayer(block, None)
    stores = decode_layer_stores(cache, rows)
    sqk = cache.qk_scales(block.layer) if hasattr(cache, "qk_scales") else None
    if rows:
        return DecodeLayer(block, stores, sqk=sqk) if stores is not None else None
    return DecodeLayer(block, stores, decode_layer_window(cache) if stores is None else None, sqk)
