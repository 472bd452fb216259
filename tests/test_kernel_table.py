"""One contract over the kernel table (kvcli/kernel_table.py): every entry this machine can run equals its role's
reference within its arithmetic (Entry.tol); an entry it cannot run (another device, an instruction set this CPU
lacks or KVCLI_ISA hides) is skipped with its name and the reason, so an AVX2 machine reports the AVX-512 cases
it did not test. The cases come from the registries (cache types, weight forms, table entries): a type or an
entry registered anywhere, this file's toys included, is covered with no list to edit. The CUDA entries run
under Triton's interpreter in tests/test_kernels.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import kvcli.attention  # noqa: F401  (registers attention's entries)
import kvcli.kernels.cpu.int4_tiles
import kvcli.rope  # noqa: F401  (registers RoPE's entries)
import kvcli.swiglu  # noqa: F401  (registers SwiGLU's entries)
import kvcli.weights  # registers the weights' entries
from kvcli import kernel_table as table
from kvcli.attention import Attention, attend_reference
from kvcli.cache import STORAGE_TYPES, KVCache
from kvcli.cache.dense import DenseStore
from kvcli.cache.key_bias import KeyBias
from kvcli.kernels.layout import KernelLayout, Kind

D, HKV, G = 64, 2, 2
LENS = [1, 7, 300, 4096]  # the rows' depths: inside the sinks, past them, a few chunks, several splits deep


def _kinds(name: str) -> tuple[int, int] | None:
    """The layout kinds of a cache type's K and V stores (None: no kernel reads it)."""
    k, v = (STORAGE_TYPES[name](1, 1, 1, 1, D, keys=keys).kernel_layout() for keys in (True, False))
    return None if k is None or v is None else (k.kind, v.kind)


def attend_cases(entry: table.Entry) -> list[tuple[str, str]]:
    """The K/V type pairs an ATTEND entry reads: each type with itself, and one mixed pair."""
    kinds = {name: _kinds(name) for name in STORAGE_TYPES}
    same = [(n, n) for n, k in kinds.items() if k is not None and k in entry.keys]
    mixed = [(a, b) for a, ka in kinds.items() for b, kb in kinds.items()
             if a != b and ka and kb and (ka[0], kb[1]) in entry.keys][:1]
    return same + mixed


def _cases(role: str, cases) -> list:
    return [pytest.param(e, *c, id=f"{e.device}:{e.name}:{'/'.join(map(str, c))}")
            for e in table.entries(role) if e.device != "any" for c in cases(e)]


def _runnable(entry: table.Entry) -> None:
    """Skip, naming the entry and the reason, where this machine cannot run it."""
    if entry.device == "cuda":
        pytest.skip(f"{entry.name}: a CUDA entry (tests/test_kernels.py runs it under Triton's interpreter)")
    reason = table.why_not(entry, "cpu")
    if reason:
        pytest.skip(f"{entry.name}: {reason}")


