"""q4_hadamard's CPU decode kernel (kvcli/kernels/cpu/attention_rotated.py): the reference's attention for one
query token per sequence, in one compiled call, over the codes where they lie."""

from __future__ import annotations

import pytest
import torch

from kvcli.attention import Attention, attend_reference
from kvcli.cache import KVCache, hadamard
from kvcli.cache.hadamard import HadamardQ4Store
from kvcli.cache.window import Recent
from kvcli.kernels.cpu import attention_rotated as hadamard_decode
from tests.decode_checks import decode, rows_match_reference

pytestmark = pytest.mark.skipif(not hadamard_decode.available(), reason="numba is not installed")
HKV, G, D = 3, 3, 64


def _cache(batch: int, window: int, tile: int, n_ctx: int = 600) -> KVCache:
    cache = KVCache(2, batch, HKV, n_ctx, D, "q4_hadamard", "q4_hadamard", window=window, attention=Attention())
    cache.k = HadamardQ4Store(2, batch, HKV, n_ctx, D, keys=True, tile=tile)  # either CPU's tile width
    cache.v = HadamardQ4Store(2, batch, HKV, n_ctx, D, tile=tile)
    return cache


def _fill(cache: KVCache, lens: list[int], g: torch.Generator) -> None:
    """Row b holds lens[b] positions in both layers (an offset away from 0, as real keys have)."""
    for b, n in enumerate(lens):
        for layer in range(2):
            cache.rows(b, b + 1).store(layer, torch.randn(1, n, HKV, D, generator=g) * 2 + 0.5,
                                       torch.randn(1, n, HKV, D, generator=g), 0)


@pytest.mark.parametrize("tile", [64, 32])
@pytest.mark.parametrize("window", [16, 0])
def test_rows_equal_the_reference(monkeypatch, tile, window):
    """Rows at their own positions (one among its sinks, one inside its window, two deep), across window
    hand-overs: the reference's result."""
    g = torch.Generator().manual_seed(0)
    lens = [3, 12, 140, 400]
    cache = _cache(len(lens), window, tile)
    _fill(cache, lens, g)
    rows_match_reference(monkeypatch, hadamard_decode, cache, lens, 20, g)


@pytest.mark.parametrize("window", [16, 0])
def test_one_position_for_every_row(monkeypatch, window):
    """`kvcli run`'s decode: an int position, the window's positions all read."""
    g = torch.Generator().manual_seed(1)
    cache = _cache(2, window, 64)
    cache.store(0, torch.randn(2, 150, HKV, D, generator=g), torch.randn(2, 150, HKV, D, generator=g), 0)
    for pos in range(150, 170):
        q = torch.randn(2, 1, HKV * G, D, generator=g)
        recent = cache.store(0, torch.randn(2, 1, HKV, D, generator=g), torch.randn(2, 1, HKV, D, generator=g), pos)
        torch.testing.assert_close(decode(q, cache, 0, pos, recent, "attention_rotated"),
                                   attend_reference(q, cache, 0, pos, recent=recent), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("groups, dim, tile", [(1, 64, 64), (2, 32, 64), (4, 128, 32), (5, 64, 32), (8, 128, 64)])
def test_head_shapes(monkeypatch, groups, dim, tile):
    """Query heads per KV head taken 1-4 at a time (a group of 5 is 4 and 1), a head size of one to four blocks,
    value tiles narrower than a head (W = 32) and as wide: the reference's result."""
    g = torch.Generator().manual_seed(groups)
    cache = KVCache(1, 2, 2, 300, dim, "q4_hadamard", "q4_hadamard", window=16, attention=Attention())
    cache.k = HadamardQ4Store(1, 2, 2, 300, dim, keys=True, tile=tile)
    cache.v = HadamardQ4Store(1, 2, 2, 300, dim, tile=tile)
    cache.store(0, torch.randn(2, 200, 2, dim, generator=g) + 0.5, torch.randn(2, 200, 2, dim, generator=g), 0)
    for pos in range(200, 204):
        q = torch.randn(2, 1, 2 * groups, dim, generator=g)
        recent = cache.store(0, torch.randn(2, 1, 2, dim, generator=g), torch.randn(2, 1, 2, dim, generator=g), pos)
        torch.testing.assert_close(decode(q, cache, 0, pos, recent, "attention_rotated"),
                                   attend_reference(q, cache, 0, pos, recent=recent), rtol=1e-5, atol=2e-5)


def test_a_row_gets_the_same_bits_alone_and_beside_others():
    """Each (sequence, head) is computed alone: the server's concurrent streams equal their solo runs."""
    g = torch.Generator().manual_seed(2)
    lens = [20, 90, 300]
    cache = _cache(3, 16, 64)
    _fill(cache, lens, g)
    pos = torch.tensor(lens)
    q = torch.randn(3, 1, HKV * G, D, generator=g)
    recent = cache.store(1, torch.randn(3, 1, HKV, D, generator=g), torch.randn(3, 1, HKV, D, generator=g), pos)
    together = decode(q, cache, 1, pos, recent, "attention_rotated")
    for b in range(3):  # the same row through a one-row view: its ring slots and limits as the batch had them
        one = cache.rows(b, b + 1)
        r = Recent(recent.k[b : b + 1], recent.v[b : b + 1], int(recent.lim[b]), recent.size,
                                   recent.masked[b : b + 1], recent.lim[b : b + 1], int(recent.lim[b]))
        assert torch.equal(decode(q[b : b + 1], one, 1, pos[b : b + 1], r, "attention_rotated"), together[b : b + 1])


def test_deep_stores_take_the_kernel_and_fa_off_the_reference(monkeypatch):
    """The kernel reads a store at any depth; -fa off is the reference."""
    g = torch.Generator().manual_seed(3)
    cache = _cache(1, 16, 64, n_ctx=1400)
    cache.store(0, torch.randn(1, 1300, HKV, D, generator=g), torch.randn(1, 1300, HKV, D, generator=g), 0)
    q = torch.randn(1, 1, HKV * G, D, generator=g)
    recent = cache.store(0, torch.randn(1, 1, HKV, D, generator=g), torch.randn(1, 1, HKV, D, generator=g), 1300)
    torch.testing.assert_close(decode(q, cache, 0, 1300, recent, "attention_rotated"),
                               attend_reference(q, cache, 0, 1300, recent=recent), rtol=1e-5, atol=2e-5)
    monkeypatch.setattr(hadamard_decode, "attend", lambda *a: pytest.fail("the kernel ran"))
    torch.testing.assert_close(Attention(flash=False)(q, cache, 0, 99), attend_reference(q, cache, 0, 99, flash=False))


@pytest.mark.parametrize("dim", [16, 32, 64, 128])
def test_the_rotations_are_fast_walsh_hadamard_transforms(dim):
    """The kernel rotates with H (x * R[0]) and back with R[0] * (H y), in place: R x and R^T y to f32 rounding."""
    R = hadamard.rotation(dim)
    x = torch.randn(dim, generator=torch.Generator().manual_seed(dim))
    there = (x * R[0]).numpy().copy()
    hadamard_decode._walsh_hadamard(there)
    torch.testing.assert_close(torch.from_numpy(there), R @ x, rtol=0, atol=1e-6)
    back = there.copy()
    hadamard_decode._walsh_hadamard(back)
    torch.testing.assert_close(torch.from_numpy(back * R[0].numpy()), x, rtol=0, atol=1e-5)
