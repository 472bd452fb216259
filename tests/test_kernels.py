"""Layer (b): every Triton kernel against its PyTorch reference, under TRITON_INTERPRET=1 on CPU.

The interpreter runs the kernels' programs one by one on CPU tensors (slow): shapes are tiny.
Quantize-on-write: bytes equal to the stores' quantizers (tq: equal but for a stated near-tie
bound where a kernel's sums are ordered otherwise than torch's). Attention: f32 tolerance against
`kvcli.attention.attend_reference` (the kernels read the same stored bytes, so the only
difference is summation order), with and without the recent window. The kernels are a leaf:
they import nothing from kvcli.
"""

import os
import warnings

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels then run on CPU tensors

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton); the kernels need it")

import kvcli.kernels  # noqa: E402
from kvcli.kernels.gpu.quantize import quantize_codes, quantize_into, quantize_tq  # noqa: E402
from kvcli.attention import Attention, attend_reference, attend_triton  # noqa: E402
from kvcli.cache import KVCache  # noqa: E402
from kvcli.kernels.cpu import int4_tiles  # noqa: E402
from kvcli.cache.base import STORAGE_TYPES  # noqa: E402
from kvcli.cache.ggml_blocks import quantize_reference  # noqa: E402
from kvcli.cache.hadamard import quantize_vectors as quantize_codes_reference  # noqa: E402
from kvcli.cache.turbo import TQ3Store, lloyd_max_levels  # noqa: E402
from kvcli.kernels.layout import Kind  # noqa: E402
from kvcli.kernel_table import QUANTIZE, choose  # noqa: E402
from tests.triton_cpu import cuda_entries_on_cpu  # noqa: E402

# every registered type a kernel reads (a new type with a layout is tested with no list to edit)
ALL_TYPES = [n for n, cls in STORAGE_TYPES.items() if cls(1, 1, 1, 1, 64).kernel_layout() is not None]
# one row of blocks per vector; tiled types (q4_hadamard) write codes, the store packs them
ROW_TYPES = [n for n in ALL_TYPES if STORAGE_TYPES[n](1, 1, 1, 1, 64).kernel_layout().tile == 0]
# the rotated b-bit codebook types (tq4, tq3, tq2): their scale search has a kernel of its own
TQ_TYPES = [n for n in ALL_TYPES if STORAGE_TYPES[n](1, 1, 1, 1, 64).kernel_layout().kind in (Kind.TQ_KEYS,
                                                                                               Kind.TQ_VALUES)]
DENSE = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():  # numpy warns on masked-out lanes the interpreter still computes
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _adversarial(B: int, T: int, H: int, D: int) -> torch.Tensor:
    """(B, T, H, D) random vectors, some with special 32-element blocks."""
    g = torch.Generator().manual_seed(D + T)
    x = torch.randn(B, T, H, D, generator=g) * torch.rand(B, T, H, 1, generator=g) * 4
    specials = [torch.zeros(32), torch.full((32,), 0.75), torch.full((32,), -3.0),
                torch.zeros(32).index_fill_(0, torch.tensor([7]), -50.0),  # one outlier
                torch.randn(32, generator=g) * 1e4, torch.randn(32, generator=g) * 1e-6,
                torch.linspace(-1, 1, 32), torch.tensor([1.0, -1.0] * 16)]  # ties of |max|
    flat = x.view(-1, 32)
    for i, block in enumerate(specials[: flat.shape[0]]):
        flat[i] = block
    return x


def _row_bytes(kind: str, D: int) -> int:
    return D if kind in DENSE else D // 32 * STORAGE_TYPES[kind].block_bytes


def _layout(kind: str, D: int = 64):
    """The KernelLayout a store of this type publishes."""
    return STORAGE_TYPES[kind](1, 1, 1, 1, D).kernel_layout()


