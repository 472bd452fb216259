"""The tiles of torch's int4 CPU GEMM: its layout, found on the running CPU, and the product itself.

`torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, group, sz)` computes x @ W.T for a packed
4-bit weight W (N, K) with W[n, k] = (code - 8) * scale[k // group, n] + zero[k // group, n],
in bf16 with f32 accumulation (torchao's weight-only int4 kernel). It packs W in tiles of T
rows of N, T depending on the CPU's vector width (64 with AVX-512, 32 with AVX2): byte
(tile, k, j), j < T / 2, holds W[T tile + j, k] (low nibble) and W[T tile + j + T / 2, k]
(high); a tile's K * T / 2 bytes are contiguous. q4_hadamard stores its codes in exactly that
layout (kvcli/cache/hadamard.py, kvcli/cache/turbo.py), with T found once by `tile_width()`, and
so do kvcli's Int4 weights (kvcli/weights.py): the rotated types' decode kernel
(kvcli/kernels/cpu/attention_rotated.py) and the weight products read them as they lie. Inputs and outputs are bf16, sums f32. The layout is
private to torch, so `tile_width()` checks it against ours; where neither tile width matches or the
op is missing, None.
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


# ---- b-bit rows: the tq types' packing of nibble rows (kvcli/cache/turbo.py's format, step 3) ----
_SHIFT2 = torch.tensor([0, 2], dtype=torch.int32).view(2, 1, 1)
_SHIFT4 = torch.tensor([0, 1, 2, 3], dtype=torch.int32).view(4, 1, 1)


def pack_rows(n: torch.Tensor, bits: int) -> torch.Tensor:
    """Nibble rows (..., S, C) uint8, a b-bit code in each nibble -> the packed (..., b S / 4, C)."""
    if bits == 4:
        return n
    S = n.shape[-2]
    low = (n[..., : S // 2, :] & 0x33) | ((n[..., S // 2 :, :] & 0x33) << 2)
    if bits == 2:
        return low
    high = [((n[..., k * S // 4 : (k + 1) * S // 4, :] >> 2) & 0x11) << k for k in range(4)]
    return torch.cat([low, high[0] | high[1] | high[2] | high[3]], -2)


def unpack_rows(p: torch.Tensor, bits: int, add: int = 0) -> torch.Tensor:
    """Packed (..., b S / 4, C) -> nibble rows (..., S, C) uint8 (plus `add` in every nibble, the sum
    below 16), C a multiple of 4: int32 shifts and masks over the bytes (bits moving across a byte
    boundary land where the mask drops them)."""
    if bits == 4:
        return p if not add else (p.view(torch.int32) + add * 0x11111111).view(torch.uint8)
    lead, C, S = p.shape[:-2], p.shape[-1], p.shape[-2] * 4 // bits
    low = p[..., : S // 2, :].view(torch.int32).unsqueeze(-3)  # (..., 1, S / 2, C / 4)
    n = (low >> _SHIFT2.to(p.device)).bitwise_and_(0x33333333).view(*lead, S, C // 4)  # rows r, r + S / 2
    if bits == 3:
        high = p[..., S // 2 :, :].view(torch.int32).unsqueeze(-3)  # (..., 1, S / 4, C / 4)
        n.add_((high >> _SHIFT4.to(p.device)).bitwise_and_(0x11111111).view(*lead, S, C // 4), alpha=4)
    if add:
        n.add_(add * 0x11111111)
    return n.view(torch.uint8)
