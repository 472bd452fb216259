"""tq4, tq3, tq2: rotated low-bit caches (TurboQuant's rotation and scalar codebook, arXiv
2504.19874, with q4_hadamard's offset, sinks and least-squares scales).

The format, in one place. For each layer, sequence and KV head, a head vector x (D, a power of
two and a multiple of the block) is
  1. rotated and offset as in q4_hadamard (kvcli/cache/hadamard.py, RotatedStore): y = R x - c,
     R the signed Walsh-Hadamard rotation, c the per-head mean of the first batch past the
     sinks; the first N_SINK positions are also kept as rotated f16 and read in place of
     their codes;
  2. quantized in blocks of `block_size` elements: y ~ d L[u], u a b-bit code, L the type's
     codebook (2^b levels in units of d), d one bf16 scale per block chosen to minimise the
     block's squared error: candidates g max|y| / max|L| over a grid of g, each refit by least
     squares for its codes (not TurboQuant's stored norm);
  3. laid out as q4_hadamard's codes, in the tiles torch's int4 CPU GEMM reads (T = 32 or 64
     rows as it packs them on the running CPU, kvcli/kernels/cpu/int4_tiles.py), one code per nibble:
       keys:   tiles (n_pad / T, D, T / 2); byte (i, e, j) = element e of positions T i + j (low
               nibble) and T i + j + T / 2 (high);
       values: planes (D / W, n_pad, W / 2), W = min(T, D); byte (i, t, j) = elements W i + j
               (low) and W i + j + W / 2 (high) of position t;
     then squeezed to b bits by packing rows S at a time (keys: a tile's S = D element rows;
     values: groups of S = 64 positions), a row r of the packed group holding, in each nibble,
       b = 4: row r as it is;
       b = 2: bits 0-1 the code of row r, bits 2-3 that of row r + S / 2 (S / 2 rows);
       b = 3: the same for the low two bits (S / 2 rows), then S / 4 rows of third bits: bit k
              of row S / 2 + r's nibble is bit 2 of row r + k S / 4's code.
     Stored: keys (n_pad / T, b D / 4, T / 2), values (D / W, n_pad / 64, 16 b, W / 2) bytes per
     head, scales (D / block_size, n_pad) bf16 per head; n_pad = n_ctx rounded up to 64.
Bits per element: b + 16 / block_size. Fixed costs, counted in `nbytes`: the sinks (N_SINK D
f16) and offsets (D f32) per layer and head, and the padding to 64 positions.

A decode write of one position (no window; with one, decode writes N + 1 positions at once,
kvcli/cache/window.py) changes only its bits, in place, from one small matmul. The kernels that read
and write these layouts as they lie are the kernel table's (kvcli/kernel_table.py): on the CPU a decode
step's pass over the packed codes, a tile unpacked at a time (kvcli/kernels/cpu/attention_rotated.py); on
CUDA the Triton attention kernel and the scale search (kvcli/kernels/gpu/), the store packing the codes.
"""

from __future__ import annotations

import functools
import math
from typing import ClassVar

import torch

from kvcli.kernels.cpu import int4_tiles
from kvcli.kernels.cpu.int4_tiles import pack_rows, unpack_rows
from kvcli.cache.hadamard import PAD, RotatedStore, _whole_tiles
from kvcli.errors import KvcliError
from kvcli.kernels.layout import Kind, KernelLayout
from kvcli.memory import lazy_zeros

GROUP = 64  # value positions packed together (S for values), = PAD: whole groups in every store
# Scale candidates g max|y| / max|L| per block, each refit by least squares for its codes: a wide grid
# for any codebook, and each tq type's own 8 (the range its blocks pick, benchmarks/README.md).
SCALE_GRID = tuple(round(0.30 + 0.05 * i, 2) for i in range(17))  # 0.30 .. 1.10


