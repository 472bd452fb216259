"""The dense (f32, f16, bf16) and ggml block (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl) CPU decode kernel
(kvcli/kernels/cpu/attention.py): the reference's attention for one query token per sequence, in one compiled call, over
the stored elements where they lie and the recent window's f16 rows, at any depth (cut in splits of SPLIT positions) and
thread count, a row's bits the same alone and in a batch and at 1 and 2 threads.

Every check goes through the real path: a KVCache built with Attention(), written by the cache, read by the entry the
kernel table picks for a CPU decode step (this kernel: asserted), compared with kvcli.attention.attend_reference. Both
read the same stored elements (the reference loads them, the kernel widens them where they lie), so the difference is
f32 arithmetic alone (the order of the sums, exp_f32): one tolerance for every type, as before."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import kvcli.attention
from kvcli.attention import Attention, attend_reference
from kvcli.cache import KVCache
from kvcli.cache.window import Recent
from kvcli.kernels.cpu import attention as kernel
from kvcli.kernels.cpu.compile import THREADED

pytestmark = pytest.mark.skipif(not kernel.available(), reason="numba is not installed")
HKV, G = 3, 3
TOL = dict(rtol=1e-5, atol=2e-5)  # f32 sums in another order over up to ~4,200 positions (keys 2x + 0.5, q 3x)
SPLIT = kernel.SPLIT
DENSE_PAIRS = [("f16", "f16"), ("f32", "f32"), ("bf16", "bf16"), ("f16", "f32")]
BLOCK_PAIRS = [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q4_1", "q5_0"), ("q5_1", "iq4_nl"), ("iq4_nl", "q4_1"),
               ("q5_0", "q5_1"), ("q8_0", "f16"), ("f16", "q4_0")]
# rows at their own positions: inside one chunk, one of two splits, one of eight (all at once: ~4,200 deep)
LENS = [5, 2 * SPLIT + 200, 8 * SPLIT + 100]


def _cache(lens: list[int], types: tuple[str, str], D: int, window: int, steps: int = 2) -> KVCache:
    """A cache whose row b holds lens[b] positions in layer 1 (keys an offset away from 0, as real keys are),
    written by the cache itself (window=N: the newest N in its f16 ring, the rest quantized into the stores)."""
    g = torch.Generator().manual_seed(len(lens) * 1000 + D + window)
    cache = KVCache(2, len(lens), HKV, max(lens) + steps + 1, D, *types, window=window, attention=Attention())
    for b, n in enumerate(lens):
        cache.rows(b, b + 1).store(1, torch.randn(1, n, HKV, D, generator=g) * 2 + 0.5,
                                   torch.randn(1, n, HKV, D, generator=g), 0)
    return cache


def _token(cache: KVCache, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode token's q (B, 1, H, D) and new k, v (B, 1, Hkv, D)."""
    B, D = cache.batch, cache.k.head_dim
    return (torch.randn(B, 1, HKV * G, D, generator=g) * 3, torch.randn(B, 1, HKV, D, generator=g) * 2 + 0.5,
            torch.randn(B, 1, HKV, D, generator=g))


def _attend_at(threads: int, q, cache, pos, recent) -> torch.Tensor:
    torch.set_num_threads(threads)
    return Attention()(q, cache, 1, pos, recent)


@pytest.fixture
def ran(monkeypatch) -> list:
    """Counts the kernel's calls (the table's entry must reach it, not the reference)."""
    calls = []
    monkeypatch.setattr(kernel, "attend", lambda *a, f=kernel.attend: calls.append(1) or f(*a))
    return calls


def _decode_matches(cache: KVCache, lens: list[int], steps: int, ran: list) -> None:
    """Rows b at positions lens[b] + step decode `steps` tokens in layer 1 through cache.store and Attention() (the
    server's step): at 1 and 2 threads the same bits, the reference's result."""
    g = torch.Generator().manual_seed(sum(lens))
    for step in range(steps):
        pos = torch.tensor([n + step for n in lens])
        q, k, v = _token(cache, g)
        recent = cache.store(1, k, v, pos)
        one, two = (_attend_at(t, q, cache, pos, recent) for t in (1, 2))
        assert torch.equal(one, two)  # the same splits whatever the thread count
        torch.testing.assert_close(one, attend_reference(q, cache, 1, pos, recent=recent), **TOL)
    assert len(ran) == 2 * steps


