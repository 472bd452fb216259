"""Attention over what the cache holds: the one dispatcher, its PyTorch reference, and the table entries of
the roles attention owns (kvcli/kernel_table.py: ATTEND, HIDDEN, QUANTIZE).

Every query attends to stored-then-loaded K/V (prefill included), so a lossy cache type shows its loss
everywhere. The reference reads the cache in chunks of positions, so no step holds the whole cache in f32:
with flash attention on, an online softmax (FlashAttention's recurrence) over the chunks; off, the scores are
materialized (they are small: one row per query) and V is still read chunk by chunk. A store may keep vectors
in a rotated space: the query goes into the K store's space and the output comes back out of the V store's.
The reference is load + matmul and nothing else: the truth every kernel is tested against.

With a recent window (kvcli/cache/window.py) the query at position i reads its newest positions
(i-N+1..i) from the window's f16 copy, handed in as `Recent`, and only older ones from the store:
per query row, so a batched prefill sees exactly what token-by-token decode would.

`Attention` (the -fa choice) asks the kernel table once per cache and shape (decode or batch, one position
or one per row, the device) and keeps the entry on the cache: on CUDA the Triton kernels (kvcli/kernels/gpu),
for a CPU decode step the compiled kernels (kvcli/kernels/cpu), elsewhere the reference; `bind` hands each
store its quantizer the same way.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math

import numpy as np
import torch

from kvcli import kernel_table as table
from kvcli.cache.window import Recent
from kvcli.kernel_table import ATTEND, HIDDEN, QUANTIZE, WRITE, Entry
from kvcli.kernels.layout import DENSE_KINDS, GGML_KINDS, DecodeWindow, Kind
from kvcli.memory import MIB

# f32 scratch budget per chunk of positions, in bytes: a chunk's K (B, Hkv, n, D) and the scores of a block of
# query rows (B, Hkv, ROW_BLOCK, n) each stay within it, so a long prefill holds a few of these at a time, never
# scores over the whole context, and the softmax's passes over a block's scores (max, exp, sum, the values'
# product) read them from the CPU's cache: 2 MiB against 16 MiB made Qwen's and SmolLM2's prefill attention at depth
# 4096 ~1.5x faster (benchmarks/README.md). Below glibc's mmap threshold, so the heap reuses the buffers.
CHUNK_BYTES = 2 * MIB
MIN_CHUNK = 256
ROW_BLOCK = 256  # query rows (of a prefill's G*T) an online softmax takes at a time


def device_of(x: torch.Tensor | str | torch.device) -> str:
    """The kernel table's device for a tensor or a device name: "cuda" or "cpu" (the tests run the CUDA entries on
    CPU tensors under TRITON_INTERPRET=1 by changing this)."""
    return "cuda" if (x.is_cuda if torch.is_tensor(x) else torch.device(x).type == "cuda") else "cpu"


class Attention:
    """How caches attend: flash on (online softmax over chunks, the kernels where they apply) or off
    (materialized scores, the reference's path on any device). Caches are built with one and call it."""

    def __init__(self, flash: bool = True):
        self.flash = flash

    def __repr__(self) -> str:
        return f"Attention(flash={self.flash})"

    def bind(self, *stores) -> None:
        """Hand each store (or window ring) its write kernels, chosen once for its device and kind: `quantizer`
        (QUANTIZE, stores only) and `writer` (WRITE; None: the store's own torch writes, the reference)."""
        for s in stores:
            layout = s.kernel_layout()
            device, kind = device_of(s.device), None if layout is None else layout.kind
            if hasattr(s, "quantize_reference"):
                s.quantizer = table.choose(QUANTIZE, device, kind).run
            s.writer = table.choose(WRITE, device, kind).run

    def __call__(self, q: torch.Tensor, cache, layer: int, pos: int | torch.Tensor,
                 recent: Recent | None = None) -> torch.Tensor:
        """q (B, T, H, D) f32 at positions pos..pos+T-1 over a K/V cache -> (B, T, H * D) f32 (pos a (B,)
        tensor at decode: each sequence at its own); recent: the cache's f16 window for this batch, if it keeps one."""
        key = (q.shape[1] == 1, torch.is_tensor(pos), device_of(q), self.flash)
        run = cache.kernels.get(key)
        if run is None:
            run = cache.kernels[key] = self.choose(q, cache, pos).run
        return run(q, cache, layer, pos, recent)

    def choose(self, q: torch.Tensor, cache, pos) -> Entry:
        """The ATTEND entry for this cache at this shape (the reference with -fa off, or where a store has no layout)."""
        k, v = cache.k.kernel_layout(), cache.v.kernel_layout()
        if not self.flash or k is None or v is None:
            return _MATERIALIZED
        return table.choose(ATTEND, device_of(q), (k.kind, v.kind), decode=q.shape[1] == 1,
                            per_row=torch.is_tensor(pos), head_dim=q.shape[-1], k=k, v=v,
                            key_bias=cache.key_bias is not None)

    def hidden(self, q: torch.Tensor, cache, layer: int, pos: int, recent: Recent | None = None) -> torch.Tensor:
        """The same over a hidden-state cache, whose K/V are rebuilt from the stored x (the entry chosen once per
        cache and shape, as for a K/V cache)."""
        key = (q.shape[1] == 1, recent is not None, device_of(q), self.flash)
        run = cache.kernels.get(key)
        if run is None:
            run = cache.kernels[key] = self.choose_hidden(q, cache, recent).run
        return run(q, cache, layer, pos, recent)

    def choose_hidden(self, q: torch.Tensor, cache, recent: Recent | None) -> Entry:
        h = cache.h.kernel_layout()
        if not self.flash or h is None:
            return _MATERIALIZED if not self.flash else table.reference(HIDDEN)
        block = cache.block_kv[0]
        return table.choose(HIDDEN, device_of(q), h.kind, decode=q.shape[1] == 1, window=recent is not None,
                            head_dim=q.shape[-1], dense_kv=hasattr(block.wkv, "w"), linear_kv=block.linear_kv)


def warm_up(cache) -> None:
    """Load the CPU decode kernel this cache will run (from numba's cache: a fraction of a second; compiled the
    first time: seconds) now, with the model, not in the first token's time. A cache of per-layer types
    (kvcli/cache/layers.py) loads each of its groups' kernels."""
    if hasattr(cache, "parts"):
        for part, _ in cache.parts:
            warm_up(part)
        return
    k, v = cache.k.kernel_layout(), cache.v.kernel_layout()
    if k is None or v is None:
        return
    entry = table.choose(ATTEND, "cpu", (k.kind, v.kind), decode=True, per_row=False, head_dim=cache.k.head_dim,
                         k=k, v=v)
    module = getattr(entry.run, "module", None)
    if module is not None:
        _cpu_module(module).warm_up(k, v)


def chunk_positions(B: int, Hkv: int, rows: int, D: int) -> int:
    """Positions per chunk of the cache: its K (B, Hkv, n, D) and scores (B, Hkv, rows, n) f32 within CHUNK_BYTES,
    at least MIN_CHUNK."""
    return max(MIN_CHUNK, CHUNK_BYTES // (4 * B * Hkv * max(D, rows)))


def attend_reference(q: torch.Tensor, cache, layer: int, pos: int | torch.Tensor, flash: bool = True,
                     recent: Recent | None = None) -> torch.Tensor:
    """pos: the batch's first position, or (T = 1) a (B,) tensor of each sequence's own."""
    B, T, H, D = q.shape
    Hkv = cache.k.n_heads
    G = H // Hkv
    # Group the query heads of each KV head: (B, Hkv, G*T, D); row r = g*T + t. No K/V repeat.
    qm = q.reshape(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D) * (1.0 / math.sqrt(D))
    qg = cache.k.to_storage(qm)  # the stores' space; the window is read in the model's (qm)
    # Query row r sits at position i = pos + r % T and reads the store below lim_i: lim_i = i + 1 (causal)
    # without a window, max(i - N + 1, recent.start) with one (the rest, up to i, from the window).
    # first / last: the smallest and largest lim; the store is read below `last`.
    if torch.is_tensor(pos) and recent is not None:  # one query per sequence, each at its own position
        lim = recent.lim  # per sequence, (B, 1, 1, 1)
        return _heads_out(_rows_out(qm, qg, cache, layer, recent.start, recent.high, lim, None, flash, recent), T)
    if torch.is_tensor(pos):
        at = pos.tolist()
        return _heads_out(_rows_out(qm, qg, cache, layer, min(at) + 1, max(at) + 1, (pos + 1).view(B, 1, 1, 1),
                                    None, flash, recent), T)
    if T == 1:
        first = last = pos + 1 if recent is None else max(pos - recent.size + 1, recent.start)
        return _heads_out(_rows_out(qm, qg, cache, layer, first, last, None, None, flash, recent), T)
    # T > 1: per-row limits (G*T, 1), and the rows in blocks of ROW_BLOCK: a block's scores against a chunk of
    # the store stay small enough to be read again from cache by the softmax's passes, and a block skips the
    # chunks past its own last row (the causal triangle's far half).
    q_pos = (pos + torch.arange(T, device=q.device)).repeat(G)[:, None]
    lim = q_pos + 1 if recent is None else (q_pos - recent.size + 1).clamp_min(recent.start)
    if not flash or (recent is not None and recent.masked is not None) or not _dense(cache):
        # materialized (-fa off); a window's own mask; a store whose chunks are decoded (rotated, block types, the
        # hidden cache): all rows at once, each chunk decoded once
        return _heads_out(_rows_out(qm, qg, cache, layer, int(lim.min()), int(lim.max()), lim, q_pos, flash, recent),
                          T)
    out = torch.empty_like(qm)
    for r0 in range(0, G * T, ROW_BLOCK):
        r1 = min(r0 + ROW_BLOCK, G * T)
        lim_b = lim[r0:r1]
        out[:, :, r0:r1] = _rows_out(qm[:, :, r0:r1], qg[:, :, r0:r1], cache, layer, int(lim_b.min()),
                                     int(lim_b.max()), lim_b, q_pos[r0:r1], flash, recent)
    return _heads_out(out, T)


def _dense(cache) -> bool:
    """K and V stored as plain f32 / f16 / bf16 rows (the stores' `dense`; the hidden cache's views have none): a chunk
    read again for each row block costs a cast at most."""
    return getattr(cache.k, "dense", False) and getattr(cache.v, "dense", False)


def _rows_out(qm: torch.Tensor, qg: torch.Tensor, cache, layer: int, first: int, last: int,
              lim: torch.Tensor | None, q_pos: torch.Tensor | None, flash: bool, recent: Recent | None) -> torch.Tensor:
    """Query rows qm (B, Hkv, R, D) in the model's space, scaled (qg: the same in the stores' space), each reading
    the store below its lim ((R, 1), or (B, 1, 1, 1) per sequence; None: `first` for every row) and the window's
    positions from lim to its own q_pos ((R, 1); None: all of them) -> (B, Hkv, R, D) in the model's space.
    first / last: the smallest and largest lim."""
    B, Hkv, R, D = qm.shape
    key_bias = getattr(cache, "key_bias", None)
    chunk = chunk_positions(B, Hkv, R, D)

    def scores(c0: int, c1: int) -> torch.Tensor:  # (B, Hkv, R, c1 - c0), a fresh tensor: changed in place below
        if key_bias is None:
            s = cache.k.scores(layer, qg, c0, c1)
        else:  # keys stored less their turning mean R(p) m (kvcli/cache/key_bias.py): put back on the chunk's loaded
            # keys, in the store's space (its map is orthogonal: q . x = to_storage(q) . to_storage(x)), so the
            # rows take one product over the chunk, not a second one of q . R(p) m the size of the scores
            k = cache.k.load(layer, c0, c1) + cache.k.to_storage(key_bias.keys(layer, c0, c1))  # (f32's load: a view)
            s = qg @ k.transpose(-1, -2)
        if c1 > first and lim is not None:  # the chunk reaches a row's limit: that row reads no further here
            s.masked_fill_(torch.arange(c0, c1, device=qm.device) >= lim, float("-inf"))
        return s

    # (scores, p -> p . V) per part, in the order the softmax reads them: the window first (every row
    # sees its own position there, so the online maximum is finite from the start), then store chunks.
    # The window's part is in the model's space (its K and V are not rotated: q is, once, for the stores).
    parts = []
    if recent is not None:
        kw, vw = recent.k, recent.v  # (B, Hkv, n, D) f32

        def window_scores() -> torch.Tensor:  # (B, Hkv, R, n)
            s = qm @ kw.transpose(-1, -2)
            if recent.masked is not None:  # rows at their own positions: each reads its own slots
                s = s.masked_fill(recent.masked, float("-inf"))
            elif q_pos is not None:  # row r reads lim_r..its own position here
                j = torch.arange(recent.start, recent.start + kw.shape[2], device=qm.device)
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
        return out if model else cache.v.from_storage(out)
    if not flash or last <= chunk:  # materialized scores (-fa off, or one chunk and the window), V by part
        ss = [s() for s, _ in parts]
        p = torch.softmax(torch.cat(ss, -1), -1).split([x.shape[-1] for x in ss], -1)
        first, out = parts[0][1](p[0]), parts[1][1](p[1])
        for (_, weighted_sum), pi in zip(parts[2:], p[2:]):
            out = out + weighted_sum(pi)
        return cache.v.from_storage(out) + first if model else cache.v.from_storage(first + out)
    m = torch.full((B, Hkv, R, 1), float("-inf"), device=qm.device)
    l = torch.zeros((B, Hkv, R, 1), device=qm.device)
    out = torch.zeros((B, Hkv, R, D), device=qm.device)
    for i, (s, weighted_sum) in enumerate(parts):
        s = s()
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))  # finite: every row sees a key in part 0
        p = s.sub_(m_new).exp_()
        scale = torch.exp(m - m_new)
        l = l * scale + p.sum(dim=-1, keepdim=True)
        pv = weighted_sum(p)
        out = out * scale + (cache.v.to_storage(pv) if model and i == 0 else pv)
        m = m_new
    return cache.v.from_storage(out / l)


