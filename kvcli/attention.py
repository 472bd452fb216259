"""Attention over what the cache holds: the one dispatcher and its PyTorch reference.

Every query attends to stored-then-loaded K/V (prefill included), so a lossy cache
type shows its loss everywhere. The reference reads the cache in chunks of positions, so
no step holds the whole cache in f32: with flash attention on, an online softmax
(FlashAttention's recurrence) over the chunks; off, the scores are materialized (they are
small: one row per query) and V is still read chunk by chunk. A store may keep vectors in
a rotated space: the query goes into the K store's space and the output comes back out of
the V store's. The products q.K and p.V of a chunk are the stores' own (Store.scores,
Store.weighted_sum): q4_0 and q4_hadamard compute them for decode straight from their bytes
(kvcli/cache/block_products.py, kvcli/cache/int4_gemm.py).

With a recent window (kvcli/cache/window.py) the query at position i reads its newest positions
(i-N+1..i) from the window's f16 copy, handed in as `Recent`, and only older ones from the store:
per query row, so a batched prefill sees exactly what token-by-token decode would.

This is the one dispatcher: `Attention` (the -fa choice) runs the Triton kernels (kvcli.kernels,
a leaf fed tensors and each store's KernelLayout) where they cover the case on CUDA, and the
PyTorch reference elsewhere, with the same result; `use_triton` is the switch the stores'
quantize-on-write asks too. The KV kernel reads the window too (the same per-row split); the
hidden-state cache's kernel knows none: with one, CUDA runs its reference.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from kvcli.kernel_layout import DENSE_KINDS, GGML_KINDS, Kind
from kvcli.memory import MIB

# f32 scratch budget per chunk of K (and again of V), in bytes: bounds peak memory.
CHUNK_BYTES = 8 * MIB
MIN_CHUNK = 256


def use_triton(t: torch.Tensor) -> bool:
    """Run the Triton kernels on this tensor's data? A CUDA tensor, and the kernels not turned off with
    KVCLI_TRITON=0 (which runs the PyTorch reference on the GPU, to show the kernels' gain)."""
    return t.is_cuda and os.environ.get("KVCLI_TRITON", "1") != "0"


class Recent:
    """A batch's f16 window (kvcli/cache/window.py), as attention reads it: k and v (B, Hkv, n, D) f32
    of positions start..start+n-1 (the batch's last position is start+n-1), in the model's space. The
    query at position i reads positions max(i - size + 1, start)..i from here, older ones from the store.
    Rows at their own positions (a (B,) pos at decode, kvcli/cache/window.py `push_rows`): k and v hold each
    row's whole ring in slot order (n = size); masked (B, 1, 1, n) is True where row b reads no slot, and
    row b reads the store below lim[b] (B, 1, 1, 1); start and high: the smallest and largest lim. There
    kv16 is the ring itself, (B, 2 Hkv, n, D) f16, K's heads then V's: a kernel reads it as it is, and k and v
    are widened from it only when asked for (the reference's path)."""

    def __init__(self, k: torch.Tensor | None, v: torch.Tensor | None, start: int, size: int,
                 masked: torch.Tensor | None = None, lim: torch.Tensor | None = None, high: int = 0,
                 kv16: torch.Tensor | None = None):
        self._k, self._v, self.start, self.size = k, v, start, size
        self.masked, self.lim, self.high, self.kv16 = masked, lim, high, kv16

    @property
    def k(self) -> torch.Tensor:
        if self._k is None:
            self._widen()
        return self._k

    @property
    def v(self) -> torch.Tensor:
        if self._v is None:
            self._widen()
        return self._v

    def _widen(self) -> None:
        kv = self.kv16.float()
        h = kv.shape[1] // 2
        self._k, self._v = kv[:, :h], kv[:, h:]


@dataclass(frozen=True)
class Attention:
    """How caches attend: flash on (online softmax over chunks, the kernels where they apply) or off
    (materialized scores, the reference's path on any device). Caches are built with one and call it."""

    flash: bool = True

    def __call__(self, q: torch.Tensor, cache, layer: int, pos: int | torch.Tensor,
                 recent: Recent | None = None) -> torch.Tensor:
        """q (B, T, H, D) f32 at positions pos..pos+T-1 over a K/V cache -> (B, T, H * D) f32 (pos a (B,)
        tensor at decode: each sequence at its own, the reference's path); recent: the cache's f16 window
        for this batch, if it keeps one."""
        if use_triton(q) and self.flash and not torch.is_tensor(pos) and kernel_covers(q, cache):
            return attend_triton(q, cache, layer, pos, recent)
        if self.flash and q.shape[1] == 1 and not q.is_cuda:
            out = attend_cpu_decode(q, cache, layer, pos, recent)
            if out is not None:
                return out
        return attend_reference(q, cache, layer, pos, flash=self.flash, recent=recent)

    def hidden(self, q: torch.Tensor, cache, layer: int, pos: int, recent: Recent | None = None) -> torch.Tensor:
        """The same over a hidden-state cache, whose K/V are rebuilt from the stored x (its kernel reads no
        window: with one, the reference runs)."""
        if recent is None and use_triton(q) and self.flash and hidden_kernel_covers(q, cache):
            return attend_hidden_triton(q, cache, layer, pos)
        return attend_reference(q, cache, layer, pos, flash=self.flash, recent=recent)


def kernel_covers(q: torch.Tensor, cache) -> bool:
    """Does the Triton attention kernel read this K/V type pair (both publish a layout) at this head size?"""
    k, v = cache.k.kernel_layout(), cache.v.kernel_layout()
    if k is None or v is None:
        return False
    return (k.kind in DENSE_KINDS and v.kind in DENSE_KINDS) or q.shape[-1] % 32 == 0


def attend_triton(q: torch.Tensor, cache, layer: int, pos: int, recent: Recent | None = None,
                  **launch) -> torch.Tensor:
    """attend_reference's result through the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1);
    launch: num_splits, block_n. The query and the window go into K's (V's) storage space and the
    output out of V's here."""
    from kvcli.kernels.attention import StoreTensors, Window, attend_kernel  # imports triton: only where kernels run

    k = StoreTensors(cache.k.kernel_layout(), *cache.k.kernel_operands(layer))
    v = StoreTensors(cache.v.kernel_layout(), *cache.v.kernel_operands(layer))
    window = None if recent is None else Window(cache.k.to_storage(recent.k), cache.v.to_storage(recent.v),
                                                recent.start, recent.size)
    out = cache.v.from_storage(attend_kernel(cache.k.to_storage(q.float()), k, v, pos, window=window,
                                             **launch))  # (B, T, H, D)
    return out.flatten(2)


_CPU_KERNELS: dict = {}  # (K store type, V store type, head size) -> the kernel module or None


def cpu_decode_kernel(cache):
    """The CPU decode kernel that reads this K/V pair (its module), or None: q4_hadamard keys and values
    (kvcli/cache/hadamard_decode.py) or dense or ggml block ones at a head size it takes (kvcli/cache/dense_decode.py),
    numba importable. Asked every layer at decode: decided once per pair of store types."""
    key = (type(cache.k), type(cache.v), cache.k.head_dim)
    if key not in _CPU_KERNELS:
        _CPU_KERNELS[key] = _pick_cpu_kernel(cache.k, cache.v)
    return _CPU_KERNELS[key]


def _pick_cpu_kernel(k_store, v_store):
    k, v = k_store.kernel_layout(), v_store.kernel_layout()
    if k is None or v is None:
        return None
    # imported here: the stores import this module, and numba loads only where a kernel may run
    if k.kind == Kind.HADAMARD_KEYS and v.kind == Kind.HADAMARD_VALUES:
        from kvcli.cache import hadamard_decode as kernel
    elif k.kind in DENSE_KINDS + GGML_KINDS and v.kind in DENSE_KINDS + GGML_KINDS:
        from kvcli.cache import dense_decode as kernel

        if not (kernel.covers(k_store) and kernel.covers(v_store)):
            return None
    else:
        return None
    return kernel if kernel.available() else None


def attend_cpu_decode(q: torch.Tensor, cache, layer: int, pos: int | torch.Tensor,
                      recent: Recent | None = None) -> torch.Tensor | None:
    """attend_reference's result (B, 1, H * D) for one query token per sequence (q (B, 1, H, D)) through a CPU
    decode kernel, or None where none reads this cache (another type pair, or a case its `decode` declines)."""
    kernel = cpu_decode_kernel(cache)
    return None if kernel is None else kernel.decode(q, cache, layer, pos, recent)


def hidden_kernel_covers(q: torch.Tensor, cache) -> bool:
    """The hidden-state decode kernel: T = 1, dense x, a power-of-two head size >= 32 (tl.dot needs 16 a side),
    K = RoPE(x Wk) as Llama's (no bias, head norm or NEOX pairs: qwen2/qwen3 run the reference)."""
    D, h, block = q.shape[-1], cache.h.kernel_layout(), cache.model.blocks[0]
    dense = hasattr(block.wkv, "w")  # the kernel reads a plain K/V weight (packed forms: CPU only)
    return (dense and block.linear_kv and q.shape[1] == 1 and h is not None and h.kind in DENSE_KINDS
            and D >= 32 and D & (D - 1) == 0)


def attend_hidden_triton(q: torch.Tensor, cache, layer: int, pos: int, **launch) -> torch.Tensor:
    """attend_reference's result over a hidden cache through the Triton decode kernel; launch:
    num_splits, block_n, block_e."""
    from kvcli.kernels.hidden import attend_hidden_kernel  # imports triton: only where kernels run

    block = cache.model.blocks[layer]
    cos, sin = cache.cos_sin()
    return attend_hidden_kernel(q, cache.h.data[layer], block.wkv.w, cos, sin, pos, **launch)


def attend_reference(q: torch.Tensor, cache, layer: int, pos: int | torch.Tensor, flash: bool = True,
                     recent: Recent | None = None) -> torch.Tensor:
    """pos: the batch's first position, or (T = 1) a (B,) tensor of each sequence's own."""
    B, T, H, D = q.shape
    Hkv = cache.k.n_heads
    G = H // Hkv
    # Group the query heads of each KV head: (B, Hkv, G*T, D); row r = g*T + t. No K/V repeat.
    qm = q.reshape(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D) * (1.0 / math.sqrt(D))
    qg = cache.k.to_storage(qm)  # the stores' space; the window is read in the model's (qm)
    chunk = max(MIN_CHUNK, CHUNK_BYTES // (4 * B * Hkv * D))
    # Query row r sits at position i = pos + r % T and reads the store below lim_i: lim_i = i + 1 (causal)
    # without a window, max(i - N + 1, recent.start) with one (the rest, up to i, from the window).
    # first / last: the smallest and largest lim; the store is read below `last`.
    q_pos = lim = None
    if torch.is_tensor(pos) and recent is not None:  # one query per sequence, each at its own position
        first, last, lim = recent.start, recent.high, recent.lim  # lim per sequence, (B, 1, 1, 1)
    elif torch.is_tensor(pos):
        at = pos.tolist()
        first, last = min(at) + 1, max(at) + 1
        lim = (pos + 1).view(B, 1, 1, 1)
    elif recent is None:
        first, last = pos + 1, pos + T
    else:
        first, last = max(pos - recent.size + 1, recent.start), max(pos + T - recent.size, recent.start)
    if T > 1:  # per-row limits, (G*T, 1): a mask for T > 1 only
        q_pos = (pos + torch.arange(T, device=q.device)).repeat(G)[:, None]
        lim = q_pos + 1 if recent is None else (q_pos - recent.size + 1).clamp_min(recent.start)

    def scores(c0: int, c1: int) -> torch.Tensor:  # (B, Hkv, G*T, c1 - c0)
        s = cache.k.scores(layer, qg, c0, c1)
        if c1 > first:  # the chunk reaches a row's limit: that row reads no further here
            s = s.masked_fill(torch.arange(c0, c1, device=q.device) >= lim, float("-inf"))
        return s

    # (scores, p -> p . V) per part, in the order the softmax reads them: the window first (every row
    # sees its own position there, so the online maximum is finite from the start), then store chunks.
    # The window's part is in the model's space (its K and V are not rotated: q is, once, for the stores).
    parts = []
    if recent is not None:
        kw, vw = recent.k, recent.v  # (B, Hkv, n, D) f32

        def window_scores() -> torch.Tensor:  # (B, Hkv, G*T, n)
            s = qm @ kw.transpose(-1, -2)
            if recent.masked is not None:  # rows at their own positions: each reads its own slots
                s = s.masked_fill(recent.masked, float("-inf"))
            elif T > 1:  # row r reads lim_r..its own position here
                j = torch.arange(recent.start, recent.start + kw.shape[2], device=q.device)
                s = s.masked_fill((j < lim) | (j > q_pos), float("-inf"))
            return s

        parts.append((window_scores, lambda p: p @ vw))
    for c0 in range(0, last, chunk):
        c1 = min(c0 + chunk, last)
        parts.append((lambda c0=c0, c1=c1: scores(c0, c1),
                      lambda p, c0=c0, c1=c1: cache.v.weighted_sum(layer, p, c0, c1)))
    model = recent is not None  # parts[0] in the model's space, the rest in V's storage space

    if len(parts) == 1:  # one chunk: plain softmax, the common case
        s, weighted_sum = parts[0]
        out = weighted_sum(torch.softmax(s(), dim=-1))
        return _heads_out(out if model else cache.v.from_storage(out), T)
    if not flash or last <= chunk:  # materialized scores (-fa off, or one chunk and the window), V by part
        ss = [s() for s, _ in parts]
        p = torch.softmax(torch.cat(ss, -1), -1).split([x.shape[-1] for x in ss], -1)
        first, out = parts[0][1](p[0]), parts[1][1](p[1])
        for (_, weighted_sum), pi in zip(parts[2:], p[2:]):
            out = out + weighted_sum(pi)
        return _heads_out(cache.v.from_storage(out) + first if model else cache.v.from_storage(first + out), T)
    m = torch.full((B, Hkv, G * T, 1), float("-inf"), device=q.device)
    l = torch.zeros((B, Hkv, G * T, 1), device=q.device)
    out = torch.zeros((B, Hkv, G * T, D), device=q.device)
    for i, (s, weighted_sum) in enumerate(parts):
        s = s()
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))  # finite: every row sees a key in part 0
        p = torch.exp(s - m_new)
        scale = torch.exp(m - m_new)
        l = l * scale + p.sum(dim=-1, keepdim=True)
        pv = weighted_sum(p)
        out = out * scale + (cache.v.to_storage(pv) if model and i == 0 else pv)
        m = m_new
    return _heads_out(cache.v.from_storage(out / l), T)


def _heads_out(out: torch.Tensor, T: int) -> torch.Tensor:
    """(B, Hkv, G*T, D) in the model's space -> (B, T, H*D)."""
    B, Hkv, GT, D = out.shape
    return out.reshape(B, Hkv, GT // T, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, -1)