@pytest.mark.parametrize("window", [0, 16])
@pytest.mark.parametrize("D", [64, 32])
@pytest.mark.parametrize("types", DENSE_PAIRS + BLOCK_PAIRS)
def test_rows_equal_the_reference(ran, types, D, window):
    """Rows at their own positions, one of them ~4,200 deep (several splits), with and without an f16 window (its
    slots read where the row's mask leaves them): the reference's result at 1 and 2 threads, bit for bit alike."""
    _decode_matches(_cache(LENS, types, D, window), LENS, 2, ran)


@pytest.mark.parametrize("window", [0, 16])
@pytest.mark.parametrize("types", DENSE_PAIRS)
def test_dense_head_size_16(ran, types, window):
    """The dense types' fixed-order sums take any multiple of 16."""
    lens = [3, 2 * SPLIT + 40]
    _decode_matches(_cache(lens, types, 16, window), lens, 2, ran)


@pytest.mark.parametrize("groups, dim, types", [(1, 64, ("f16", "f16")), (2, 32, ("q4_1", "bf16")),
                                                (4, 128, ("q8_0", "q5_0")), (5, 16, ("f32", "f16")),
                                                (8, 64, ("iq4_nl", "q8_0"))])
def test_head_shapes(ran, groups, dim, types):
    """Query heads per KV head taken 1-4 at a time (a group of 5 is 4 and 1, of 8 two of 4), head sizes of one to
    eight VEC lanes' columns, and a window wider than a chunk (300 slots): the reference's result."""
    g = torch.Generator().manual_seed(groups)
    lens = [3, 2 * SPLIT + 30]
    cache = KVCache(2, 2, 2, max(lens) + 4, dim, *types, window=300, attention=Attention())
    for b, n in enumerate(lens):
        k, v = torch.randn(1, n, 2, dim, generator=g) + 0.5, torch.randn(1, n, 2, dim, generator=g)
        cache.rows(b, b + 1).store(1, k, v, 0)
    for step in range(2):
        pos = torch.tensor([n + step for n in lens])
        q = torch.randn(2, 1, 2 * groups, dim, generator=g) * 3
        k, v = torch.randn(2, 1, 2, dim, generator=g) + 0.5, torch.randn(2, 1, 2, dim, generator=g)
        recent = cache.store(1, k, v, pos)
        one, two = (_attend_at(t, q, cache, pos, recent) for t in (1, 2))
        assert torch.equal(one, two)
        torch.testing.assert_close(one, attend_reference(q, cache, 1, pos, recent=recent), **TOL)
    assert len(ran) == 4


@pytest.mark.parametrize("window", [0, 16])
@pytest.mark.parametrize("types", [("f16", "f16"), ("q4_0", "q8_0")])
def test_every_depth_on_the_way(ran, types, window):
    """One sequence (batch 1) decoding from 1 position to past three splits, the window filling up on the way: every
    step about the first positions and the cuts (2 SPLIT: the first, 3 SPLIT; lim is 15 behind with the window) the
    reference's result. Between them the cache is filled as a prompt is (an int position, many at once)."""
    lens = [1]
    cache = _cache(lens, types, 32, window, steps=3 * SPLIT + 20)
    g = torch.Generator().manual_seed(5)
    for p in [*range(1, 40), *range(2 * SPLIT - 10, 2 * SPLIT + 20), *range(3 * SPLIT - 10, 3 * SPLIT + 20)]:
        if lens[0] < p:
            n = p - lens[0]
            cache.store(1, torch.randn(1, n, HKV, 32, generator=g) + 0.5, torch.randn(1, n, HKV, 32, generator=g),
                        lens[0])
            lens[0] = p
        _decode_matches(cache, lens, 1, ran)
        ran.clear()
        lens[0] += 1


