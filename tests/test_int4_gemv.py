"""Decode's product kernel (kvcli/kernels/cpu/weights.py) through its table entries (kvcli/weights.py: PRODUCT,
AVX512, Int4 and Int8): a few rows of x times Int4 and Int8 forms, against x quantized as the kernel quantizes it
(int8 per 32 columns) times W dequantized in f64, for every row count it takes; a row's bits alone, in a batch and at
any thread count; views. Where the entries do not run (a CPU without AVX512-VNNI/VBMI, KVCLI_ISA=avx2, no numba or
tiles it reads) every case skips, naming the entry and why."""

import pytest
import torch

import kvcli.weights  # noqa: F401  (registers the weights' entries)
from kvcli import kernel_table as table
from kvcli.kernel_table import AVX512, PRODUCT
from kvcli.kernels.cpu.int4_tiles import tile_width
from kvcli.weights import Int4, Int8
from tests.test_weights import adversarial_blocks

ENTRIES = {kind: next(e for e in table.entries(PRODUCT) if kind in e.keys and e.isa == AVX512 and e.device == "cpu")
           for kind in ("int4", "int8")}


@pytest.fixture(autouse=True)
def _runs_here():
    for e in ENTRIES.values():
        reason = table.why_not(e, "cpu")
        if reason:
            pytest.skip(f"{e.name}: {reason}")


@pytest.fixture(scope="module")
def int4_gemv():
    """The kernel module (imported only where it may run: numba loads with it)."""
    from kvcli.kernels.cpu import weights

    return weights


def product(form, x: torch.Tensor) -> torch.Tensor:
    return ENTRIES[form.kind].run(form, x)


def quantized(x: torch.Tensor, x_range: int = 127 * 256) -> torch.Tensor:
    """x (M, K) f32 as the kernel reads it (int4_gemv.quantize_rows), in f64: per 32 columns, sx = max |x| / 32512 and
    xi = x (1 / sx) rounded to nearest even (f32 ops), x ~ sx xi; a block of zeros stays zero."""
    b = x.unflatten(-1, (-1, 32))
    sx = b.abs().amax(-1, keepdim=True) / x_range
    inv = 1 / torch.where(sx == 0, torch.ones_like(sx), sx)
    xq = torch.where(sx == 0, torch.zeros_like(b), torch.round(b * inv))
    return (xq.double() * sx.double()).flatten(-2)


def _reference(form, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x quantized as the kernel does times W as the kernel reads it, in f64 -> (product, a bound on f32's error). An
    Int8's W is its Int4 parts' (bf16 scales: 2^-9 off its f16 ones), each over its columns twice. The kernel's
    integer sums are exact, then a few f32 roundings a block of s sx (xq . q) and (z - 8 s) sx sum xq, each at most
    sum |x| (|W| + 16 s): the bound is 2^-20 of sum |x| (|W| + 136 s), as it was for bf16's."""
    parts = form.parts if isinstance(form, Int8) else [form]
    if isinstance(form, Int8):
        x = x.unflatten(-1, (len(parts), -1)).repeat(1, 1, 2).flatten(-2)
    xb = quantized(x)
    w = torch.cat([p.dequantize() for p in parts], 1).double()
    s = torch.cat([p.sz[:, : p.n, 0].T.double().repeat_interleave(32, 1) for p in parts], 1)
    return (xb @ w.T).float(), (2.0**-20 * (xb.abs() @ (w.abs() + 136 * s.abs()).T) + 1e-6).float()


def _forms(N: int, K: int) -> list:
    codes, scale, zero = adversarial_blocks(N, K)
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    d = torch.exp(torch.empty(N, K // 32).uniform_(-9, 3, generator=g)).half()
    return [Int4.from_codes(codes, scale, zero), Int8.from_codes(q, d)]


@pytest.mark.parametrize("N,K", [(64, 64), (40, 96), (96, 32), (200, 576)])  # N, K off the tile width too
def test_rows_match_reference(N, K, int4_gemv):
    assert int4_gemv.X_RANGE == 127 * 256  # quantized()'s
    for form in _forms(N, K):
        for M in range(1, int4_gemv.MAX_ROWS + 1):
            x = torch.randn(1, M, K, generator=torch.Generator().manual_seed(M)) * 3
            want, bound = _reference(form, x[0])
            got = product(form, x)
            assert got.shape == (1, M, N) and got.dtype == torch.float32
            assert ((got[0] - want).abs() <= bound).all(), (type(form).__name__, M)


def test_same_bits_alone_and_in_a_batch(int4_gemv):
    """The server's slots: a row's product does not depend on what shares the call (rows padded or not)."""
    for form in _forms(128, 576):
        x = torch.randn(int4_gemv.MAX_ROWS, 576, generator=torch.Generator().manual_seed(0))
        together = product(form, x)
        for M in (1, 3, 5):
            assert torch.equal(product(form, x[:M]), together[:M])
        for m in range(len(x)):
            assert torch.equal(product(form, x[m : m + 1]), together[m : m + 1])


def test_threads_give_the_same_bits(int4_gemv):
    """-t N splits the tiles over N threads: every row count, Int4 and Int8, the same bits as one thread (tiles that
    split unevenly: 200 rows are 4 tiles of 64, or 7 of 32)."""
    if not int4_gemv.THREADED:
        pytest.skip("numba's OpenMP threading layer does not load here")
    before = torch.get_num_threads()
    try:
        for form in _forms(200, 576):
            x = torch.randn(int4_gemv.MAX_ROWS, 576, generator=torch.Generator().manual_seed(3))
            for M in (1, 2, 3, 8):
                torch.set_num_threads(1)
                one = product(form, x[:M])
                for threads in (2, 3):
                    torch.set_num_threads(threads)
                    assert torch.equal(product(form, x[:M]), one), (type(form).__name__, M, threads)
    finally:
        torch.set_num_threads(before)


def test_narrowed_forms_read_their_views():
    """A narrowed Int4 or Int8 (the hidden-state cache's K/V slices of a fused matrix) keeps views of the codes."""
    for form in _forms(256, 128):
        part = form.narrow(64, 128)
        x = torch.randn(2, 128, generator=torch.Generator().manual_seed(2))
        want, bound = _reference(part, x)
        assert ((product(part, x) - want).abs() <= bound).all()


def test_more_rows_than_it_takes_use_torch(monkeypatch, int4_gemv):
    """Past MAX_ROWS the entries run torch's int4 GEMV (Int8: its parts'), then slabs: not the kernel."""
    monkeypatch.setattr(int4_gemv.Operands, "matmul", lambda *a: pytest.fail("the kernel ran"))
    for form in _forms(64, 64):
        for M in (int4_gemv.MAX_ROWS + 1, 40, 300):
            product(form, torch.randn(M, 64))


def test_the_kernel_is_the_tables_choice_here(int4_gemv):
    """Where the AVX512 entries run, the forms choose them (the first entries of their kinds)."""
    for form in _forms(64, 64):
        form.matmul(torch.randn(1, 64))
        assert form.product is ENTRIES[form.kind].run and form.operands is not None


def test_rows_padding_and_tiles(int4_gemv):
    assert [int4_gemv.ROWS[m] for m in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert int4_gemv.covers(64) and int4_gemv.covers(32) and not int4_gemv.covers(16)
    assert tile_width() in (32, 64)