def test_every_store_publishes_a_layout():
    """Every type kvcli ships has a kernel (so ALL_TYPES, read from the registry, holds them all)."""
    for kind in [n for n, cls in STORAGE_TYPES.items() if cls.__module__.startswith("kvcli.cache")]:
        for keys in (True, False):
            layout = STORAGE_TYPES[kind](1, 1, 1, 64, 64, keys=keys).kernel_layout()
            assert layout is not None and (layout.block_bytes == 0) == (kind in DENSE), kind


@pytest.mark.parametrize("kind", ROW_TYPES)
def test_quantize_on_write_equals_reference(kind):
    # positions 3..8 of a 12-position cache: the kernel writes only its rows, the rest stay as they were
    B, T, H, D = 2, 5, 2, 64
    x = _adversarial(B, T, H, D)
    dtype = DENSE.get(kind, torch.uint8)
    fill = torch.randint(0, 255, (B, H, 12, _row_bytes(kind, D) * torch.empty(0, dtype=dtype).element_size()),
                         generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    out, ref = fill.clone().view(dtype), fill.clone().view(dtype)
    quantize_into(_layout(kind, D), x, out, 3)
    quantize_reference(kind, x, ref, 3)
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q5_1"])
@pytest.mark.parametrize("D", [32, 128])
def test_quantize_head_dims(kind, D):
    x = torch.randn(1, 3, 2, D, generator=torch.Generator().manual_seed(D)) * 2
    out = torch.zeros(1, 2, 3, _row_bytes(kind, D), dtype=torch.uint8)
    ref = out.clone()
    quantize_into(_layout(kind, D), x, out, 0)
    quantize_reference(kind, x, ref, 0)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("D", [32, 64, 128])
def test_hadamard_codes_equal_reference(D):
    """q4_hadamard's scale search: the kernel's codes and bf16 scales equal the store's own."""
    x = _adversarial(2, 5, 2, D)
    u, d = quantize_codes(_layout("q4_hadamard", D), x)
    u_ref, d_ref = quantize_codes_reference(x)
    assert u.shape == u_ref.shape == (2, 5, 2, D) and d.shape == d_ref.shape == (2, 5, 2, D // 32)
    assert torch.equal(u, u_ref) and torch.equal(d, d_ref)


# Keys in AVX2's 32-wide tiles and values in AVX-512's 64 by default (each ~20 s in Triton's interpreter on a 2-core
# AVX2 EPYC); the other two pairs behind the slow marker, to keep the default suite within its 15 minutes there.
@pytest.mark.parametrize("keys, tile", [(True, 32), (False, 64), pytest.param(True, 64, marks=pytest.mark.slow),
                                        pytest.param(False, 32, marks=pytest.mark.slow)])
def test_store_hadamard_matches_the_store(monkeypatch, keys, tile):
    """The store with the table's CUDA quantizer (rotation, sinks, offset, the kernel's scale search, then the
    store's packing into key or value tiles) equals its PyTorch path: the interpreter runs it on CPU tensors."""
    g = torch.Generator().manual_seed(3)
    a = STORAGE_TYPES["q4_hadamard"](1, 1, 2, 80, 64, keys=keys, tile=tile)
    b = STORAGE_TYPES["q4_hadamard"](1, 1, 2, 80, 64, keys=keys, tile=tile)
    steps = [(0, 6), (6, 1), (7, 30), (37, 1), (38, 40)]  # prefill past the sinks, decode, a second tile
    xs = [torch.randn(1, T, 2, 64, generator=g) for _, T in steps]
    for (pos, _), x in zip(steps, xs):
        a.store(0, x, pos)
    b.quantizer = choose(QUANTIZE, "cuda", b.kernel_layout().kind).run
    assert b.quantizer.__module__ == "kvcli.attention" and "gpu" in b.quantizer.__name__
    for (pos, _), x in zip(steps, xs):
        b.store(0, x, pos)
    for name in ("data", "scale", "sink", "offset"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


class _LloydMax3(TQ3Store):
    """tq3's layout with a non-uniform codebook (no name: not registered), read through the level table."""

    levels, signed = lloyd_max_levels(3), False


class _Wide3(TQ3Store):
    """A non-uniform codebook with a signed scale, as the lead may give tq3."""

    levels = (-4.5, -2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 4.5)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("kind", TQ_TYPES + ["lloyd_max3", "wide3"])
def test_tq_codes_equal_reference(kind, D):
    """tq's scale search (candidates, refit, bf16 scale, least error): the kernel's codes and scales equal
    the store's own PyTorch quantizer bit for bit with a uniform codebook (integer levels: no near-ties seen).
    A non-uniform one's 64-term sums q . y are ordered differently by torch and tl.sum, which can flip a
    near-tie between two candidates: there >= 99% of the codes are equal and every block that differs has
    the reference's squared error to within 1e-6 of |y|^2."""
    cls = {"lloyd_max3": _LloydMax3, "wide3": _Wide3}.get(kind) or STORAGE_TYPES[kind]
    store = cls(1, 1, 2, 8, D)
    g = torch.Generator().manual_seed(D)
    y = _adversarial(2, 3, 2, D)
    y.view(-1, 64)[-1] = torch.randn(64, generator=g) * 1e3  # a block wider than 32 of the adversarial ones
    u, d = quantize_tq(store.kernel_layout(), y)
    u_ref, d_ref = store.quantize(y)
    assert u.shape == u_ref.shape == (2, 3, 2, D) and d.shape == d_ref.shape == (2, 3, 2, D // 64)
    if store.uniform:
        assert torch.equal(u, u_ref) and torch.equal(d, d_ref)
        return
    assert (u == u_ref).float().mean() >= 0.99
    yb, lv = y.view(-1, 64), store.lv
    err, err_ref = (((yb - dd.view(-1, 1) * lv[uu.view(-1, 64).long()]) ** 2).sum(-1)
                    for uu, dd in ((u, d), (u_ref, d_ref)))
    torch.testing.assert_close(err, err_ref, rtol=0, atol=1e-6 * (yb ** 2).sum(-1).max().item())


def _same_tq_stores(a: KVCache, b: KVCache) -> None:
    """a's and b's K and V stores hold the same sinks and offsets, and the same codes and scales at every
    position (packed neighbours included) but for a near-tie: the kernels' sums (decode's rotation R x, the
    refit's q . y) are ordered otherwise than torch's, which can flip a code at a rounding boundary."""
    for x, y in ((a.k, b.k), (a.v, b.v)):
        assert torch.equal(x.sink, y.sink) and torch.equal(x.offset, y.offset)
        assert (x.codes(0, 0, x.n_pad) == y.codes(0, 0, y.n_pad)).float().mean() >= 0.999
        assert (x.scale == y.scale).float().mean() >= 0.99


@pytest.mark.parametrize("kind", TQ_TYPES)
def test_store_tq_matches_the_store(monkeypatch, kind):
    """Stores bound to the table's CUDA quantizer (the scale-search kernel, then the store's packing into b-bit rows
    of key tiles and value planes, prefill and decode) leave what their PyTorch path does."""
    g = torch.Generator().manual_seed(5)
    steps = [(0, 6), (6, 1), (7, 9), (16, 1)]  # prefill across the sinks, decode, prefill, decode
    kvs = [(torch.randn(1, T, 2, 64, generator=g), torch.randn(1, T, 2, 64, generator=g)) for _, T in steps]
    a = KVCache(1, 1, 2, 20, 64, kind, kind, attention=Attention())
    for (pos, _), (k, v) in zip(steps, kvs):
        a.store(0, k, v, pos)
    cuda_entries_on_cpu(monkeypatch)
    b = KVCache(1, 1, 2, 20, 64, kind, kind, attention=Attention())
    assert "gpu" in b.k.quantizer.__name__
    for (pos, _), (k, v) in zip(steps, kvs):
        b.store(0, k, v, pos)
    _same_tq_stores(a, b)


def _filled_cache(kind_k: str, kind_v: str, B: int, Hkv: int, D: int, n: int, seed: int = 0) -> KVCache:
    cache = KVCache(1, B, Hkv, n + 8, D, kind_k, kind_v, attention=Attention())
    g = torch.Generator().manual_seed(seed)
    cache.store(0, torch.randn(B, n, Hkv, D, generator=g), torch.randn(B, n, Hkv, D, generator=g), 0)
    return cache


def _check(out, ref, kind):
    # Kernel and reference dequantize the same stored bytes (f16/bf16 included) and both
    # accumulate in f32, so every type gets the f32 tolerance; `kind` names the failing case.
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"{kind}: {m}")


@pytest.fixture(params=[64, 32], ids=["tile64", "tile32"])
def tile(request, monkeypatch):
    """q4_hadamard stores built with either int4 tile width, whatever this CPU's GEMM packs."""
    monkeypatch.setattr(int4_tiles, "tile_width", lambda: request.param)
    return request.param


@pytest.mark.parametrize("kind", ALL_TYPES)
def test_attention_every_type(kind, tile):
    """GQA (4 query heads per KV head), batch 2, decode split in 3 and a 5-token prefill."""
    if _layout(kind).tile == 0 and tile == 32:
        pytest.skip("the tile width is the rotated types' alone")
    B, H, Hkv, D, n = 2, 8, 2, 64, 37
    cache = _filled_cache(kind, kind, B, Hkv, D, n)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, 1, H, D, generator=g)
    _check(attend_triton(q, cache, 0, n - 1, num_splits=3, block_n=16), attend_reference(q, cache, 0, n - 1), kind)
    q = torch.randn(B, 5, H, D, generator=g)
    _check(attend_triton(q, cache, 0, n - 5, block_n=16), attend_reference(q, cache, 0, n - 5), kind)


@pytest.mark.parametrize("kinds,B,H,Hkv,D,n", [
    (("f16", "f16"), 1, 4, 4, 32, 1),  # MHA, a single key
    (("q4_0", "q8_0"), 2, 2, 2, 32, 17),  # mixed K/V types
    (("q4_hadamard", "f16"), 1, 4, 1, 128, 100),  # G = 4 with one KV head, past the sinks
    (("q8_0", "q4_hadamard"), 1, 6, 2, 128, 100),  # G = 3: rows padded to a power of two
    (("q4_hadamard", "q4_hadamard"), 2, 2, 2, 32, 70),  # 32-element value tiles, a second key tile
    (("tq3", "tq2"), 1, 4, 1, 128, 100),  # head size 128: two scale blocks, 3-bit rows of a 128-row tile
    (("tq4", "q8_0"), 1, 6, 2, 128, 70),  # G = 3, a second key tile
    (("f16", "tq3"), 2, 2, 2, 64, 70),  # MHA, a second group of 64 value positions
])
def test_attention_shapes(kinds, B, H, Hkv, D, n, tile):
    if all(_layout(k, D).tile == 0 for k in kinds) and tile == 32:
        pytest.skip("the tile width is the rotated types' alone")
    cache = _filled_cache(*kinds, B, Hkv, D, n, seed=n)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, 1, H, D, generator=g)
    _check(attend_triton(q, cache, 0, n - 1, block_n=32), attend_reference(q, cache, 0, n - 1), kinds[0])
    T = min(n, 7)  # prefill of the last T positions: causal w.r.t. pos + t
    q = torch.randn(B, T, H, D, generator=g)
    _check(attend_triton(q, cache, 0, n - T), attend_reference(q, cache, 0, n - T), kinds[0])


def test_attention_lloyd_max_codebook():
    """A non-uniform codebook is read through the level table, never as a grid."""
    B, Hkv, D, n = 1, 2, 64, 37
    cache = KVCache(1, B, Hkv, n, D, "f16", "f16", attention=Attention())
    cache.k = _LloydMax3(1, B, Hkv, n, D, keys=True)
    cache.v = _LloydMax3(1, B, Hkv, n, D)
    g = torch.Generator().manual_seed(6)
    cache.store(0, torch.randn(B, n, Hkv, D, generator=g), torch.randn(B, n, Hkv, D, generator=g), 0)
    q = torch.randn(B, 3, 4, D, generator=g)
    _check(attend_triton(q, cache, 0, n - 3, block_n=16), attend_reference(q, cache, 0, n - 3), "lloyd_max3")


@pytest.mark.parametrize("kind", ["q4_0", "q4_hadamard", "tq4", "tq3", "tq2"])
def test_attention_window(kind):
    """With a recent window of N, row i reads i-N+1..i from the f16 window and the rest from the store, as
    the reference: a prefill all in the window (an empty store), a prefill that leaves positions to the
    store, a batch in mid-sequence, then decode split in 3 with the window read by the last split."""
    _prefills_then_decode(KVCache(1, 1, 2, 64, 64, kind, kind, window=8, attention=Attention()), kind, seed=7)


def _prefills_then_decode(cache: KVCache, kind: str, seed: int) -> None:
    """Prefills of 5, 20 and 7 positions, then two decode steps split in 3: the kernel equals the reference."""
    B, Hkv, D = cache.batch, cache.k.n_heads, cache.k.head_dim
    g = torch.Generator().manual_seed(seed)
    pos = 0
    for T, splits in [(5, None), (20, None), (7, None), (1, 3), (1, 3)]:
        recent = cache.store(0, torch.randn(B, T, Hkv, D, generator=g), torch.randn(B, T, Hkv, D, generator=g), pos)
        q = torch.randn(B, T, 3 * Hkv, D, generator=g)
        out = attend_triton(q, cache, 0, pos, recent, num_splits=splits, block_n=8)
        _check(out, attend_reference(q, cache, 0, pos, recent=recent), f"{kind} T={T} pos={pos}")
        pos += T


def test_dispatcher(monkeypatch):
    """Where the table's CUDA entries run, flash attention takes the Triton kernel (chosen once per cache and shape,
    kept on the cache), -fa off the reference; with a window the kernel reads it too."""
    cuda_entries_on_cpu(monkeypatch)
    cache = _filled_cache("q4_0", "q4_0", 1, 2, 32, 9)
    q = torch.randn(1, 1, 4, 32, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(Attention(flash=True)(q, cache, 0, 8), attend_reference(q, cache, 0, 8),
                               rtol=1e-4, atol=1e-4)
    assert cache.kernels[(True, False, "cuda", True)] is attend_triton
    Attention(flash=False)(q, cache, 0, 8)
    assert cache.kernels[(True, False, "cuda", False)].__name__ == "_materialized"
    cache = KVCache(1, 1, 2, 16, 32, "q4_0", "q4_0", window=4, attention=Attention())
    g = torch.Generator().manual_seed(8)
    recent = cache.store(0, torch.randn(1, 9, 2, 32, generator=g), torch.randn(1, 9, 2, 32, generator=g), 0)
    q = torch.randn(1, 9, 4, 32, generator=g)
    torch.testing.assert_close(Attention()(q, cache, 0, 0, recent), attend_reference(q, cache, 0, 0, recent=recent),
                               rtol=1e-4, atol=1e-4)
    assert cache.kernels[(False, False, "cuda", True)] is attend_triton


@pytest.mark.parametrize("kind", ["q8_0", "q4_hadamard", "tq3"])
@pytest.mark.parametrize("N", [0, 8])
def test_attention_keys_less_their_bias(kind, N):
    """Keys stored less a K bias (kvcli/cache/key_bias.py): the kernel adds q . R(p) b to each store score as the
    reference does, in prefills and in decode split in 3, with and without a recent window."""
    from test_kernel_table import key_bias

    cache = KVCache(1, 1, 2, 64, 64, kind, kind, window=N, attention=Attention(), key_bias=key_bias(64))
    _prefills_then_decode(cache, kind, seed=9)
