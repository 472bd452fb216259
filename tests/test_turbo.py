"""tq4 / tq3 / tq2 (kvcli/cache/turbo.py): packing, codebooks, the scale search, bytes per element, round trips,
single-position writes; and their CPU decode kernel (kvcli/kernels/cpu/attention_rotated.py: the packed codes
unpacked a tile at a time) against the reference's dequantize-then-matmul."""

import math
from contextlib import contextmanager

import pytest
import torch

from kvcli import kernel_table as table
from kvcli.attention import Attention, attend_reference
from kvcli.cache import STORAGE_TYPES, KVCache, resolve_type
from kvcli.cache.hadamard import N_SINK
from kvcli.cache.turbo import (SCALE_GRID, TurboStore, lloyd_max_levels, pack_rows, quantize_blocks, uniform_levels,
                               unpack_rows)
from kvcli.cache.window import Recent
from kvcli.kernels.cpu import int4_tiles
from kvcli.kernels.cpu.compile import available

from decode_checks import decode

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
    return dict(name=f"tq{bits}_b32_test", bits=bits, block_size=32, block_bytes=bits * 4 + 2,
                levels=uniform_levels(bits))


# ---- the format ----

@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("S, C", [(64, 16), (64, 32), (128, 16)])
def test_pack_rows_round_trip(bits, S, C):
    g = torch.Generator().manual_seed(bits * S + C)
    codes = torch.randint(0, 1 << bits, (2, 3, S, 2 * C), generator=g, dtype=torch.uint8)
    nib = int4_tiles.pack_pairs(codes)  # (2, 3, S, C): two codes a byte
    packed = pack_rows(nib, bits)
    assert packed.shape == (2, 3, bits * S // 4, C)
    assert torch.equal(unpack_rows(packed, bits), nib)
    # a slice along leading axes (a chunk of tiles) unpacks the same as the slice of the unpacked whole
    assert torch.equal(unpack_rows(packed[:, 1:], bits), nib[:, 1:])
    # the decode kernel's widening add: every nibble plus `add`
    add = 8 - (1 << (bits - 1))
    assert torch.equal(unpack_rows(packed, bits, add), nib + add * 0x11)  # both nibbles of a byte


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


@pytest.mark.parametrize("name", TQ)
def test_attention_through_the_cache_tracks_f32(name):
    """Decode attention over a cache of the type stays near attention over f32 K/V, through the decode kernel (where
    this CPU has the int4 GEMM) as through the reference."""
    g = torch.Generator().manual_seed(1)
    n, Hkv, G, D = 200, 3, 3, 64
    k, v = torch.randn(1, n, Hkv, D, generator=g), torch.randn(1, n, Hkv, D, generator=g)
    q = torch.randn(1, 1, Hkv * G, D, generator=g)
    ref_cache = KVCache(1, 1, Hkv, n, D, "f32", "f32", attention=Attention())
    cache = KVCache(1, 1, Hkv, n, D, name, name, attention=Attention())
    for c in (ref_cache, cache):
        c.store(0, k[:, :-1], v[:, :-1], 0)
        c.store(0, k[:, -1:], v[:, -1:], n - 1)
    ref = attend_reference(q, ref_cache, 0, n - 1)
    for got in (Attention()(q, cache, 0, n - 1), attend_reference(q, cache, 0, n - 1)):
        assert ((got - ref).norm() / ref.norm()).item() < 2 * FORMATS[name][1]


# ---- the decode kernel (kvcli/kernels/cpu/attention_rotated.py: the codes unpacked a tile at a time) ----

needs_numba = pytest.mark.skipif(not available(), reason="numba does not load here: decode takes the reference")
HKV, G = 3, 3
MODULE = "attention_rotated"


def _tq_entry() -> table.Entry:
    return next(e for e in table.entries(table.ATTEND) if getattr(e.run, "module", None) == MODULE)


def assert_f32_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """The kernel sums in f32 in another order than the reference's matmuls: within 1e-5 of the largest output."""
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5 * max(1.0, ref.abs().max().item()))


def _filled(name: str, lens: list[int], D: int, window: int, layers: int = 2, g=None) -> KVCache:
    """Rows b holding lens[b] positions in every layer (keys an offset away from 0, as real keys are)."""
    cache = KVCache(layers, len(lens), HKV, max(lens) + 40, D, name, name, attention=Attention(), window=window)
    for b, n in enumerate(lens):
        for layer in range(layers):
            cache.rows(b, b + 1).store(layer, torch.randn(1, n, HKV, D, generator=g) * 2 + 0.5,
                                       torch.randn(1, n, HKV, D, generator=g), 0)
    return cache


