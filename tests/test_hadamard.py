"""q4_hadamard: rotation, scale search, sinks, offsets, byte count, and attention in the rotated space."""

import pytest
import torch

from kvcli import kernel_table as table
from kvcli.cache import KVCache, hadamard, resolve_type
from kvcli.kernels.cpu import quantize as hadamard_quantize
from kvcli.cache.ggml_blocks import Q4_0Store
from kvcli.cache.hadamard import N_SINK, HadamardQ4Store, quantize_q4_mse, rotation
from kvcli.llama import Llama
from kvcli.attention import Attention
from tiny import make_hf_model, write_gguf


def test_rotation_is_orthogonal():
    for d in (32, 64, 128):
        r = rotation(d)
        assert torch.allclose(r @ r.T, torch.eye(d), atol=1e-5)


def test_mse_scale_never_worse_than_ggml_q4_0():
    x = torch.randn(4096, 32) * torch.rand(4096, 1) * 10
    d, u = quantize_q4_mse(x)
    assert d.shape == (4096, 1) and u.dtype == torch.uint8 and int(u.max()) <= 15
    assert torch.equal(d, d.bfloat16().float())  # the scale is a bf16 value
    ours = d * (u.float() - 8)
    ggml = Q4_0Store.dequantize_blocks(Q4_0Store.quantize_blocks(x))
    err_ours, err_ggml = ((x - ours) ** 2).sum(-1), ((x - ggml) ** 2).sum(-1)
    assert (err_ours <= err_ggml * 1.01 + 1e-6).all()  # 1%: the refit scale is rounded to bf16, ggml's to fp16
    assert err_ours.mean() < 0.9 * err_ggml.mean()


@pytest.mark.skipif(not hadamard_quantize.available(), reason="numba is not installed")
def test_compiled_scale_search_matches_torch():
    """The CPU's compiled search (the store's path) against quantize_vectors' torch ops: the same codes and scales,
    bar blocks where an f32 sum, ordered differently, rounds across a bf16 boundary (then the squared error
    matches); blocks of zeros, ties of magnitude, tiny and huge scales included; a block alone gets its bits."""
    g = torch.Generator().manual_seed(0)
    y = torch.randn(16, 17, 3, 64, generator=g) * torch.rand(16, 17, 3, 64, generator=g) ** 3 * 5
    y[0, 0, 0, :32] = 0
    y[0, 1, 0, :32] = torch.tensor([1.0, -1.0] * 16)  # the largest magnitude tied: the first is m
    y[1] *= 1e-30
    y[2] *= 1e20
    u, d = hadamard_quantize.quantize(y, HadamardQ4Store.scale_grid_f32)
    u_ref, d_ref = hadamard.quantize_vectors(y)
    assert u.shape == u_ref.shape and d.shape == d_ref.shape and u.dtype == torch.uint8
    differ = (u != u_ref).view(-1, 32).any(-1) | (d != d_ref).view(-1)
    assert int(differ.sum()) <= differ.numel() // 1000
    err = ((y.view(-1, 32) - d.view(-1, 1) * (u.view(-1, 32).float() - 8)) ** 2).sum(-1)
    err_ref = ((y.view(-1, 32) - d_ref.view(-1, 1) * (u_ref.view(-1, 32).float() - 8)) ** 2).sum(-1)
    assert torch.allclose(err, err_ref, rtol=1e-5, atol=0)
    one = hadamard_quantize.quantize(y[3:4, 5:6], HadamardQ4Store.scale_grid_f32)
    assert torch.equal(one[0], u[3:4, 5:6]) and torch.equal(one[1], d[3:4, 5:6])


