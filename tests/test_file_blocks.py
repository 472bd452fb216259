"""Weights kept in the file's own ggml blocks (kvcli/weights.py FileBlocks, kvcli/kernels/cpu/ggml_rows.py): every type's
decoder against gguf-py's dequantization on adversarial blocks, every PRODUCT entry of the kind against
dequantize-then-matmul in f64 at decode and prompt row counts, the bits alone and in a batch and at any thread count,
the load as a view of the memory map, tiny models of each type gguf-py quantizes against --weights f32."""

import importlib

import gguf
import numpy as np
import pytest
import torch

from kvcli import kernel_table as table
from kvcli.gguf_file import open_gguf, read_tensor
from kvcli.kernel_table import PRODUCT, ROWS
from kvcli.llama import Llama
from kvcli.sampler import Sampler
from kvcli.shapes import weight_bytes
from kvcli.errors import KvcliError
from kvcli.model import FUSED
from kvcli.weights import DOT_TOL, _joined, F16_FIELDS, FILE_GEMV_ROWS, batch_dtype, FILE_BLOCKS, FileBlocks, FileTiles, _check_file_scales, load, resident_form, tiles_kernel_rows
from tests.test_weights import assert_products_near_f64, runnable
from tests.tiny import make_hf_model, write_gguf

ggml_rows = pytest.importorskip("kvcli.kernels.cpu.ggml_rows")
QUAD_TYPES = importlib.import_module("kvcli.kernels.cpu.vectors").QUAD_TYPES
TYPES = sorted(FILE_BLOCKS)
ROW_COUNTS = (1, 4, 8, 16, 17, 33, 512)  # the kernel's groups of 4, its last row count, the slabs' GEMM