def _token(B: int, D: int, g) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.randn(B, 1, HKV * G, D, generator=g) * 2, torch.randn(B, 1, HKV, D, generator=g) * 2 + 0.5,
            torch.randn(B, 1, HKV, D, generator=g))


@needs_numba
@pytest.mark.parametrize("name", TQ)
@pytest.mark.parametrize("D", [64, 128])  # one scale block per head, or two
@pytest.mark.parametrize("window", [0, 16])
def test_rows_at_their_own_depths_match_the_reference(name, D, window):
    """Three rows at their own positions (among the sinks, a few tiles, ~3000 deep) decode a few tokens, across
    window hand-overs: the kernel runs (the table's choice for the cache) and gives the reference's result."""
    g = torch.Generator().manual_seed(D + window)
    lens = [2, 130, 2990]
    cache = _filled(name, lens, D, window, g=g)
    for step in range(3):
        pos = torch.tensor([n + step for n in lens])
        q, k, v = _token(len(lens), D, g)
        recent = cache.store(1, k, v, pos)
        assert_f32_close(decode(q, cache, 1, pos, recent, module=MODULE),
                         attend_reference(q, cache, 1, pos, recent=recent))


@needs_numba
@pytest.mark.parametrize("name", TQ)
@pytest.mark.parametrize("window", [0, 16])
def test_every_depth_through_the_cache(name, window):
    """`kvcli run`'s decode (one sequence, an int position, through KVCache.attention) from the first position on:
    every depth 1..140 (the sinks, the window's first fill and hand-overs, the first tile and group edges), then a
    batch write to 2,100 and steps across the tile edge at 2,112; against the same writes into a cache that attends
    with the reference (-fa off)."""
    g = torch.Generator().manual_seed(window)
    D, n = 64, 2120
    cache = KVCache(1, 1, HKV, n, D, name, name, attention=Attention(), window=window)
    ref = KVCache(1, 1, HKV, n, D, name, name, attention=Attention(flash=False), window=window)
    ks, vs = torch.randn(1, n, HKV, D, generator=g) * 2 + 0.5, torch.randn(1, n, HKV, D, generator=g)
    for pos in list(range(140)) + [None] + list(range(2100, n)):
        if pos is None:  # positions 140..2099 in one write (a prefill's, its attention not asked)
            for c in (cache, ref):
                c.store(0, ks[:, 140:2100], vs[:, 140:2100], 140)
            continue
        q = torch.randn(1, 1, HKV * G, D, generator=g) * 2
        got, want = (c.attention(0, q, ks[:, pos : pos + 1], vs[:, pos : pos + 1], None, pos) for c in (cache, ref))
        assert_f32_close(got, want)
    assert cache.kernels[(True, bool(window), "cpu", True)].module == MODULE  # with a window: rows' positions


@needs_numba
@pytest.mark.parametrize("window", [0, 16])
def test_one_position_for_every_row(window):
    """An int position for a batch (the window's positions all read: no slot masked), two sequences."""
    g = torch.Generator().manual_seed(3)
    D = 64
    cache = KVCache(1, 2, HKV, 200, D, "tq3", "tq3", attention=Attention(), window=window)
    cache.store(0, torch.randn(2, 150, HKV, D, generator=g) * 2 + 0.5, torch.randn(2, 150, HKV, D, generator=g), 0)
    for pos in range(150, 155):
        q, k, v = _token(2, D, g)
        recent = cache.store(0, k, v, pos)
        assert_f32_close(decode(q, cache, 0, pos, recent, module=MODULE),
                         attend_reference(q, cache, 0, pos, recent=recent))


@needs_numba
@pytest.mark.parametrize("name", TQ)
@pytest.mark.parametrize("window", [0, 16])
def test_a_row_gets_the_same_bits_alone_and_beside_others(name, window):
    """A sequence's bits depend neither on the batch nor on the thread count (each sequence and head is computed
    alone, in one order): the server's concurrent streams equal their solo runs, at 1 thread and at 2."""
    g = torch.Generator().manual_seed(4)
    lens = [3, 10, 20, 20, 900, 300, 300]  # with the window, 3 and 10 read no store position (and other slots)
    threads = torch.get_num_threads()
    for D in (64, 128):
        cache = _filled(name, lens, D, window, g=g)
        pos = torch.tensor(lens)
        q, k, v = _token(len(lens), D, g)
        recent = cache.store(1, k, v, pos)
        outs = []
        for t in (1, 2):
            torch.set_num_threads(t)
            try:
                together = decode(q, cache, 1, pos, recent, module=MODULE)
                outs.append(together)
                for b in range(len(lens)):  # the row through a one-row view: its ring slots and limits as in the batch
                    one = cache.rows(b, b + 1)
                    r = None if recent is None else Recent(None, None, int(recent.lim[b]), recent.size,
                                                           recent.masked[b : b + 1], recent.lim[b : b + 1],
                                                           int(recent.lim[b]), kv16=recent.kv16[b : b + 1])
                    assert torch.equal(decode(q[b : b + 1], one, 1, pos[b : b + 1], r, module=MODULE),
                                       together[b : b + 1])
            finally:
                torch.set_num_threads(threads)
        assert torch.equal(outs[0], outs[1])