def _heads_out(out: torch.Tensor, T: int) -> torch.Tensor:
    """(B, Hkv, G*T, D) in the model's space -> (B, T, H*D)."""
    B, Hkv, GT, D = out.shape
    return out.reshape(B, Hkv, GT // T, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, -1)


# ---- the table's entries for attention's roles ----
def _reference(q, cache, layer, pos, recent):
    return attend_reference(q, cache, layer, pos, flash=True, recent=recent)


def _materialized(q, cache, layer, pos, recent):
    return attend_reference(q, cache, layer, pos, flash=False, recent=recent)


_MATERIALIZED = Entry(ATTEND, "any", frozenset(), "kvcli/attention.py attend_reference (-fa off)", _materialized)


def attend_triton(q: torch.Tensor, cache, layer: int, pos: int, recent: Recent | None = None,
                  **launch) -> torch.Tensor:
    """attend_reference's result through the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1);
    launch: num_splits, block_n. The query and the window go into K's (V's) storage space and the
    output out of V's here."""
    from kvcli.kernels.gpu.attention import StoreTensors, Window, attend_kernel  # imports triton: only where kernels run

    k = StoreTensors(cache.k.kernel_layout(), *cache.k.kernel_operands(layer))
    v = StoreTensors(cache.v.kernel_layout(), *cache.v.kernel_operands(layer))
    window = None if recent is None else Window(cache.k.to_storage(recent.k), cache.v.to_storage(recent.v),
                                                recent.start, recent.size)
    key_bias = None
    if cache.key_bias is not None:  # (u, w) of each query row, grouped as the kernel's rows r = t * G + g
        B, T, H, D = q.shape
        Hkv = cache.k.n_heads
        rows = q.float().reshape(B, T, Hkv, H // Hkv, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, -1, D)
        key_bias = (cache.key_bias.query(layer, rows), cache.key_bias.table)
    out = cache.v.from_storage(attend_kernel(cache.k.to_storage(q.float()), k, v, pos, window=window,
                                             key_bias=key_bias, **launch))  # (B, T, H, D)
    return out.flatten(2)


def _triton_covers(per_row: bool, head_dim: int, k, v, **_) -> bool:
    """The Triton kernel reads one position per batch (not each row's own) and blocks of 32 at any head size a
    block type divides (dense types: any)."""
    return not per_row and ((k.kind in DENSE_KINDS and v.kind in DENSE_KINDS) or head_dim % 32 == 0)


def attend_hidden_triton(q: torch.Tensor, cache, layer: int, pos: int, recent=None, **launch) -> torch.Tensor:
    """attend_reference's result over a hidden cache through the Triton decode kernel; launch:
    num_splits, block_n, block_e."""
    from kvcli.kernels.gpu.hidden import attend_hidden_kernel  # imports triton: only where kernels run

    block = cache.block_kv[layer]
    cos, sin = cache.cos_sin()
    return attend_hidden_kernel(q, cache.h.data[layer], block.wkv.w, cos, sin, pos, **launch)


def _hidden_covers(decode: bool, window: bool, head_dim: int, dense_kv: bool, linear_kv: bool) -> bool:
    """The hidden-state decode kernel: T = 1, no window, a plain K/V weight (packed forms: CPU only), K = RoPE(x Wk)
    as Llama's (no bias, head norm or NEOX pairs: qwen2/qwen3 run the reference), a power-of-two head size >= 32
    (tl.dot needs 16 a side)."""
    return decode and not window and dense_kv and linear_kv and head_dim >= 32 and head_dim & (head_dim - 1) == 0


def _triton_ready() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _cpu_module(name: str):
    """A CPU kernel module, imported where it first runs (numba loads only there)."""
    return importlib.import_module(f"kvcli.kernels.cpu.{name}")


def decode_reads(B: int, pos: int | torch.Tensor, recent: Recent | None) -> tuple[np.ndarray, DecodeWindow | None]:
    """What a decode step's row b reads, as the CPU kernels take it: the store below lim[b] ((B,) int64) and the
    unmasked slots of the window (kvcli/kernels/layout.py), as attend_reference splits them."""
    rows = torch.is_tensor(pos)
    if recent is None:
        return ((pos + 1).numpy() if rows else np.full(B, pos + 1, np.int64)), None
    if recent.masked is not None:  # the ring as it is (kv16), or k and v as given (a test's rows)
        kv = recent.kv16 if recent.kv16 is not None else torch.cat([recent.k, recent.v], 1).half()
        return recent.lim.view(B).numpy(), DecodeWindow(kv.view(torch.uint16).numpy(), recent.masked.view(B, -1).numpy())
    # one position for every row: the window is positions recent.start..pos (all read), widened from its f16
    kv = torch.cat([recent.k, recent.v], 1).half().view(torch.uint16)
    return (np.full(B, max(pos - recent.size + 1, recent.start), np.int64),
            DecodeWindow(kv.numpy(), np.zeros((B, kv.shape[2]), np.bool_)))


def _cpu_decode(module: str):
    """An ATTEND entry's run over a CPU decode kernel module (its `attend`, kvcli/kernels/layout.py's signature)."""

    def run(q, cache, layer, pos, recent):
        B, _, H, D = q.shape
        Hkv = cache.k.n_heads
        lim, window = decode_reads(B, pos, recent)
        qg = q.reshape(B, Hkv, H // Hkv, D)
        kernel, extra = _cpu_module(module), None
        if cache.key_bias is not None and getattr(kernel, "READS_KEY_MEAN", False):  # added in the kernel's pass
            extra = cache.key_bias.operands(layer)
        elif cache.key_bias is not None:  # q . R(p) m of the stored positions, scaled as the scores: (B, Hkv, G, P)
            extra = cache.key_bias.scores(layer, qg * (1.0 / math.sqrt(D)), 0, int(lim.max())).numpy()
        out = kernel.attend(qg, cache.k.operands(layer), cache.v.operands(layer), lim, window,
                            extra)  # (B, Hkv, G, D): T = 1
        return out.view(B, 1, H * D)

    run.module = module
    return run


def _pairs(kinds) -> frozenset:
    return frozenset((a, b) for a in kinds for b in kinds)


def _decode_covers(decode: bool, head_dim: int, k, v, **_) -> bool:
    """Decode steps; the dense types' fixed-order sums take head sizes in multiples of 16."""
    dense = k.kind in DENSE_KINDS or v.kind in DENSE_KINDS
    return decode and (not dense or head_dim % 16 == 0)


def _rotated_covers(decode: bool, head_dim: int, k, v, **_) -> bool:
    """Decode steps over q4_hadamard's codes or tq's uniform codebooks (L[u] = u - mid), whole blocks of 32."""
    uniform = all(lay.table == tuple(float(u + lay.table[0]) for u in range(len(lay.table)))
                  for lay in (k, v) if lay.kind in _TQ)
    return decode and uniform and head_dim % 32 == 0


_ALL_KINDS = tuple(range(13))
_BLOCK_KINDS = tuple(k for k in DENSE_KINDS + GGML_KINDS if k != Kind.IQ4_NL)
_ROTATED = (Kind.HADAMARD_KEYS, Kind.HADAMARD_VALUES)
_TQ = (Kind.TQ_KEYS, Kind.TQ_VALUES)
for _entry in (
    Entry(ATTEND, "cuda", _pairs(_ALL_KINDS), "kvcli/kernels/gpu/attention.py (Triton)", attend_triton,
          covers=_triton_covers, ready=_triton_ready, why="one kernel over the codes, prefill and decode", tol=1e-4),
    Entry(ATTEND, "cpu", _pairs(_BLOCK_KINDS), "kvcli/kernels/cpu/attention.py (LLVM vectors)",
          _cpu_decode("attention"), covers=_decode_covers, ready=table.cpu_compiler,
          why="decode: one compiled pass, blocks widened as they are read"),
    Entry(ATTEND, "cpu", _pairs(_BLOCK_KINDS + (Kind.IQ4_NL,)) - _pairs(_BLOCK_KINDS),
          "kvcli/kernels/cpu/attention.py (x86 byte shuffle)", _cpu_decode("attention"), isa=table.X86,
          covers=_decode_covers, ready=table.cpu_compiler, why="decode: iq4_nl's codebook by a byte shuffle"),
    Entry(ATTEND, "cpu", _pairs(_ROTATED + _TQ), "kvcli/kernels/cpu/attention_rotated.py (LLVM vectors)",
          _cpu_decode("attention_rotated"), covers=_rotated_covers, ready=table.cpu_compiler,
          why="decode: the codes read where they lie (tq's unpacked a tile at a time), both rotations as fast "
              "Walsh-Hadamard transforms, keys' turning mean added in the pass"),
    Entry(HIDDEN, "cuda", frozenset(DENSE_KINDS), "kvcli/kernels/gpu/hidden.py (Triton)", attend_hidden_triton,
          covers=_hidden_covers, ready=_triton_ready, why="decode: K/V rebuilt from x in registers"),
):
    table.register(_entry)
table.register(Entry(ATTEND, "any", frozenset(), "kvcli/attention.py attend_reference", _reference), reference=True)
table.register(Entry(HIDDEN, "any", frozenset(), "kvcli/attention.py attend_reference", _reference), reference=True)


# QUANTIZE: run(store, y (B, T, H, D) f32) -> the store's codes before it lays them out (Store.quantize_reference's)
def _cpu_hadamard_codes(store, y):
    return _cpu_module("quantize").quantize(y, store.scale_grid_f32)


def _cpu_q8_0_blocks(store, y):
    return _cpu_module("quantize").q8_0_blocks(y)


def _gpu_hadamard_codes(store, y):
    from kvcli.kernels.gpu.quantize import quantize_codes  # imports triton: only where kernels run

    return quantize_codes(store.kernel_layout(), y)


def _gpu_tq_codes(store, y):
    from kvcli.kernels.gpu.quantize import quantize_tq  # imports triton: only where kernels run

    return quantize_tq(store.kernel_layout(), y)


def _gpu_blocks(store, y):
    """A ggml type's blocks (B, Hkv, T, row_bytes), as quantize_reference lays them."""
    from kvcli.kernels.gpu.quantize import quantize_into  # imports triton: only where kernels run

    B, T, H, _ = y.shape
    out = torch.empty(B, H, T, store.row_bytes, dtype=torch.uint8, device=y.device)
    quantize_into(store.kernel_layout(), y, out, 0)
    return out


for _entry in (
    Entry(QUANTIZE, "cpu", frozenset(_ROTATED), "kvcli/kernels/cpu/quantize.py (numba)", _cpu_hadamard_codes,
          ready=table.cpu_compiler, why="the scale search block by block, no (grid, blocks, 32) temporaries"),
    Entry(QUANTIZE, "cpu", frozenset({Kind.Q8_0}), "kvcli/kernels/cpu/quantize.py q8_0_blocks (numba)",
          _cpu_q8_0_blocks, ready=table.cpu_compiler, why="one pass where torch's quantizer takes a dozen ops, byte-exact"),
    Entry(QUANTIZE, "cuda", frozenset(_ROTATED), "kvcli/kernels/gpu/quantize.py (Triton)", _gpu_hadamard_codes,
          ready=_triton_ready),
    Entry(QUANTIZE, "cuda", frozenset(_TQ), "kvcli/kernels/gpu/quantize.py (Triton)", _gpu_tq_codes, ready=_triton_ready),
    Entry(QUANTIZE, "cuda", frozenset(GGML_KINDS), "kvcli/kernels/gpu/quantize.py (Triton)", _gpu_blocks,
          ready=_triton_ready, why="byte-exact with ggml's quantizers"),
):
    table.register(_entry)
table.register(Entry(QUANTIZE, "any", frozenset(), "the store's quantize_reference (torch)",
                     lambda store, y: store.quantize_reference(y)), reference=True)


def decode_layer_stores(cache, rows: bool = False):
    """Where a compiled decode layer (kvcli/decode_layer.py) may write and read this cache: (views, layouts, q8_0),
    views(cache, layer) the layer's K and V data as attention.py's kernel reads them (1, Hkv, n_ctx, D or row bytes), and
    for q8_0 their bytes as uint8 after them, layouts that kernel's (kfmt, ktab, vfmt, vtab); else None. It may where
    one sequence's decode token is a compiled write (dense: put_dense; q8_0: its compiled quantizer) and this table's
    CPU kernel over K and V (attention.py's): one sequence (a cache's only one, or a row of it: a server's slot; rows:
    any rows of it, a token each, views then given rows views of it), no window, keys as they come, -fa on, one type
    for both."""
    k, v = getattr(cache, "k", None), getattr(cache, "v", None)
    if (k is None or type(k) is not type(v) or getattr(cache, "window", 1) or cache.key_bias is not None
            or (cache.batch != 1 and not rows) or not cache.attend.flash or k.device != "cpu"):
        return None
    lk, lv = k.kernel_layout(), v.kernel_layout()
    dense = lk is not None and lk.kind in DENSE_KINDS and k.writer is _cpu_dense_write
    q8_0 = lk is not None and lk.kind == Kind.Q8_0 and k.quantizer is _cpu_q8_0_blocks
    if not (dense or q8_0) or lv.kind != lk.kind:
        return None
    entry = table.choose(ATTEND, "cpu", (lk.kind, lv.kind), decode=True, per_row=False, head_dim=k.head_dim, k=lk,
                         v=lv, key_bias=False)
    if getattr(entry.run, "module", None) != "attention":
        return None
    kernel = _cpu_module("attention")

    def views(cache, layer: int) -> tuple:  # the cache passed at each call: a plan keeps no cache alive
        ko, vo = cache.k.operands(layer), cache.v.operands(layer)
        read = (kernel._rows(ko), kernel._rows(vo))
        return read + (ko.arrays[0], vo.arrays[0]) if q8_0 else read

    return views, (*kernel._layout(lk), *kernel._layout(lv)), q8_0


def decode_layer_window(cache):
    """Where a compiled decode layer (kvcli/decode_layer.py) may put one sequence's token in this cache's window and
    attend with attention_rotated.py's kernel: a function step(cache, layer, p) -> the token's operands (the ring's K
    and V halves to write at p's slot, then that kernel's arrays as its `attend` passes them, from the signs on), or
    None where the window puts positions into the stores at this step (the cache's own attention then); else None.
    It may where the window's ring is written by the compiled pass and both stores are read by that kernel: one
    sequence (or one row of a cache: a server's slot), -fa on."""
    k, v, ring = getattr(cache, "k", None), getattr(cache, "v", None), getattr(cache, "ring", None)
    if (ring is None or cache.batch != 1 or not cache.attend.flash or k.device != "cpu"
            or ring.writer is not _cpu_dense_write):
        return None
    lk, lv = k.kernel_layout(), v.kernel_layout()
    if lk is None or lv is None:
        return None
    entry = table.choose(ATTEND, "cpu", (lk.kind, lv.kind), decode=True, per_row=True, head_dim=k.head_dim, k=lk,
                         v=lv, key_bias=cache.key_bias is not None)
    if getattr(entry.run, "module", None) != "attention_rotated":
        return None
    kernel = _cpu_module("attention_rotated")
    fmt, mid = kernel.formats(lk, lv)
    no_mean = (kernel._NO_MEAN, False, kernel._NO_TABLE)

    def step(cache, layer: int, p: int) -> tuple | None:
        got = cache.ring.step_one(layer, p)
        if got is None:
            return None
        lim, masked = got
        ko, vo = cache.k.operands(layer), cache.v.operands(layer)
        kd, ks, ksink, koff = ko.arrays
        vd, vs, vsink, voff = vo.arrays
        mean = no_mean if cache.key_bias is None else cache.key_bias.operands(layer)
        k_half, v_half, ring_bits = cache.ring.halves(layer)
        return (k_half, v_half, p % cache.ring.size, ko.signs, kd, ks, ksink, koff, kernel._values_5d(vd), vs, vsink,
                voff, ring_bits, masked, *mean, np.full(1, lim, np.int64), fmt, mid)

    return step


# WRITE: run(layout, arrays, values, rows, pos): vector m of values[i] into arrays[i] at sequence rows[m], position
# pos[m] of a layer (a dense type: its data, or a K and V pair of one type in one call)
def _cpu_dense_write(layout, arrays, values, rows, pos):
    _cpu_module("quantize").put_dense(arrays, values, rows, pos)


def _cpu_rotated_write(layout, arrays, values, rows, pos):
    _cpu_module("quantize").put_vectors(arrays[0], arrays[1], *values, rows, pos, layout.kind == Kind.HADAMARD_KEYS)


table.register(Entry(WRITE, "cpu", frozenset(DENSE_KINDS), "kvcli/kernels/cpu/quantize.py put_dense (numba)",
                     _cpu_dense_write, ready=table.cpu_compiler, why="one pass where torch's rounding write takes a dozen ops"))
table.register(Entry(WRITE, "cpu", frozenset(_ROTATED), "kvcli/kernels/cpu/quantize.py put_vectors (numba)",
                     _cpu_rotated_write, ready=table.cpu_compiler, why="nibbles placed position by position, no tile repacking"))
table.register(Entry(WRITE, "any", frozenset(), "the store's own writes (torch)", None), reference=True)


def kernel_lines(head_dim: int = 64, device: str = "cpu") -> list[str]:
    """`kvcli info`'s lines on the cache kernels: for each cache type (as both K and V), the entries that run a decode
    step, a prompt's batch and its writes on this machine, then the entries that do not run here and why."""
    from kvcli.cache import STORAGE_TYPES  # every type registered

    lines = []
    for name, cls in STORAGE_TYPES.items():
        try:
            k, v = (cls(1, 1, 1, 1, head_dim, keys=keys).kernel_layout() for keys in (True, False))
        except Exception as e:  # noqa: BLE001 - a type that cannot take this head size says so
            lines.append(f"  {name:12s} not at head size {head_dim}: {e}")
            continue
        if k is None or v is None:
            lines.append(f"  {name:12s} decode and prompt: {table.reference(ATTEND).name}; writes: "
                         f"{table.reference(QUANTIZE).name}")
            continue
        shape = dict(per_row=False, head_dim=head_dim, k=k, v=v)
        decode = table.choose(ATTEND, device, (k.kind, v.kind), decode=True, **shape)
        prompt = table.choose(ATTEND, device, (k.kind, v.kind), decode=False, **shape)
        codes, lay = table.choose(QUANTIZE, device, k.kind), table.choose(WRITE, device, k.kind)
        lines.append(f"  {name:12s} decode: {decode.name}; prompt: {prompt.name}; codes: {codes.name}; "
                     f"laid out: {lay.name}")
    idle = dict.fromkeys(f"  not here: {e.name}, {e.role} ({table.why_not(e, device)})"
                         for e in table.entries(ATTEND) + table.entries(QUANTIZE) + table.entries(WRITE)
                         + table.entries(HIDDEN)
                         if e.device != "any" and table.why_not(e, device))
    return lines + list(idle)
