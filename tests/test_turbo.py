"""tq4 / tq3 / tq2 (kvcli/cache/turbo.py): packing, codebooks, the scale search, bytes per element,
round trips, single-position writes, and the int4 GEMM decode path against the dequantizing one."""

from contextlib import contextmanager

import pytest
import torch

from kvcli.cache import STORAGE_TYPES, KVCache, resolve_type
from kvcli.cache import block_products, int4_gemm
from kvcli.cache.hadamard import N_SINK
from kvcli.cache.turbo import (SCALE_GRID, TurboStore, lloyd_max_levels, pack_rows, quantize_blocks, uniform_levels,
                               unpack_rows)

TQ = ["tq4", "tq3", "tq2"]
# (bits per element, largest relative RMS error of a Gaussian round trip): a b-bit uniform grid with
# its best scale errs by about 0.12 (4), 0.19 (3), 0.36 (2) of the RMS on a Gaussian; sinks, offsets and
# the 64-wide blocks' outliers take a little more
FORMATS = {"tq4": (4.25, 0.13), "tq3": (3.25, 0.21), "tq2": (2.25, 0.40)}


@contextmanager
def registered(cls_attrs: dict):
    """A TurboStore variant registered for the block's duration (other tests see the usual registry)."""
    before = dict(STORAGE_TYPES)
    try:
        yield type("Variant", (TurboStore,), cls_attrs)
    finally:
        STORAGE_TYPES.clear()
        STORAGE_TYPES.update(before)


