"""Decode products over q4_hadamard's 4-bit tiles through torch's int4 CPU GEMM.

`torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, group, sz)` computes x @ W.T for a packed
4-bit weight W (N, K) with W[n, k] = (code - 8) * scale[k // group, n] + zero[k // group, n],
in bf16 with f32 accumulation (torchao's weight-only int4 kernel; AVX-512/AVX2). It packs W in
tiles of 64 rows of N: byte (tile, k, j) holds W[64 tile + j, k] (low nibble) and
W[64 tile + j + 32, k] (high). q4_hadamard stores its codes in exactly that layout
(kvcli/cache/hadamard.py), so decode reads the cache as it lies:
  * scores   q . y_t: K tiles are W with N = positions, K = elements, group 32 = a block's scale;
  * weighted sums sum_t p_t y_t: V tiles are W with N = elements (64 per tile), K = positions,
    unit scales; the block scales go into the weights, x[(r, b), t] = p[r, t] d[t, b], and row
    (r, b) keeps only block b's columns.
Inputs and outputs are bf16, sums f32: a score or an output element is good to 2^-8 of itself
(llama.cpp rounds q to q8_0 for quantized keys and sums f16 values in f16). On SmolLM2 the
decode logits differ from the exact dequantizing path by KL 6e-4 to 1e-3, against the type's
own 0.016 from f16. Measured at depth 4096 (benchmarks/cache_decode.py, two runs): q4_hadamard
decodes at 0.83x and 0.95x kvcli's f16 speed, against 0.54x with the int8 path that
block_products.py keeps for q4_0 (q4_0 itself: 0.58x and 0.68x in the same runs). The layout
is private to torch, so `available()` checks it once against ours; where it differs or the op
is missing, the store dequantizes instead.
"""

from __future__ import annotations

import functools

import torch

TILE = 64  # rows of N per packed tile: positions (keys) or elements (values)
GROUP = 32  # the GEMM's scale group along K: one q4 block (keys); any (values: unit scales)


def pack_pairs(u: torch.Tensor) -> torch.Tensor:
    """(..., 64) nibbles -> (..., 32) bytes: byte j = u[j] | u[j + 32] << 4."""
    return u[..., : TILE // 2] | (u[..., TILE // 2 :] << 4)


def unpack_pairs(b: torch.Tensor) -> torch.Tensor:
    """(..., 32) bytes -> (..., 64) nibbles, the inverse of pack_pairs."""
    return torch.cat([b & 15, b >> 4], -1)


@functools.cache
def available() -> bool:
    """Does this torch have the CPU int4 GEMM with the layout and dequantization described above?"""
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randint(0, 16, (TILE, 2 * GROUP), generator=g, dtype=torch.int32)  # (N, K) codes
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w, 1)
        ours = pack_pairs(w.T.to(torch.uint8))  # (K, 32): byte (k, j) = W[j, k] | W[j + 32, k] << 4
        if not torch.equal(packed.view(-1), ours.reshape(-1)):
            return False
        x = torch.randn(3, 2 * GROUP, generator=g).bfloat16()
        sz = torch.stack([torch.rand(2, TILE, generator=g) + 0.5, torch.zeros(2, TILE)], -1).bfloat16()
        got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz).float()
        ref = x.float() @ ((w - 8) * sz[..., 0].float().repeat_interleave(GROUP, 0).T).T
        return bool(torch.allclose(got, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item()))
    except (AttributeError, RuntimeError, NotImplementedError):  # no such op, or none for this CPU
        return False


def _mm(x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """x (M, K) bf16 @ W.T for packed w (N, K / 2) uint8 and scales sz (K / 32, N, 2) bf16 -> (M, N) bf16."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, GROUP, sz)


def scores(q: torch.Tensor, tiles: torch.Tensor, scale: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """q (B, H, R, D) f32 against the keys at start..end-1 -> (B, H, R, end - start) f32.

    tiles (B, H, n_pad / 64, D, 32) uint8, scale (B, H, D / 32, n_pad) bf16: one layer of a K store."""
    B, H, R, D = q.shape
    t0, t1 = start // TILE, -(-end // TILE)
    n = (t1 - t0) * TILE
    s = scale[..., t0 * TILE : t1 * TILE]
    sz = torch.stack([s, s.new_zeros(()).expand_as(s)], -1)  # (B, H, nb, n, 2): scale, zero point 0
    qb = q.to(torch.bfloat16)
    out = torch.stack([_mm(qb[b, h], tiles[b, h, t0:t1].view(n, D // 2), sz[b, h])
                       for b in range(B) for h in range(H)])  # (B * H, R, n)
    return out.view(B, H, R, n)[..., start - t0 * TILE : end - t0 * TILE].float()


def weighted_sum(p: torch.Tensor, planes: torch.Tensor, scale: torch.Tensor, start: int, end: int,
                 unit: torch.Tensor, skip: int = 0) -> torch.Tensor:
    """p (B, H, R, end - start) f32 over the values at start..end-1 -> (B, H, R, D) f32; the first
    `skip` positions get no weight (the store adds its full-precision sinks itself).

    planes (B, H, D / 64, n_pad, 32) uint8, scale (B, H, D / 32, n_pad) bf16: one layer of a V
    store; unit (>= n_pad / 32, 64, 2) bf16 holds scale 1, zero point 0."""
    B, H, R, t = p.shape
    nt = planes.shape[2]
    a, z = start // GROUP * GROUP, -(-end // GROUP) * GROUP  # K must be whole groups
    # x (B, H, nt, R, 2, K): x[.., i, r, c, k] = p[r, a + k] d[a + k, 2 i + c], zero off start..end-1
    x = torch.zeros(B, H, nt, R, 2, z - a, dtype=torch.bfloat16)
    d = scale[..., start:end].unflatten(2, (nt, 1, 2))  # (B, H, nt, 1, 2, t)
    torch.mul(p[:, :, None, :, None], d, out=x[..., start - a : end - a])
    if skip:
        x[..., start - a : start - a + skip] = 0
    sz = unit[: (z - a) // GROUP]
    out = torch.stack([_mm(x[b, h, i].view(2 * R, z - a), planes[b, h, i, a:z].view(TILE, (z - a) // 2), sz)
                       for b in range(B) for h in range(H) for i in range(nt)])  # (B * H * nt, 2R, 64)
    # row (r, c) of tile i is the sum with block 2i + c's scales: keep its own 32 columns
    out = out.view(B, H, nt, R, 2, 2, GROUP).diagonal(dim1=4, dim2=5)  # (B, H, nt, R, 32, 2)
    return out.permute(0, 1, 3, 2, 5, 4).reshape(B, H, R, -1).float()