@pytest.mark.parametrize("tile", [32, 64])  # the bytes do not depend on the CPU's tile width
@pytest.mark.parametrize("keys", [True, False])
def test_bytes_counted_and_planned(keys, tile):
    L, B, H, n, D = 3, 2, 4, 100, 64
    store = resolve_type("q4_hadamard")(L, B, H, n, D, keys=keys, tile=tile)
    n_pad = 128  # padded to a multiple of 64 positions
    assert store.nbytes() == L * B * H * (n_pad * D // 32 * 18 + N_SINK * D * 2 + D * 4)
    assert store.nbytes() == type(store).nbytes_for(L, B, H * D, n)
    assert store.bits_per_element() == 4.5
    assert resolve_type("q4").name == "q4_hadamard" and resolve_type("q8").name == "q8_0"


@pytest.mark.parametrize("tile", [32, 64])
@pytest.mark.parametrize("keys", [True, False])  # position tiles (keys) or element tiles (values)
def test_round_trip_in_rotated_space_sinks_exactish(keys, tile):
    torch.manual_seed(0)
    store = resolve_type("q4_hadamard")(1, 1, 2, 140, 64, keys=keys, tile=tile)
    x = torch.randn(1, 140, 2, 64) + 3.0  # an offset the store should take out
    store.store(0, x[:, :10], 0)
    for pos in range(10, 70):  # one position at a time (decode), across a tile boundary
        store.store(0, x[:, pos : pos + 1], pos)
    store.store(0, x[:, 70:], 70)
    back = store.from_storage(store.load(0, 0, 140)).transpose(1, 2)  # (1, 140, 2, 64)
    torch.testing.assert_close(store.from_storage(store.load(0, 33, 97)).transpose(1, 2), back[:, 33:97])
    assert torch.allclose(back[:, :N_SINK], x[:, :N_SINK], atol=1e-2)  # sinks: f16
    rel = (back - x).norm() / x.norm()
    assert rel < 0.05, rel


def test_flash_on_off_and_chunked_equal(monkeypatch, tmp_path):
    import kvcli.attention

    hf = make_hf_model(n_heads=4, n_kv_heads=2, hidden=128)
    path = write_gguf(hf, tmp_path / "t.gguf")
    ids = list(range(3, 60))
    outs = []
    for flash in (True, False):
        llm = Llama(path, ctx_size=64, dtype="f32", cache_type_k="q4_hadamard", cache_type_v="q4_0", flash_attn=flash)
        outs.append(llm.logits(ids))
    monkeypatch.setattr(kvcli.attention, "MIN_CHUNK", 8)
    monkeypatch.setattr(kvcli.attention, "CHUNK_BYTES", 1)
    for flash in (True, False):
        llm = Llama(path, ctx_size=64, dtype="f32", cache_type_k="q4_hadamard", cache_type_v="q4_0", flash_attn=flash)
        outs.append(llm.logits(ids))
    for o in outs[1:]:
        assert (o - outs[0]).abs().max() < 1e-4


def test_hadamard_closer_than_plain_q4_0(tmp_path):
    hf = make_hf_model(n_heads=4, n_kv_heads=2, hidden=128, seed=3)
    path = write_gguf(hf, tmp_path / "t.gguf")
    ids = list(range(3, 60))
    ref = Llama(path, ctx_size=64, dtype="f32", cache_type_k="f32", cache_type_v="f32").logits(ids)
    err = {}
    for t in ("q4_0", "q4_hadamard", "q8_0"):
        got = Llama(path, ctx_size=64, dtype="f32", cache_type_k=t, cache_type_v=t).logits(ids)
        err[t] = (got - ref).abs().mean().item()
    assert err["q8_0"] < err["q4_hadamard"] < err["q4_0"], err


def test_kv_cache_describe_counts_all_bytes():
    cache = KVCache(2, 1, 3, 128, 64, "q4_hadamard", "q8_0", attention=Attention())
    assert cache.nbytes() == KVCache.bytes_needed(2, 1, 3 * 64, 128, "q4_hadamard", "q8_0")
    assert "K (q4_hadamard)" in cache.describe() and "V (q8_0)" in cache.describe()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])
