"""Decode products over q4_hadamard's 4-bit tiles through torch's int4 CPU GEMM.

`torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, group, sz)` computes x @ W.T for a packed
4-bit weight W (N, K) with W[n, k] = (code - 8) * scale[k // group, n] + zero[k // group, n],
in bf16 with f32 accumulation (torchao's weight-only int4 kernel). It packs W in tiles of T
rows of N, T depending on the CPU's vector width (64 with AVX-512, 32 with AVX2): byte
(tile, k, j), j < T / 2, holds W[T tile + j, k] (low nibble) and W[T tile + j + T / 2, k]
(high); a tile's K * T / 2 bytes are contiguous. q4_hadamard stores its codes in exactly that
layout (kvcli/cache/hadamard.py), with T found once by `tile_width()`, so decode reads the
cache as it lies:
  * scores   q . y_t: K tiles are W with N = positions, K = elements, group 32 = a block's scale;
  * weighted sums sum_t p_t y_t: V tiles are W with N = elements (T per tile), K = positions,
    unit scales; the block scales go into the weights, x[(r, b), t] = p[r, t] d[t, b] for the
    T / 32 blocks b of a tile, and row (r, b) keeps only block b's 32 columns.
Inputs and outputs are bf16, sums f32: a score or an output element is good to 2^-8 of itself
(llama.cpp rounds q to q8_0 for quantized keys and sums f16 values in f16). The layout is
private to torch, so `tile_width()` checks it against ours; where neither tile width matches
or the op is missing, the store dequantizes instead. Speed and accuracy figures:
benchmarks/README.md.
"""

from __future__ import annotations

import functools

import torch

TILE_WIDTHS = (64, 32)  # rows of N per packed tile that torch's CPU kernels use (AVX-512, AVX2)
GROUP = 32  # the GEMM's scale group along K: one q4 block (keys); any (values: unit scales)


def pack_pairs(u: torch.Tensor) -> torch.Tensor:
    """(..., W) nibbles -> (..., W / 2) bytes: byte j = u[j] | u[j + W / 2] << 4."""
    h = u.shape[-1] // 2
    return u[..., :h] | (u[..., h:] << 4)


def unpack_pairs(b: torch.Tensor) -> torch.Tensor:
    """(..., W / 2) bytes -> (..., W) nibbles, the inverse of pack_pairs."""
    return torch.cat([b & 15, b >> 4], -1)