def key_bias(n_ctx: int, neox: bool = True, scale: float = 20.0) -> KeyBias:
    """A K bias of a few large channels (as qwen2's first layers have) and a RoPE table for n_ctx positions."""
    g = torch.Generator().manual_seed(7)
    bias = torch.randn(1, HKV, D, generator=g)
    bias[..., :: D // 4] *= scale
    theta = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    rot = torch.polar(torch.full((n_ctx, D // 2), 1.1), torch.outer(torch.arange(n_ctx, dtype=torch.float64), theta).float())
    return KeyBias(bias, rot, neox)


def _filled(type_k: str, type_v: str, window: int, g: torch.Generator, biased: bool = False) -> KVCache:
    """Rows b at depths LENS[b] (keys an offset away from 0, as real keys are); biased: keys stored less a K bias."""
    n_ctx = max(LENS) + 8
    cache = KVCache(1, len(LENS), HKV, n_ctx, D, type_k, type_v, attention=Attention(), window=window,
                    key_bias=key_bias(n_ctx) if biased else None)
    for b, n in enumerate(LENS):
        cache.rows(b, b + 1).store(0, torch.randn(1, n, HKV, D, generator=g) * 2 + 0.5,
                                   torch.randn(1, n, HKV, D, generator=g), 0)
    return cache


def check_attend(entry: table.Entry, type_k: str, type_v: str) -> None:
    """Decode steps of 4 rows at their own depths (1 to 4,096) and of 1 row at an int position, with and without a
    recent window (sinks included where the type keeps them), and with keys stored less a K bias: the entry's result
    is the reference's."""
    for window, biased in ((0, False), (16, False), (0, True), (16, True)):
        g = torch.Generator().manual_seed(window)
        cache = _filled(type_k, type_v, window, g, biased)
        layouts = cache.k.kernel_layout(), cache.v.kernel_layout()
        for rows, pos in ((cache, torch.tensor(LENS)), (cache.rows(3, 4), LENS[3])):
            B = rows.batch
            shape = dict(decode=True, per_row=torch.is_tensor(pos), head_dim=D, k=layouts[0], v=layouts[1],
                         key_bias=biased)
            if not entry.covers(**shape):
                continue
            recent = rows.store(0, torch.randn(B, 1, HKV, D, generator=g) + 0.5, torch.randn(B, 1, HKV, D, generator=g), pos)
            q = torch.randn(B, 1, HKV * G, D, generator=g) * 3
            got = entry.run(q, rows, 0, pos, recent)
            ref = attend_reference(q, rows, 0, pos, recent=recent)
            torch.testing.assert_close(got, ref, rtol=entry.tol, atol=entry.tol * ref.abs().max().item(),
                                       msg=lambda m: f"{entry.name} {type_k}/{type_v} window {window} "
                                                     f"{'keys less a bias ' if biased else ''}{m}")


@pytest.mark.parametrize("entry, type_k, type_v", _cases(table.ATTEND, attend_cases))
def test_attend_entries(entry, type_k, type_v):
    _runnable(entry)
    check_attend(entry, type_k, type_v)


def quantize_cases(entry: table.Entry) -> list[tuple[str]]:
    return [(n,) for n in STORAGE_TYPES if any(k in entry.keys for k in (_kinds(n) or ()))]


def check_quantize(entry: table.Entry, name: str) -> None:
    """The entry's codes are the reference quantizer's (adversarial blocks: zeros, ties, tiny and huge scales), bar
    at most 1 in 1,000 blocks where an f32 sum ordered otherwise rounds across a bf16 boundary."""
    g = torch.Generator().manual_seed(0)
    y = torch.randn(4, 9, 3, D, generator=g) * torch.rand(4, 9, 3, D, generator=g) ** 3 * 5
    y[0, 0, 0, :32] = 0
    y[0, 1, 0, :32] = torch.tensor([1.0, -1.0] * 16)
    y[1] *= 1e-30
    y[2] *= 1e20
    for keys in (True, False):
        store = STORAGE_TYPES[name](1, 4, 3, 16, D, keys=keys)
        got, ref = entry.run(store, y), store.quantize_reference(y)
        for a, b in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,)):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert (a != b).float().mean().item() <= 1e-3, f"{entry.name} {name}: codes differ"


@pytest.mark.parametrize("entry, name", _cases(table.QUANTIZE, quantize_cases))
def test_quantize_entries(entry, name):
    _runnable(entry)
    check_quantize(entry, name)


def write_cases(entry: table.Entry) -> list[tuple[str]]:
    """The cache types an entry writes: their K or V stores' kind, or the f16 window ring beside a quantized type."""
    out = []
    for name, cls in STORAGE_TYPES.items():
        kinds = set(_kinds(name) or ()) | (set() if cls.dense else {Kind.F16})
        if kinds & entry.keys:
            out.append((name,))
    return out


def check_write(entry: table.Entry, name: str) -> None:
    """Prompts of four rows at their own lengths, then decode steps at per-row and int positions, with and without a
    window: every tensor of the stores (and the window's ring) holds the reference writes' bytes."""
    for window in (0, 16):
        caches = [KVCache(1, len(LENS), HKV, 340, D, name, name, attention=Attention(), window=window) for _ in range(2)]
        for target in (caches[0].k, caches[0].v, caches[0].ring):
            if target is not None:
                layout = target.kernel_layout()
                target.writer = entry.run if layout is not None and layout.kind in entry.keys else None
        for target in (caches[1].k, caches[1].v, caches[1].ring):
            if target is not None:
                target.writer = None
        for c in caches:
            g = torch.Generator().manual_seed(window)
            for b, n in enumerate((1, 7, 40, 300)):
                c.rows(b, b + 1).store(0, torch.randn(1, n, HKV, D, generator=g) * 2 + 0.5,
                                       torch.randn(1, n, HKV, D, generator=g), 0)
            for step in range(20):
                pos = torch.tensor([1, 7, 40, 300]) + step
                c.store(0, torch.randn(4, 1, HKV, D, generator=g), torch.randn(4, 1, HKV, D, generator=g), pos)
            c.rows(3, 4).store(0, torch.randn(1, 1, HKV, D, generator=g), torch.randn(1, 1, HKV, D, generator=g), 320)
        for part in ("k", "v", "ring"):
            got, ref = getattr(caches[0], part), getattr(caches[1], part)
            for attr, t in (vars(ref) if ref is not None else {}).items():
                if torch.is_tensor(t):
                    assert torch.equal(getattr(got, attr), t), f"{entry.name} {name} window {window}: {part}.{attr}"


@pytest.mark.parametrize("entry, name", _cases(table.WRITE, write_cases))
def test_write_entries(entry, name):
    _runnable(entry)
    check_write(entry, name)


# ---- the weights' roles: a form of each kind, adversarial blocks ----
N, K = 96, 256  # N not a whole number of tiles: the last tile's padding rows
ROWS = (1, 4, 8, 33, 512)


def _int4(g: torch.Generator):
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    codes[0, :32], codes[1, :32] = 0, 15  # a block at each extreme code
    scale = torch.rand(N, K // 32, generator=g) * 0.02 + 1e-3
    scale[2, 0] = 0  # a zero scale
    zero = torch.randn(N, K // 32, generator=g) * 0.02
    return kvcli.weights.Int4.from_codes(codes, scale, zero)


def _int8(g: torch.Generator):
    q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    q[0, :32] = -128  # a block of the most negative code
    d = (torch.rand(N, K // 32, generator=g) * 0.01).half()
    return kvcli.weights.Int8.from_codes(q, d)


FORMS = {"int4": _int4, "int8": _int8}  # weight form kind -> a CPU example of it (the toy adds its own)


def product_cases(entry: table.Entry) -> list[tuple[str]]:
    return [(kind,) for kind in FORMS if kind in entry.keys]


def check_product(entry: table.Entry, kind: str) -> None:
    """x @ W.T at 1, 4, 8, 33 and 512 rows (an outlier column among them) against dequantize-then-matmul in f64."""
    g = torch.Generator().manual_seed(3)
    form = FORMS[kind](g)
    W = form.dequantize().double()
    for rows in ROWS:
        x = torch.randn(rows, K, generator=g)
        x[:, 7] *= 50  # a massive activation dimension, as real models have
        y = entry.run(form, x)
        ref = x.double() @ W.T
        assert y.shape == (rows, N) and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), ref, rtol=entry.tol, atol=entry.tol * ref.abs().max().item(),
                                   msg=lambda m: f"{entry.name} {kind} rows {rows}: {m}")


@pytest.mark.parametrize("entry, kind", _cases(table.PRODUCT, product_cases))
def test_product_entries(entry, kind):
    _runnable(entry)
    check_product(entry, kind)


def rows_cases(entry: table.Entry) -> list[tuple[str]]:
    return [(kind,) for kind in FORMS if kind in entry.keys]


@pytest.mark.parametrize("entry, kind", _cases(table.ROWS, rows_cases))
def test_rows_entries(entry, kind):
    """A slab of W.T as the entry makes it: the reference's bits, for every dtype the entry takes."""
    _runnable(entry)
    form = FORMS[kind](torch.Generator().manual_seed(4))
    T = kvcli.kernels.cpu.int4_tiles.tile_width()
    for dtype in (torch.bfloat16, torch.float32):
        if entry.covers(dtype=dtype):
            got = entry.run(form, T, 2 * T, dtype).clone()
            assert torch.equal(got, table.reference(table.ROWS).run(form, T, 2 * T, dtype)), f"{entry.name} {dtype}"


@pytest.mark.parametrize("entry, key", _cases(table.NORM, lambda e: [(k,) for k in sorted(e.keys)]))
def test_norm_entries(entry, key):
    _runnable(entry)
    g = torch.Generator().manual_seed(5)
    for rows in (1, 4, 33):
        x, w = torch.randn(rows, 576, generator=g) * 3, torch.rand(576, generator=g) + 0.5
        ref = torch.nn.functional.rms_norm(x.double(), (576,), w.double(), 1e-5)
        torch.testing.assert_close(entry.run(x, w, 1e-5).double(), ref, rtol=entry.tol, atol=entry.tol)


@pytest.mark.parametrize("entry, key", _cases(table.ROPE, lambda e: [(k,) for k in sorted(e.keys)]))
def test_rope_entries(entry, key):
    """Bitwise the reference's rotation: both pair layouts, decode's row, a prompt's strided view of q and k, rows of
    their own positions (the server's step) and one table shared by the rows."""
    _runnable(entry)
    g = torch.Generator().manual_seed(6)
    for neox in (False, True):
        for B, T, H, shared in ((1, 1, 16, True), (2, 7, 3, True), (3, 1, 4, False), (2, 5, 2, False)):
            base = torch.randn(B, T, H + 2, D, generator=g) * 10  # x: the first H heads, a view as the model's qk
            rot = torch.polar(torch.ones((T, D // 2) if shared else (B, T, D // 2)),
                              torch.rand((T, D // 2) if shared else (B, T, D // 2), generator=g) * 7)
            got, want = base.clone(), base.clone()
            entry.run(got[:, :, :H], rot, neox)
            table.reference(table.ROPE).run(want[:, :, :H], rot, neox)
            assert torch.equal(got, want), (entry.name, neox, B, T, H, shared)


@pytest.mark.parametrize("entry, key", _cases(table.SWIGLU, lambda e: [(k,) for k in sorted(e.keys)]))
def test_swiglu_entries(entry, key):
    _runnable(entry)
    g = torch.Generator().manual_seed(7)
    for shape in ((1, 1, 2 * 1536), (3, 5, 2 * 64), (33, 2 * 4864)):
        gu = torch.randn(shape, generator=g) * 6
        gate, up = gu.double().chunk(2, dim=-1)
        want = gate * torch.sigmoid(gate) * up
        torch.testing.assert_close(entry.run(gu).double(), want, rtol=entry.tol, atol=entry.tol)


def test_a_batchs_swiglu_over_threads_equals_one_threads():
    """The CPU's SwiGLU split over threads (a prompt's batch) gives each row the bits of the one-thread pass (decode's)."""
    kernels = pytest.importorskip("kvcli.kernels.cpu.swiglu")
    if kernels.numba is None:
        pytest.skip("numba is not installed")
    gu = (torch.randn(33, 2 * 320, generator=torch.Generator().manual_seed(3)) * 6).numpy()
    np.testing.assert_array_equal(kernels.rows_out(gu, 2), kernels.swiglu(gu))
    np.testing.assert_array_equal(kernels.rows_out(gu[:1], 2)[0], kernels.swiglu(gu)[0])


def test_every_role_has_a_reference_and_every_entry_a_name():
    for role in table.ROLES:
        assert table.reference(role).device == "any"
        assert callable(table.reference(role).run) or role == table.WRITE  # WRITE's: the stores' own torch writes
    for e in table.entries():
        assert e.name and e.role in table.ROLES and e.device in ("cpu", "cuda", "any")


def test_a_choice_is_made_once_and_kept_on_the_cache():
    """The entry for a cache and shape is chosen once (kept on the cache, shared by its rows views) and does not
    change with depth or threads."""
    cache = KVCache(1, 1, HKV, 4200, D, "q8_0", "q8_0", attention=Attention())
    g = torch.Generator().manual_seed(1)
    cache.store(0, torch.randn(1, 4100, HKV, D, generator=g), torch.randn(1, 4100, HKV, D, generator=g), 0)
    q = torch.randn(1, 1, HKV * G, D, generator=g)
    threads = torch.get_num_threads()
    try:
        runs = []
        for pos, t in ((10, 1), (4099, 2), (4099, 1)):
            torch.set_num_threads(t)
            cache.attend(q, cache, 0, pos)
            runs.append(cache.kernels[(True, False, "cpu", True)])
    finally:
        torch.set_num_threads(threads)
    assert runs[0] is runs[1] is runs[2]
    assert cache.rows(0, 1).kernels is cache.kernels


# ---- a toy cache type and its kernel, registered here: the contract covers them with no other file edited ----
TOY_KIND = 1000  # a layout kind no kernel of the project reads


class _ToyStore(DenseStore):
    """f16 vectors under a layout kind of their own (no name: registered by the fixture only)."""

    block_bytes, dtype, kind = 2, torch.float16, TOY_KIND

    def kernel_layout(self) -> KernelLayout:
        return KernelLayout(TOY_KIND)


def _toy_attend(q, cache, layer, pos, recent):
    """The toy's decode kernel: dense f16 rows, one softmax over store and window (the reference's own split)."""
    B, _, H, Dh = q.shape
    Hkv = cache.k.n_heads
    lim = (pos + 1) if torch.is_tensor(pos) else torch.full((B,), pos + 1)
    if recent is not None:
        return attend_reference(q, cache, layer, pos, recent=recent)  # the window's masks, as the reference reads them
    out = torch.empty(B, Hkv, H // Hkv, Dh)
    for b in range(B):
        n = int(lim[b])
        k, v = cache.k.data[layer, b, :, :n].float(), cache.v.data[layer, b, :, :n].float()  # (Hkv, n, D)
        qb = q[b, 0].view(Hkv, H // Hkv, Dh)
        out[b] = torch.softmax(qb @ k.transpose(-1, -2) / math.sqrt(Dh), -1) @ v
    return out.view(B, 1, H * Dh)


@pytest.fixture
def toy():
    """The toy cache type "toy16" and its CPU decode entry, registered for one test and taken out again."""
    cls = type("ToyStore", (_ToyStore,), {"name": "toy16"})  # registers through Store.__init_subclass__
    entry = table.register(table.Entry(table.ATTEND, "cpu", frozenset({(TOY_KIND, TOY_KIND)}), "tests: toy f16",
                                       _toy_attend, covers=lambda decode, key_bias, **_: decode and not key_bias))
    try:
        yield cls, entry
    finally:
        table.unregister(entry)
        del STORAGE_TYPES["toy16"]


def test_a_toy_type_gets_its_entry_and_the_contract(toy):
    cls, entry = toy
    cases = attend_cases(entry)
    assert ("toy16", "toy16") in cases
    cache = KVCache(1, 1, HKV, 16, D, "toy16", "toy16", attention=Attention())
    cache.store(0, torch.randn(1, 5, HKV, D), torch.randn(1, 5, HKV, D), 0)
    Attention()(torch.randn(1, 1, HKV * G, D), cache, 0, 5 - 1)
    assert cache.kernels[(True, False, "cpu", True)] is _toy_attend  # chosen from the table, no dispatcher edited
    for type_k, type_v in cases:
        check_attend(entry, type_k, type_v)


class _Toy8:
    """A toy weight form: int8 codes (N, K) with one f32 scale a row, its own kind."""

    kind = name = "toy8"

    def __init__(self, q: torch.Tensor, s: torch.Tensor):
        self.q, self.s = q, s

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.s[:, None]


def _toy8_product(form: _Toy8, x: torch.Tensor) -> torch.Tensor:
    """The toy's kernel: x times the codes, each output scaled once (not the dequantized matrix)."""
    return (x @ form.q.float().T) * form.s


@pytest.fixture
def toy_weights():
    entry = table.register(table.Entry(table.PRODUCT, "cpu", frozenset({"toy8"}), "tests: toy int8", _toy8_product,
                                       tol=1e-5))
    FORMS["toy8"] = lambda g: _Toy8(torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8),
                                    torch.rand(N, generator=g) * 0.01)
    try:
        yield entry
    finally:
        table.unregister(entry)
        del FORMS["toy8"]


def test_a_toy_weight_form_gets_its_entry_and_the_contract(toy_weights):
    assert table.choose(table.PRODUCT, "cpu", "toy8") is toy_weights
    assert product_cases(toy_weights) == [("toy8",)]
    check_product(toy_weights, "toy8")
