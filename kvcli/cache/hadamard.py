"""q4_hadamard: a Hadamard-rotated 4-bit cache (exllamav2's idea, QuaRot's random signs).

The format, in one place. For each layer, sequence and KV head, a head vector x (D) is
  1. rotated: r = R x, with R = H_D diag(s) / sqrt(D) (Walsh-Hadamard H_D, fixed random
     signs s from seed 0): orthogonal, so dot products are kept and outliers spread out;
  2. offset: y = r - c, where c (D, f32) is the mean of the rotated vectors of the first
     stored batch past the sinks. Exact: softmax ignores a constant added to every score
     of a query (keys), and its weights sum to 1 (values);
  3. quantized in blocks of 32 elements: y = d (u - 8), u a 4-bit code, d a bf16 scale chosen
     from a small grid plus a least-squares refit to minimise the block's squared error (not
     ggml's max/-8). Scales: (D / 32, n_pad) bf16 per head, n_pad = n_ctx rounded up to 64
     (on every CPU, so the byte count does not depend on it).
     Codes, two per byte, in the tiles torch's int4 CPU GEMM reads (kvcli/kernels/cpu/int4_tiles.py),
     of T = 64 or 32 rows as that GEMM packs them on the running CPU (`int4_tiles.tile_width()`):
       keys:   (n_pad / T, D, T / 2) per head; byte (i, e, j) = element e of positions T i + j
               (low nibble) and T i + j + T / 2 (high): 16 positions' codes of one element per vector;
       values: (D / W, n_pad, W / 2) per head, W = min(T, D); byte (i, t, j) = elements
               W i + j (low) and W i + j + W / 2 (high) of position t: 32 elements per vector.
The first N_SINK positions (attention sinks) are also kept as rotated f16 and used in place
of their 4-bit copy. Attention compares keys in the rotated space (q is rotated once) and
rotates the value output back once. Bytes: 4.5 bits per element, plus the sinks, offsets and
the padding to 64 positions, all counted in `nbytes`. The CPU decode kernel reads the codes where they
lie (kvcli/kernels/cpu/attention_rotated.py), as the Triton one does (kvcli/kernels/gpu/attention.py).
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np
import torch

from kvcli.kernels.cpu import int4_tiles
from kvcli.memory import lazy_zeros
from kvcli.cache.base import Store
from kvcli.kernels.layout import Kind, KernelLayout
from kvcli.errors import KvcliError

N_SINK = 4
# Scales tried per block, as fractions of ggml's q4_0 scale max / -8, each refit by least squares.
_SCALE_GRID = torch.linspace(0.70, 1.10, 9)


def rotation(dim: int, seed: int = 0) -> torch.Tensor:
    """(dim, dim) orthogonal R = H diag(s) / sqrt(dim); dim a power of two."""
    if dim & (dim - 1):
        raise KvcliError(f"q4_hadamard needs a power-of-two head size, got {dim}")
    h = torch.ones(1, 1)
    while h.shape[0] < dim:  # Sylvester's construction
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (dim,), generator=torch.Generator().manual_seed(seed)).float() * 2 - 1
    return h * signs / math.sqrt(dim)


def quantize_q4_mse(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., 32) f32 -> d (..., 1) f32 holding bf16 values, u (..., 32) uint8 codes 0..15: x ~ d (u - 8).

    Candidates d = g * m / -8 (m: the signed value of largest magnitude; g = 1 is ggml's q4_0
    choice, so the extreme may use level -8), each refit by least squares for its levels."""
    m = x.gather(-1, x.abs().argmax(dim=-1, keepdim=True))  # (..., 1)
    grid = _SCALE_GRID.to(x.device).view(-1, *([1] * x.dim()))  # (S, 1, ..., 1)
    d = m * grid / -8  # (S, ..., 1) candidate scales
    q = (x / torch.where(d == 0, 1.0, d)).round().clamp(-8, 7)  # (S, ..., 32)
    d = (q * x).sum(-1, keepdim=True) / (q * q).sum(-1, keepdim=True).clamp_min(1e-30)
    d = d.bfloat16().float()  # the scale is stored as bf16: judge the error with that
    err = ((x - d * q) ** 2).sum(-1, keepdim=True)  # (S, ..., 1)
    best = err.argmin(dim=0, keepdim=True)
    d = d.gather(0, best)[0]
    q = q.gather(0, best.expand(1, *q.shape[1:]))[0]
    return d, (q + 8).to(torch.uint8)