@pytest.mark.parametrize("tile", [32, 64])
@pytest.mark.parametrize("keys", [True, False])
def test_tile_layout_bytes(monkeypatch, keys, tile, compiled):
    """The documented byte of a code: keys (n_pad / T, D, T / 2), values (D / W, n_pad, W / 2), written by the
    compiled pass (kvcli/kernels/cpu/quantize.py put_vectors) and by torch's ops (elsewhere than the CPU)."""
    if compiled and not hadamard_quantize.available():
        pytest.skip("numba is not installed")
    D, n = 128, 100
    store = resolve_type("q4_hadamard")(1, 1, 1, n, D, keys=keys, tile=tile)
    store.writer = compiled_writer(store) if compiled else None
    u = torch.randint(0, 16, (1, n, 1, D), dtype=torch.uint8, generator=torch.Generator().manual_seed(tile))
    store.put(0, u[:, :70], torch.ones(1, 70, 1, D // 32), 0)
    for t in range(70, n):  # decode writes share bytes with earlier positions
        store.put(0, u[:, t : t + 1], torch.ones(1, 1, 1, D // 32), t)
    data = store.data[0, 0, 0]
    half, W = tile // 2, min(tile, D)
    for t, e in [(0, 0), (5, 77), (tile // 2 + 1, 3), (tile + 2, 127), (99, 64)]:
        if keys:
            byte, high = data[t // tile, e, t % half], t % tile >= half
        else:
            byte, high = data[e // W, t, e % (W // 2)], e % W >= W // 2
        assert int(byte >> 4 if high else byte & 15) == int(u[0, t, 0, e]), (t, e)
    assert torch.equal(store.codes(0, 0, n)[0, 0], u[0, :, 0])


def compiled_writer(store):
    """The compiled layout write (the kernel table's CPU WRITE entry for the store's kind), bound or not."""
    entry = table.choose(table.WRITE, "cpu", store.kernel_layout().kind)
    assert entry.run is not None, "no compiled write on this machine"
    return entry.run


def test_a_compiled_write_outside_the_store_raises():
    """The compiled pass has no bounds checks of its own: a position past the store is an IndexError, as torch's."""
    if not hadamard_quantize.available():
        pytest.skip("numba is not installed")
    store = resolve_type("q4_hadamard")(1, 1, 1, 64, 64, keys=True)
    store.writer = compiled_writer(store)
    with pytest.raises(IndexError):
        store.put(0, torch.zeros(1, 1, 1, 64, dtype=torch.uint8), torch.ones(1, 1, 1, 2), store.n_pad)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])
@pytest.mark.parametrize("window", [0, 16])
def test_rows_store_a_step_as_each_alone(monkeypatch, window, compiled):
    """The server's slots: a step's decode tokens at their own positions (one pass where every row writes one
    token past the sinks, and for the window's flushes that fall in one step where the compiled writes run;
    row by row otherwise: young rows) leave the bytes each row's own writes leave."""
    if compiled and not hadamard_quantize.available():
        pytest.skip("numba is not installed")
    H, D, lens = 3, 64, [2, 40, 57, 100]  # row 0 still in its sinks for the first steps
    caches = [KVCache(2, 4, H, 300, D, "q4_hadamard", "q4_hadamard", window=window, attention=Attention()) for _ in range(2)]
    for c in caches:
        c.k.writer, c.v.writer = (compiled_writer(c.k), compiled_writer(c.v)) if compiled else (None, None)
        g = torch.Generator().manual_seed(1)
        for r, n in enumerate(lens):
            c.rows(r, r + 1).store(1, torch.randn(1, n, H, D, generator=g), torch.randn(1, n, H, D, generator=g), 0)
    g = torch.Generator().manual_seed(0)
    for step in range(40):
        k, v = torch.randn(4, 1, H, D, generator=g), torch.randn(4, 1, H, D, generator=g)
        pos = torch.tensor([n + step for n in lens])
        caches[0].rows(0, 4).store(1, k, v, pos)
        for r in range(4):
            caches[1].rows(r, r + 1).store(1, k[r : r + 1], v[r : r + 1], int(pos[r]))
    for s in ("k", "v"):
        for name in HadamardQ4Store.batched:
            assert torch.equal(getattr(getattr(caches[0], s), name), getattr(getattr(caches[1], s), name)), (s, name)
