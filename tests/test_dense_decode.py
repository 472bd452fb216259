"""The dense (f32, f16, bf16) and ggml block (q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl) CPU decode kernel
(kvcli/cache/dense_decode.py): the reference's attention for one query token per sequence, in one compiled call, over
the stored elements where they lie."""

from __future__ import annotations

import pytest
import torch

from kvcli.attention import Attention, attend_cpu_decode, attend_reference, cpu_decode_kernel
from kvcli.cache import KVCache, dense_decode
from kvcli.cache.ggml_blocks import GgmlBlockStore
from tests.decode_checks import rows_match_reference

pytestmark = pytest.mark.skipif(not dense_decode.available(), reason="numba is not installed")
HKV, G, D = 3, 3, 64


def _cache(batch: int, k: str, v: str, head_dim: int = D, window: int | None = None) -> KVCache:
    return KVCache(2, batch, HKV, 700, head_dim, k, v, window=window)


def _fill(cache: KVCache, lens: list[int], g: torch.Generator) -> None:
    """Row b holds lens[b] positions in layer 1 (an offset away from 0, as real keys have)."""
    D = cache.k.head_dim
    for b, n in enumerate(lens):
        cache.rows(b, b + 1).store(1, torch.randn(1, n, HKV, D, generator=g) * 2 + 0.5,
                                   torch.randn(1, n, HKV, D, generator=g), 0)


@pytest.mark.parametrize("types", [("f16", "f16"), ("f32", "f32"), ("bf16", "bf16"), ("f16", "f32"),
                                   ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16"), ("f16", "q4_0"),
                                   ("q4_1", "q5_0"), ("q5_1", "iq4_nl"), ("iq4_nl", "q4_1"), ("q5_0", "q5_1")])
def test_rows_equal_the_reference(monkeypatch, types):
    """Rows at their own positions, one past several of the online softmax's chunks: the reference's result."""
    g = torch.Generator().manual_seed(0)
    lens = [1, 40, dense_decode.CHUNK + 3, 2 * dense_decode.CHUNK + 100]
    cache = _cache(len(lens), *types)
    assert not cache.window  # dense and ggml stores: no window
    # the reference over the blocks dequantized (its own decode path reads the bytes with q split in two int8 parts:
    # ~1e-4)
    monkeypatch.setattr(GgmlBlockStore, "direct", lambda self, x: False)
    _fill(cache, lens, g)
    rows_match_reference(monkeypatch, dense_decode, cache, lens, 5, g)


