"""The tiles of torch's int4 CPU GEMM (kvcli/kernels/cpu/int4_tiles.py): found on the running CPU, the layout the
rotated cache types and the Int4 weights keep their codes in."""

import pytest
import torch

from kvcli.attention import Attention
from kvcli.cache import KVCache
from kvcli.kernels.cpu import int4_tiles


def test_torch_layout_is_ours():
    """This torch packs and multiplies in one of the tile layouts int4_tiles knows, and q4_hadamard and tq stores
    take that tile width."""
    T = int4_tiles.tile_width()
    assert T in int4_tiles.TILE_WIDTHS, "torch's _weight_int4pack_mm_for_cpu is missing or changed its tile layout"
    for kind in ("q4_hadamard", "tq3"):
        assert KVCache(1, 1, 1, 8, 64, kind, kind, attention=Attention()).k.tile == T


@pytest.mark.parametrize("W", [32, 64])
def test_pack_pairs_round_trip(W):
    u = torch.randint(0, 16, (5, W), dtype=torch.uint8)
    b = int4_tiles.pack_pairs(u)
    assert b.shape == (5, W // 2) and torch.equal(b[:, 3], u[:, 3] | u[:, 3 + W // 2] << 4)
    assert torch.equal(int4_tiles.unpack_pairs(b), u)


def test_mm_reads_our_tiles():
    """mm over codes packed as ours equals (code - 8) * scale + zero, to bf16 precision."""
    T = int4_tiles.tile_width()
    g = torch.Generator().manual_seed(0)
    N, K = 2 * T, 64
    w = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    packed = int4_tiles.pack_pairs(w.view(N // T, T, K).transpose(-1, -2)).reshape(N, K // 2)
    sz = torch.stack([torch.rand(K // 32, N, generator=g) + 0.5, torch.randn(K // 32, N, generator=g)], -1).bfloat16()
    x = torch.randn(3, K, generator=g).bfloat16()
    W = (w.float() - 8) * sz[..., 0].float().repeat_interleave(32, 0).T + sz[..., 1].float().repeat_interleave(32, 0).T
    ref = x.float() @ W.T
    got = int4_tiles.mm(x, packed, sz).float()
    torch.testing.assert_close(got, ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())