def _packs_as(w: torch.Tensor, packed: torch.Tensor, tile: int) -> bool:
    """Is `packed` W (N, K) codes in tiles of `tile` rows: byte (i, k, j) = W[tile i + j, k] | W[.. + tile / 2, k] << 4?"""
    N, K = w.shape
    ours = pack_pairs(w.to(torch.uint8).view(N // tile, tile, K).transpose(-1, -2))  # (N / tile, K, tile / 2)
    return torch.equal(packed.reshape(-1), ours.reshape(-1))


@functools.cache
def tile_width() -> int | None:
    """T, the tile width of this torch's CPU int4 GEMM on the running CPU (one of TILE_WIDTHS), or None
    where the op is missing, packs another way, or does not dequantize as described above."""
    try:
        g = torch.Generator().manual_seed(0)
        N, K = max(TILE_WIDTHS), 2 * GROUP
        one_hot = torch.zeros(N, K, dtype=torch.int32)
        one_hot[N // 2 + 3, 5] = 15  # one code: where it lands tells the tile width apart from the others
        w = torch.randint(0, 16, (N, K), generator=g, dtype=torch.int32)  # (N, K) codes
        packed = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(a, 1) for a in (one_hot, w)]
        tile = next((t for t in TILE_WIDTHS if all(_packs_as(a, p, t) for a, p in zip((one_hot, w), packed))), None)
        if tile is None:
            return None
        x = torch.randn(3, K, generator=g).bfloat16()
        sz = torch.stack([torch.rand(K // GROUP, N, generator=g) + 0.5, torch.zeros(K // GROUP, N)], -1).bfloat16()
        got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed[1], GROUP, sz).float()
        ref = x.float() @ ((w - 8) * sz[..., 0].float().repeat_interleave(GROUP, 0).T).T
        return tile if torch.allclose(got, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item()) else None
    except (AttributeError, RuntimeError, NotImplementedError):  # no such op, or none for the running CPU
        return None


def mm(x: torch.Tensor, w: torch.Tensor, sz: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """x (M, K) bf16 @ W.T for packed w (N, K / 2) uint8 and scales sz (K / group, N, 2) bf16 -> (M, N) bf16;
    group: 32, 64, 128 or 256 elements of K per scale."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, group, sz)


def scores(q: torch.Tensor, tiles: torch.Tensor, scale: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """q (B, H, R, D) f32 against the keys at start..end-1 -> (B, H, R, end - start) f32.

    tiles (B, H, n_pad / T, D, T / 2) uint8, scale (B, H, D / 32, n_pad) bf16: one layer of a K store."""
    B, H, R, D = q.shape
    T = 2 * tiles.shape[-1]
    t0, t1 = start // T, -(-end // T)
    n = (t1 - t0) * T
    s = scale[..., t0 * T : t1 * T]
    sz = torch.stack([s, s.new_zeros(()).expand_as(s)], -1)  # (B, H, nb, n, 2): scale, zero point 0
    qb = q.to(torch.bfloat16).flatten(0, 1)
    # one product per head (iterating a tensor unbinds it in one call: few ops per layer and token)
    out = torch.stack([mm(x, w.view(n, D // 2), z)
                       for x, w, z in zip(qb, tiles[:, :, t0:t1].flatten(0, 1), sz.flatten(0, 1))])  # (B H, R, n)
    return out.view(B, H, R, n)[..., start - t0 * T : end - t0 * T].float()


def weighted_sum(p: torch.Tensor, planes: torch.Tensor, scale: torch.Tensor, start: int, end: int,
                 unit: torch.Tensor, skip: int = 0) -> torch.Tensor:
    """p (B, H, R, end - start) f32 over the values at start..end-1 -> (B, H, R, D) f32; the first
    `skip` positions get no weight (the store adds its full-precision sinks itself).

    planes (B, H, D / T, n_pad, T / 2) uint8, scale (B, H, D / 32, n_pad) bf16: one layer of a V
    store; unit (>= n_pad / 32, T, 2) bf16 holds scale 1, zero point 0."""
    B, H, R, t = p.shape
    nt, T = planes.shape[2], 2 * planes.shape[-1]
    nb = T // GROUP  # blocks of 32 elements per tile
    a, z = start // GROUP * GROUP, -(-end // GROUP) * GROUP  # K must be whole groups
    # x (B, H, nt, R, nb, K): x[.., i, r, c, k] = p[r, a + k] d[a + k, nb i + c], zero off start..end-1
    x = torch.zeros(B, H, nt, R, nb, z - a, dtype=torch.bfloat16)
    d = scale[..., start:end].unflatten(2, (nt, 1, nb))  # (B, H, nt, 1, nb, t)
    torch.mul(p[:, :, None, :, None], d, out=x[..., start - a : end - a])
    if skip:
        x[..., start - a : start - a + skip] = 0
    sz = unit[: (z - a) // GROUP, :T]
    out = torch.stack([mm(xi.view(nb * R, z - a), w.view(T, (z - a) // 2), sz)
                       for xi, w in zip(x.flatten(0, 2), planes[..., a:z, :].flatten(0, 2))])  # (B H nt, nb R, T)
    # row (r, c) of tile i is the sum with block nb i + c's scales: keep its own 32 columns
    out = out.view(B, H, nt, R, nb, nb, GROUP).diagonal(dim1=4, dim2=5)  # (B, H, nt, R, 32, nb)
    return out.permute(0, 1, 3, 2, 5, 4).reshape(B, H, R, -1).float()