def quantize_vectors(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """y (B, T, H, D) f32 -> codes (B, T, H, D) uint8, scales (B, T, H, D / 32) f32, block by block."""
    B, T, H, D = y.shape
    d, u = quantize_q4_mse(y.reshape(B, T, H, D // 32, 32))
    return u.view(B, T, H, D), d.view(B, T, H, D // 32)


PAD = 64  # positions are padded to a multiple of the widest tile, whatever the running CPU's tile width


def _whole_tiles(n: int) -> int:
    """n positions rounded up to a multiple of PAD (whole tiles of either width)."""
    return -(-n // PAD) * PAD


class RotatedStore(Store):
    """What the rotated types share (q4_hadamard here, tq4/tq3/tq2 in kvcli/cache/turbo.py): the
    rotation R, the first n_sink positions kept as rotated f16, and the per-head offset c (steps 1
    and 2 of the format above). Subclasses give the codes; `prepare` hands them y = R x - c."""

    rotated = True
    n_sink: ClassVar[int] = N_SINK
    offset_keys: ClassVar[bool] = True  # subtract c from keys (exact: softmax ignores q . c)
    offset_values: ClassVar[bool] = True  # and from values (exact: the weights sum to 1)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        L, B, H, n, D = self.n_layers, self.batch, self.n_heads, self.n_ctx, self.head_dim
        if D & (D - 1):
            raise KvcliError(f"cache type {self.name} needs a power-of-two head size, got {D}")
        self.rot = rotation(D).to(self.device)  # r = x @ rot.T
        self.sink = torch.zeros(L, B, H, min(self.n_sink, n), D, dtype=torch.float16, device=self.device)
        self.offset = torch.zeros(L, B, 1, H, D, device=self.device)  # c, broadcast over positions
        # per layer and sequence: has the offset been set (a `rows` view shares it, reading rows row0..)
        self.offset_set = [[False] * B for _ in range(L)]
        self.centred = self.offset_keys if self.keys else self.offset_values

    def to_storage(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.rot.T

    def from_storage(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.rot

    def prepare(self, layer: int, x: torch.Tensor, pos: int) -> torch.Tensor:
        """Rotate x (B, T, H, D), keep the sinks, set the offset on a sequence's first batch past
        them -> y = r - c, the values the codes hold."""
        T = x.shape[1]
        r = self.to_storage(x.float())  # (B, T, H, D)
        rows = slice(self.row0, self.row0 + self.batch)
        if pos == 0:
            self.offset_set[layer][rows] = [False] * self.batch  # a new sequence
        if pos < self.n_sink:
            n = min(T, self.n_sink - pos)
            self.sink[layer, :, :, pos : pos + n] = r[:, :n].transpose(1, 2).half()
        first = max(0, self.n_sink - pos)
        if self.centred and not self.ready(layer) and first < T:
            self.offset[layer] = r[:, first:].mean(dim=1, keepdim=True)
            self.offset_set[layer][rows] = [True] * self.batch
        return r - self.offset[layer]

    def row_state(self, row: int) -> torch.Tensor:
        """Whether each layer's offset is set for sequence row: (L,) uint8."""
        return torch.tensor([flags[self.row0 + row] for flags in self.offset_set], dtype=torch.uint8)

    def restored(self, row: int, state: torch.Tensor) -> None:
        for flags, was_set in zip(self.offset_set, state.tolist()):
            flags[self.row0 + row] = bool(was_set)

    def ready(self, layer: int) -> bool:
        """Has this layer's offset been set for these sequences (or does this store use none)?"""
        return not self.centred or all(self.offset_set[layer][self.row0 : self.row0 + self.batch])

    def row_ready(self, layer: int, b: int) -> bool:
        """`ready` for sequence b of these alone."""
        return not self.centred or self.offset_set[layer][self.row0 + b]

    def _sinks(self, layer: int, start: int, end: int) -> torch.Tensor:
        """The f16 sinks among positions start..end-1 as f32 (B, H, m, D); m may be 0."""
        return self.sink[layer, :, :, start : max(start, min(end, self.n_sink))].float()


class HadamardQ4Store(RotatedStore):
    """Rotated, offset vectors as 4-bit codes in int4 GEMM tiles (keys and values differ), bf16 scales."""

    name = "q4_hadamard"
    batched = ("data", "scale", "sink", "offset")
    per_row_positions = True
    default_window = 16  # f16 recent window (kvcli/cache/window.py): from KLD per size, benchmarks/README.md
    block_size, block_bytes = 32, 18  # 16 bytes of codes and a bf16 scale per 32 elements: 4.5 bits

    def __init__(self, *args, tile: int | None = None, **kwargs):
        """tile: T, the tile width (64 or 32); by default the one the running CPU's int4 GEMM packs, else 64."""
        super().__init__(*args, **kwargs)
        L, B, H, n, D = self.n_layers, self.batch, self.n_heads, self.n_ctx, self.head_dim
        self.n_pad = _whole_tiles(n)
        self.tile = tile or int4_tiles.tile_width() or PAD
        tw = self.tile
        self.width = min(tw, D)  # W: elements per value tile
        shape = (self.n_pad // tw, D, tw // 2) if self.keys else (D // self.width, self.n_pad, self.width // 2)
        self.data = lazy_zeros((L, B, H, *shape), torch.uint8, self.device)
        self.scale = lazy_zeros((L, B, H, D // 32, self.n_pad), torch.bfloat16, self.device)
        # fixed for the store's life: built once, not per layer and token where the kernels run
        self._layout = KernelLayout(Kind.HADAMARD_KEYS if self.keys else Kind.HADAMARD_VALUES, self.block_bytes,
                                    table=tuple(_SCALE_GRID.tolist()), n_sink=N_SINK,
                                    tile=self.tile if self.keys else self.width)

    @classmethod
    def nbytes_for(cls, n_layers: int, batch: int, kv_dim: int, n_ctx: int) -> int:
        per_layer = _whole_tiles(n_ctx) * kv_dim // 32 * cls.block_bytes + kv_dim * (min(N_SINK, n_ctx) * 2 + 4)
        return n_layers * batch * per_layer

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scale, self.sink, self.offset))

    def position_axes(self) -> dict[str, tuple[int, int]]:
        """Keys' codes by tiles of `tile` positions, values' and the scales by position; sinks, offsets: whole."""
        return {"data": (2, self.tile) if self.keys else (3, 1), "scale": (3, 1)}

    # ---- writing ----
    def kernel_layout(self) -> KernelLayout:
        return self._layout

    def kernel_operands(self, layer: int) -> tuple[torch.Tensor, ...]:
        """codes (B, H, tiles...) uint8, scales (B, H, D / 32, n_pad) bf16, sinks (B, H, n_sink, D) f16,
        offsets (B, H, D) f32."""
        return self.data[layer], self.scale[layer], self.sink[layer], self.offset[layer, :, 0]

    scale_grid_f32 = _SCALE_GRID.numpy()  # the scale grid as the CPU quantizer takes it

    def quantize_reference(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """y (B, T, H, D) f32 -> codes (B, T, H, D) uint8, scales (B, T, H, D / 32) f32 (quantize_vectors)."""
        return quantize_vectors(y)

    def store(self, layer: int, x: torch.Tensor, pos: int | torch.Tensor) -> None:
        """pos: an int, or at decode (T = 1) a (B,) tensor, each sequence's own position (store_rows)."""
        if torch.is_tensor(pos):
            return self.store_rows((self,), layer, (x,), pos)
        self.put(layer, *self.quantize(self.prepare(layer, x, pos)), pos)

    def store_pair(self, other: "HadamardQ4Store", layer: int, x: torch.Tensor, y: torch.Tensor,
                   pos: int | torch.Tensor) -> None:
        """K here, V in `other`, quantized in one pass (the scale search's ops run once per token)."""
        if torch.is_tensor(pos):
            return self.store_rows((self, other), layer, (x, y), pos)
        B = x.shape[0]
        u, d = self.quantize(torch.cat([self.prepare(layer, x, pos), other.prepare(layer, y, pos)]))
        self.put(layer, u[:B], d[:B], pos)
        other.put(layer, u[B:], d[B:], pos)

    def store_spans(self, other: "HadamardQ4Store", layer: int, spans: list[tuple]) -> bool:
        """Store.store_spans on the CPU: every span rotated, offset, quantized and written in one pass each, where
        all are past the sinks with their offsets set (the server's steady state; `prepare` does the rest). A span's
        bytes are those its own store_pair writes: the same rotation, offset and block-by-block search."""
        if not (self.writer is not None and all(w0 >= self.n_sink and self.row_ready(layer, b)
                                              and other.row_ready(layer, b) for b, _, _, w0 in spans)):
            return False
        rows = np.concatenate([np.full(x.shape[1], b, np.int64) for b, x, _, _ in spans])
        pos = np.concatenate([np.arange(w0, w0 + x.shape[1], dtype=np.int64) for _, x, _, w0 in spans])
        at = torch.from_numpy(rows)
        ys = [s.to_storage(torch.cat([part[0] for part in parts]).float()) - s.offset[layer, at, 0]
              for s, parts in ((self, [x for _, x, _, _ in spans]), (other, [y for _, _, y, _ in spans]))]
        u, d = self.quantize(torch.cat(ys)[None])  # (1, 2 M, H, D): keys, then values
        M = rows.shape[0]
        self._put_vectors(layer, u[0, :M], d[0, :M], rows, pos)
        other._put_vectors(layer, u[0, M:], d[0, M:], rows, pos)
        return True

    def _put_vectors(self, layer: int, u: torch.Tensor, d: torch.Tensor, rows: np.ndarray, pos: np.ndarray) -> None:
        """Codes u (M, H, D) and scales d (M, H, D / 32), vector m to sequence rows[m] at position pos[m], through
        the bound writer (the kernel table's WRITE) over this layer's bytes."""
        self.writer(self._layout, self.operands(layer).arrays, (u, d), rows, pos)

    @staticmethod
    def store_rows(stores: tuple, layer: int, xs: tuple, pos: torch.Tensor) -> None:
        """xs[i] (B, 1, H, D) into stores[i] (K, or K and V), sequence b's token at position pos[b]: quantized in one
        pass where every row is past the sinks with its offset set (the server's steady state), else row by row."""
        if not (all(s.ready(layer) for s in stores) and int(pos.min()) >= stores[0].n_sink):
            for b, p in enumerate(pos.tolist()):
                one = [s.rows(b, b + 1) for s in stores]
                if len(one) == 2:
                    one[0].store_pair(one[1], layer, xs[0][b : b + 1], xs[1][b : b + 1], p)
                else:
                    one[0].store(layer, xs[0][b : b + 1], p)
            return
        # prepare's y = R x - c, past the sinks with the offsets set
        y = torch.cat([s.to_storage(x.float()) - s.offset[layer] for s, x in zip(stores, xs)])  # (n B, 1, H, D)
        u, d = stores[0].quantize(y)
        B = xs[0].shape[0]
        for i, s in enumerate(stores):
            s.put_rows(layer, u[i * B : i * B + B, 0], d[i * B : i * B + B, 0], pos)

    def put_rows(self, layer: int, u: torch.Tensor, d: torch.Tensor, pos: torch.Tensor) -> None:
        """Codes u (B, H, D) and scales d (B, H, D / 32) of sequence b's token at position pos[b]."""
        if self.writer is not None:
            return self._put_vectors(layer, u, d, np.arange(u.shape[0], dtype=np.int64), pos.numpy())
        seqs = self.sequences(u.shape[0])
        self.scale[layer, seqs, :, :, pos] = d.to(self.scale.dtype)
        tw = self.tile
        if self.keys:  # one nibble of D bytes each: positions p and p +- T / 2 share them
            tile, col = pos // tw, pos % (tw // 2)
            high = (pos % tw >= tw // 2).view(-1, 1, 1)
            old = self.data[layer, seqs, :, tile, :, col]  # (B, H, D)
            self.data[layer, seqs, :, tile, :, col] = torch.where(high, (old & 0x0F) | (u << 4), (old & 0xF0) | u)
        else:
            W = self.width
            self.data[layer, seqs, :, :, pos] = int4_tiles.pack_pairs(u.unflatten(-1, (-1, W)))  # (B, H, D / W, W / 2)

    def put(self, layer: int, u: torch.Tensor, d: torch.Tensor, pos: int) -> None:
        """Codes u (B, T, H, D) and scales d (B, T, H, D / 32) into positions pos..pos+T-1."""
        B, T, H, D = u.shape
        if self.writer is not None:
            rows = np.repeat(np.arange(B, dtype=np.int64), T)
            at = np.tile(np.arange(pos, pos + T, dtype=np.int64), B)
            return self._put_vectors(layer, u.reshape(B * T, H, D), d.reshape(B * T, H, D // 32), rows, at)
        self.scale[layer, :, :, :, pos : pos + T] = d.permute(0, 2, 3, 1)
        tw = self.tile
        if self.keys and T == 1:  # decode: one nibble of D bytes, positions pos and pos +- T / 2 share them
            high = pos % tw >= tw // 2
            col = self.data[layer, :, :, pos // tw, :, pos % (tw // 2)]  # (B, H, D), a view
            col.copy_((col & (0x0F if high else 0xF0)) | (u[:, 0] << 4 if high else u[:, 0]))
        elif self.keys:  # rewrite the touched tiles
            t0, t1 = pos // tw, -(-(pos + T) // tw)
            tiles = self.data[layer, :, :, t0:t1]  # (B, H, nt, D, T / 2)
            codes = self._tile_codes(tiles)
            codes[:, :, pos - tw * t0 : pos - tw * t0 + T] = u.transpose(1, 2)
            tiles.copy_(int4_tiles.pack_pairs(codes.view(B, H, t1 - t0, tw, D).transpose(-1, -2)))
        else:
            W = self.width
            u = u.reshape(B, T, H, D // W, W)
            self.data[layer, :, :, :, pos : pos + T] = int4_tiles.pack_pairs(u).permute(0, 2, 3, 1, 4)

    # ---- reading ----
    def _tile_codes(self, tiles: torch.Tensor) -> torch.Tensor:
        """Key tiles (B, H, nt, D, T / 2) -> the codes of their T nt positions (B, H, T nt, D) uint8."""
        return int4_tiles.unpack_pairs(tiles).transpose(-1, -2).reshape(self.batch, self.n_heads, -1, self.head_dim)

    def codes(self, layer: int, start: int, end: int) -> torch.Tensor:
        """The codes of positions start..end-1 as (B, H, end - start, D) uint8."""
        B, H, D = self.batch, self.n_heads, self.head_dim
        if self.keys:
            tw = self.tile
            t0, t1 = start // tw, -(-end // tw)
            return self._tile_codes(self.data[layer, :, :, t0:t1])[:, :, start - tw * t0 : end - tw * t0]
        planes = self.data[layer, :, :, :, start:end]  # (B, H, D / W, n, W / 2), W = self.width
        u = int4_tiles.unpack_pairs(planes)  # (B, H, D / W, n, W)
        return u.transpose(2, 3).reshape(B, H, end - start, D)

    def load(self, layer: int, start: int, end: int) -> torch.Tensor:
        """Rotated-space vectors (B, H, end - start, D) f32."""
        B, H, n, D = self.batch, self.n_heads, end - start, self.head_dim
        y = self.codes(layer, start, end).float().sub_(8).view(B, H, n, D // 32, 32)
        y = y.mul_(self.scale[layer, :, :, :, start:end].transpose(-1, -2)[..., None]).view(B, H, n, D)
        y.add_(self.offset[layer].transpose(1, 2))  # (B, H, 1, D)
        sinks = self._sinks(layer, start, end)
        y[:, :, : sinks.shape[2]] = sinks
        return y
