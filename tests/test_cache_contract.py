"""The contract every registered cache storage type keeps, checked over the registry itself:
a new type (one class, registered by subclassing Store) is tested here with no list to edit.

Each check is a plain function of the store class, so the toy type at the bottom (a q8 with
another scale rule, registered inside this file) runs through exactly the same checks."""

from __future__ import annotations

import json
import os
import re
import sys
import warnings
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

from kvcli.cache import STORAGE_TYPES, CacheSpec, KVCache, cache_bytes
from kvcli.cache.base import Store
from kvcli.cache.ggml_blocks import GgmlBlockStore, _f16_at, _f16_bytes, _round_to_int8, _signed_absmax
from kvcli.errors import KvcliError
from kvcli.memory import MIB
from kvcli.attention import Attention

L, B, HKV, D = 2, 2, 3, 64
TYPES = list(STORAGE_TYPES)


def _config(n_kv_heads=HKV, head_dim=D, n_layers=L, n_embd=None):
    """The fields the cache planner reads (kvcli.config.ModelConfig has them all)."""
    return SimpleNamespace(n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim, kv_dim=n_kv_heads * head_dim,
                           n_embd=n_embd or 2 * n_kv_heads * head_dim)


def _vectors(n: int, seed: int) -> torch.Tensor:
    """(B, n, Hkv, D) f32: Gaussian, a few outliers and one all-zero vector (zero scales)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, n, HKV, D, generator=g)
    x[:, :, :, 3] *= 6.0  # an outlier channel, as real keys have
    x[:, min(5, n - 1)] = 0.0
    return x


def _fill(store: Store, x: torch.Tensor, layer: int = 1) -> None:
    """Write x (B, n, Hkv, D) as a run does: a prefill batch, then decode steps one position each."""
    n = x.shape[1]
    cut = max(1, n - 5)
    store.store(layer, x[:, :cut], 0)
    for pos in range(cut, n):
        store.store(layer, x[:, pos : pos + 1], pos)


def _rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).pow(2).mean() / b.pow(2).mean()).sqrt().item()


def error_bound(bits: float) -> float:
    """Relative RMS error a type of `bits` bits per element may have on Gaussian data. A block
    format spends nearly all its bits on codes: a uniform b-bit grid over a block's range errs by
    a few times 2^-b of the RMS (q4_0 about 3x), allowed 5.7x. A 16-bit float keeps about half
    its bits as mantissa."""
    return 2.0 ** (2.5 - bits) if bits < 12 else 2.0 ** (-bits / 2)


# ---- the checks ----

def check_bytes(cls: type[Store]) -> None:
    """nbytes() is the planned size (nbytes_for, cache_bytes) and the size the start-up line prints."""
    for n_ctx in (1, 77, 256):
        store = cls(L, B, HKV, n_ctx, D)
        assert store.nbytes() == cls.nbytes_for(L, B, HKV * D, n_ctx)
        spec = CacheSpec("kv", cls.name, cls.name, key_bias="off")  # the type's default window; keys as they come
        cache = KVCache(L, B, HKV, n_ctx, D, cls.name, cls.name, window=spec.window, attention=Attention())
        planned = cache_bytes(_config(), spec, n_ctx, B)
        assert cache.nbytes() == planned
        printed = float(re.search(r"size = +([\d.]+) MiB", cache.describe()).group(1))
        assert printed == round(planned / MIB, 2)
    assert cls.bits_per_element() == 8 * cls.block_bytes / cls.block_size


def check_chunked_loads(cls: type[Store]) -> None:
    """Loading in chunks gives the slices of one whole load, bit for bit (keys and values)."""
    n = 150
    for keys in (True, False):
        store = cls(L, B, HKV, n, D, keys=keys)
        _fill(store, _vectors(n, seed=1))
        whole = store.load(1, 0, n)
        assert whole.shape == (B, HKV, n, D) and whole.dtype == torch.float32
        for a, b in [(0, 1), (0, 64), (3, 9), (60, 70), (64, 128), (140, 150)]:
            assert torch.equal(store.load(1, a, b), whole[:, :, a:b]), (a, b)


def check_store_pair(cls: type[Store]) -> None:
    """store_pair writes what two separate stores write."""
    n = 40
    x, y = _vectors(n, seed=2), _vectors(n, seed=3)
    pk, pv = cls(L, B, HKV, n, D, keys=True), cls(L, B, HKV, n, D)
    sk, sv = cls(L, B, HKV, n, D, keys=True), cls(L, B, HKV, n, D)
    for a, b in [(0, n - 3), (n - 3, n - 2), (n - 2, n - 1), (n - 1, n)]:
        pk.store_pair(pv, 0, x[:, a:b], y[:, a:b], a)
        sk.store(0, x[:, a:b], a)
        sv.store(0, y[:, a:b], a)
    assert torch.equal(pk.load(0, 0, n), sk.load(0, 0, n))
    assert torch.equal(pv.load(0, 0, n), sv.load(0, 0, n))


def check_products(cls: type[Store]) -> None:
    """scores and weighted_sum (a store's own, possibly straight from its bytes) equal the products
    over load(), to bf16 precision (the coarsest arithmetic a store's decode path may use)."""
    n = 141
    k, v = cls(L, B, HKV, n, D, keys=True), cls(L, B, HKV, n, D)
    k.store_pair(v, 0, _vectors(n, seed=4), _vectors(n, seed=5), 0)
    g = torch.Generator().manual_seed(6)
    tol = 2 * 2.0**-8
    for rows in (1, 5, 40):  # decode-sized and prefill-sized query groups
        q = k.to_storage(torch.randn(B, HKV, rows, D, generator=g))
        p = torch.softmax(torch.randn(B, HKV, rows, n, generator=g) * 3, -1)
        for a, b in [(0, n), (0, 3), (2, 9), (64, 130), (70, 71)]:
            ref = q @ k.load(0, a, b).transpose(-1, -2)
            torch.testing.assert_close(k.scores(0, q, a, b), ref, rtol=0, atol=tol * ref.abs().max().item())
            ref = p[..., a:b] @ v.load(0, a, b)
            got = v.weighted_sum(0, p[..., a:b].contiguous(), a, b)
            torch.testing.assert_close(got, ref, rtol=0, atol=tol * ref.abs().max().item() + 1e-7)


def check_round_trip(cls: type[Store]) -> None:
    """What comes back (mapped out of the store's space) is the input within the type's bits."""
    n = 96
    x = _vectors(n, seed=7)
    x[:, 5] = torch.randn(B, HKV, D)  # no zero vector here: it would flatter the error
    bound = error_bound(cls.bits_per_element())
    for keys in (True, False):
        store = cls(L, B, HKV, n, D, keys=keys)
        _fill(store, x)
        back = store.from_storage(store.load(1, 0, n)).transpose(1, 2)  # (B, n, Hkv, D)
        err = _rel_rms(back, x)
        assert err <= bound, f"{cls.name}: relative RMS error {err:.2e} over the {bound:.2e} its bits allow"


def check_triton(cls: type[Store]) -> None:
    """Where a kernel reads the type (it publishes a KernelLayout): under the Triton interpreter, the
    store's Triton write leaves the same state as its PyTorch write, and attention through the
    kernel equals the library's reference to f32 precision."""
    if cls(1, 1, 1, 1, D).kernel_layout() is None:
        return
    pytest.importorskip("triton", reason="triton is not installed; the kernels need it")
    from kvcli.attention import attend_reference, attend_triton
    from kvcli.kernel_table import QUANTIZE, choose

    n, hkv = 24, 2
    x = _vectors(n, seed=9)[:1, :, :hkv]  # (1, n, 2, D)
    for keys in (True, False):
        cpu, kernel = cls(1, 1, hkv, n, D, keys=keys), cls(1, 1, hkv, n, D, keys=keys)
        kernel.quantizer = choose(QUANTIZE, "cuda", kernel.kernel_layout().kind).run  # the CUDA entry (or reference)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # masked-out lanes the interpreter still computes
            _fill(cpu, x, layer=0)
            _fill(kernel, x, layer=0)
        for name, t in vars(cpu).items():
            if isinstance(t, torch.Tensor):
                assert torch.equal(t, getattr(kernel, name)), f"{cls.name} keys={keys}: {name} differs"
    cache = KVCache(1, 1, hkv, n, D, cls.name, cls.name, attention=Attention())
    cache.store(0, x, _vectors(n, seed=10)[:1, :, :hkv], 0)
    q = torch.randn(1, 3, 2 * hkv, D, generator=torch.Generator().manual_seed(11))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out, ref = attend_triton(q, cache, 0, n - 3, block_n=16), attend_reference(q, cache, 0, n - 3)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


CHECKS = [check_bytes, check_chunked_loads, check_store_pair, check_products, check_round_trip, check_triton]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", TYPES)
def test_contract(name, check):
    check(STORAGE_TYPES[name])


@pytest.fixture(scope="module")
def tiny32(tmp_path_factory):
    """A tiny random MHA model with head size 32, which every block type accepts."""
    from tiny import make_hf_model, write_gguf

    return write_gguf(make_hf_model(n_heads=2, n_kv_heads=2, hidden=64), tmp_path_factory.mktemp("t32") / "t32.gguf")


@pytest.mark.parametrize("name", TYPES)
def test_hidden_cache_accepts_every_type(tiny32, name):
    """The hidden-state cache over each storage type: its planned bytes are its real ones, and
    logits through it stay within the type's precision of the f32 K/V cache's."""
    from kvcli.llama import Llama

    llm = Llama(tiny32, ctx_size=48, dtype="f32", cache_type_k="f32", cache_type_v="f32")
    spec = CacheSpec("hidden", type_h=name)
    cache = llm.new_cache(spec)
    assert cache.nbytes() == cache_bytes(llm.config, spec, 48)
    ids = torch.randint(0, llm.config.vocab_size, (40,), generator=torch.Generator().manual_seed(8))
    ref, got = llm.logits(ids), llm.logits(ids, cache=cache)
    assert torch.isfinite(got).all()
    assert _rel_rms(got, ref) <= 4 * error_bound(STORAGE_TYPES[name].bits_per_element())


def test_registering_a_name_twice_is_an_error():
    with pytest.raises(KvcliError, match="q8_0"):
        type("Q8Again", (Store,), {"name": "q8_0", "block_bytes": 1})
    assert STORAGE_TYPES["q8_0"].__name__ != "Q8Again"


# ---- a toy extra type, registered by subclassing inside this test file ----

def _toy_class() -> type[Store]:
    class Q8MseStore(GgmlBlockStore):
        """q8_0's block layout (fp16 d, 32 x int8) with the scale refit by least squares for the
        rounded codes instead of ggml's max / 127."""

        name, block_size, block_bytes = "q8_toy", 32, 34

        @staticmethod
        def quantize_blocks(x: torch.Tensor) -> torch.Tensor:
            d = _signed_absmax(x).abs() / 127
            q = _round_to_int8(x * torch.where(d == 0, 0.0, 1.0 / d))
            qf = q.float()
            d = (qf * x).sum(-1, keepdim=True) / (qf * qf).sum(-1, keepdim=True).clamp_min(1e-30)
            return torch.cat([_f16_bytes(d), q.view(torch.uint8)], -1)

        @staticmethod
        def dequantize_blocks(blocks: torch.Tensor) -> torch.Tensor:
            return _f16_at(blocks, 0) * blocks[..., 2:].contiguous().view(torch.int8).float()

    return Q8MseStore


@contextmanager
def registered_toy():
    """The toy type registered for the block's duration (other tests see the usual registry)."""
    before = dict(STORAGE_TYPES)
    try:
        yield _toy_class()
    finally:
        STORAGE_TYPES.clear()
        STORAGE_TYPES.update(before)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_toy_type_keeps_the_contract(check):
    with registered_toy() as toy:
        assert STORAGE_TYPES["q8_toy"] is toy
        check(toy)
    assert "q8_toy" not in STORAGE_TYPES


def test_toy_type_is_a_cache_choice_everywhere(tiny32, tmp_path):
    """Registered, the toy is a -ctk choice, a row of `kvcli info`, and a pair of `--sweep all`."""
    from typer.testing import CliRunner

    from kvcli.cli import app

    runner = CliRunner()
    with registered_toy():
        r = runner.invoke(app, ["run", "-m", str(tiny32), "-p", "hello", "-n", "2", "--temp", "0", "-c", "32",
                                "-ctk", "q8_toy", "-ctv", "q8_toy"])
        assert r.exit_code == 0, r.output
        assert "K (q8_toy)" in r.output
        r = runner.invoke(app, ["info", "-m", str(tiny32)])
        assert r.exit_code == 0, r.output
        assert "kv q8_toy/q8_toy" in r.output and "hidden q8_toy" in r.output
        text = tmp_path / "text.txt"
        text.write_text("the cat sat on the mat and the dog ran far away from the old town " * 4)
        r = runner.invoke(app, ["perplexity", str(tiny32), "-f", str(text), "-c", "16", "--chunks", "2",
                                "--sweep", "all", "--json", str(tmp_path / "s.json")])
        assert r.exit_code == 0, r.output
        rows = json.loads((tmp_path / "s.json").read_text())["rows"]
        assert ("q8_toy", "q8_toy") in [(x["type_k"], x["type_v"]) for x in rows]
    r = runner.invoke(app, ["run", "-m", str(tiny32), "-p", "hello", "-n", "2", "-ctk", "q8_toy"])
    assert r.exit_code != 0 and "unknown cache type" in r.output