def _block32_attrs(bits: int) -> dict:
    return dict(name=f"tq{bits}_b32_test", bits=bits, block_size=32, block_bytes=bits * 4 + 2, levels=uniform_levels(bits))


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("S, C", [(64, 16), (64, 32), (128, 16)])
def test_pack_rows_round_trip(bits, S, C):
    g = torch.Generator().manual_seed(bits * S + C)
    codes = torch.randint(0, 1 << bits, (2, 3, S, 2 * C), generator=g, dtype=torch.uint8)
    nib = int4_gemm.pack_pairs(codes)  # (2, 3, S, C): two codes a byte
    packed = pack_rows(nib, bits)
    assert packed.shape == (2, 3, bits * S // 4, C)
    assert torch.equal(unpack_rows(packed, bits), nib)
    # a slice along leading axes (a chunk of tiles) unpacks the same as the slice of the unpacked whole
    assert torch.equal(unpack_rows(packed[:, 1:], bits), nib[:, 1:])


def test_codebooks():
    assert uniform_levels(2) == (-1.5, -0.5, 0.5, 1.5)
    lm2, lm3 = lloyd_max_levels(2), lloyd_max_levels(3)
    torch.testing.assert_close(torch.tensor(lm2), torch.tensor([-1.5104, -0.4528, 0.4528, 1.5104]), atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(lm3[4:]), torch.tensor([0.2451, 0.7560, 1.3439, 2.1520]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_scale_search_never_worse_than_its_first_guess(bits):
    g = torch.Generator().manual_seed(bits)
    y = torch.randn(2000, 64, generator=g) * torch.rand(2000, 1, generator=g) * 5
    y[0] = 0  # a zero block: d = 0, no NaN
    lv = torch.tensor(uniform_levels(bits))
    d, u = quantize_blocks(y, lv, torch.tensor(SCALE_GRID))
    assert d.shape == (2000, 1) and u.shape == (2000, 64) and u.dtype == torch.uint8 and int(u.max()) < 1 << bits
    assert torch.equal(d, d.bfloat16().float()) and d[0].item() == 0 and torch.isfinite(d).all()
    err = ((y - d * lv[u.long()]) ** 2).sum(-1)
    d1, u1 = quantize_blocks(y, lv, torch.tensor([1.0]))  # max|y| onto the outer level, refit
    err1 = ((y - d1 * lv[u1.long()]) ** 2).sum(-1)
    assert (err <= err1 * 1.01 + 1e-6).all() and err.mean() < err1.mean()


@pytest.mark.parametrize("name", TQ)
@pytest.mark.parametrize("tile", [32, 64])  # the bytes do not depend on the CPU's tile width
@pytest.mark.parametrize("keys", [True, False])
def test_bytes_per_element_and_fixed_costs(name, tile, keys):
    L, B, H, n, D = 3, 2, 4, 100, 64
    cls = resolve_type(name)
    bits, _ = FORMATS[name]
    assert cls.bits_per_element() == bits and cls.rotated and cls.default_window >= 16  # measured, benchmarks/README.md
    store = cls(L, B, H, n, D, keys=keys, tile=tile)
    n_pad = 128  # padded to a multiple of 64 positions
    codes_and_scales = L * B * H * n_pad * D * bits / 8
    fixed = L * B * H * (N_SINK * D * 2 + D * 4)  # f16 sinks, f32 offsets per layer and head
    assert store.nbytes() == codes_and_scales + fixed == cls.nbytes_for(L, B, H * D, n)
    assert store.kernel_layout().bits == store.bits  # the kernels read the packed rows (tests/test_kernels.py)


def test_aliases():
    for n in (4, 3, 2):
        assert resolve_type(f"turbo{n}").name == f"tq{n}" == resolve_type(f"TQ{n}").name


def _write(store, x, layer=0, split=(10, 70)):
    """A prefill of x[:, :a], decode steps a..b-1 (one position each, across tile and group edges), a batch after."""
    a, b = split
    store.store(layer, x[:, :a], 0)
    for pos in range(a, b):
        store.store(layer, x[:, pos : pos + 1], pos)
    store.store(layer, x[:, b:], b)


@pytest.mark.parametrize("name", TQ)
@pytest.mark.parametrize("tile", [32, 64])
@pytest.mark.parametrize("keys", [True, False])
def test_round_trip(name, tile, keys):
    torch.manual_seed(0)
    store = resolve_type(name)(1, 1, 2, 140, 64, keys=keys, tile=tile)
    x = torch.randn(1, 140, 2, 64) + 3.0  # an offset the store takes out
    _write(store, x)
    back = store.from_storage(store.load(0, 0, 140)).transpose(1, 2)  # (1, 140, 2, 64)
    torch.testing.assert_close(store.from_storage(store.load(0, 33, 97)).transpose(1, 2), back[:, 33:97])
    assert torch.allclose(back[:, :N_SINK], x[:, :N_SINK], atol=1e-2)  # sinks: f16
    spread = x - x.mean(1, keepdim=True) if store.centred else x  # what the codes hold
    rel = ((back - x)[:, N_SINK:].norm() / spread[:, N_SINK:].norm()).item()
    assert rel < FORMATS[name][1], rel


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("tile", [32, 64])
@pytest.mark.parametrize("keys", [True, False])
@pytest.mark.parametrize("block", [64, 32])
def test_single_position_writes_equal_a_batch_write(bits, tile, keys, block):
    """Decode's read-modify-write of one position's bits leaves the bytes a batch write leaves."""
    attrs = dict(name="tq_put_test", bits=bits, block_size=block, block_bytes=bits * block // 8 + 2,
                 levels=uniform_levels(bits))
    with registered(attrs) as cls:
        g = torch.Generator().manual_seed(bits + tile)
        u = torch.randint(0, 1 << bits, (2, 150, 3, 64), generator=g, dtype=torch.uint8)
        d = torch.rand(2, 150, 3, 64 // block, generator=g)
        one, batch = cls(1, 2, 3, 150, 64, keys=keys, tile=tile), cls(1, 2, 3, 150, 64, keys=keys, tile=tile)
        batch.put(0, u[:, :7], d[:, :7], 0)
        batch.put(0, u[:, 7:], d[:, 7:], 7)
        for pos in torch.randperm(150, generator=g).tolist():  # any order: each write touches only its own bits
            one.put(0, u[:, pos : pos + 1], d[:, pos : pos + 1], pos)
        assert torch.equal(one.data, batch.data) and torch.equal(one.scale, batch.scale)
        assert torch.equal(one.codes(0, 0, 150), u.transpose(1, 2))


needs_gemm = pytest.mark.skipif(int4_gemm.tile_width() is None, reason="no int4 CPU GEMM in this torch on this CPU")


def _products(cls, n, rows, seed, D=64):
    """Keys and values of one cache filled with n positions, a query and softmax weights."""
    g = torch.Generator().manual_seed(seed)
    k, v = cls(1, 2, 3, n, D, keys=True), cls(1, 2, 3, n, D)
    x, y = torch.randn(2, n, 3, D, generator=g), torch.randn(2, n, 3, D, generator=g)
    x[..., 5] *= 8  # an outlier channel, as real keys have
    k.store_pair(v, 0, x[:, : n - 3], y[:, : n - 3], 0)
    for pos in range(n - 3, n):
        k.store_pair(v, 0, x[:, pos : pos + 1], y[:, pos : pos + 1], pos)
    q = k.to_storage(torch.randn(2, 3, rows, D, generator=g))
    p = torch.softmax(torch.randn(2, 3, rows, n, generator=g) * 3, -1)
    return k, v, q, p


def _check_fast_path(cls, monkeypatch, D=64):
    for n, rows in [(300, 1), (300, 3), (1000, 16), (70, 2)]:
        k, v, q, p = _products(cls, n, rows, seed=n + rows, D=D)
        assert k.gemm(q) and v.gemm(p)
        for a, b in [(0, n), (0, 2), (3, 9), (64, n), (n - 1, n), (30, 200 if n > 200 else n)]:
            fast_s, fast_o = k.scores(0, q, a, b), v.weighted_sum(0, p[..., a:b].contiguous(), a, b)
            with monkeypatch.context() as mp:
                mp.setattr(block_products, "MAX_ROWS", 0)  # the dequantizing path
                assert not k.gemm(q)
                ref_s, ref_o = k.scores(0, q, a, b), v.weighted_sum(0, p[..., a:b].contiguous(), a, b)
            # bf16 inputs and outputs, f32 sums: each result good to a few 2^-8 of the largest
            torch.testing.assert_close(fast_s, ref_s, rtol=0, atol=2 * 2.0**-8 * ref_s.abs().max().item())
            torch.testing.assert_close(fast_o, ref_o, rtol=0, atol=2 * 2.0**-8 * ref_o.abs().max().item())


@needs_gemm
@pytest.mark.parametrize("name", TQ)
@pytest.mark.parametrize("D", [64, 128])  # one scale block per head, or two
def test_fast_path_equals_dequantizing_path(name, D, monkeypatch):
    _check_fast_path(resolve_type(name), monkeypatch, D)


@needs_gemm
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_fast_path_blocks_of_32(bits, monkeypatch):
    """Scale blocks narrower than the head: the value products go through q4_hadamard's per-tile GEMMs."""
    with registered(_block32_attrs(bits)) as cls:
        _check_fast_path(cls, monkeypatch)


def test_non_uniform_codebook_dequantizes():
    attrs = dict(name="tq3_lm_test", bits=3, block_size=64, block_bytes=26, levels=lloyd_max_levels(3))
    with registered(attrs) as cls:
        k, _, q, _ = _products(cls, 100, 1, seed=0)
        assert not k.uniform and not k.gemm(q)
        torch.testing.assert_close(k.scores(0, q, 0, 100), q @ k.load(0, 0, 100).transpose(-1, -2))


@pytest.mark.parametrize("name", TQ)
def test_attention_through_the_cache_tracks_f32(name):
    """Decode attention over a cache of the type stays near attention over f32 K/V, on the fast path
    (where this CPU has it) as on the dequantizing one."""
    from kvcli.attention import attend_reference

    g = torch.Generator().manual_seed(1)
    n, Hkv, G, D = 200, 3, 3, 64
    k, v = torch.randn(1, n, Hkv, D, generator=g), torch.randn(1, n, Hkv, D, generator=g)
    q = torch.randn(1, 1, Hkv * G, D, generator=g)
    ref_cache, cache = KVCache(1, 1, Hkv, n, D, "f32", "f32"), KVCache(1, 1, Hkv, n, D, name, name)
    for c in (ref_cache, cache):
        c.store(0, k[:, :-1], v[:, :-1], 0)
        c.store(0, k[:, -1:], v[:, -1:], n - 1)
    ref, got = attend_reference(q, ref_cache, 0, n - 1), attend_reference(q, cache, 0, n - 1)
    assert ((got - ref).norm() / ref.norm()).item() < 2 * FORMATS[name][1]


# The bf16 GEMM rounds each score to 2^-9 of itself (SmolLM2's reach 40: errors of 0.02 to 0.06), as
# q4_hadamard's does (its bound in test_block_products is 5e-3); measured KLs up to 7.8e-3 (tq3), against
# the types' own 0.02 to 0.6 from f16: benchmarks/README.md
@needs_gemm
@pytest.mark.parametrize("name,max_kld", [("tq4", 1e-2), ("tq3", 2e-2), ("tq2", 2e-2)])
def test_real_model_decode_matches_the_exact_path(default_model, monkeypatch, name, max_kld):
    """SmolLM2 (massive activations in a few dimensions): decode logits through the int4 GEMM against
    dequantize-then-matmul, same cache bytes. The top token must agree wherever the exact path's top
    two are not a near tie. Measured KLs: benchmarks/README.md."""
    from kvcli.llama import Llama

    prompt = [(i * 7919) % 40000 + 100 for i in range(300)]
    logits = []
    for max_rows in (block_products.MAX_ROWS, 0):
        monkeypatch.setattr(block_products, "MAX_ROWS", max_rows)
        llm = Llama(default_model, ctx_size=512, cache_type_k=name, cache_type_v=name, dtype="f32", weights="f32")
        llm.eval(prompt)
        logits.append(torch.stack([llm.eval([tok]) for tok in (200, 300, 400, 500)]).log_softmax(-1))
    fast, exact = logits
    kld = (exact.exp() * (exact - fast)).sum(-1)
    print(f"{name}: KL of the GEMM path against the exact one, per step: {kld.tolist()}")
    assert kld.max().item() < max_kld
    top2 = exact.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 0.1  # log-prob margin
    assert torch.equal(fast.argmax(-1)[clear], exact.argmax(-1)[clear])