def uniform_levels(bits: int, tread: bool = False) -> tuple[float, ...]:
    """The mid-rise grid u - (2^b - 1) / 2, u = 0 .. 2^b - 1; tread: q4_0's u - 2^(b-1), zero a level and
    one extreme level more on the negative side (with a signed scale, on the side of a block's outlier)."""
    n = 1 << bits
    return tuple(u - (n // 2 if tread else (n - 1) / 2) for u in range(n))


@functools.cache
def lloyd_max_levels(bits: int, iters: int = 500) -> tuple[float, ...]:
    """Lloyd-Max levels for a standard Gaussian (TurboQuant's codebook for rotated coordinates):
    each level the mean of N(0, 1) between its neighbours' midpoints. Max 1960's tables: 2 bits
    +-0.4528, +-1.5104."""
    phi = lambda t: math.exp(-t * t / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda t: 0.5 * (1 + math.erf(t / math.sqrt(2)))  # noqa: E731
    n = 1 << bits
    lv = [3.0 * (2 * i + 1 - n) / n for i in range(n)]
    for _ in range(iters):
        edges = [-math.inf] + [(a + b) / 2 for a, b in zip(lv, lv[1:])] + [math.inf]
        lv = [(phi(a) - phi(b)) / (cdf(b) - cdf(a)) for a, b in zip(edges, edges[1:])]
    return tuple(lv)


# ---- packing b-bit codes into rows (the format's step 3) ----

# ---- the quantizer (step 2) ----

def quantize_blocks(y: torch.Tensor, levels: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y (..., S) f32 -> d (..., 1) f32 holding bf16 values and u (..., S) uint8 with y ~ d levels[u],
    d the candidate (g max|y| / max|L| for g in grid, refit by least squares) of least squared error."""
    lv = levels.tolist()
    uniform = all(v - lv[0] == u for u, v in enumerate(lv))
    return search_scales(y, levels, grid / levels.abs().max(), uniform)


def search_scales(y: torch.Tensor, levels: torch.Tensor, steps: torch.Tensor, uniform: bool, signed: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_blocks with the candidates made once: steps (G,) candidate scales over max|y| (signed: over
    the block's element of largest magnitude, with its sign, so that it can take an asymmetric grid's lone
    extreme level, as q4_hadamard does). Few ops (decode runs it per token on a few vectors); uniform:
    levels are L[0] + u, the nearest found by rounding."""
    n = len(levels)
    if signed:
        m = y.gather(-1, y.abs().argmax(-1, keepdim=True))  # (..., 1)
        d = steps.view(-1, *([1] * y.dim())) * m  # (G, ..., 1) candidates
        z = y / torch.where(d == 0, 1.0, d)  # (G, ..., S); y = 0 where m is 0
    else:
        m = torch.linalg.vector_norm(y, math.inf, -1, keepdim=True)  # (..., 1) max|y|
        z = y / (steps.view(-1, *([1] * y.dim())) * m.clamp_min_(1e-30))  # y = 0 where m is 0
    if uniform:
        lo = levels[0].item()
        u = z.sub_(lo).round_().clamp_(0, n - 1)
        q = u + lo
    else:
        u = torch.bucketize(z, (levels[1:] + levels[:-1]) / 2)
        q = levels.take(u)
    qy, qq = torch.linalg.vecdot(q, y)[..., None], torch.linalg.vecdot(q, q)[..., None].clamp_min_(1e-30)
    d = (qy / qq).bfloat16().float()  # the least-squares scale, as stored
    best = torch.sub(d * qq, qy, alpha=2).mul_(d).argmin(0, keepdim=True)  # |y - d q|^2 - |y|^2, bf16 d
    return d.gather(0, best)[0], u.gather(0, best.expand(1, *u.shape[1:]))[0].to(torch.uint8)


_LAYER_VIEWS = ("_data", "_scales")  # TurboStore._layer_views's attributes


class TurboStore(RotatedStore):
    """Rotated, offset vectors as b-bit codes (see the module's docstring); subclasses set name, bits,
    block_size, block_bytes and levels."""

    bits: ClassVar[int]
    levels: ClassVar[tuple[float, ...]]  # the codebook L, ascending, in units of the block's scale
    # newest positions kept in f16 (kvcli/cache/window.py), per type from KLD per size on SmolLM2 and Qwen2.5-Coder
    # (benchmarks/README.md, Recent window): a fixed 2 N kv_dim f16 a layer, ~1 MiB whatever the context
    default_window: ClassVar[int] = 64
    scale_grid: ClassVar[tuple[float, ...]] = SCALE_GRID
    signed: ClassVar[bool] = False  # the scale's sign follows each block's largest element (for asymmetric L)
    batched = ("data", "scale", "sink", "offset")

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__ and cls.block_bytes != cls.bits * cls.block_size // 8 + 2:
            raise KvcliError(f"{cls.name}: block_bytes must be the codes plus one bf16 scale")

    def __init__(self, *args, tile: int | None = None, **kwargs):
        """tile: T, the tile width (64 or 32); by default the one the running CPU's int4 GEMM packs, else 64."""
        super().__init__(*args, **kwargs)
        L, B, H, n, D = self.n_layers, self.batch, self.n_heads, self.n_ctx, self.head_dim
        self.n_pad = _whole_tiles(n)
        self.tile = tile or int4_tiles.tile_width() or PAD
        self.width = min(self.tile, D)  # W: elements per value tile
        b = self.bits
        shape = ((self.n_pad // self.tile, b * D // 4, self.tile // 2) if self.keys
                 else (D // self.width, self.n_pad // GROUP, 16 * b, self.width // 2))
        self.data = lazy_zeros((L, B, H, *shape), torch.uint8, self.device)
        self.scale = lazy_zeros((L, B, H, D // self.block_size, self.n_pad), torch.bfloat16, self.device)
        self._layer_views()
        self._prepared = [0] * L  # prepare() calls per layer: the pair offsets below are of one generation
        self._pair_offsets: dict[int, tuple[tuple[int, int], torch.Tensor]] = {}
        self.lv = torch.tensor(self.levels, device=self.device)
        # candidate scales over max|y| (signed: over the largest element, onto the lone extreme level L[0])
        self.steps = torch.tensor(self.scale_grid, device=self.device) / (self.levels[0] if self.signed else
                                                                           self.lv.abs().max())
        # uniform: L[u] = u - mid, so d L[u] = d (u + 8 - 2^(b-1) - 8) + d zero: the int4 GEMM's (nibble - 8) s + z
        self.mid = -self.levels[0]
        self.uniform = all(v == u - self.mid for u, v in enumerate(self.levels))
        self.zero = (1 << (self.bits - 1)) - self.mid  # 0 (tread) or 1/2 (mid-rise): exact in bf16
        self._columns: dict[tuple, tuple] = {}  # _image's matrices

    def _layer_views(self) -> None:
        """Per-layer views and read-side forms, made once (and once per `rows` view): decode runs a few dozen
        small ops per layer and token."""
        self._data, self._scales = self.data.unbind(0), self.scale.unbind(0)

    def __getattr__(self, name: str):
        """A `rows` view makes its per-layer views on first use: a view that only writes a window (T > 1) never
        reads them, and making them costs about as much as the rest of the view."""
        if name in _LAYER_VIEWS:
            self._layer_views()
            return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def rows(self, start: int, stop: int) -> "TurboStore":
        """Store.rows, with pair offsets of its own and per-layer views of its rows, made on first use (a view's
        are of its rows only)."""
        view = super().rows(start, stop)
        for name in _LAYER_VIEWS:
            view.__dict__.pop(name, None)
        view._pair_offsets = {}
        return view

    @classmethod
    def nbytes_for(cls, n_layers: int, batch: int, kv_dim: int, n_ctx: int) -> int:
        per_layer = (_whole_tiles(n_ctx) * kv_dim // cls.block_size * cls.block_bytes
                     + kv_dim * (min(cls.n_sink, n_ctx) * 2 + 4))
        return n_layers * batch * per_layer

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.sink, self.offset))

    def position_axes(self) -> dict[str, tuple[int, int]]:
        """Keys' codes by tiles of `tile` positions, values' by groups of GROUP, the scales by position."""
        return {"data": (2, self.tile) if self.keys else (3, GROUP), "scale": (3, 1)}

    def restored(self, row: int, state: torch.Tensor) -> None:
        super().restored(row, state)
        for layer in range(self.n_layers):
            self._prepared[layer] += 1  # the pair offsets made from the old offsets are stale

    # ---- writing ----
    def quantize_reference(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """y (B, T, H, D) f32 -> codes (B, T, H, D) uint8, scales (B, T, H, D / block) f32."""
        B, T, H, D = y.shape
        d, u = search_scales(y.reshape(B, T, H, D // self.block_size, self.block_size), self.lv, self.steps,
                             self.uniform, self.signed)
        return u.view(B, T, H, D), d.view(B, T, H, -1)

    def prepare(self, layer: int, x: torch.Tensor, pos: int) -> torch.Tensor:
        self._prepared[layer] += 1  # the offset may change
        return super().prepare(layer, x, pos)

    def store(self, layer: int, x: torch.Tensor, pos: int) -> None:
        self.put(layer, *self.quantize(self.prepare(layer, x, pos)), pos)

    def store_pair(self, other: "TurboStore", layer: int, x: torch.Tensor, y: torch.Tensor, pos: int) -> None:
        """K here, V in `other`, quantized in one pass (the scale search's ops run once per token)."""
        B, T, H, D = x.shape
        if T == 1 and pos >= self.n_sink and self.ready(layer) and other.ready(layer):
            # decode past the sinks, offsets set: prepare's rotation and offsets for both at once, then each
            # store's bits of this one position
            u, d = self.quantize((torch.cat([x, y]).float() @ self.rot.T).sub_(self._both_offsets(other, layer)))
            u = u.view(2, B, H, D)
            (uk, uv), (dk, dv) = u.unbind(0), d.view(2, B, H, -1).unbind(0)
            pk, pv = self._parts(u).unbind(0) if self.bits < 4 else (None, None)  # both at once
            self._scales[layer][..., pos] = dk
            self._put_one(layer, uk, pos, pk)
            other._scales[layer][..., pos] = dv
            other._put_one(layer, uv, pos, pv)
            return
        u, d = self.quantize(torch.cat([self.prepare(layer, x, pos), other.prepare(layer, y, pos)]))
        self.put(layer, u[:B], d[:B], pos)
        other.put(layer, u[B:], d[B:], pos)

    def _both_offsets(self, other: "TurboStore", layer: int) -> torch.Tensor:
        """(2 B, 1, H, D): this store's offset c of `layer`, then other's, joined once per generation."""
        key = (self._prepared[layer], other._prepared[layer])
        if self._pair_offsets.get(layer, (None,))[0] != key:
            self._pair_offsets[layer] = key, torch.cat([self.offset[layer], other.offset[layer]])
        return self._pair_offsets[layer][1]

    def put(self, layer: int, u: torch.Tensor, d: torch.Tensor, pos: int) -> None:
        """Codes u (B, T, H, D) and scales d (B, T, H, D / block) into positions pos..pos+T-1."""
        B, T, H, D = u.shape
        b, tw, W = self.bits, self.tile, self.width
        if T == 1:  # decode: rewrite only this position's bits
            self._scales[layer][..., pos] = d[:, 0]
            self._put_one(layer, u[:, 0], pos)
            return
        self.scale[layer, :, :, :, pos : pos + T] = d.permute(0, 2, 3, 1)
        if self.keys:  # the touched tiles, unpacked, updated, packed again
            t0, t1 = pos // tw, -(-(pos + T) // tw)
            tiles = self.data[layer, :, :, t0:t1]  # (B, H, nt, b D / 4, T / 2)
            codes = self._key_codes(unpack_rows(tiles, b))
            codes[:, :, pos - tw * t0 : pos - tw * t0 + T] = u.transpose(1, 2)
            tiles.copy_(pack_rows(int4_tiles.pack_pairs(codes.view(B, H, t1 - t0, tw, D).transpose(-1, -2)), b))
        else:  # the touched groups of 64 positions likewise
            g0, g1 = pos // GROUP, -(-(pos + T) // GROUP)
            groups = self.data[layer, :, :, :, g0:g1]  # (B, H, D / W, ng, 16 b, W / 2)
            codes = self._value_codes(unpack_rows(groups, b))
            codes[:, :, pos - GROUP * g0 : pos - GROUP * g0 + T] = u.transpose(1, 2)
            planes = codes.view(B, H, g1 - g0, GROUP, D // W, W).permute(0, 1, 4, 2, 3, 5)
            groups.copy_(pack_rows(int4_tiles.pack_pairs(planes), b))

    def _put_one(self, layer: int, u: torch.Tensor, pos: int, parts: torch.Tensor | None = None) -> None:
        """u (B, H, D) uint8: the codes of position pos, into the bits that hold it (read-modify-write in place);
        parts: _parts(u), if the caller has it (store_pair makes K's and V's at once)."""
        B, H, D = u.shape
        b, tw, W = self.bits, self.tile, self.width
        if self.keys:  # one nibble in each packed row of column pos % (T / 2) of tile pos // T
            high = pos % tw >= tw // 2
            where = self._data[layer][:, :, pos // tw, :, pos % (tw // 2)]  # (B, H, b D / 4), a view
            if b == 4:
                where.bitwise_and_(0x0F if high else 0xF0).bitwise_or_(u << 4 if high else u)
                return
            key = (high,)
        else:
            rows = self._data[layer][:, :, :, pos // GROUP]  # (B, H, D / W, 16 b, W / 2), a view
            s = pos % GROUP
            if b == 4:
                rows[..., s, :] = int4_tiles.pack_pairs(u.view(B, H, D // W, W))
                return
            (f, r), (k, r3) = divmod(s, GROUP // 2), divmod(s, GROUP // 4)  # 2-bit field f of packed row r;
            r3 += GROUP // 2  # the third bit: bit k of packed row S / 2 + r3
            where = rows[..., r : r3 + 1 : r3 - r, :] if b == 3 else rows[..., r, :]  # rows r and r3 (r < r3)
            key = (f, k)
        image, keep = self._image(key)
        parts = self._parts(u) if parts is None else parts
        where.bitwise_and_(keep).bitwise_or_((parts @ image).to(torch.uint8).view(where.shape))

    def _parts(self, u: torch.Tensor) -> torch.Tensor:
        """Codes (..., D) uint8 -> the inputs of _image's matrices (..., D) or (..., 2 D) f32: u, and u >> 2 (b = 3)."""
        return (torch.cat([u, u >> 2], -1) if self.bits == 3 else u).float()

    def _image(self, key: tuple) -> tuple[torch.Tensor, torch.Tensor | int]:
        """For b = 2, 3: (M, keep), so that one position's bits are (bytes & keep) | parts @ M (exact in f32),
        the bytes those _put_one reads: keys (key: the high nibble?) one nibble of each packed row; values (key:
        the 2-bit field f and third bit k of the position) packed row r, and row S / 2 + r3 (b = 3), of each plane.
        u & 3 = u - 4 (u >> 2); made once per key (keys: 2, values: 8)."""
        if key not in self._columns:
            D, b, W = self.head_dim, self.bits, self.width
            eye = torch.eye(D, device=self.device)
            if b == 3:  # [u, u >> 2] -> [u & 3, u >> 2]
                low = torch.cat([eye, -4 * eye])  # (2 D, D): the low two bits
                third = torch.cat([0 * eye, eye])  # (2 D, D): bit 2
            else:
                low, third = eye, None
            if self.keys:  # packed row r < D / 2: low(r) + 4 low(r + D / 2); row D / 2 + r: sum_k 2^k third(r + k D / 4)
                m = low[:, : D // 2] + 4 * low[:, D // 2 :]
                if b == 3:
                    m = torch.cat([m, sum(2**k * third[:, k * D // 4 : (k + 1) * D // 4] for k in range(4))], 1)
                nib = 16 if key[0] else 1
                self._columns[key] = m * nib, 0x0F if key[0] else 0xF0
            else:  # byte j of plane i: element W i + j in the low nibble, W i + j + W / 2 in the high
                f, k = key
                pair = lambda c: (c.view(-1, D // W, W)[..., : W // 2] + 16 * c.view(-1, D // W, W)[..., W // 2 :])  # noqa: E731
                rows = [pair(low) * 4**f]  # (P, D / W, W / 2): field f of row r
                keep = [0xFF ^ (0x33 << 2 * f)]
                if b == 3:
                    rows.append(pair(third) * 2**k)  # bit k of row S / 2 + r3
                    keep.append(0xFF ^ (0x11 << k))
                m = torch.stack(rows, 2).flatten(1)  # (P, D / W, rows, W / 2): the view's order
                keep = torch.tensor(keep, dtype=torch.uint8, device=self.device).view(-1, 1) if b == 3 else keep[0]
                self._columns[key] = m, keep
        return self._columns[key]

    # ---- reading ----
    def _key_codes(self, tiles: torch.Tensor) -> torch.Tensor:
        """Nibble tiles (B, H, nt, D, T / 2) -> the codes of their T nt positions (B, H, T nt, D) uint8."""
        return int4_tiles.unpack_pairs(tiles).transpose(-1, -2).reshape(self.batch, self.n_heads, -1, self.head_dim)

    def _value_codes(self, planes: torch.Tensor) -> torch.Tensor:
        """Nibble planes (B, H, D / W, ng, 64, W / 2) -> the codes of their 64 ng positions (B, H, 64 ng, D)."""
        u = int4_tiles.unpack_pairs(planes)  # (B, H, D / W, ng, 64, W)
        return u.permute(0, 1, 3, 4, 2, 5).reshape(self.batch, self.n_heads, -1, self.head_dim)

    def codes(self, layer: int, start: int, end: int) -> torch.Tensor:
        """The codes of positions start..end-1 as (B, H, end - start, D) uint8."""
        span = self.tile if self.keys else GROUP
        a, z = start // span, -(-end // span)
        if self.keys:
            u = self._key_codes(unpack_rows(self.data[layer, :, :, a:z], self.bits))
        else:
            u = self._value_codes(unpack_rows(self.data[layer, :, :, :, a:z], self.bits))
        return u[:, :, start - span * a : end - span * a]

    def load(self, layer: int, start: int, end: int) -> torch.Tensor:
        """Rotated-space vectors (B, H, end - start, D) f32."""
        B, H, n, D = self.batch, self.n_heads, end - start, self.head_dim
        u = self.codes(layer, start, end)
        y = u.float().sub_(self.mid) if self.uniform else self.lv[u.long()]
        y = y.view(B, H, n, D // self.block_size, self.block_size)
        y = y.mul_(self.scale[layer, :, :, :, start:end].transpose(-1, -2)[..., None]).view(B, H, n, D)
        y.add_(self.offset[layer].transpose(1, 2))  # (B, H, 1, D)
        sinks = self._sinks(layer, start, end)
        y[:, :, : sinks.shape[2]] = sinks
        return y

    def kernel_layout(self) -> KernelLayout:
        """The kernels' constants (kvcli/kernels/layout.py): codebook, scale candidates, bits, tiles; made on
        first use and fixed for the store's life (the kernels ask once per layer and token)."""
        if getattr(self, "_layout", None) is None:
            self._layout = KernelLayout(Kind.TQ_KEYS if self.keys else Kind.TQ_VALUES, self.block_bytes,
                                        table=tuple(self.lv.tolist()), n_sink=self.n_sink,
                                        tile=self.tile if self.keys else self.width, bits=self.bits,
                                        scale_block=self.block_size, steps=tuple(self.steps.tolist()),
                                        signed=self.signed)
        return self._layout

    def kernel_operands(self, layer: int) -> tuple[torch.Tensor, ...]:
        """packed codes (B, H, ...) uint8 as the module's docstring, scales (B, H, D / block, n_pad) bf16,
        sinks (B, H, n_sink, D) f16, offsets (B, H, D) f32."""
        return self.data[layer], self.scale[layer], self.sink[layer], self.offset[layer, :, 0]


class TQ4Store(TurboStore):
    name = "tq4"
    bits, block_size, block_bytes = 4, 64, 34  # 32 bytes of codes and a bf16 scale per 64 elements: 4.25 bits
    levels, signed = uniform_levels(4, tread=True), True  # -8 .. 7, the scale's sign after the block's largest
    scale_grid = tuple(round(0.75 + 0.05 * i, 2) for i in range(8))


class TQ3Store(TurboStore):
    name = "tq3"
    bits, block_size, block_bytes = 3, 64, 26  # 24 bytes of codes and a bf16 scale per 64 elements: 3.25 bits
    levels, signed = uniform_levels(3, tread=True), True  # -4 .. 3
    default_window = 128  # measured KLD per window size, K/V and hidden-state caches (benchmarks/README.md)
    scale_grid = tuple(round(0.64 + 0.06 * i, 2) for i in range(8))


class TQ2Store(TurboStore):
    name = "tq2"
    bits, block_size, block_bytes = 2, 64, 18  # 16 bytes of codes and a bf16 scale per 64 elements: 2.25 bits
    levels = uniform_levels(2)  # +-0.5, +-1.5: at 2 bits the symmetric grid measured better
    offset_values = False  # keys only: values' offset measured worse at 2 bits
    default_window = 128
    scale_grid = tuple(round(0.25 + 0.09 * i, 2) for i in range(8))