@pytest.mark.parametrize("window", [0, 16])
def test_one_position_for_every_row(ran, window):
    """`kvcli run`'s decode: an int position for the batch (1 and 2 rows), through cache.attention (with a window the
    cache hands the step on as rows, each reading its ring) and through a window of the batch's positions."""
    for B in (1, 2):
        g = torch.Generator().manual_seed(B)
        n = 2 * SPLIT + 50
        cache = KVCache(2, B, HKV, n + 5, 64, "q8_0", "q4_1", window=window, attention=Attention())
        cache.store(1, torch.randn(B, n, HKV, 64, generator=g) + 0.5, torch.randn(B, n, HKV, 64, generator=g), 0)
        real = cache.attend
        for pos in range(n, n + 2):
            q, k, v = _token(cache, g)
            want = []

            def spy(q, cache, layer, pos, recent):  # the reference on what cache.attention hands attention
                want.append(attend_reference(q, cache, layer, pos, recent=recent))
                return real(q, cache, layer, pos, recent)

            cache.attend = spy
            got = cache.attention(1, q, k, v, None, pos)
            cache.attend = real
            torch.testing.assert_close(got, want[0], **TOL)
        q, k, v = _token(cache, g)
        recent = cache.store(1, k, v, n + 2)  # an int position's window: the batch's positions, all read
        assert (recent is None) == (window == 0) and (recent is None or recent.masked is None)
        torch.testing.assert_close(Attention()(q, cache, 1, n + 2, recent),
                                   attend_reference(q, cache, 1, n + 2, recent=recent), **TOL)
    assert len(ran) == 2 * 3


@pytest.mark.parametrize("window", [0, 16])
@pytest.mark.parametrize("types", [("f16", "f16"), ("bf16", "f32"), ("q8_0", "q4_0"), ("q5_1", "iq4_nl")])
def test_a_row_gets_the_same_bits_alone_and_beside_others(monkeypatch, types, window):
    """Each (sequence, head, split) is computed alone and merged in split order: the server's concurrent streams equal
    their solo runs, at 1 and 2 threads (threads started even for the short rows here)."""
    monkeypatch.setattr(kernel, "PARALLEL_MIN", 0)
    lens = [20, 2 * SPLIT + 90, 5 * SPLIT + 7]
    cache = _cache(lens, types, 64, window)
    g = torch.Generator().manual_seed(2)
    pos = torch.tensor(lens)
    q, k, v = _token(cache, g)
    recent = cache.store(1, k, v, pos)
    together = {t: _attend_at(t, q, cache, pos, recent) for t in (1, 2)}
    assert torch.equal(together[1], together[2])
    for b in range(3):  # the same row through a one-row view: its ring slots and limits as the batch had them
        one = cache.rows(b, b + 1)
        r = None if recent is None else Recent(None, None, int(recent.lim[b]), recent.size, recent.masked[b : b + 1],
                                               recent.lim[b : b + 1], int(recent.lim[b]),
                                               kv16=recent.kv16[b : b + 1])
        for t in (1, 2):
            assert torch.equal(_attend_at(t, q[b : b + 1], one, pos[b : b + 1], r), together[t][b : b + 1])


def test_the_splits_depend_on_a_row_alone():
    """_plan: a row that reads fewer than 2 SPLIT store positions is one unit (a single pass), a deeper one is cut at
    multiples of SPLIT, the last unit taking the rest (no short unit); a row with no store positions (all in its
    window) is one unit; the same units whatever else is in the batch; the threads' runs cover them in order."""
    lim = np.array([1, SPLIT, SPLIT + 1, 2 * SPLIT - 1, 2 * SPLIT, 8 * SPLIT + 100, 0], np.int64)
    units, first, runs, work = kernel._plan(lim, 2, 16, 3)
    spans = {}
    for b in range(len(lim)):
        for h in range(2):
            rows = units[first[2 * b + h] : first[2 * b + h + 1]]
            assert (rows[:, 0] == b).all() and (rows[:, 1] == h).all()
            spans[b, h] = [tuple(r) for r in rows[:, 2:].tolist()]
        assert spans[b, 0] == spans[b, 1]
        alone = kernel._plan(lim[b : b + 1], 2, 16, 1)[0]
        assert [tuple(r[2:]) for r in alone.tolist() if r[1] == 0] == spans[b, 0]
    assert [spans[b, 0] for b in range(5)] == [[(0, 1)], [(0, SPLIT)], [(0, SPLIT + 1)], [(0, 2 * SPLIT - 1)],
                                                [(0, SPLIT), (SPLIT, 2 * SPLIT)]]
    assert spans[5, 0] == [(i * SPLIT, (i + 1) * SPLIT) for i in range(7)] + [(7 * SPLIT, 8 * SPLIT + 100)]
    assert spans[6, 0] == [(0, 0)]
    assert work == 2 * (int(lim.sum()) + 16 * len(lim))
    assert runs[0] == 0 and runs[-1] == len(units) and (np.diff(runs) >= 0).all() and (np.diff(runs) > 0).sum() == 3


