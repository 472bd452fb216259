"""ggml block cache types (layer a): byte-exact against gguf-py, sizes, chunked loads, a tiny model.

Set KVCLI_LIBGGML=/path/to/libggml-base.so to also compare with ggml's C `quantize_row_*_ref`
(LIBGGML_HOW below says how to build it).
"""

from __future__ import annotations

import ctypes
import os

import gguf
import numpy as np
import pytest
import torch

from kvcli.cache import STORAGE_TYPES, KVCache, resolve_type
from kvcli.cache.ggml_blocks import GGML_BLOCKS, GROUP_MAX_EPS, KVALUES_IQ4NL

TYPES = list(GGML_BLOCKS)  # the ggml block types, compared with gguf-py and libggml
BITS = {"q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0, "q5_0": 5.5, "q5_1": 6.0, "iq4_nl": 4.5}  # llama.cpp's bpw
B, T, H, D = 2, 24, 3, 64  # 288 blocks of 32
LAYER, POS, N_CTX = 1, 7, 40
LIBGGML_HOW = ("KVCLI_LIBGGML is not set: set it to a built libggml-base.so to compare these bytes with ggml's C "
               "quantize_row_*_ref too (build it from a llama.cpp checkout: cmake -B build -DBUILD_SHARED_LIBS=ON && "
               "cmake --build build --target ggml-base; then KVCLI_LIBGGML=$PWD/build/bin/libggml-base.so)")


def adversarial_blocks(seed: int = 0) -> np.ndarray:
    """(B*T*H*D/32, 32) f32: random blocks of magnitudes 1e-4..1e4, then the adversarial ones."""
    rng = np.random.default_rng(seed)
    n = B * T * H * D // 32
    x = rng.standard_normal((n, 32)) * 10.0 ** rng.uniform(-4, 4, (n, 1))
    noise = rng.standard_normal(32) * 1e-3
    special = {
        "zeros": np.zeros(32),
        "negative zeros": np.full(32, -0.0),
        "one outlier": np.where(np.arange(32) == 5, 100.0, noise),
        "one negative outlier": np.where(np.arange(32) == 31, -100.0, noise),
        "negative max": -np.abs(rng.standard_normal(32)) * 3 + 1,
        "all equal": np.full(32, 0.37),
        "all equal negative": np.full(32, -2.5),
        "magnitude tie": np.where(np.arange(32) % 2 == 0, 1.5, -1.5),  # first of the ties wins
        "rounding ties": np.concatenate([[127.0, -127.0], np.arange(-15, 15) + 0.5]),  # q8_0 d = 1: x.5 exactly
        "q4 grid": np.concatenate([[-8.0], np.linspace(-7.5, 7.5, 31)]),  # q4_0 d = 1
        "huge": rng.standard_normal(32) * 1e7,  # fp16 scale overflows to inf (as in ggml)
        "fp16 edge": np.full(32, 65504.0 * 8),
        "tiny": rng.standard_normal(32) * 1e-30,
        "near iq4_nl eps": rng.standard_normal(32) * 1e-14,
        "below iq4_nl eps": rng.standard_normal(32) * 1e-16,
        "one nonzero": np.where(np.arange(32) == 17, -3e-3, 0.0),
    }
    for i, block in enumerate(special.values()):
        x[i * 3] = block  # spread out, so the specials sit in varied heads and positions
    return x.astype(np.float32)


def stored(name: str, x: np.ndarray):
    """Store x through the Store API at (LAYER, POS); return the store and its raw rows (B, H, T, bytes)."""
    store = resolve_type(name)(2, B, H, N_CTX, D)
    store.store(LAYER, torch.from_numpy(x.reshape(B, T, H, D)), POS)
    rows = store.data[LAYER, :, :, POS : POS + T].numpy()
    assert not store.data[0].any() and not store.data[LAYER, :, :, :POS].any()  # nothing else written
    assert not store.data[LAYER, :, :, POS + T :].any()
    return store, rows


def in_row_order(x: np.ndarray) -> np.ndarray:
    """Blocks laid out (B, T, H, D) -> the cache's row order (B, H, T, D)."""
    return np.ascontiguousarray(x.reshape(B, T, H, D).transpose(0, 2, 1, 3))


# ---- ggml's iq4_nl reference, ported (gguf-py cannot quantize iq4_nl) ----
# ggml-quants.c's loops over a block's elements stay loops here, so the f32 sums run in ggml's
# order; each step runs for all blocks at once (blocks are independent).

def best_index_int8(values: np.ndarray, x: np.ndarray) -> np.ndarray:
    """ggml-quants.c best_index_int8, elementwise: binary search, then the nearer neighbour (ties go up)."""
    ml, mu = np.zeros(x.shape, np.int64), np.full(x.shape, len(values) - 1)
    while (mu - ml > 1).any():  # converged entries stay put: x >= values[ml] keeps ml
        mav = (ml + mu) // 2
        below = x < values[mav]
        mu, ml = np.where(below, mav, mu), np.where(below, ml, mav)
    nearest = np.where(x - values[mu - 1] < values[mu] - x, mu - 1, mu)
    return np.where(x <= values[0], 0, np.where(x >= values[-1], len(values) - 1, nearest))


def quantize_iq4_nl_ref(x: np.ndarray) -> np.ndarray:
    """quantize_row_iq4_nl_ref (ntry = -1, no imatrix): (n, 32) f32 -> (n, 18) uint8.

    Blocks with max |x| < GROUP_MAX_EPS: ggml writes d = 0 and leaves the nibbles stale; zeros here."""
    f32, n = np.float32, len(x)
    values = np.array(KVALUES_IQ4NL, f32)
    amax, mx = np.zeros(n, f32), np.zeros(n, f32)
    for j in range(32):  # the first strictly larger |x| wins
        bigger = np.abs(x[:, j]) > amax
        amax, mx = np.where(bigger, np.abs(x[:, j]), amax), np.where(bigger, x[:, j], mx)
    live = amax >= f32(GROUP_MAX_EPS)
    inv = f32(1) / (mx / values[0])
    idx, sumqx, sumq2 = np.zeros((n, 32), np.int64), np.zeros(n, f32), np.zeros(n, f32)
    for j in range(32):
        v = x[:, j]
        idx[:, j] = best_index_int8(values, inv * v)
        w, q = v * v, values[idx[:, j]]
        sumqx = sumqx + w * q * v
        sumq2 = sumq2 + w * q * q
    d = np.where(live & (sumq2 > 0), sumqx / sumq2, f32(0))
    idx[~live] = 0
    qs = (idx[:, :16] | (idx[:, 16:] << 4)).astype(np.uint8)
    return np.concatenate([d.astype(np.float16).view(np.uint8).reshape(n, 2), qs], axis=1)


def reference_bytes(name: str, rows: np.ndarray) -> np.ndarray:
    """(..., D) f32 -> (..., D / 32 * bytes): gguf-py's quantizer, or the port above for iq4_nl."""
    if name == "iq4_nl":
        with np.errstate(all="ignore"):  # zero blocks divide by zero before being masked, as in ggml
            return quantize_iq4_nl_ref(rows.reshape(-1, 32)).reshape(*rows.shape[:-1], -1)
    return gguf.quants.quantize(rows, gguf.GGMLQuantizationType[name.upper()])


@pytest.mark.parametrize("name", TYPES)
def test_stored_bytes_and_loads_equal_gguf_py(name):
    x = adversarial_blocks()
    store, rows = stored(name, x)
    with np.errstate(all="ignore"):  # the huge blocks overflow the fp16 scale, as in ggml
        expected = reference_bytes(name, in_row_order(x))
        deq = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[name.upper()])
    assert rows.shape == expected.shape == (B, H, T, D // 32 * store.block_bytes)
    bad = np.argwhere((rows != expected).reshape(-1, store.block_bytes).any(-1))
    assert bad.size == 0, f"{len(bad)} blocks differ, first {bad[:4].ravel()}"
    np.testing.assert_array_equal(store.load(LAYER, POS, POS + T).numpy(), deq)  # NaN == NaN here


@pytest.mark.parametrize("name", TYPES)
def test_random_blocks_many_seeds(name):
    """Many random blocks straight through the block functions. For iq4_nl about 1 block in 8000
    gets another fp16 d if the sums run in another order than ggml's: 65536 blocks catch that."""
    cls = STORAGE_TYPES[name]
    rng = np.random.default_rng(1)
    n = 65536 if name == "iq4_nl" else 4096
    x = (rng.standard_normal((n, 32)) * 10.0 ** rng.uniform(-3, 3, (n, 1))).astype(np.float32)
    mine = cls.quantize_blocks(torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(mine, reference_bytes(name, x))
    deq = gguf.quants.dequantize(mine, gguf.GGMLQuantizationType[name.upper()])
    np.testing.assert_array_equal(cls.dequantize_blocks(torch.from_numpy(mine)).numpy(), deq)


@pytest.fixture(scope="module")
def libggml():
    """ggml's C library named by KVCLI_LIBGGML: skipped (saying how to build it) when unset, a
    clear failure when set but not loadable."""
    path = os.environ.get("KVCLI_LIBGGML")
    if not path:
        pytest.skip(LIBGGML_HOW)
    try:
        return ctypes.CDLL(path)
    except OSError as e:
        pytest.fail(f"KVCLI_LIBGGML={path} cannot be loaded ({e}); it should name a built libggml-base.so",
                    pytrace=False)


@pytest.mark.parametrize("name", TYPES)
def test_bytes_equal_libggml(name, libggml):
    lib = libggml
    cls = STORAGE_TYPES[name]
    x = adversarial_blocks(seed=2)
    out = np.zeros((len(x), cls.block_bytes), np.uint8)
    getattr(lib, f"quantize_row_{name}_ref")(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(out.ctypes.data),
                                              ctypes.c_int64(x.size))
    mine = cls.quantize_blocks(torch.from_numpy(x)).numpy()
    if name == "iq4_nl":  # ggml leaves the nibbles of near-zero blocks stale: compare their d only
        live = np.abs(x).max(-1) >= np.float32(GROUP_MAX_EPS)
        mine[~live, 2:] = out[~live, 2:]
    # All -0.0: ggml's max starts at +0.0, so d = 0 / -8 = -0.0; gguf-py (which we follow) takes
    # the element, -0.0, so d = +0.0. Both dequantize to zeros.
    minus_zero = (x == 0).all(-1) & np.signbit(x).all(-1)
    mine[minus_zero, :2] = out[minus_zero, :2]
    np.testing.assert_array_equal(mine, out)


def test_table_registry_and_sizes():
    for name in TYPES:
        cls = STORAGE_TYPES[name]
        assert resolve_type(name.upper()) is cls
        assert (cls.block_size, cls.block_bytes) == GGML_BLOCKS[name] == gguf.GGML_QUANT_SIZES[
            gguf.GGMLQuantizationType[name.upper()]]
        assert cls.bits_per_element() == BITS[name]
        layers, batch, kv_heads, n_ctx = 3, 2, 2, 100
        store = cls(layers, batch, kv_heads, n_ctx, D)
        assert store.nbytes() == layers * n_ctx * kv_heads * D * BITS[name] / 8 * batch
        assert store.nbytes() == cls.nbytes_for(layers, batch, kv_heads * D, n_ctx)  # the memory plan agrees
        assert KVCache.bytes_needed(layers, batch, kv_heads * D, n_ctx, name, "f16") == store.nbytes() + (
            layers * batch * kv_heads * D * n_ctx * 2)


@pytest.mark.parametrize("name", TYPES)
def test_chunked_load_equals_slices_of_full_load(name):
    store = resolve_type(name)(1, 2, 3, 48, 64)
    x = torch.randn(2, 40, 3, 64)
    store.store(0, x[:, :30], 0)  # a prefill, then decode steps of one token
    for t in range(30, 40):
        store.store(0, x[:, t : t + 1], t)
    full = store.load(0, 0, 40)
    assert full.shape == (2, 3, 40, 64) and full.dtype == torch.float32
    for a, b in [(0, 1), (0, 17), (5, 33), (29, 31), (39, 40), (12, 40)]:
        assert torch.equal(store.load(0, a, b), full[:, :, a:b])
    single = resolve_type(name)(1, 2, 3, 48, 64)
    single.store(0, x, 0)
    assert torch.equal(single.data, store.data)  # per-token writes equal one batched write


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from tests.tiny import make_hf_model, write_gguf

    model = make_hf_model(n_heads=4, n_kv_heads=2, hidden=128)  # head size 32: one block per head
    return write_gguf(model, tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def test_tiny_model_logits_close_to_f32_cache(tiny_gguf):
    from kvcli.llama import Llama

    ids = torch.randint(0, 200, (48,), generator=torch.Generator().manual_seed(0))

    def logits(k, v):
        return Llama(tiny_gguf, ctx_size=64, dtype="f32", cache_type_k=k, cache_type_v=v).logits(ids)

    base = logits("f32", "f32")
    err = {}
    for k, v in [("q8_0", "q8_0"), ("q8_0", "q4_0"), ("q4_0", "q4_0"), ("q4_1", "q5_0"), ("q5_1", "iq4_nl")]:
        out = logits(k, v)
        assert out.shape == base.shape and torch.isfinite(out).all()
        err[k, v] = ((out - base).norm() / base.norm()).item()
    assert err["q8_0", "q8_0"] < 0.01, err  # 0.005 on this model; the 4-bit ones about 0.07
    assert err["q8_0", "q8_0"] * 4 < min(err["q8_0", "q4_0"], err["q4_0", "q4_0"]), err
    assert max(err.values()) < 0.15, err