def test_one_position_for_every_row():
    """`kvcli run`'s decode: an int position."""
    g = torch.Generator().manual_seed(1)
    cache = _cache(2, "f16", "f16")
    cache.store(1, torch.randn(2, 300, HKV, D, generator=g), torch.randn(2, 300, HKV, D, generator=g), 0)
    for pos in range(300, 305):
        q = torch.randn(2, 1, HKV * G, D, generator=g)
        cache.store(1, torch.randn(2, 1, HKV, D, generator=g), torch.randn(2, 1, HKV, D, generator=g), pos)
        torch.testing.assert_close(attend_cpu_decode(q, cache, 1, pos), attend_reference(q, cache, 1, pos),
                                   rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("types", [("f16", "f16"), ("q8_0", "q4_0"), ("q5_1", "iq4_nl")])
def test_a_row_gets_the_same_bits_alone_and_beside_others(types):
    """Each (sequence, head) is computed alone: the server's concurrent streams equal their solo runs."""
    g = torch.Generator().manual_seed(2)
    lens = [20, 90, 600]
    cache = _cache(3, *types)
    _fill(cache, lens, g)
    pos = torch.tensor(lens)
    q = torch.randn(3, 1, HKV * G, D, generator=g)
    cache.store(1, torch.randn(3, 1, HKV, D, generator=g), torch.randn(3, 1, HKV, D, generator=g), pos)
    together = attend_cpu_decode(q, cache, 1, pos)
    for b in range(3):
        assert torch.equal(attend_cpu_decode(q[b : b + 1], cache.rows(b, b + 1), 1, pos[b : b + 1]),
                           together[b : b + 1])
        assert torch.equal(attend_cpu_decode(q[b : b + 1], cache.rows(b, b + 1), 1, lens[b]), together[b : b + 1])


def test_what_the_kernel_declines_runs_the_reference(monkeypatch):
    """-fa off, a window over dense stores, a head size its sums do not take, a pair of types it does not read: the
    reference."""
    g = torch.Generator().manual_seed(3)
    monkeypatch.setattr(dense_decode, "attend", lambda *a: pytest.fail("the kernel ran"))
    cache = _cache(1, "f16", "f16")
    cache.store(1, torch.randn(1, 50, HKV, D, generator=g), torch.randn(1, 50, HKV, D, generator=g), 0)
    q = torch.randn(1, 1, HKV * G, D, generator=g)
    torch.testing.assert_close(Attention(flash=False)(q, cache, 1, 49), attend_reference(q, cache, 1, 49, flash=False))
    windowed = _cache(1, "f16", "f16", window=16)
    recent = windowed.store(1, torch.randn(1, 50, HKV, D, generator=g), torch.randn(1, 50, HKV, D, generator=g), 0)
    assert recent is not None and attend_cpu_decode(q, windowed, 1, 49, recent) is None
    assert cpu_decode_kernel(_cache(1, "f16", "f16", head_dim=24)) is None
    assert cpu_decode_kernel(_cache(1, "q4_hadamard", "q8_0")) is None
    assert cpu_decode_kernel(_cache(1, "q8_0", "tq4")) is None


def test_several_threads_leave_deep_reads_to_the_reference(monkeypatch):
    """With more than one thread, past THREADED_MAX_POSITIONS read the reference's threaded products cost less."""
    g = torch.Generator().manual_seed(4)
    cache = _cache(1, "f16", "f16")
    cache.store(1, torch.randn(1, 200, HKV, D, generator=g), torch.randn(1, 200, HKV, D, generator=g), 0)
    q = torch.randn(1, 1, HKV * G, D, generator=g)
    monkeypatch.setattr(dense_decode, "THREADED_MAX_POSITIONS", 100)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert attend_cpu_decode(q, cache, 1, 199) is None
    assert attend_cpu_decode(q, cache, 1, 50) is not None
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert attend_cpu_decode(q, cache, 1, 199) is not None


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
def test_decode_tokens_stored_as_torch_rounds_them(dtype):
    """dense_decode.put (a decode token per sequence, at an int or per-row positions) writes the bits torch's
    conversion gives: ties to even, subnormals, overflow to inf, signed zero."""
    g = torch.Generator().manual_seed(7)
    cache = _cache(3, dtype, dtype)
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
    """The kernels' softmax exponent (cpu_jit.exp_f32, inlined so that its loop vectorizes): within 2 ulp of e^x
    over the exponents a softmax meets, 1 at 0, 0 at -inf and past f32's normal range."""
    import numba
    import numpy as np

    from kvcli.cache.cpu_jit import FAST, exp_f32

    @numba.njit(fastmath=FAST | {"reassoc"})  # as the reassociating kernels compile it
    def exps(x, out):
        for i in range(x.shape[0]):
            out[i] = exp_f32(x[i])

    x = np.concatenate([-np.logspace(-9, np.log10(87), 100_000), [0.0, -np.inf, -88.0, -200.0, -1e30]]).astype(np.float32)
    out = np.empty_like(x)
    exps(x, out)
    want = np.exp(x.astype(np.float64))
    normal = want > np.finfo(np.float32).tiny
    assert (np.abs(out[normal] - want[normal]) <= 2.5 * 2.0**-23 * want[normal]).all()
    assert out[-5] == 1.0 and (out[-4:] == 0).all()


def test_a_changed_cpu_jit_drops_the_compiled_kernels(tmp_path):
    """numba would load a kernel compiled against an older cpu_jit (its cache follows the kernel's own file): a
    change of cpu_jit.py drops the package's compiled kernels once, then keeps them."""
    from kvcli.cache.cpu_jit import drop_stale_kernels

    kernels = [tmp_path / "__pycache__" / "int4_gemv._gemv-1.py311.nbi", tmp_path / "cache" / "__pycache__" / "x.nbc"]
    other = tmp_path / "__pycache__" / "weights.cpython-311.pyc"
    for f in kernels + [other]:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("compiled")
    (tmp_path / "__pycache__" / "cpu_jit.stamp").write_text("an older cpu_jit.py")
    drop_stale_kernels(tmp_path)
    assert not any(f.exists() for f in kernels) and other.exists()
    for f in kernels:
        f.write_text("compiled")
    drop_stale_kernels(tmp_path)  # the stamp now matches: nothing dropped
    assert all(f.exists() for f in kernels)
