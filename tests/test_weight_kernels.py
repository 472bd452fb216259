"""The CUDA resident forms (kvcli.weights.Blocks) and their Triton decode kernel (kvcli/kernels/gpu/weights.py).

(a) The form, built on CPU as the loader builds it before .to("cuda"): a tiny model's Q4_0 / Q4_1 /
Q8_0 / Q4_K tensors dequantize to gguf-py's values, its bytes are the plan's, cat and narrow keep
the rows. (b) The kernel, and the table's PRODUCT entries of Blocks (the CUDA entry, the reference), under
TRITON_INTERPRET=1 on CPU tensors against the form's dequantize() then a matmul: same values, f32 summation order
only; for a whole model, the CUDA entry registered for CPU tensors too (`blocks_entry_on_cpu`). (c) A synthetic
--shape model's native weights.
"""

import dataclasses
import importlib.util
import os
import warnings

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels then run on CPU tensors

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import kvcli.weights as weights  # noqa: E402
from kvcli import kernel_table as table  # noqa: E402
from kvcli.kernel_table import PRODUCT  # noqa: E402
from kvcli.kernels.cpu.int4_tiles import tile_width  # noqa: E402
from kvcli.errors import KvcliError  # noqa: E402
from kvcli.gguf_file import open_gguf, read_tensor  # noqa: E402
from kvcli.llama import Llama  # noqa: E402
from kvcli.shapes import synthetic_types, weight_bytes  # noqa: E402
from kvcli.weights import Blocks, cat, load, random_int4, resident_bytes, resident_form  # noqa: E402
from tests.test_weights import _quantized_model, adversarial_q4_k, product_bound, product_params, q4_k_bytes  # noqa: E402

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="triton is not installed (pip install triton); the kernel needs it")
Q = gguf.GGMLQuantizationType
F16 = 2.0**-11  # f16 rounding: |x - f16(x)| <= 2^-11 |x| (normal range)


CUDA_ENTRY = next(e for e in table.entries(PRODUCT) if e.device == "cuda" and "int4_cuda" in e.keys)


@pytest.fixture
def blocks_entry_on_cpu():
    """Blocks' CUDA entry registered for CPU tensors as well (the interpreter stands for CUDA): forms made from here
    on choose it; taken out again after the test."""
    entry = table.register(dataclasses.replace(CUDA_ENTRY, device="cpu"))
    try:
        yield entry
    finally:
        table.unregister(entry)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():  # numpy warns on masked-out lanes the interpreter still computes
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _form(t) -> Blocks:
    return load(t, resident_form(t.tensor_type.name, "native", "f32", "cuda"))


# ---- (a) the form, on CPU ----

@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_blocks_equal_gguf_py(tmp_path, qtype):
    """Q4_0, Q4_1 and Q8_0 keep their f16 scales (and Q4_1's min) as they are: dequantize() equals
    gguf-py's values exactly, rows(ids) its rows, and the bytes are resident_bytes'."""
    g = open_gguf(_quantized_model(tmp_path, qtype, tied=False))
    for name in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight", "token_embd.weight", "output.weight"):
        form = _form(g.tensors[name])
        ref = torch.from_numpy(read_tensor(g, name))
        assert isinstance(form, Blocks) and form.shape == ref.shape
        assert torch.equal(form.dequantize(), ref), name
        ids = torch.tensor([[3, 0], [ref.shape[0] - 1, 3]])
        assert torch.equal(form.rows(ids), ref[ids])
        assert form.nbytes == resident_bytes(form.name, *ref.shape)
        assert form.name == ("int8_cuda" if qtype == Q.Q8_0 else "int4_cuda")


def _q4_k_file(tmp_path, d, dmin, sc, m, codes):
    w = gguf.GGUFWriter(str(tmp_path / "q4_k.gguf"), "llama")
    w.add_tensor("w", q4_k_bytes(d, dmin, sc, m, codes), raw_dtype=Q.Q4_K)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return gguf.GGUFReader(tmp_path / "q4_k.gguf").tensors[0]


def test_q4_k_blocks_within_f16_rounding(tmp_path):
    """Q4_K's scale d sc and min dmin m are rounded to f16 once each: within 2^-11 of each term."""
    N, K = 40, 512
    d, dmin, sc, m, codes = adversarial_q4_k(N, K)
    d, dmin = (np.clip(v, -60, 60).astype(np.float16) for v in (d, dmin))  # d sc, dmin m within f16
    t = _q4_k_file(tmp_path, d, dmin, sc, m, codes)
    form = _form(t)
    ref = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(N, K))
    s = (d.astype(np.float64)[..., None] * sc).reshape(N, -1, 1)
    mn = (dmin.astype(np.float64)[..., None] * m).reshape(N, -1, 1)
    bound = (F16 * (codes.reshape(N, -1, 32) * np.abs(s) + mn) + 6e-8 * 16 * (np.abs(s) + mn)).reshape(N, K)
    assert ((form.dequantize() - ref).abs() <= torch.from_numpy(bound)).all()
    assert form.nbytes == resident_bytes("int4_cuda", N, K)


