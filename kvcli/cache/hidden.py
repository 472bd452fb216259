"""The hidden-state cache: keep each layer's normed attention input x instead of K and V.

Per layer and position it stores x (n_embd), the block's RMSNorm output, in one storage
type; attention rebuilds K = RoPE(x Wk) from the stored-then-loaded x, a chunk of positions
at a time, with the block's own weights (slices of `wqkv`) and RoPE table. Values are not
rebuilt: sum_t p_t (Wv x_t) = Wv (sum_t p_t x_t), so a chunk's weighted sum of x is projected
once (R query rows, not every position), which halves the rebuild work of a decode step.
For MHA models (kv_dim == n_embd) that is half the bytes of K+V; for GQA it is more, and
`describe` says so. Prefill attends to rebuilt K/V as well, so perplexity shows the loss.

x (B, T, n_embd) is stored as (B, T, n_embd / Ds, Ds) "heads" with Ds the largest power of
two dividing n_embd, at most HADAMARD_MAX: every ggml block type fits (Ds % 32 == 0), and
q4_hadamard gets a power-of-two rotation as wide as is cheap (rotation cost per token is
n_embd * Ds; 64 for SmolLM2's 576, 256 for a 4096-wide model).

With a recent window (kvcli/cache/window.py) the newest N positions' x stay in f16 and reach the
store only when they leave; attention rebuilds their K/V from the f16 copy. Its default N is the
type's `default_window` (measured for this cache too: benchmarks/README.md, Hidden-state cache).

How a run picks and builds a cache (kv, hidden or auto) is kvcli/cache/spec.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcli.cache.base import KVCache, Store, resolve_type
from kvcli.cache.window import Recent, Ring
from kvcli.errors import KvcliError
from kvcli.memory import MIB
from kvcli.rope import apply_rope

HADAMARD_MAX = 256


def store_head_dim(n_embd: int) -> int:
    """Ds: the largest power of two dividing n_embd, capped at HADAMARD_MAX."""
    return min(n_embd & -n_embd, HADAMARD_MAX)


class _Keys:
    """A read-only K "store" over the hidden cache: `load` rebuilds K = RoPE(x Wk) from the stored x.

    Shaped like a Store (n_heads, head_dim, identity to/from_storage) so the library's
    `attend_reference` runs unchanged over it (online softmax or -fa off, GQA, masks, chunks)."""

    name = "rebuilt"

    def __init__(self, cache: "HiddenCache"):
        self.cache = cache
        self.n_heads, self.head_dim = cache.config.n_kv_heads, cache.config.head_dim
        self.device = cache.h.device

    def to_storage(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def from_storage(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def load(self, layer: int, start: int, end: int) -> torch.Tensor:
        return self.cache.keys(layer, start, end)

    scores = Store.scores  # q . K over the rebuilt chunk


class _Values(_Keys):
    """The V side: values are never rebuilt. V_t = Wv x_t is linear in x, so for each KV head h
        sum_t p_t V_t = Wv_h (sum_t p_t x_t)
    one product of the weighted sum of x (R rows) instead of a projection of every position's x."""

    def load(self, layer: int, start: int, end: int) -> torch.Tensor:
        return self.cache.values(layer, start, end)  # for callers that want V itself (tests, kernels)

    def weighted_sum(self, layer: int, p: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """p (B, Hkv, R, n) -> (B, Hkv, R, D)."""
        xs = p @ self.cache.x_chunk(layer, start, end)[:, None]  # (B, Hkv, R, n_embd)
        return self.cache.project_values(layer, xs, p)


class BlockKV:
    """One block's K and V as this cache rebuilds them from x: K's and V's rows of the block's fused wqkv (views,
    made on first use; a packed form's scales copied then), their biases, K's head norm and RoPE, applied as
    Block.forward applies them (kvcli/model.py)."""

    def __init__(self, block):
        self.block, self.c = block, block.c
        self.q_dim = block.c.n_heads * block.c.head_dim
        self._wkv = self._wk = self._wv_heads = None  # views of wqkv, made on first use

    @property
    def wkv(self):
        """The k,v rows of wqkv as a form (a view; a packed form's scales copied on first use)."""
        if self._wkv is None:
            self._wkv = self.block.wqkv.narrow(self.q_dim, 2 * self.c.kv_dim)
        return self._wkv

    @property
    def wk(self):
        """The k rows of wqkv as a form (a view, made once)."""
        if self._wk is None:
            self._wk = self.block.wqkv.narrow(self.q_dim, self.c.kv_dim)
        return self._wk

    @property
    def wv_heads(self) -> list:
        """Each KV head's rows of Wv, a form apiece (views): weighted sums of x are projected with them."""
        if self._wv_heads is None:
            c = self.c
            self._wv_heads = [self.block.wqkv.narrow(self.q_dim + c.kv_dim + h * c.head_dim, c.head_dim)
                              for h in range(c.n_kv_heads)]
        return self._wv_heads

    @property
    def bv(self) -> torch.Tensor | None:
        """V's bias per KV head, (Hkv, D) f32, or None: added to rebuilt values."""
        bqkv = self.block.bqkv
        return None if bqkv is None else bqkv[self.q_dim + self.c.kv_dim :].view(self.c.n_kv_heads, -1)

    @property
    def linear_kv(self) -> bool:
        """K = adjacent-pair RoPE(x Wk) and V = x Wv, nothing more: what the hidden decode kernel rebuilds."""
        return not (self.c.rope_neox or self.c.qkv_bias or self.c.qk_norm)

    def project_k(self, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        """K = RoPE(x Wk + bk) (each head RMS-normed first where qk_norm) for normed inputs x (B, n, n_embd) f32
        at rot's n positions -> (B, n, Hkv, D) f32, computed as Block.forward computes it."""
        c, bqkv, qk_norm = self.c, self.block.bqkv, self.block.qk_norm
        k = self.wk.matmul(x)  # (B, n, kv_dim)
        if bqkv is not None:
            k = k + bqkv[self.q_dim : self.q_dim + c.kv_dim]
        k = k.unflatten(-1, (c.n_kv_heads, c.head_dim))  # (B, n, Hkv, D)
        if qk_norm is not None:
            k = F.rms_norm(k, (c.head_dim,), eps=c.rms_eps) * qk_norm[c.n_heads :]
        return apply_rope(k, rot, c.rope_neox)


class HiddenCache:
    """Stores x per layer; `.attention` has KVCache's signature. Needs the Transformer's weights.
    window: the newest positions whose x stays in f16 (as KVCache's)."""

    def __init__(self, config, batch: int, n_ctx: int, type_h: str = "f16", device: str = "cpu",
                 *, attention, model=None, window: int = 0):
        if model is None:
            raise KvcliError("the hidden-state cache needs the model (its K/V weights and RoPE table)")
        c = self.config = config
        self.model = model  # blocks' wqkv and the rope table, read at attention time (no copies)
        self.block_kv = [BlockKV(b) for b in model.blocks]  # each block's K/V weights, as this cache reads them
        self.attend = attention  # how to attend (kvcli.attention.Attention); the cache only holds it
        self.kernels: dict = {}  # the entries attention chose for it, by shape (Attention.hidden)
        self.n_layers, self.batch, self.n_ctx = c.n_layers, batch, n_ctx
        ds = store_head_dim(c.n_embd)
        self.h = resolve_type(type_h)(c.n_layers, batch, c.n_embd // ds, n_ctx, ds, device=device)
        attention.bind(self.h)
        self.window = window
        self.ring = Ring(c.n_layers, batch, c.n_embd // ds, window, ds, device) if window else None
        self.k, self.v = _Keys(self), _Values(self)
        self._x_key, self._x = None, None  # the last chunk of x loaded: K and V of a chunk read it once
        self._cos_sin = None  # (n_ctx, D/2) f32 pair for the Triton kernel, made on first use

    # ---- sizes ----
    def window_nbytes(self) -> int:
        return self.ring.nbytes() if self.ring else 0

    def nbytes(self) -> int:
        return self.h.nbytes() + self.window_nbytes()

    @staticmethod
    def bytes_needed(n_layers: int, batch: int, n_embd: int, n_ctx: int, type_h: str, window: int = 0) -> int:
        return resolve_type(type_h).nbytes_for(n_layers, batch, n_embd, n_ctx) + Ring.nbytes_for(n_layers, batch,
                                                                                                  n_embd, window)

    def kv_f16_bytes(self) -> int:
        c = self.config
        return KVCache.bytes_needed(c.n_layers, self.batch, c.kv_dim, self.n_ctx, "f16", "f16")

    def describe(self) -> str:
        """The start-up size line, with the f16 K+V size beside it; a warning line where hidden is larger."""
        c, hb, kvb = self.config, self.nbytes(), self.kv_f16_bytes()
        window = f", window {self.window} (f16): {self.window_nbytes() / MIB:7.2f} MiB" if self.window else ""
        line = (f"hidden cache: size = {hb / MIB:7.2f} MiB ({self.n_ctx:6d} cells, {self.n_layers:3d} layers, "
                f"{self.batch}/{self.batch} seqs), x ({self.h.name}): {self.h.nbytes() / MIB:7.2f} MiB{window}; "
                f"an f16 K+V cache would take {kvb / MIB:7.2f} MiB")
        if hb > kvb:
            line += (f"\nwarning: the hidden-state cache ({hb / MIB:.2f} MiB) is larger than an f16 K+V cache "
                     f"({kvb / MIB:.2f} MiB): this model has {c.n_heads}/{c.n_kv_heads} heads (GQA), so "
                     f"n_embd {c.n_embd} > K+V width {2 * c.kv_dim}; --cache-mode kv is smaller")
        return line

    # ---- storing and rebuilding ----
    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor,
                  pos: int) -> torch.Tensor:
        """Store x (B, T, n_embd), then attend q (B, T, H, D) over K/V rebuilt from the stored x.
        k and v, the block's own projections of this batch, are unused: the new positions are
        rebuilt from their stored (possibly lossy) x like every other."""
        B, T, E = x.shape
        if pos + T > self.n_ctx:
            raise KvcliError(f"context full: {pos + T} tokens do not fit in a {self.n_ctx}-token cache")
        x = x.float().reshape(B, T, self.h.n_heads, self.h.head_dim)
        self._x_key = None  # the stored contents change
        if not self.window:
            self.h.store(layer, x, pos)
            return self.attend.hidden(q, self, layer, pos)
        write, w0, recent, r0 = self.ring.push(layer, x, pos)  # recent (B, Hs, n, Ds): x of r0..pos+T-1
        if write is not None:
            self.h.store(layer, write, w0)
        block, xr = self.block_kv[layer], recent.transpose(1, 2).reshape(B, -1, E)
        k = block.project_k(xr, self.model.rot[r0 : pos + T])  # (B, n, Hkv, D)
        v = torch.stack([w.matmul(xr) for w in block.wv_heads], 2)  # (B, n, Hkv, D): the window's own V
        if block.bv is not None:
            v = v + block.bv
        return self.attend.hidden(q, self, layer, pos, Recent(k.transpose(1, 2), v.transpose(1, 2), r0, self.window))

    def load_x(self, layer: int, start: int, end: int) -> torch.Tensor:
        """Stored x of positions start..end-1 as (B, end - start, n_embd) f32, back in the model's space."""
        x = self.h.from_storage(self.h.load(layer, start, end))  # (B, Hs, n, Ds)
        return x.transpose(1, 2).reshape(x.shape[0], end - start, self.config.n_embd)

    def x_chunk(self, layer: int, start: int, end: int) -> torch.Tensor:
        """load_x, kept until the next chunk: the keys and the values of a chunk read it once."""
        key = (layer, start, end)
        if self._x_key != key:
            self._x_key, self._x = key, self.load_x(layer, start, end)
        return self._x

    def keys(self, layer: int, start: int, end: int) -> torch.Tensor:
        """K = RoPE(x Wk) at positions start..end-1 -> (B, Hkv, n, D) f32."""
        return self.block_kv[layer].project_k(self.x_chunk(layer, start, end), self.model.rot[start:end]).transpose(1, 2)

    def values(self, layer: int, start: int, end: int) -> torch.Tensor:
        """V = x Wv (+ bv) at positions start..end-1 -> (B, Hkv, n, D) f32 (attention itself never builds it)."""
        x, block = self.x_chunk(layer, start, end), self.block_kv[layer]  # x (B, n, n_embd)
        v = torch.stack([w.matmul(x) for w in block.wv_heads], 1)
        return v if block.bv is None else v + block.bv[:, None]

    def project_values(self, layer: int, xs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """xs (B, Hkv, R, n_embd), weighted sums of x for each KV head's query rows, p (B, Hkv, R, n) the
        chunk's weights -> (B, Hkv, R, D): head h's rows times Wv_h, one product per KV head.
        With a V bias: sum_t p_t (Wv x_t + bv) = Wv (sum_t p_t x_t) + bv sum_t p_t, p summed over this chunk."""
        block = self.block_kv[layer]
        out = torch.stack([w.matmul(xs[:, h]) for h, w in enumerate(block.wv_heads)], 1)
        return out if block.bv is None else out + block.bv[:, None] * p.sum(-1, keepdim=True)  # summed only with a bias

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        rot = self.model.rot
        if self._cos_sin is None or self._cos_sin[0].device != rot.device:
            self._cos_sin = (rot.real.contiguous().float(), rot.imag.contiguous().float())
        return self._cos_sin
