"""The CPU decode path that reads q4_0 blocks without dequantizing (kvcli/cache/block_products.py)
against the dequantize-then-matmul reference. q4_hadamard's own path: test_int4_gemm.py."""

import pytest
import torch

import kvcli.attention as attention
from kvcli.attention import attend_reference
from kvcli.cache import KVCache, block_products
from kvcli.cache.base import STORAGE_TYPES

DIRECT_TYPES = ["q4_0"]


def _cache(kind_k, kind_v, B, Hkv, D, n, seed=0, scale=1.0):
    cache = KVCache(1, B, Hkv, n + 8, D, kind_k, kind_v)
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(B, n, Hkv, D, generator=g) * scale for _ in range(2))
    k[:, 5] = 0.0  # an all-zero vector: zero scales, codes at the bias
    cache.store(0, k, v, 0)
    return cache


def _exact(monkeypatch, fn):
    """fn() with the direct path off: dequantize, then f32 matmuls."""
    with monkeypatch.context() as m:
        m.setattr(block_products, "MAX_ROWS", 0)
        return fn()


def test_split_int8_precision():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, 32, generator=g) * torch.logspace(-6, 6, 5)[:, None]
    x[0, 0] = 0.0  # a zero block: no NaN, reconstructs to zero
    i, s = block_products.split_int8(x)
    assert i.dtype == torch.int8 and i.shape == (7, 5, 2, 32) and s.shape == (7, 5, 2)
    back = s[..., 0:1] * i[..., 0, :].float() + s[..., 1:2] * i[..., 1, :].float()
    bound = x.abs().amax(-1, keepdim=True) / 64516 * 1.001 + 1e-30
    assert ((back - x).abs() <= bound).all()
    assert torch.equal(back[0, 0], torch.zeros(32))


@pytest.mark.parametrize("kind", DIRECT_TYPES)
@pytest.mark.parametrize("D", [32, 64, 128])
def test_products_equal_the_dequantized_ones(kind, D, monkeypatch):
    """Store.scores / weighted_sum straight from the bytes equal q @ load().T and p @ load()."""
    B, Hkv, n, R = 2, 3, 41, 5
    cache = _cache(kind, kind, B, Hkv, D, n, seed=D)
    g = torch.Generator().manual_seed(1)
    q = cache.k.to_storage(torch.randn(B, Hkv, R, D, generator=g))
    p = torch.softmax(torch.randn(B, Hkv, R, n, generator=g) * 3, -1)
    p[..., 7] = 0.0  # zero weights stay exact
    for start, end in [(0, n), (0, 3), (2, 9), (17, n)]:  # sinks, inside and past them
        s = cache.k.scores(0, q, start, end)
        s_ref = q @ cache.k.load(0, start, end).transpose(-1, -2)
        torch.testing.assert_close(s, s_ref, rtol=1e-4, atol=2e-4 * s_ref.abs().max().item())
        out = cache.v.weighted_sum(0, p[..., start:end], start, end)
        ref = p[..., start:end] @ cache.v.load(0, start, end)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("kind", DIRECT_TYPES)
