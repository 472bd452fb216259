"""Resident weight forms (kvcli/weights.py): each form's product against dequantize-then-matmul,
loading from GGUF blocks against gguf-py's dequantization, tiny quantized models against
--weights f32, and the memory plan against the resident bytes."""

import gguf
import numpy as np
import pytest
import torch

from kvcli.cache.int4_gemm import tile_width
from kvcli.generate import Sampler
from kvcli.gguf_file import open_gguf, read_tensor
from kvcli.llama import Llama
from kvcli.shapes import weight_bytes
from kvcli.weights import Dense, Int4, Int8, cat, load
from tests.tiny import make_hf_model, write_gguf

needs_int4 = pytest.mark.skipif(tile_width() is None, reason="torch's CPU int4 GEMM is missing or packs another way")
BF16 = 2.0**-8  # bf16 activations and scales: a product is good to about 2^-8 of its magnitude


def adversarial_blocks(N: int, K: int, seed: int = 0):
    """codes (N, K) 0..15, scale and zero (N, K / 32): scales spanning 1e-4..1e3, all-equal codes,
    negative and zero mins, a zero scale."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
    codes[0] = 15
    codes[1, :32] = 0
    scale = torch.exp(torch.empty(N, K // 32).uniform_(-9, 7, generator=g))
    scale[2, 0] = 0
    zero = torch.randn(N, K // 32, generator=g) * scale * 8
    zero[3] = -scale[3] * 8  # Q4_1's most negative min
    return codes, scale, zero


def _check(form, ref_w: torch.Tensor, rows=(1, 3, 64)):
    """form.matmul(x) against x @ ref_w.T for decode and prefill row counts, per output column."""
    for M in rows:
        x = torch.randn(M, ref_w.shape[1], generator=torch.Generator().manual_seed(M))
        ref = x @ ref_w.T
        # bf16 error bound per output: 2^-8 of sum |x| |w| (each term rounded), not of the result
        bound = 2 * BF16 * (x.abs() @ ref_w.abs().T) + 1e-6
        assert ((form.matmul(x) - ref).abs() <= bound).all(), M


@needs_int4
@pytest.mark.parametrize("N,K", [(64, 64), (40, 96), (96, 32), (128, 576)])  # N, K off the tile width too
def test_int4_product_equals_dequantized(N, K):
    codes, scale, zero = adversarial_blocks(N, K)
    form = Int4.from_codes(codes, scale, zero)
    w = form.dequantize()
    exact = ((codes.float() - 8).view(N, -1, 32) * scale[..., None] + zero[..., None]).view(N, K)
    # dequantize differs from the file's values only by the bf16 rounding of scale and zero point
    assert ((w - exact).abs() <= BF16 * ((codes.float() - 8).abs().view(N, -1, 32) * scale[..., None]
                                         + zero.abs()[..., None]).view(N, K) + 1e-12).all()
    _check(form, w)
    assert form.nbytes == form.packed.numel() + 2 * form.sz.numel()


@pytest.mark.parametrize("N,K", [(64, 64), (40, 96), (49, 32)])
def test_int8_product_and_rows(N, K):
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    q[0] = 127
    d = torch.exp(torch.empty(N, K // 32).uniform_(-12, 4, generator=g)).half()
    form = Int8.from_codes(q, d)
    w = (q.float().view(N, -1, 32) * d.float()[..., None]).view(N, K)
    assert torch.equal(form.dequantize(), w)  # exact: f16 scales times int8 codes
    ids = torch.tensor([[N - 1, 0], [2, 2]])
    assert torch.equal(form.rows(ids), w[ids])
    _check(form, w)


@needs_int4
def test_cat_and_narrow_keep_products():
    parts = [Int4.from_codes(*adversarial_blocks(n, 64, seed=n)) for n in (64, 32, 40)]
    whole = cat(parts)
    ref = torch.cat([p.dequantize() for p in parts])
    assert isinstance(whole, Int4)  # joined in place: one product
    _check(whole, ref, rows=(1,))
    for start, n in ((64, 72), (0, 64), (32, 40), (70, 10)):  # tile-aligned views and a split tile
        _check(whole.narrow(start, n), ref[start : start + n], rows=(1,))
    dense = cat([Dense(torch.randn(8, 32)), Dense(torch.randn(4, 32))])
    assert torch.equal(dense.narrow(8, 4).w, dense.w[8:])


def _quantized_model(tmp_path, qtype, tied):
    """A tiny model with every matrix quantized to qtype by gguf-py; norms stay f32."""
    model = make_hf_model(n_layers=2, hidden=64, tied=tied, seed=3)
    path = write_gguf(model, tmp_path / "f32.gguf")
    g = open_gguf(path)
    raw = {n: (gguf.quants.quantize(read_tensor(g, n), qtype), qtype) for n, t in g.tensors.items()
           if len(t.shape) == 2}
    return write_gguf(model, tmp_path / f"{qtype.name}.gguf", raw=raw)


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
                                   gguf.GGMLQuantizationType.Q8_0])
def test_loaded_forms_equal_the_files_values(tmp_path, qtype):
    path = _quantized_model(tmp_path, qtype, tied=True)
    g = open_gguf(path)
    for name in ("blk.0.attn_q.weight", "token_embd.weight"):
        t = g.tensors[name]
        form = load(t, "int8" if qtype.name == "Q8_0" else "int4")
        ref = torch.from_numpy(read_tensor(g, name))
        scale = torch.from_numpy(read_tensor(g, name)).abs().max()
        tol = 0 if qtype.name == "Q8_0" else 2 * BF16 * scale  # bf16 scale/zero rounding only
        assert (form.dequantize() - ref).abs().max() <= tol


# Logits of a 2-layer 64-wide model: native products are bf16 (2^-8 relative per product);
# a loose bound on logits of magnitude ~1 (the exact margin is still to be measured).
LOGIT_BOUND = 0.05


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
                                   gguf.GGMLQuantizationType.Q8_0])
@pytest.mark.parametrize("tied", [True, False])
def test_tiny_quantized_model_native_equals_f32(tmp_path, qtype, tied):
    path = _quantized_model(tmp_path, qtype, tied)
    native = Llama(path, ctx_size=64, dtype="f32", cache_type_k="f32", cache_type_v="f32")
    exact = Llama(path, ctx_size=64, dtype="f32", cache_type_k="f32", cache_type_v="f32", weights="f32")
    kinds = {f.kind for f in native.model.forms().values()}
    assert kinds == {"int8" if qtype.name == "Q8_0" else "int4"} or tile_width() is None
    ids = list(range(5, 45))  # 40 tokens: one prefill batch (dequantized) and decode steps below
    a, b = native.logits(ids), exact.logits(ids)
    assert (a - b).abs().max().item() <= LOGIT_BOUND
    prompt = [7, 100, 33]
    ga = list(native.generate(prompt, n_predict=12, sampler=Sampler(temp=0), stop_at_eog=False))
    gb = list(exact.generate(prompt, n_predict=12, sampler=Sampler(temp=0), stop_at_eog=False))
    assert ga == gb
    # the memory plan counts exactly what is resident
    types = {n: t.tensor_type.name for n, t in native.gguf.tensors.items()}
    for llm, w in ((native, "native"), (exact, "f32")):
        assert weight_bytes(llm.config, "f32", not tied, w, types) == llm.model.weight_bytes()


def test_default_model_native_matches_f32(default_model):
    """The default model's greedy text with native weights starts as --weights f32's does."""
    prompt = "The capital of France is"
    out = {}
    for w in ("native", "f32"):
        llm = Llama(default_model, ctx_size=128, weights=w)
        out[w] = list(llm.generate(prompt, n_predict=16, sampler=Sampler(temp=0)))
        types = {n: t.tensor_type.name for n, t in llm.gguf.tensors.items()}
        assert weight_bytes(llm.config, "f16", False, w, types) == llm.model.weight_bytes()
    assert llm.detokenize(out["native"]).startswith(" Paris")
    assert out["native"][:8] == out["f32"][:8]