def test_what_the_kernel_declines_runs_the_reference(monkeypatch):
    """-fa off, a dense head size its sums do not take, a prefill, types it does not read: not this kernel."""
    g = torch.Generator().manual_seed(3)
    monkeypatch.setattr(kernel, "attend", lambda *a: pytest.fail("the kernel ran"))
    cache = _cache([50], ("f16", "f16"), 64, 0)
    q = torch.randn(1, 1, HKV * G, 64, generator=g)
    torch.testing.assert_close(Attention(flash=False)(q, cache, 1, 49), attend_reference(q, cache, 1, 49, flash=False))

    def ours(types, D=64, T=1):
        c = KVCache(1, 1, HKV, 8, D, *types, attention=Attention())
        return getattr(Attention().choose(torch.zeros(1, T, HKV * G, D), c, 0).run, "module", None) == "attention"

    assert ours(("f16", "f16")) and ours(("q5_1", "iq4_nl")) and ours(("f32", "q8_0"), D=32)
    assert not ours(("f16", "f16"), D=24)
    assert not ours(("f16", "f16"), T=4)
    assert not ours(("q4_hadamard", "q8_0"))
    assert not ours(("q8_0", "tq4"))


@pytest.mark.parametrize("types", [("f16", "q8_0"), ("iq4_nl", "bf16")])
def test_warm_up_loads_what_decode_runs(types):
    """kvcli.attention.warm_up(cache) loads the one-thread kernel for the cache's types and, where numba has OpenMP,
    the threaded one: the first token compiles nothing."""
    cache = _cache([4], types, 64, 0)
    kvcli.attention.warm_up(cache)
    want = tuple(np.dtype(kernel._rows_like(s.kernel_layout(), 32).dtype) for s in (cache.k, cache.v))
    for f in (kernel._attend, *([kernel._attend_threaded] if THREADED else [])):
        assert any((sig[2].dtype.name, sig[3].dtype.name) == tuple(d.name for d in want) for sig in f.signatures)


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
def test_decode_tokens_stored_as_torch_rounds_them(dtype):
    """A dense store's decode writes (a token per sequence, at an int or per-row positions) are the bits torch's
    conversion gives: ties to even, subnormals, overflow to inf, signed zero."""
    g = torch.Generator().manual_seed(7)
    D = 64
    cache = KVCache(2, 3, HKV, 20, D, dtype, dtype, attention=Attention())
    k = torch.randn(3, 1, HKV, D, generator=g) * torch.logspace(-9, 6, D)  # f16's subnormals to past its max
    k[0, 0, 0, :4] = torch.tensor([-0.0, 1 + 2**-11, 1 + 3 * 2**-11, 65520.0])  # ties to even, f16's overflow
    v = k.flip(-1) * 0.5
    rows = cache.rows(1, 3)
    rows.store(1, k[1:], v[1:], torch.tensor([5, 9]))  # per-row positions (the server's slots)
    cache.rows(0, 1).store(1, k[:1], v[:1], 4)  # an int position (kvcli run)
    want = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[dtype]
    bits = torch.int32 if want == torch.float32 else torch.int16
    for store, x in ((cache.k, k), (cache.v, v)):
        for b, p in ((0, 4), (1, 5), (2, 9)):
            assert torch.equal(store.data[1, b, :, p].view(bits), x[b, 0].to(want).view(bits))