def test_one_hot_weights_read_back_each_vector(kind):
    """A weighted sum with all weight on one position is that position's stored vector: every
    element is read from the right nibble, the header columns never leak in."""
    B, Hkv, D, n = 1, 2, 64, 12
    cache = _cache(kind, kind, B, Hkv, D, n, seed=3, scale=50.0)
    p = torch.eye(n).expand(B, Hkv, n, n).contiguous()[:, :, :10]  # R = 10 rows, one per position
    out = cache.v.weighted_sum(0, p, 0, n)
    torch.testing.assert_close(out, cache.v.load(0, 0, n)[:, :, :10], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("kinds", [("q4_0", "q4_0"), ("q8_0", "q4_0"), ("q4_0", "f16"), ("q4_hadamard", "q4_hadamard"),
                                   ("q4_hadamard", "f16"), ("q8_0", "q4_hadamard")])
@pytest.mark.parametrize("H,Hkv", [(6, 2), (4, 4)])  # GQA and MHA
@pytest.mark.parametrize("flash", [True, False])
def test_decode_attention_matches_the_reference(kinds, H, Hkv, flash, monkeypatch):
    """Whole decode attention (1 and 3 new tokens), chunked so the online softmax and the -fa off
    path both cross chunk boundaries (and q4_hadamard's 64-position tiles), against the
    dequantizing reference; q4_hadamard's int4 GEMM works in bf16 (kvcli/cache/int4_gemm.py)."""
    monkeypatch.setattr(attention, "MIN_CHUNK", 16)
    monkeypatch.setattr(attention, "CHUNK_BYTES", 16 * 4 * 2 * Hkv * 64)  # 16-position chunks
    B, D, n = 2, 64, 83
    cache = _cache(*kinds, B, Hkv, D, n, seed=H)
    g = torch.Generator().manual_seed(2)
    for T in (1, 3):
        q = torch.randn(B, T, H, D, generator=g)
        out = attend_reference(q, cache, 0, n - T, flash=flash)
        ref = _exact(monkeypatch, lambda: attend_reference(q, cache, 0, n - T, flash=flash))
        bf16 = "q4_hadamard" in kinds
        torch.testing.assert_close(out, ref, rtol=0 if bf16 else 1e-4,
                                   atol=2**-6 * ref.abs().max().item() if bf16 else 1e-4)


def test_path_choice():
    """Decode-sized queries on CPU read the bytes; prefill-sized ones dequantize."""
    store = STORAGE_TYPES["q4_0"](1, 1, 2, 8, 32)
    assert store.direct(torch.zeros(1, 2, block_products.MAX_ROWS, 32))
    assert not store.direct(torch.zeros(1, 2, block_products.MAX_ROWS + 1, 32))
    for kind in ("q8_0", "q5_0"):  # q8_0: dequantizing is one cast, and measured faster
        assert not STORAGE_TYPES[kind](1, 1, 2, 8, 32).direct(torch.zeros(1, 2, 1, 32))


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1", "iq4_nl", "q4_hadamard"])
def test_store_pair_writes_what_two_stores_write(kind):
    """K and V quantized in one pass are byte for byte what each store writes alone."""
    g = torch.Generator().manual_seed(5)
    steps = [(0, 6), (6, 1), (7, 3)]
    xs = [(torch.randn(2, T, 2, 64, generator=g), torch.randn(2, T, 2, 64, generator=g)) for _, T in steps]
    pair = KVCache(2, 2, 2, 16, 64, kind, kind)
    k_alone = STORAGE_TYPES[kind](2, 2, 2, 16, 64, keys=True)
    v_alone = STORAGE_TYPES[kind](2, 2, 2, 16, 64)
    for (pos, _), (k, v) in zip(steps, xs):
        pair.store(1, k, v, pos)
        k_alone.store(1, k, pos)
        v_alone.store(1, v, pos)
    for a, b in ((pair.k, k_alone), (pair.v, v_alone)):
        for name in ("data", "scale", "sink", "offset"):
            if hasattr(a, name):
                assert torch.equal(getattr(a, name), getattr(b, name)), name


# q4_hadamard's bound: the bf16 int4 GEMM measured 1.5e-3..2.5e-3 at 2 threads (AVX2) and 3.7e-3 at 1 thread
@pytest.mark.parametrize("kind,max_kld", [("q4_0", 2e-3), ("q4_hadamard", 5e-3)])
def test_real_model_decode_matches_the_exact_path(default_model, monkeypatch, kind, max_kld):
    """SmolLM2 (massive activations in a few dimensions: the hard case for the two-part query split
    and for bf16): decode logits through the byte-reading path (q4_hadamard: the bf16 int4 GEMM,
    kvcli/cache/int4_gemm.py) against dequantize-then-matmul, same cache bytes. The top token must
    agree wherever the exact path's top two are not a near tie (bf16 sums may swap a tie).
    Measured KLs: benchmarks/README.md."""
    from kvcli.llama import Llama

    from kvcli.cache import hadamard

    monkeypatch.setattr(hadamard, "GEMM_MIN_POSITIONS", {True: 0, False: 0})  # the GEMM at every depth
    prompt = [(i * 7919) % 40000 + 100 for i in range(300)]
    logits = []
    for max_rows in (block_products.MAX_ROWS, 0):
        monkeypatch.setattr(block_products, "MAX_ROWS", max_rows)
        llm = Llama(default_model, ctx_size=512, cache_type_k=kind, cache_type_v=kind, dtype="f32",
                    weights="f32")  # exact weights: the comparison is of the two cache paths
        llm.eval(prompt)
        logits.append(torch.stack([llm.eval([tok]) for tok in (200, 300, 400, 500)]).log_softmax(-1))
    direct, exact = logits
    kld = (exact.exp() * (exact - direct)).sum(-1)
    assert kld.max().item() < max_kld
    top2 = exact.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 0.1  # log-prob margin
    assert torch.equal(direct.argmax(-1)[clear], exact.argmax(-1)[clear])