def adversarial(ggml_type: str, N: int, K: int, seed: int = 0) -> np.ndarray:
    """(N, K / QK * bytes) uint8 blocks: random codes and sub-scales (every bit pattern), f16 scales from 6e-8
    (subnormal) to 1e3, negative and zero ones, and whole rows of all-zero and all-one code bytes."""
    QK, B = ggml_rows.TYPES[ggml_type]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (N, K // QK, B), dtype=np.uint8)
    raw[0], raw[1] = 255, 0
    for o in F16_FIELDS[ggml_type]:
        d = np.exp(rng.uniform(-16, 7, (N, K // QK))) * rng.choice([1, 1, -1], (N, K // QK))
        d[2, 0], d[3, -1] = 0, 6e-8
        raw[..., o : o + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(N, -1)


@pytest.mark.parametrize("ggml_type", TYPES)
def test_a_nan_or_inf_scale_is_refused_at_load(ggml_type):
    """Every f16 field of every block is checked, in the file's blocks and in FileTiles' (checked once made)."""
    raw = adversarial(ggml_type, 8, 512)
    tiles = importlib.import_module("kvcli.kernels.cpu.ggml_tiles") if ggml_type in tile_types() else None
    _check_file_scales("w", raw, ggml_type)  # finite (subnormal, zero, negative) scales pass
    if tiles:
        _check_file_scales("w", tiles.retile(ggml_type, raw), ggml_type, tiled=True)
    QK, B = ggml_rows.TYPES[ggml_type]
    for at in F16_FIELDS[ggml_type]:
        for bad in (np.inf, -np.inf, np.nan):
            for row in range(8):
                hostile = raw.copy().reshape(8, -1, B)
                hostile[row, -1, at : at + 2] = np.frombuffer(np.float16(bad).tobytes(), np.uint8)
                with pytest.raises(KvcliError, match="tensor w holds NaN/Inf block scales"):
                    _check_file_scales("w", hostile.reshape(8, -1), ggml_type)
                if tiles:
                    with pytest.raises(KvcliError, match="tensor w holds NaN/Inf block scales"):
                        _check_file_scales("w", tiles.retile(ggml_type, hostile.reshape(8, -1)), ggml_type, tiled=True)


def test_block_tables_are_ggmls():
    assert sorted(ggml_rows.KINDS) == TYPES
    for t in TYPES:
        assert ggml_rows.TYPES[t] == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t]], t


@pytest.mark.parametrize("ggml_type", TYPES)
def test_decoders_equal_gguf_py(ggml_type):
    """Each type's decoder (its LLVM-vector form where it has one) gives gguf-py's values bit for bit, whole and
    for rows picked out of order (the embedding's)."""
    QK, _ = ggml_rows.TYPES[ggml_type]
    N, K = 6, 3 * max(QK, 64)
    raw = adversarial(ggml_type, N, K)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[ggml_type])
    got = ggml_rows.dequantize(ggml_type, raw, 0, N, np.empty((N, K), np.float32))
    np.testing.assert_array_equal(got, want)
    ids = np.array([4, 0, 4, 2], np.int64)
    np.testing.assert_array_equal(ggml_rows.dequantize_ids(ggml_type, raw, ids, np.empty((4, K), np.float32)),
                                  want[ids])


def product_params() -> list:
    return [pytest.param(e, id=f"{e.isa}-{min(e.keys)}") for e in table.entries(PRODUCT)
            if e.keys & {"ggml", "ggml_tiles"} and e.device == "cpu"] + [pytest.param(table.reference(PRODUCT), id="reference")]


def tile_types() -> list:
    return list(importlib.import_module("kvcli.kernels.cpu.vectors").TILE_TYPES)


@pytest.mark.parametrize("entry", product_params())
@pytest.mark.parametrize("ggml_type", TYPES)
def test_each_product_entry_equals_dequantized_f64(ggml_type, entry):
    """x W.T against W = gguf-py's values times x in f64 at every path's row counts, x with a zero block and columns
    of different scales: f32 arithmetic, so within 2^-18 of sum |x| |w| per output."""
    runnable(entry)
    tiled = "ggml_tiles" in entry.keys
    if not entry.covers(ggml_type=ggml_type) or tiled and ggml_type not in tile_types():
        pytest.skip(f"{entry.name}: not for {ggml_type}")
    QK, _ = ggml_rows.TYPES[ggml_type]
    N, K = 37, 2 * max(QK, 128)
    form = FileBlocks(adversarial(ggml_type, N, K, seed=1), ggml_type, K)
    if tiled:  # whole tiles of 8 rows
        form = FileTiles.of(adversarial(ggml_type, 40, K, seed=1), ggml_type, K)
    w = torch.from_numpy(gguf.quants.dequantize(form.raw, gguf.GGMLQuantizationType[ggml_type])).double()
    assert_products_near_f64(entry, form, w, ROW_COUNTS, lambda x, w: product_bound(entry, x, w, ggml_type))


def product_bound(entry, x: torch.Tensor, w: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """f32 arithmetic: 2^-18 of sum |x| |w| per output; a batch's bf16 GEMM (batch_dtype: x and W rounded to bf16,
    2^-9 each, and the output, 2^-9) 2^-7; the byte-product kernels' 15-bit x (Entry.tol DOT_TOL) adds, per 32-column
    block, its largest |x| / 64770 (half a step of 32385) times the block's sum of |w|; the tiles' 8-bit x of the
    K-quants (ggml_tiles.QUAD_TYPES) its largest |x| / 254 (half a step of 127)."""
    xa = x.double().abs()
    rows = x.reshape(-1, x.shape[-1]).shape[0]
    on_codes = tiles_kernel_rows(ggml_type) if "ggml_tiles" in entry.keys else FILE_GEMV_ROWS  # more: slabs + GEMM
    bf16 = entry is not table.reference(PRODUCT) and rows > on_codes and batch_dtype() == torch.bfloat16
    bound = (2.0**-7 if bf16 else 2.0**-18) * (xa @ w.abs().T) + 1e-30
    if entry.tol == DOT_TOL:
        bmax = xa.unflatten(-1, (-1, 32)).amax(-1, keepdim=True).expand(*xa.shape[:-1], -1, 32).flatten(-2)
        steps = 254 if "ggml_tiles" in entry.keys and ggml_type in QUAD_TYPES else 64770
        bound = bound + (bmax / steps) @ w.abs().T
    return bound


def decode_kernels() -> list:
    """The decode kernels this machine runs: the f32 slabs, and the byte products where the CPU has AVX2."""
    avx2 = [] if table.has(table.AVX2) else [pytest.mark.skip(reason="needs AVX2")]
    return [pytest.param("ggml_rows", id="ggml_rows")] + [pytest.param(k, marks=avx2, id=k) for k in ("ggml_dot", "ggml_tiles")]


@pytest.mark.parametrize("kernel", decode_kernels())
@pytest.mark.parametrize("ggml_type", ["Q4_1", "Q5_0", "Q4_K", "Q6_K", "IQ4_XS"])
def test_a_rows_bits_do_not_depend_on_its_batch_or_threads(ggml_type, kernel):
    """A row's product alone equals the same row beside 3 others and in a batch of 41 (the tiles' blocked batch, its
    last row in a group of one) and at -t 1 and -t 2, bit for bit (the server's slots, and a sequence's answer at any
    thread count)."""
    module = importlib.import_module(f"kvcli.kernels.cpu.{kernel}")
    if ggml_type not in getattr(module, {"ggml_dot": "DOT_TYPES", "ggml_tiles": "TILE_TYPES"}.get(kernel, "KINDS")):
        pytest.skip(f"{kernel} does not take {ggml_type}")
    QK, _ = ggml_rows.TYPES[ggml_type]
    K = 2 * max(QK, 128)
    raw = adversarial(ggml_type, 208, K, seed=2)
    if kernel == "ggml_tiles":
        raw = module.retile(ggml_type, raw)
    x = np.random.default_rng(3).standard_normal((41, K)).astype(np.float32)
    before = torch.get_num_threads()
    try:
        firsts, lasts = [], []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            batch = module.matmul(ggml_type, raw, x)
            firsts += [module.matmul(ggml_type, raw, x[:1].copy())[0], module.matmul(ggml_type, raw, x[:4].copy())[0],
                       batch[0]]
            lasts += [module.matmul(ggml_type, raw, x[40:].copy())[0], batch[40]]
    finally:
        torch.set_num_threads(before)
    for outs in (firsts, lasts):
        for o in outs[1:]:
            np.testing.assert_array_equal(o, outs[0])


_AVX2_PRODUCTS = """
import sys, numpy as np
from kvcli.kernels.cpu import ggml_tiles
from tests.test_file_blocks import adversarial
for t in sys.argv[1:]:
    raw = adversarial(t, 24, 512, seed=4)
    x = np.random.default_rng(5).standard_normal((5, 512)).astype(np.float32)
    sys.stdout.buffer.write(ggml_tiles.matmul(t, ggml_tiles.retile(t, raw), x).tobytes())
"""


def test_the_k_quants_tiles_give_the_same_bits_on_avx2_and_vnni():
    """The K-quants' tiles compiled for VNNI (vpdpbusd / vpdpwssd) and for AVX2 (vpmaddubsw, vpmaddwd) sum the same
    integers exactly: the same bits. The AVX2 code runs in a process under KVCLI_ISA=avx2 (numba compiling for
    haswell), so a VNNI machine's CI runs both."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    vectors = importlib.import_module("kvcli.kernels.cpu.vectors")
    if "Q4_K" not in tile_types() or not vectors.target_has("avx512vnni"):
        pytest.skip("the tiles' VNNI code is not compiled here (an AVX2 machine runs only the AVX2 code)")
    tiles = importlib.import_module("kvcli.kernels.cpu.ggml_tiles")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU")}
    env.update(KVCLI_ISA="avx2", ATEN_CPU_CAPABILITY="avx2", PYTHONPATH=str(root))
    types_ = list(vectors.QUAD_TYPES)
    out = subprocess.run([sys.executable, "-c", _AVX2_PRODUCTS, *types_], env=env, cwd=root, capture_output=True,
                         check=True).stdout
    avx2 = np.frombuffer(out, np.float32).reshape(len(types_), 5, 24)
    for i, t in enumerate(types_):
        raw = adversarial(t, 24, 512, seed=4)
        x = np.random.default_rng(5).standard_normal((5, 512)).astype(np.float32)
        np.testing.assert_array_equal(tiles.matmul(t, tiles.retile(t, raw), x), avx2[i], err_msg=t)


def iq4_nl_quantize(w: np.ndarray) -> np.ndarray:
    """A plain IQ4_NL quantizer (gguf-py has none): each block of 32 scaled by its largest |w| / 127 onto the
    codebook, each element its nearest entry -> (N, K / 32 * 18) bytes: f16 d, then 16 bytes of nibble pairs."""
    N, K = w.shape
    x = w.reshape(N, K // 32, 32).astype(np.float32)
    d = (np.abs(x).max(-1) / 127).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):
        u = np.nan_to_num(x / d.astype(np.float32)[..., None])
    q = np.abs(u[..., None] - ggml_rows.IQ4_VALUES).argmin(-1).astype(np.uint8)  # (N, K / 32, 32)
    qs = q[..., :16] | q[..., 16:] << 4
    return np.concatenate([d[..., None].view(np.uint8), qs], -1).reshape(N, -1)


def _model(tmp_path, qtype: str, tied: bool = False):
    """A tiny model with every matrix quantized to qtype by gguf-py (IQ4_NL, which it cannot quantize: by
    iq4_nl_quantize); norms stay f32."""
    model = make_hf_model(n_layers=2, hidden=64, tied=tied, seed=3)
    path = write_gguf(model, tmp_path / "f32.gguf")
    g = open_gguf(path)
    q = gguf.GGMLQuantizationType[qtype]
    quantize = iq4_nl_quantize if qtype == "IQ4_NL" else (lambda w: gguf.quants.quantize(w, q))
    raw = {n: (quantize(read_tensor(g, n)), q) for n, t in g.tensors.items() if len(t.shape) == 2}
    return write_gguf(model, tmp_path / f"{qtype}.gguf", raw=raw)


def test_load_keeps_the_files_bytes_in_place(tmp_path):
    """A Q5_0 matrix loads as a read-only view of the file's memory map: its bytes, no copy, nothing decoded."""
    g = open_gguf(_model(tmp_path, "Q5_0"))
    t = g.tensors["blk.0.ffn_down.weight"]
    form = load(t, "q5_0")
    assert isinstance(form, FileBlocks) and form.name == "q5_0"
    assert form.nbytes == t.n_bytes and np.shares_memory(form.raw, np.asarray(t.data))
    assert not form.raw.flags.writeable
    np.testing.assert_array_equal(form.dequantize().numpy(), read_tensor(g, "blk.0.ffn_down.weight"))


def test_a_fused_products_tiles_load_into_one_buffer(tmp_path):
    """A layer's q, k, v (and gate, up) of one FileTiles type are regrouped straight into one buffer
    (weights.joined_buffers): the fused product's tiles are a view of it, no second copy, holding the file's rows of
    the parts in order."""
    if "Q5_0" not in tile_types():
        pytest.skip("ggml_tiles does not run here")
    path = _model(tmp_path, "Q5_0")
    g, llm = open_gguf(path), Llama(path, ctx_size=32)
    for i, block in enumerate(llm.model.blocks):
        for form, names in ((block.wqkv, FUSED[0]), (block.w_gate_up, FUSED[1])):
            parts = [g.tensors[f"blk.{i}.{n}"] for n in names]
            blocks = [np.asarray(t.data).reshape(int(np.prod(t.shape[1:])), -1) for t in parts]
            assert isinstance(form, FileTiles) and not form.tiles.flags.owndata
            np.testing.assert_array_equal(form.raw, np.concatenate(blocks))


def test_arrays_lying_one_after_another_join_as_a_view():
    """_joined: slices of one buffer in order join as a view of it; apart, out of order or from the file's map
    (np.memmap), as a copy; the values are the concatenation either way."""
    flat = np.arange(60, dtype=np.uint8)
    a, b, c = flat[:12].reshape(3, 4), flat[12:20].reshape(2, 4), flat[20:60].reshape(10, 4)
    for parts, view in (([a, b, c], True), ([a, c], False), ([b, a], False), ([a.copy(), b], False)):
        out = _joined(parts)
        np.testing.assert_array_equal(out, np.concatenate(parts))
        assert np.shares_memory(out, flat) == view


@pytest.mark.parametrize("ggml_type", TYPES)
def test_tiles_hold_the_files_bytes(ggml_type):
    """FileTiles (8 rows' blocks regrouped, ggml_tiles.retile) hold the file's bytes, each exactly once: put back,
    whole or any run of rows, they are the file's; its bytes are the file's count; its embedding rows and slabs
    equal FileBlocks'."""
    if ggml_type not in tile_types():
        pytest.skip(f"ggml_tiles does not take {ggml_type}")
    K = 2 * max(ggml_rows.TYPES[ggml_type][0], 128)
    raw = adversarial(ggml_type, 48, K, seed=5)
    form = FileTiles.of(raw, ggml_type, K)
    blocks = FileBlocks(raw, ggml_type, K)
    assert form.shape == (48, K) and form.nbytes == raw.nbytes and not form.tiles.flags.writeable
    np.testing.assert_array_equal(form.raw, raw)
    for start, stop in ((0, 48), (3, 5), (8, 16), (13, 41), (47, 48)):
        np.testing.assert_array_equal(form.file_rows(start, stop), raw[start:stop])
    ids = torch.tensor([[47, 0], [9, 9]])
    assert torch.equal(form.rows(ids), blocks.rows(ids))
    assert torch.equal(form.slab_t(5, 30), blocks.slab_t(5, 30))
    from kvcli.weights import _tiles_slab  # a batch's slab: whole tiles decoded in one pass (f32, bf16), others apart

    for start, stop in ((8, 40), (0, 48), (3, 29)):
        want = blocks.slab_t(start, stop)
        assert torch.equal(_tiles_slab(form, start, stop), want)
        assert torch.equal(_tiles_slab(form, start, stop, torch.bfloat16), want.bfloat16())


def test_a_tiles_units_lie_in_the_order_its_kernel_reads_them():
    """vectors.tile_order: each type's pieces hold every 16-bit unit of its block once; a Q6_K tile block starts with
    its 8 rows' d (the kernel's first read, the block's last bytes in the file), then the first 128's scales, then
    ql's two runs and qh's for the first 4 columns, each row's 4 bytes together (8 rows' 4 columns: one vector), so
    that the kernel reads a tile front to back (from DRAM, twice the rate of the file's order)."""
    if "Q6_K" not in tile_types():
        pytest.skip("no ggml_tiles here")
    vectors = importlib.import_module("kvcli.kernels.cpu.vectors")
    tiles = importlib.import_module("kvcli.kernels.cpu.ggml_tiles")
    for t in tile_types():
        units = [u for piece in vectors.tile_order(t) for u in piece]
        assert sorted(units) == list(range(ggml_rows.TYPES[t][1] // 2)), t
    raw = adversarial("Q6_K", 8, 512, seed=3)
    block = raw.reshape(8, 2, 210)[:, 0]  # the 8 rows' first blocks
    tile = tiles.retile("Q6_K", raw)[0, : 8 * 210]  # the tile's first block
    at = 0
    for lo, width in ((208, 2), (192, 2), (194, 2), (196, 2), (198, 2), (0, 4), (32, 4), (128, 4)):  # d; scales 0-7;
        # ql 0-3, ql 32-35, qh 0-3
        np.testing.assert_array_equal(tile[at : at + 8 * width].reshape(8, width), block[:, lo : lo + width])
        at += 8 * width


@pytest.mark.parametrize("qtype", ["Q5_0", "Q5_1", "IQ4_NL", "Q8_0"])
@pytest.mark.parametrize("tied", [True, False])
def test_tiny_model_in_file_blocks_equals_f32_weights(tmp_path, qtype, tied):
    """Greedy tokens and logits of a tiny model of each 32-element type no packed form takes (Q8_0 where the int8-dot
    kernel does not run) with native weights equal --weights f32's: the same values, f32 products (a batch's bf16
    GEMM where the CPU has one, batch_dtype: logits within 1e-2); the plan counts the resident bytes, the file's.
    (The 256-element types: tests/test_kquant_fixtures.py's llama-quantize files.)"""
    if resident_form(qtype, "native", "f32", "cpu").removesuffix("x8") != qtype.lower():
        pytest.skip(f"{qtype} is kept as {resident_form(qtype, 'native', 'f32', 'cpu')} here (tests/test_weights.py)")
    path = _model(tmp_path, qtype, tied)
    native = Llama(path, ctx_size=64, dtype="f32", cache_type_k="f32", cache_type_v="f32")
    exact = Llama(path, ctx_size=64, dtype="f32", cache_type_k="f32", cache_type_v="f32", weights="f32")
    assert {f.kind for f in native.model.forms().values()} <= {"ggml", "ggml_tiles"}
    ids = list(range(5, 45))  # one prompt batch (the slabs' GEMM) then decode's rows
    tol = 1e-4 if batch_dtype() == torch.float32 else 1e-2
    torch.testing.assert_close(native.logits(ids), exact.logits(ids), rtol=tol, atol=tol)
    prompt = [7, 100, 33]
    ga = list(native.generate(prompt, n_predict=12, sampler=Sampler(temp=0), stop_at_eog=False))
    gb = list(exact.generate(prompt, n_predict=12, sampler=Sampler(temp=0), stop_at_eog=False))
    assert ga == gb
    types = {n: t.tensor_type.name for n, t in native.gguf.tensors.items()}
    assert weight_bytes(native.config, "f32", not tied, "native", types) == native.model.weight_bytes()
    file_bytes = sum(t.n_bytes for t in native.gguf.tensors.values() if len(t.shape) == 2)
    assert native.model.weight_bytes() - sum(b.nbytes for b in native.model.buffers() if b is not native.model.rot) \
        == file_bytes


def test_the_slab_entry_equals_the_reference():
    """ROWS for FileBlocks: the kernel's f32 slab of W.T equals gguf-py's, from a middle row on too."""
    form = FileBlocks(adversarial("Q6_K", 20, 512, seed=4), "Q6_K", 512)
    entry = table.choose(ROWS, "cpu", "ggml", dtype=torch.float32)
    runnable(entry)
    ref = table.reference(ROWS)
    assert torch.equal(entry.run(form, 3, 17, torch.float32).clone(), ref.run(form, 3, 17, torch.float32))
