"""q4_hadamard: a Hadamard-rotated 4-bit cache (exllamav2's idea, QuaRot's random signs).

The format, in one place. For each layer, sequence and KV head, a head vector x (D) is
  1. rotated: r = R x, with R = H_D diag(s) / sqrt(D) (Walsh-Hadamard H_D, fixed random
     signs s from seed 0): orthogonal, so dot products are kept and outliers spread out;
  2. offset: y = r - c, where c (D, f32) is the mean of the rotated vectors of the first
     stored batch past the sinks. Exact: softmax ignores a constant added to every score
     of a query (keys), and its weights sum to 1 (values);
  3. stored as q4_0-layout blocks of 32 (fp16 d, 16 bytes of nibbles, value = d (q - 8)),
     with d chosen from a small grid plus a least-squares refit to minimise the block's
     squared error (not ggml's max/-8).
The first N_SINK positions (attention sinks) are also kept as rotated f16 and used in place
of their 4-bit copy. Attention compares keys in the rotated space (q is rotated once) and
rotates the value output back once. Bytes: 4.5 bits per element, plus sinks and offsets,
all counted in `nbytes`.
"""

from __future__ import annotations

import math

import torch

from kvcli.cache import block_products
from kvcli.cache.ggml_blocks import Q4_0Store, _f16_bytes, _pack_nibbles
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


def quantize_q4_mse(x: torch.Tensor) -> torch.Tensor:
    """(..., 32) f32 -> (..., 18) q4_0-layout blocks with a squared-error-minimising scale.

    Candidates d = g * m / -8 (m: the signed value of largest magnitude; g = 1 is ggml's q4_0
    choice, so the extreme may use level -8), each refit by least squares for its levels."""
    m = x.gather(-1, x.abs().argmax(dim=-1, keepdim=True))  # (..., 1)
    grid = _SCALE_GRID.to(x.device).view(-1, *([1] * x.dim()))  # (S, 1, ..., 1)
    d = m * grid / -8  # (S, ..., 1) candidate scales
    q = (x / torch.where(d == 0, 1.0, d)).round().clamp(-8, 7)  # (S, ..., 32)
    d = (q * x).sum(-1, keepdim=True) / (q * q).sum(-1, keepdim=True).clamp_min(1e-30)
    d = d.half().float()  # the scale is stored as fp16: judge the error with that
    err = ((x - d * q) ** 2).sum(-1, keepdim=True)  # (S, ..., 1)
    best = err.argmin(dim=0, keepdim=True)
    d = d.gather(0, best)[0]
    q = q.gather(0, best.expand(1, *q.shape[1:]))[0]
    return torch.cat([_f16_bytes(d), _pack_nibbles((q + 8).to(torch.uint8))], dim=-1)


class HadamardQ4Store(Q4_0Store):
    """q4_0's block layout (so its dequantizer and decode path) holding rotated, offset vectors."""

    name = "q4_hadamard"
    quantize_blocks = staticmethod(quantize_q4_mse)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)  # self.data: (L, B, H, n_ctx, row_bytes) q4_0 blocks
        L, B, H, n, D = self.n_layers, self.batch, self.n_heads, self.n_ctx, self.head_dim
        self.rot = rotation(D).to(self.device)  # r = x @ rot.T
        self.sink = torch.zeros(L, B, H, min(N_SINK, n), D, dtype=torch.float16, device=self.device)
        self.offset = torch.zeros(L, B, 1, H, D, device=self.device)  # c, broadcast over positions
        self.offset_set = [False] * L

    @classmethod
    def nbytes_for(cls, n_layers: int, batch: int, kv_dim: int, n_ctx: int) -> int:
        per_layer = n_ctx * kv_dim // 32 * cls.block_bytes + kv_dim * (min(N_SINK, n_ctx) * 2 + 4)
        return n_layers * batch * per_layer

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.sink, self.offset))

    def to_storage(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.rot.T

    def from_storage(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.rot

    def prepare(self, layer: int, x: torch.Tensor, pos: int) -> torch.Tensor:
        """Rotate x (B, T, H, D), keep the sinks, set the offset on a sequence's first batch past
        them -> y = r - c, the values the 4-bit blocks hold."""
        T = x.shape[1]
        r = self.to_storage(x.float())  # (B, T, H, D)
        if pos == 0:
            self.offset_set[layer] = False  # a new sequence
        if pos < N_SINK:
            n = min(T, N_SINK - pos)
            self.sink[layer, :, :, pos : pos + n] = r[:, :n].transpose(1, 2).half()
        first = max(0, N_SINK - pos)
        if not self.offset_set[layer] and first < T:
            self.offset[layer] = r[:, first:].mean(dim=1, keepdim=True)
            self.offset_set[layer] = True
        return r - self.offset[layer]

    def _sinks(self, layer: int, start: int, end: int) -> torch.Tensor:
        """The f16 sinks among positions start..end-1 as f32 (B, H, m, D); m may be 0."""
        return self.sink[layer, :, :, start : max(start, min(end, N_SINK))].float()

    def load(self, layer: int, start: int, end: int) -> torch.Tensor:
        """Rotated-space vectors (B, H, end - start, D) f32."""
        y = super().load(layer, start, end)
        y.add_(self.offset[layer].transpose(1, 2))  # (B, H, 1, D), in place: y is a fresh buffer
        sinks = self._sinks(layer, start, end)
        y[:, :, : sinks.shape[2]] = sinks
        return y

    # Decode reads the 4-bit bytes directly (block_products); the offset and sinks are added here.
    def scores(self, layer, q, start, end):
        if not self.direct(q):
            return super().scores(layer, q, start, end)
        s = super().scores(layer, q, start, end)  # q . y_t
        s += q @ self.offset[layer].permute(0, 2, 3, 1)  # + q . c: (B, H, R, D) @ (B, H, D, 1)
        sinks = self._sinks(layer, start, end)
        s[..., : sinks.shape[2]] = q @ sinks.transpose(-1, -2)
        return s

    def weighted_sum(self, layer, p, start, end):
        if not self.direct(p):
            return super().weighted_sum(layer, p, start, end)
        B, H, R, t = p.shape
        sinks = self._sinks(layer, start, end)
        m = sinks.shape[2]
        out = block_products.weighted_sum(p.reshape(B * H, R, t), self.rows(layer, start, end), self.codes,
                                          skip=m).view(B, H, R, self.head_dim)
        out.addcmul_(p[..., m:].sum(-1, keepdim=True), self.offset[layer].transpose(1, 2))  # + c, past the sinks
        if m:
            out += p[..., :m] @ sinks
        return out
