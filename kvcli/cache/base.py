"""The cache protocol: per-layer stores for K and for V, each of one storage type.

A store keeps (B, Hkv, n_ctx, D) vectors in its own format and hands them back as f32
in chunks of positions, so attention never needs the whole cache in full precision.
Storage types register themselves by subclassing (as gguf-py's quant classes do); the
CLI's choices come from `STORAGE_TYPES`.
"""

from __future__ import annotations

import copy
from typing import ClassVar, Protocol

import torch

from kvcli.errors import KvcliError
from kvcli.kernels.layout import KernelLayout, Operands
from kvcli.memory import MIB
from kvcli.cache.window import Recent, Ring

STORAGE_TYPES: dict[str, type["Store"]] = {}
ALIASES: dict[str, str] = {}


class Store:
    """One tensor family (K or V) for every layer. Subclasses set name, block_size, block_bytes."""

    name: ClassVar[str]
    block_size: ClassVar[int] = 1  # elements per block along the head dimension
    # Rotated before quantizing (outliers spread over the head): at equal bits it loses less than
    # an unrotated type (benchmarks/README.md), so `kvcli fit` ranks it first without a sweep.
    rotated: ClassVar[bool] = False
    block_bytes: ClassVar[int]  # bytes per block, scales included
    # Newest positions a cache of this type keeps in f16 unless told (kvcli/cache/window.py): 0 for
    # llama.cpp's types, so they stay llama.cpp's; kvcli's own types set theirs from measurement
    # (benchmarks/README.md, "Recent window"). A cache takes the largest of its types' defaults.
    default_window: ClassVar[int] = 0
    dense: ClassVar[bool] = False  # a plain float tensor (f32, f16, bf16): a window adds nothing to it
    # The (L, B, ...) tensors a `rows` view slices along B; () where the type gives no such views.
    batched: ClassVar[tuple[str, ...]] = ()
    # `store` (and `store_pair`) take a (B,) pos at T = 1, each sequence at its own position; else the cache
    # writes such a step one sequence at a time.
    per_row_positions: ClassVar[bool] = False
    row0 = 0  # a `rows` view's first sequence in the store it was made from
    # quantize on write, run(store, y) -> codes: the kernel table's QUANTIZE entry for this store's device and kind,
    # handed in by kvcli.attention.Attention.bind; None: the format's own torch quantizer (quantize_reference)
    quantizer = None
    # lay codes into the bytes, run(layout, arrays, values, rows, pos): the table's WRITE entry, handed in the same
    # way; None: the store's own torch writes (the reference)
    writer = None
    seqs: torch.Tensor | None = None  # a `rows` view's arange(batch): the sequences it writes at per-row positions

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            if cls.name in STORAGE_TYPES:  # a silent replacement would change what -ctk NAME means
                raise KvcliError(f"cache type {cls.name!r} is already registered by {STORAGE_TYPES[cls.name].__qualname__}")
            STORAGE_TYPES[cls.name] = cls

    @classmethod
    def bits_per_element(cls) -> float:
        return 8.0 * cls.block_bytes / cls.block_size

    @classmethod
    def nbytes_for(cls, n_layers: int, batch: int, kv_dim: int, n_ctx: int) -> int:
        """The bytes a store of this shape allocates (the memory plan and `nbytes` agree)."""
        return n_layers * batch * n_ctx * kv_dim // cls.block_size * cls.block_bytes

    def kernel_layout(self) -> KernelLayout | None:
        """The constants the Triton kernels read this type with (kvcli/kernels/layout.py); None: no kernel."""
        return None

    def kernel_operands(self, layer: int) -> tuple[torch.Tensor, ...]:
        """The tensors of one layer the kernels read, in the launchers' order: data (B, Hkv, n_ctx, ...)."""
        return (self.data[layer],)

    def to_storage(self, x: torch.Tensor) -> torch.Tensor:
        """Map a query (K store) into the space `load` returns vectors in; identity here."""
        return x

    def from_storage(self, x: torch.Tensor) -> torch.Tensor:
        """Map an attention output (V store) back from that space; identity here."""
        return x

    def __init__(self, n_layers: int, batch: int, n_heads: int, n_ctx: int, head_dim: int, device: str = "cpu",
                 keys: bool = False):
        """keys: the store holds keys (a format may lay them out for q . K rather than for p . V)."""
        if head_dim % self.block_size:
            raise KvcliError(f"cache type {self.name} needs a head size divisible by {self.block_size}, got {head_dim}")
        self.n_layers, self.batch, self.n_heads, self.n_ctx, self.head_dim = n_layers, batch, n_heads, n_ctx, head_dim
        self.device, self.keys = device, keys
        # `operands` of each layer, shared with `rows` views (keyed by their first byte and rows)
        self.kernel_views: dict = {}

    def operands(self, layer: int) -> Operands:
        """One layer as the kernels read it (kvcli/kernels/layout.py): the layout, kernel_operands(layer), their numpy
        views (CPU stores), the rotation; made once per (layer, first byte, rows) and kept where every tensor is
        contiguous (a copy would go stale): made per call, the conversions are a visible part of a decode step."""
        key = (layer, self.data.data_ptr(), self.batch)
        ops = self.kernel_views.get(key)
        if ops is None:
            tensors = self.kernel_operands(layer)
            arrays = tuple(_array(t.contiguous()) for t in tensors) if self.device == "cpu" else ()
            rot = getattr(self, "rot", None)  # rotated types' R
            signs = rot[0].contiguous().numpy() if rot is not None and self.device == "cpu" else None
            ops = Operands(self.kernel_layout(), tensors, arrays, rot, signs)
            if all(t.is_contiguous() for t in tensors):
                self.kernel_views[key] = ops
        return ops

    def nbytes(self) -> int:
        raise NotImplementedError

    def position_axes(self) -> dict[str, tuple[int, int]]:
        """For each of `batched`'s tensors that grows with the positions: (its axis once L and B are indexed,
        positions per step along it); the others are whole per sequence (kvcli/cache/state.py saves both)."""
        return {"data": (2, 1)}  # (L, B, Hkv, n_ctx, ...)

    def row_state(self, row: int) -> torch.Tensor:
        """What this store knows of sequence row outside `batched`'s tensors, as a small uint8 tensor (empty: none)."""
        return torch.zeros(0, dtype=torch.uint8)

    def restored(self, row: int, state: torch.Tensor) -> None:
        """Sequence row's bytes were just written back (kvcli/cache/state.py), with its row_state: set what lives
        outside the tensors, and forget what was made from the old bytes."""

    def rows(self, start: int, stop: int) -> "Store":
        """Sequences start..stop-1 as a store of their own over the same bytes (a view): the server's slots
        are rows of one cache, so that one step attends for all of them at once (KVCache.rows)."""
        view = copy.copy(self)
        for name in self.batched:
            setattr(view, name, getattr(self, name)[:, start:stop])
        view.batch, view.row0 = stop - start, self.row0 + start
        view.seqs = torch.arange(view.batch, device=self.device)
        return view

    def sequences(self, n: int) -> torch.Tensor:
        """arange(n), the sequences a per-row write indexes (a `rows` view keeps its own)."""
        return self.seqs if self.seqs is not None else torch.arange(n, device=self.device)

    def store(self, layer: int, x: torch.Tensor, pos: int) -> None:
        """x (B, T, Hkv, D) f32 -> positions pos..pos+T-1 of this layer."""
        raise NotImplementedError

    def store_pair(self, other: "Store", layer: int, x: torch.Tensor, y: torch.Tensor, pos: int) -> None:
        """x here and y in `other`, a store of the same type (K and V); types may do both in one pass."""
        self.store(layer, x, pos)
        other.store(layer, y, pos)

    def store_spans(self, other: "Store", layer: int, spans: list[tuple]) -> bool:
        """Window flushes of several sequences at once: spans (b, x, y, w0), x here and y in `other` (K and V, one
        type), each (1, m, Hkv, D) f32, sequence b's positions w0..w0+m-1. True where written in one pass; False
        where this type cannot (the cache then writes them a sequence at a time)."""
        return False

    def load(self, layer: int, start: int, end: int) -> torch.Tensor:
        """Positions start..end-1 of this layer as f32 (B, Hkv, end - start, D)."""
        raise NotImplementedError

    def scores(self, layer: int, q: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """q (B, Hkv, R, D), in this store's space, against the keys at start..end-1 -> (B, Hkv, R, end - start):
        load + matmul, the reference's product (no store overrides it: fast paths are the kernel table's)."""
        return q @ self.load(layer, start, end).transpose(-1, -2)

    def weighted_sum(self, layer: int, p: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """p (B, Hkv, R, end - start) over the values at start..end-1 -> (B, Hkv, R, D): load + matmul."""
        return p @ self.load(layer, start, end)

    def quantize(self, y: torch.Tensor):
        """y (B, T, Hkv, D) f32 -> the codes this format lays out (quantize_reference's form), through the bound kernel."""
        return self.quantizer(self, y) if self.quantizer is not None else self.quantize_reference(y)

    def quantize_reference(self, y: torch.Tensor):
        """The format's quantizer in torch: the truth its kernels are tested against (dense types: none, a cast)."""
        raise NotImplementedError


def _array(t: torch.Tensor):
    """A CPU tensor as the kernels' numpy view: bf16 as int16 bits, f16 as uint16 bits (numpy has no bf16)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    elif t.dtype == torch.float16:
        t = t.view(torch.uint16)
    return t.numpy()


def resolve_type(name: str) -> type[Store]:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in STORAGE_TYPES:
        choices = ", ".join(list(STORAGE_TYPES) + [f"{a} (= {t})" for a, t in ALIASES.items()])
        raise KvcliError(f"unknown cache type {name!r}; choose one of: {choices}")
    return STORAGE_TYPES[key]


def window_for(types: tuple[str, ...], window: int | None) -> int:
    """The window a cache of these storage types keeps: none where every type is dense (an f16 copy of
    what it holds anyway), else `window`, or the largest default of the types where None (the same for
    the hidden-state cache: tq3's 128 was measured for both)."""
    classes = [resolve_type(t) for t in types]
    if all(c.dense for c in classes):
        return 0
    if window is not None:
        return window
    return max(c.default_window for c in classes)


class Cache(Protocol):
    """The model's seam: what a block hands its K/V (or normed input x) to. KVCache and HiddenCache."""

    n_layers: int
    batch: int
    n_ctx: int

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor,
                  pos: int) -> torch.Tensor:
        """Store what the format keeps of positions pos..pos+T-1, then attend q (B, T, H, D) -> (B, T, H*D)."""
        ...

    def nbytes(self) -> int: ...

    def describe(self) -> str: ...


class KVCache:
    """K and V stores of one model; types chosen independently (llama.cpp's -ctk / -ctv). window: the
    newest positions kept in f16 beside them (kvcli/cache/window.py), as given (CacheSpec picks the
    types' default); 0: every position goes straight into the stores."""

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, n_ctx: int, head_dim: int,
                 type_k: str = "f16", type_v: str = "f16", device: str = "cpu", *, attention, window: int = 0,
                 key_bias=None, qk_scale: torch.Tensor | None = None, qk_gain: float | None = None):
        shape = (n_layers, batch, n_kv_heads, n_ctx, head_dim)
        # keys scaled for the queries (kvcli/cache/key_scale.py): (L, H + Hkv, D) f32 multipliers of the q heads
        # and K heads, the cache working in that basis; None: as they come
        self.qk_scale = qk_scale
        self.qk_gain = qk_gain  # the share of the score error the weights predict the scales leave, for the size line
        # keys stored less their turning mean, q . R(p) m added back on read (kvcli/cache/key_bias.py): each
        # sequence's own m; None: keys as they come
        self.key_bias = None if key_bias is None else key_bias.for_rows(batch)
        # how to attend (kvcli.attention.Attention: the -fa choice and the kernels it chose); the cache only holds it
        self.attend = attention
        self.kernels: dict = {}  # the attention entries chosen for this cache, by shape (Attention.__call__)
        self.k = resolve_type(type_k)(*shape, device=device, keys=True)
        self.v = resolve_type(type_v)(*shape, device=device)
        self.n_layers, self.batch, self.n_ctx, self.window = n_layers, batch, n_ctx, window
        # K's and V's f16 windows, their heads side by side: (L, B, 2 Hkv, N, D)
        self.ring = Ring(n_layers, batch, 2 * n_kv_heads, window, head_dim, device) if window else None
        attention.bind(self.k, self.v, *([self.ring] if self.ring else []))
        self.base, self.row0 = None, 0  # a view made by `rows`: the cache and first sequence it shows
        self._positions: tuple[int, torch.Tensor] | None = None  # _decode_positions' (pos, (B,) tensor) of this step

    @staticmethod
    def has_rows(type_k: str, type_v: str) -> bool:
        """Can a cache of these types hand out `rows`? Where both stores can (Store.batched)."""
        return bool(resolve_type(type_k).batched and resolve_type(type_v).batched)

    def rows(self, start: int, stop: int) -> KVCache:
        """Sequences start..stop-1 as a cache of their own over the same bytes (`has_rows`): the server's slots
        are rows of one cache, and a step's decode tokens of rows start..stop-1 attend as one batch through
        such a view, each at its own position (`attention` with a (B,) tensor pos)."""
        view = copy.copy(self)
        view.k, view.v = self.k.rows(start, stop), self.v.rows(start, stop)
        view.ring = self.ring.rows(start, stop) if self.ring else None
        view.key_bias = self.key_bias.rows(start, stop) if self.key_bias else None
        view.batch, view.base, view.row0 = stop - start, self.base if self.base is not None else self, self.row0 + start
        return view

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: int | torch.Tensor) -> Recent | None:
        """The new K/V (B, T, Hkv, D) at positions pos..pos+T-1 (at decode, pos may be a (B,) tensor: each
        sequence's own position). With a window, the positions leaving it go into the stores (at decode in
        batches, kvcli/cache/window.py); returns the batch's f16 window for attention (None without one)."""
        if torch.is_tensor(pos):  # the caller (the server's engine) keeps each sequence inside its context
            if self.key_bias is not None:
                for b, p in enumerate(pos.tolist()):
                    if p == 0:  # a sequence started by one token: its mean is the bias
                        self.key_bias.rows(b, b + 1).start(layer, k[b : b + 1])
            return self._store_rows(layer, k, v, pos)
        if pos + k.shape[1] > self.n_ctx:
            raise KvcliError(f"context full: {pos + k.shape[1]} tokens do not fit in a {self.n_ctx}-token cache")
        if pos == 0 and self.key_bias is not None:  # new sequences: their keys' mean, before anything is stored
            self.key_bias.start(layer, k)
        if not self.window:
            self._write(layer, k, v, pos)
            return None
        Hkv = k.shape[2]
        write, w0, recent, r0 = self.ring.push(layer, torch.cat([k, v], 2), pos)
        if write is not None:
            self._write(layer, write[:, :, :Hkv], write[:, :, Hkv:], w0)
        return Recent(recent[:, :Hkv], recent[:, Hkv:], r0, self.window)

    def _store_rows(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> Recent | None:
        """`store` of one decode token per sequence (T = 1), each at its own position pos[b]: in one pass where the
        stores can (Store.per_row_positions), else one sequence at a time; with a window, each row's ring
        (Ring.push_rows)."""
        if not self.window:
            if self.k.per_row_positions and self.v.per_row_positions:
                self._write(layer, k, v, pos)
            else:
                for b, p in enumerate(pos.tolist()):
                    self._write_row(b, layer, k[b : b + 1], v[b : b + 1], p)
            return None
        Hkv = k.shape[2]
        writes, w = self.ring.push_rows(layer, k, v, pos.tolist())
        if (len(writes) == k.shape[0] and all(wr.shape[1] == 1 for _, wr, _ in writes)
                and self.k.per_row_positions and self.v.per_row_positions):  # a token a row: one write for all
            kv = torch.cat([wr for _, wr, _ in writes])  # (B, 1, 2 Hkv, D), rows in order
            self._write(layer, kv[:, :, :Hkv], kv[:, :, Hkv:], torch.tensor([w0 for _, _, w0 in writes]))
        elif writes and not (type(self.k) is type(self.v) and self.k.store_spans(
                self.v, layer, [(b, self._keys(layer, wr[:, :, :Hkv], w0, b), wr[:, :, Hkv:], w0) for b, wr, w0 in writes])):
            for b, write, w0 in writes:
                self._write_row(b, layer, write[:, :, :Hkv], write[:, :, Hkv:], w0)
        return Recent(None, None, w.low, self.window, w.masked, w.lim, w.high, kv16=w.ring)

    def _write_row(self, b: int, layer: int, k: torch.Tensor, v: torch.Tensor, pos: int) -> None:
        """K/V (1, T, Hkv, D) of sequence b at positions pos..pos+T-1."""
        one = copy.copy(self)
        one.k, one.v = self.k.rows(b, b + 1), self.v.rows(b, b + 1)
        one.key_bias = self.key_bias.rows(b, b + 1) if self.key_bias else None
        one._write(layer, k, v, pos)

    def _keys(self, layer: int, k: torch.Tensor, pos: int | torch.Tensor, row: int | None = None) -> torch.Tensor:
        """The keys as the K store takes them: less their turning mean where the cache treats them (key_bias);
        row: k is sequence row's alone."""
        if self.key_bias is None:
            return k
        return (self.key_bias if row is None else self.key_bias.rows(row, row + 1)).remove(layer, k, pos)

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: int | torch.Tensor) -> None:
        k = self._keys(layer, k, pos)
        if type(self.k) is type(self.v):
            self.k.store_pair(self.v, layer, k, v, pos)
        else:
            self.k.store(layer, k, pos)
            self.v.store(layer, v, pos)

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor,
                  pos: int | torch.Tensor) -> torch.Tensor:
        """Store the new K/V (B, T, Hkv, D), then attend q (B, T, H, D) over the cache -> (B, T, H*D).
        pos: as `store`. x, the block's normed input, is unused here (the hidden-state cache stores it instead)."""
        if self.qk_scale is not None:  # the scaled basis: q * s, k / s (kvcli/cache/key_scale.py)
            s = self.qk_scale[layer]
            q, k = q * s[: q.shape[2]], k * s[q.shape[2] :]
        if self.window and k.shape[1] == 1 and not torch.is_tensor(pos) and k.device.type == "cpu":
            pos = self._decode_positions(pos, k.shape[0])
        recent = self.store(layer, k, v, pos)
        return self.attend(q, self, layer, pos, recent)

    def _decode_positions(self, pos: int, batch: int) -> torch.Tensor:
        """A decode token on the CPU with a window, at pos for every sequence, goes as the server's rows do ((B,) pos,
        kvcli/cache/window.py push_rows): its K/V written into the ring in one compiled pass, and the ring read in
        f16 by the decode kernel, not copied to f32 (~1 ms of a 30-layer step). (B,) pos made once a step."""
        if pos + 1 > self.n_ctx:
            raise KvcliError(f"context full: {pos + 1} tokens do not fit in a {self.n_ctx}-token cache")
        if self._positions is None or self._positions[0] != pos or len(self._positions[1]) != batch:
            self._positions = (pos, torch.full((batch,), pos))
        return self._positions[1]

    def window_nbytes(self) -> int:
        return self.ring.nbytes() if self.ring else 0

    def nbytes(self) -> int:
        return (self.k.nbytes() + self.v.nbytes() + self.window_nbytes()
                + (self.key_bias.nbytes() if self.key_bias is not None else 0))

    def describe(self) -> str:
        """llama.cpp's start-up line for the KV cache; the window, a buffer of its own, at the end."""
        line = (f"KV cache: size = {self.nbytes() / MIB:7.2f} MiB ({self.n_ctx:6d} cells, {self.n_layers:3d} layers, "
                f"{self.batch}/{self.batch} seqs), K ({self.k.name}): {self.k.nbytes() / MIB:7.2f} MiB, "
                f"V ({self.v.name}): {self.v.nbytes() / MIB:7.2f} MiB")
        if self.window:
            line += f", window {self.window} (f16): {self.window_nbytes() / MIB:7.2f} MiB"
        if self.key_bias is not None:
            line += ", keys less their mean"
        if self.qk_scale is not None:
            line += scaled_keys_note(self.qk_gain)
        return line

    def qk_scales(self, layer: int) -> torch.Tensor | None:
        """The (H + Hkv, D) multipliers this cache's layer takes q and k in (kvcli/cache/key_scale.py), or None."""
        return None if self.qk_scale is None else self.qk_scale[layer]

    @staticmethod
    def bytes_needed(n_layers: int, batch: int, kv_dim: int, n_ctx: int, type_k: str, type_v: str,
                     window: int = 0) -> int:
        return (sum(resolve_type(t).nbytes_for(n_layers, batch, kv_dim, n_ctx) for t in (type_k, type_v))
                + Ring.nbytes_for(n_layers, batch, 2 * kv_dim, window))


def scaled_keys_note(gain: float | None) -> str:
    """The size line's words for keys scaled for the queries, with the score error the weights predict they leave."""
    return ", keys scaled for the queries" + (f" (predicted score error {gain:.2f}x)" if gain is not None else "")