@needs_numba
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_scale_blocks_narrower_than_a_tile(bits):
    """Scale blocks of 32 (a variant type): each 32 dimensions' own scale, keys and values."""
    with registered(_block32_attrs(bits)) as cls:
        g = torch.Generator().manual_seed(bits)
        lens = [5, 400]
        cache = _filled(cls.name, lens, 64, 16, g=g)
        pos = torch.tensor(lens)
        q, k, v = _token(2, 64, g)
        recent = cache.store(1, k, v, pos)
        assert_f32_close(decode(q, cache, 1, pos, recent, module=MODULE),
                         attend_reference(q, cache, 1, pos, recent=recent))


def test_non_uniform_codebooks_take_the_reference():
    """A codebook that is not u - mid (Lloyd-Max levels): the kernel reads codes as d (u - mid), so the table gives
    the reference."""
    attrs = dict(name="tq3_lm_test", bits=3, block_size=64, block_bytes=26, levels=lloyd_max_levels(3))
    with registered(attrs):
        g = torch.Generator().manual_seed(5)
        cache = _filled("tq3_lm_test", [100], 64, 0, layers=1, g=g)
        assert not cache.k.uniform
        k, v = cache.k.kernel_layout(), cache.v.kernel_layout()
        for per_row in (False, True):
            entry = table.choose(table.ATTEND, "cpu", (k.kind, v.kind), decode=True, per_row=per_row, head_dim=64,
                                 k=k, v=v)
            assert entry is table.reference(table.ATTEND)
        q, kn, vn = _token(1, 64, g)
        recent = cache.store(0, kn, vn, 100)
        assert torch.equal(Attention()(q, cache, 0, 100, recent), attend_reference(q, cache, 0, 100, recent=recent))
        assert cache.kernels[(True, False, "cpu", True)] is table.reference(table.ATTEND).run
    uniform = resolve_type("tq3")(1, 1, 1, 64, 64, keys=True).kernel_layout()
    assert _tq_entry().covers(decode=True, head_dim=64, k=uniform, v=uniform)


# The kernel against the reference in f32: the same arithmetic in another order (measured: KL below 1e-6 a step).
@needs_numba
@pytest.mark.parametrize("name,max_kld", [("tq4", 1e-4), ("tq3", 1e-4), ("tq2", 1e-4)])
def test_real_model_decode_matches_the_reference(default_model, name, max_kld):
    """SmolLM2 (massive activations in a few dimensions): decode logits through the kernel against the reference's
    dequantize-then-matmul, same cache bytes. The top token must agree wherever the reference's top two are not a
    near tie."""
    from kvcli.llama import Llama

    prompt = [(i * 7919) % 40000 + 100 for i in range(300)]
    entry = _tq_entry()
    logits = []
    for kernel in (True, False):
        if not kernel:
            table.unregister(entry)  # the table's choice is then the reference
        try:
            llm = Llama(default_model, ctx_size=512, cache_type_k=name, cache_type_v=name, dtype="f32", weights="f32")
            llm.eval(prompt)
            logits.append(torch.stack([llm.eval([tok]) for tok in (200, 300, 400, 500)]).log_softmax(-1))
            ran = {getattr(run, "module", None) for key, run in llm.cache.kernels.items() if key[0]}
            assert ran == ({MODULE} if kernel else {None}), ran
        finally:
            if not kernel:
                table.register(entry)
    fast, exact = logits
    kld = (exact.exp() * (exact - fast)).sum(-1)
    print(f"{name}: KL of the kernel against the reference, per step: {kld.tolist()}")
    assert kld.max().item() < max_kld
    top2 = exact.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 0.1  # log-prob margin
    assert torch.equal(fast.argmax(-1)[clear], exact.argmax(-1)[clear])