def test_q4_k_scales_beyond_f16_are_refused(tmp_path):
    d, dmin, sc, m, codes = adversarial_q4_k(32, 256)  # d up to 65504 with 6-bit scales up to 63
    with pytest.raises(KvcliError, match="f16's range.*--weights f32"):
        _form(_q4_k_file(tmp_path, d, dmin, sc, m, codes))


def _blocks(N: int, K: int, bits: int, seed: int = 0) -> Blocks:
    """Adversarial blocks: rows of codes all 0 or all 15 (int8: -128 / 127), f16 scales from 6e-5 to
    6e4 and a zero one, mins of either sign and Q4_0's -8 d."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.empty(N, K // 32).uniform_(-9.5, 11, generator=g)).half()
    scale[2, 0], scale[5] = 0, 65504
    if bits == 8:
        q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
        q[0], q[1] = 127, -128
        return Blocks(q, scale, None, 8)
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    codes[0], codes[1], codes[5, :32] = 15, 0, 15
    min_ = (torch.randn(N, K // 32, generator=g) * scale.float() * 8).clamp(-65504, 65504).half()
    scale[3] = scale[3].clamp(max=8000)
    min_[3] = -8 * scale[3]  # Q4_0's
    assert torch.isfinite(min_).all()
    return Blocks.int4(codes, scale, min_)


@pytest.mark.parametrize("bits", [4, 8])
def test_cat_narrow_and_rows(bits):
    parts = [_blocks(n, 64, bits, seed=n) for n in (64, 32, 40)]
    whole = cat(parts)
    ref = torch.cat([p.dequantize() for p in parts])
    assert isinstance(whole, Blocks) and torch.equal(whole.dequantize(), ref)  # one form: one product
    for start, n in ((64, 72), (0, 64), (70, 10)):
        assert torch.equal(whole.narrow(start, n).dequantize(), ref[start : start + n])
    assert torch.equal(whole.rows(torch.tensor([5, 0, 135])), ref[[5, 0, 135]])
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0))  # (B, T, K): no kernel on CPU
    torch.testing.assert_close(whole.matmul(x), x @ ref.T, rtol=1e-5, atol=1e-5 * (x.abs() @ ref.abs().T).max().item())
    assert whole.product is table.reference(PRODUCT).run  # CPU tensors: the reference, chosen once


# ---- (b) the kernel, under the interpreter ----

def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor):
    """f32 tolerance: the same products summed in another order, relative to sum |x| |w|."""
    bound = 1e-5 * (x.abs() @ w.abs().T) + 1e-30
    assert ((y - x @ w.T).abs() <= bound).all(), ((y - x @ w.T).abs() / bound).max()


@needs_triton
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("N,K,block_k", [(64, 128, 256), (96, 96, 64), (80, 64, 32)])  # K off the tile
@pytest.mark.parametrize("M", [1, 3])
def test_kernel_equals_reference(bits, N, K, block_k, M):
    from kvcli.kernels.gpu.weights import weight_matmul

    form = _blocks(N, K, bits, seed=N + K)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)) * torch.logspace(-3, 3, K)
    y = weight_matmul(x, form.codes, form.scale, form.min, bits, block_n=32, block_k=block_k)
    _check(y, x, form.dequantize())


@pytest.mark.parametrize("entry", product_params("int4_cuda", "cuda"))
@pytest.mark.parametrize("bits", [4, 8])
def test_each_product_entry_equals_dequantized_f64(entry, bits):
    """Each PRODUCT entry of Blocks (the Triton kernel to KERNEL_ROWS rows then slabs; the reference's slabs), run on
    CPU tensors, against W = dequantize() times x in f64 at 1, 4, 8, 33 and 512 rows, x (1, M, K)."""
    if entry.device == "cuda" and not entry.ready():
        pytest.skip(f"{entry.name}: triton is not installed")
    N, K = 72, 128
    form = _blocks(N, K, bits, seed=bits)
    w = form.dequantize().double()
    g = torch.Generator().manual_seed(2)
    for M in (1, 4, 8, 33, 512):
        x = torch.randn(1, M, K, generator=g) * torch.logspace(-2, 2, K)
        got = entry.run(form, x)
        assert got.shape == (1, M, N) and got.dtype == torch.float32
        err = (got.double() - x.double() @ w.T).abs()
        bound = product_bound(entry, form, x, w)
        assert (err <= bound).all(), (entry.name, M, (err / bound).max().item())


@needs_triton
@pytest.mark.parametrize("bits", [4, 8])
def test_form_runs_the_kernel_for_few_rows(monkeypatch, bits, blocks_entry_on_cpu):
    """The form's product through the CUDA entry (registered for CPU tensors: the interpreter stands for CUDA): the
    kernel up to KERNEL_ROWS rows, shaped (..., K) -> (..., N); the slab GEMM above."""
    import kvcli.kernels.gpu.weights as kernel

    ran = []
    launch = kernel.weight_matmul
    monkeypatch.setattr(kernel, "weight_matmul", lambda *a, **k: ran.append(a[0].shape[0]) or launch(*a, **k))
    form = _blocks(72, 64, bits)
    w = form.dequantize()
    g = torch.Generator().manual_seed(1)
    for shape in ((1, 1, 64), (2, 3, 64), (1, weights.KERNEL_ROWS + 1, 64)):
        x = torch.randn(shape, generator=g)
        y = form.matmul(x)
        assert y.shape == (*shape[:-1], 72)
        _check(y.view(-1, 72), x.view(-1, 64), w)
    assert ran == [1, 6]
    assert form.product is blocks_entry_on_cpu.run


@needs_triton
def test_tiny_model_with_blocks_equals_f32(tmp_path, monkeypatch, blocks_entry_on_cpu):
    """A tiny Q4_1 model with its matrices as Blocks (the CUDA forms, here on CPU, through the CUDA entry): a prefill
    batch through the slabs, decode steps through the kernel, against --weights f32 (the same values)."""
    path = _quantized_model(tmp_path, Q.Q4_1, tied=True)
    exact = Llama(path, ctx_size=32, dtype="f32", cache_type_k="f32", cache_type_v="f32", weights="f32")
    monkeypatch.setattr("kvcli.weights.resident_form", lambda t, w, dt, dev, n=None: resident_form(t, w, dt, "cuda", n))
    llm = Llama(path, ctx_size=32, dtype="f32", cache_type_k="f32", cache_type_v="f32")
    assert {f.kind for f in llm.model.forms().values()} == {"int4_cuda"}
    types = {n: t.tensor_type.name for n, t in llm.gguf.tensors.items()}
    assert weight_bytes(llm.config, "f32", False, "native", types, "cuda") == llm.model.weight_bytes()
    ids = list(range(5, 25))
    torch.testing.assert_close(llm.eval(ids), exact.eval(ids), rtol=1e-4, atol=1e-4)
    for token in (7, 100):
        torch.testing.assert_close(llm.eval([token]), exact.eval([token]), rtol=1e-4, atol=1e-4)


# ---- (c) synthetic models ----

@pytest.mark.parametrize("form", ["int4", "int4_cuda"])
def test_random_int4(form):
    if form == "int4" and tile_width() is None:
        pytest.skip("torch's CPU int4 GEMM is missing or packs another way")
    w = random_int4(form, 200, 256, torch.Generator().manual_seed(0))
    assert w.shape == (200, 256) and w.nbytes == resident_bytes(form, 200, 256)
    d = w.dequantize()
    assert abs(d.mean().item()) < 1e-3 and abs(d.std().item() - 0.02) < 1e-3


def test_synthetic_shape_native_weights_are_packed():
    """--shape with native weights: 4-bit forms (CPU: as resident_form keeps Q4_0, int4 tiles or the file's blocks),
    counted as planned; f16 weights stay dense."""
    q4_0 = weights.resident_form("Q4_0", "native", "f16", "cpu")
    native = {"q4_0": {"ggml"}, "q4_0x8": {"ggml_tiles"}, "int4": {"int4"}}.get(q4_0, {"f16"})
    for w, kinds in (("native", native), ("f16", {"f16"})):
        llm = Llama(shape="smollm2-135m", ctx_size=16, weights=w)
        assert {f.kind if f.kind != "dense" else f.name for f in llm.model.forms().values()} == kinds
        assert weight_bytes(llm.config, "f16", False, w, synthetic_types(llm.config)) == llm.model.weight_bytes()
        assert torch.isfinite(llm.eval([5, 6, 7])).all()


def test_synthetic_shape_gets_the_cuda_form(monkeypatch):
    """On CUDA a --shape model's native matrices are Blocks: here on CPU, the device choice forced,
    counted as the CUDA plan counts them (their products: test_tiny_model_with_blocks_equals_f32)."""
    real = weights.resident_form
    monkeypatch.setattr(weights, "resident_form", lambda t, w, dt, dev, n=None: real(t, w, dt, "cuda", n))
    llm = Llama(shape="smollm2-135m", ctx_size=16, dtype="f32")
    assert {f.kind for f in llm.model.forms().values()} == {"int4_cuda"}
    assert weight_bytes(llm.config, "f32", False, "native", synthetic_types(llm.config)) == llm.model.weight_bytes()