def test_exp_f32_follows_libm():
    """The kernels' softmax exponent (vectors.exp_f32, inlined so that its loop vectorizes): within 2 ulp of e^x
    over the exponents a softmax meets, 1 at 0, 0 at -inf and past f32's normal range."""
    import numba

    from kvcli.kernels.cpu.compile import FAST
    from kvcli.kernels.cpu.vectors import exp_f32

    @numba.njit(fastmath=FAST | {"reassoc"})  # as the reassociating kernels compile it
    def exps(x, out):
        for i in range(x.shape[0]):
            out[i] = exp_f32(x[i])

    x = np.concatenate([-np.logspace(-9, np.log10(87), 100_000), [0.0, -np.inf, -88.0, -200.0, -1e30]])
    x = x.astype(np.float32)
    out = np.empty_like(x)
    exps(x, out)
    want = np.exp(x.astype(np.float64))
    normal = want > np.finfo(np.float32).tiny
    assert (np.abs(out[normal] - want[normal]) <= 2.5 * 2.0**-23 * want[normal]).all()
    assert out[-5] == 1.0 and (out[-4:] == 0).all()


def test_a_changed_shared_file_drops_the_compiled_kernels(tmp_path):
    """numba would load a kernel compiled against older shared intrinsics or an older callee in another file (its cache
    follows the kernel's own file): a change of any file of the folder drops its compiled kernels once, then keeps
    them."""
    from kvcli.kernels.cpu.compile import drop_stale_kernels

    kernels = [tmp_path / "__pycache__" / "weights._gemv-1.py311.nbi", tmp_path / "__pycache__" / "x.nbc"]
    other = tmp_path / "__pycache__" / "weights.cpython-311.pyc"
    for f in kernels + [other]:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("compiled")
    (tmp_path / "vectors.py").write_text("an older vectors.py")
    drop_stale_kernels(tmp_path)
    assert not any(f.exists() for f in kernels) and other.exists()
    for f in kernels:
        f.write_text("compiled")
    drop_stale_kernels(tmp_path)  # the stamp now matches: nothing dropped
    assert all(f.exists() for f in kernels)
    (tmp_path / "vectors.py").write_text("a newer vectors.py")
    drop_stale_kernels(tmp_path)
    assert not any(f.exists() for f in kernels)
    for f in kernels:
        f.write_text("compiled")
    (tmp_path / "ggml_tiles.py").write_text("a kernel another compiles into its own (decode_layer.py)")
    drop_stale_kernels(tmp_path)
    assert not any(f.exists() for f in kernels)


def test_a_cached_kernel_keeps_its_linking_ir_as_bitcode_and_still_links(tmp_path):
    """A kernel loaded from numba's cache holds its IR as bitcode, not parsed (~100 MB for the decode layer), its names
    read from its machine code, and a caller compiled afterwards still links it (the IR parsed then)."""
    import subprocess
    import sys

    (tmp_path / "kern.py").write_text("import numba\n\n@numba.njit(cache=True)\ndef add1(x):\n    return x + 1\n")
    script = """
import numba
from kvcli.kernels.cpu.compile import keep_linking_ir_as_bitcode
assert keep_linking_ir_as_bitcode()
import kern
assert kern.add1(1) == 2
library = kern.add1.overloads[kern.add1.signatures[0]].library
loaded = getattr(library, "_kvcli_linking_bitcode", None) is not None
assert library._shared_module is None if loaded else True
if loaded:  # the names read from the machine code hold those numba reads from the IR
    import llvmlite.binding as ll
    ir = ll.parse_bitcode(library._kvcli_linking_bitcode)
    names = {g.name for gs in (ir.functions, ir.global_variables) for g in gs if not g.is_declaration}
    assert names and names <= library._codegen._engine._defined_symbols, "names missing"

@numba.njit
def caller(x):
    return kern.add1(x) * 2

assert caller(3) == 8
assert library._shared_module is not None
print("loaded" if loaded else "compiled")
"""
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path,
                           timeout=300) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr[-2000:]
    assert [r.stdout.strip() for r in runs] == ["compiled", "loaded"]
