"""q4_hadamard's CPU decode products through torch's int4 GEMM (kvcli/cache/int4_gemm.py) against
the dequantize-then-matmul reference; whole decode attention and the real-model check are in
test_block_products.py, with the q4_0 path's."""

import pytest
import torch

from kvcli.cache import KVCache, block_products, hadamard, int4_gemm

BF16 = 2.0**-8  # bf16's relative precision: the GEMM's inputs and outputs are rounded to it


@pytest.fixture(autouse=True)
def gemm_at_any_length(monkeypatch):
    """The products here go through the GEMM however few positions they read (decode reads the codes as f32 below
    hadamard.GEMM_MIN_POSITIONS, where the GEMM's fixed cost does not pay)."""
    monkeypatch.setattr(hadamard, "GEMM_MIN_POSITIONS", {True: 0, False: 0})


def _cache(kind_k, kind_v, B, Hkv, D, n, seed=0):
    cache = KVCache(1, B, Hkv, n + 8, D, kind_k, kind_v)
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(B, n, Hkv, D, generator=g) for _ in range(2))
    k[:, 5] = 0.0  # an all-zero vector: zero scales
    cache.store(0, k[:, : n - 2], v[:, : n - 2], 0)
    for pos in (n - 2, n - 1):  # decode writes: one nibble per byte
        cache.store(0, k[:, pos : pos + 1], v[:, pos : pos + 1], pos)
    return cache


def test_torch_layout_is_ours():
    """This torch packs and multiplies in one of the tile layouts int4_gemm knows (else q4_hadamard
    dequantizes instead), and q4_hadamard stores take that tile width."""
    T = int4_gemm.tile_width()
    assert T in int4_gemm.TILE_WIDTHS, "torch's _weight_int4pack_mm_for_cpu is missing or changed its tile layout"
    assert KVCache(1, 1, 1, 8, 64, "q4_hadamard", "q4_hadamard").k.tile == T


@pytest.mark.parametrize("W", [32, 64])
def test_pack_pairs_round_trip(W):
    u = torch.randint(0, 16, (5, W), dtype=torch.uint8)
    b = int4_gemm.pack_pairs(u)
    assert b.shape == (5, W // 2) and torch.equal(b[:, 3], u[:, 3] | u[:, 3 + W // 2] << 4)
    assert torch.equal(int4_gemm.unpack_pairs(b), u)


@pytest.mark.parametrize("D", [32, 64, 128])
def test_products_equal_the_dequantized_ones(D):
    """Scores and weighted sums from the tiles equal q @ load().T and p @ load() to bf16 precision,
    for ranges inside and past the sinks and across tiles (T = 32 or 64 positions)."""
    B, Hkv, n, R = 2, 3, 141, 5
    cache = _cache("q4_hadamard", "q4_hadamard", B, Hkv, D, n, seed=D)
    g = torch.Generator().manual_seed(1)
    q = cache.k.to_storage(torch.randn(B, Hkv, R, D, generator=g))
    p = torch.softmax(torch.randn(B, Hkv, R, n, generator=g) * 3, -1)
    assert cache.k.gemm(q) and cache.v.gemm(p) == (D % int4_gemm.tile_width() == 0)  # value tiles of T elements only
    for start, end in [(0, n), (0, 3), (2, 9), (17, n), (64, 130), (70, 71)]:
        s = cache.k.scores(0, q, start, end)
        s_ref = q @ cache.k.load(0, start, end).transpose(-1, -2)
        torch.testing.assert_close(s, s_ref, rtol=0, atol=2 * BF16 * s_ref.abs().max().item())
        out = cache.v.weighted_sum(0, p[..., start:end], start, end)
        ref = p[..., start:end] @ cache.v.load(0, start, end)
        torch.testing.assert_close(out, ref, rtol=0, atol=2 * BF16 * ref.abs().max().item())


def test_one_hot_weights_read_back_each_vector():
    """All weight on one position gives that position's stored vector: every element from its nibble."""
    B, Hkv, D, n = 1, 2, 128, 80
    cache = _cache("q4_hadamard", "q4_hadamard", B, Hkv, D, n, seed=3)
    picked = torch.arange(4, n, 5)  # 16 positions, one per query row
    p = torch.eye(n)[picked].expand(B, Hkv, len(picked), n).contiguous()
    out = cache.v.weighted_sum(0, p, 0, n)
    ref = cache.v.load(0, 0, n)[:, :, picked]
    torch.testing.assert_close(out, ref, rtol=BF16, atol=BF16 * ref.abs().max().item())


def test_path_choice():
    """Decode-sized queries on CPU use the GEMM; prefill-sized ones dequantize."""
    cache = KVCache(1, 1, 2, 8, 64, "q4_hadamard", "q4_hadamard")
    assert cache.k.gemm(torch.zeros(1, 2, block_products.MAX_ROWS, 64))
    assert not cache.v.gemm(torch.zeros(1, 2, block_products.MAX_ROWS + 1, 8))


def test_short_products_read_the_codes(monkeypatch):
    """Below GEMM_MIN_POSITIONS positions a product reads the codes as f32 (the GEMM's per-call cost)."""
    monkeypatch.setattr(hadamard, "GEMM_MIN_POSITIONS", {True: 128, False: 256})
    cache = KVCache(1, 2, 2, 1024, 64, "q4_hadamard", "q4_hadamard")
    assert cache.k._short(0, 127) and not cache.k._short(0, 128)
    assert cache.v._short(10, 265) and not cache.v._short(10, 266)
