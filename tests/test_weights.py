"""Resident weight forms (kvcli/weights.py): each PRODUCT entry this CPU can run (AVX512, portable, the reference:
an entry it cannot run, or that KVCLI_ISA hides, is skipped with its name and why) against dequantize-then-matmul,
the ROWS entries' slabs against torch's, loading from GGUF blocks against gguf-py's dequantization, tiny quantized
models against --weights f32, and the memory plan against the resident bytes."""

import gguf
import numpy as np
import pytest
import torch

import kvcli.weights
from kvcli import kernel_table as table
from kvcli.kernel_table import PRODUCT, ROWS
from kvcli.kernels.cpu.int4_tiles import tile_width
from kvcli.sampler import Sampler
from kvcli.gguf_file import open_gguf, read_tensor
from kvcli.llama import Llama
from kvcli.shapes import weight_bytes
from kvcli.weights import Concat, Dense, Int4, Int8, Rows, cat, load
from tests.tiny import make_hf_model, write_gguf

needs_int4 = pytest.mark.skipif(tile_width() is None, reason="torch's CPU int4 GEMM is missing or packs another way")
BF16 = 2.0**-8  # bf16 activations and scales: a product is good to about 2^-8 of its magnitude


def product_params(kind: str, device: str = "cpu") -> list:
    """Every PRODUCT entry of this form kind on this device, then the reference, as pytest params named by their ISA
    level (cpu) or device: the same list on every machine, so a skipped case names what was not tested."""
    ids = {"cpu": lambda e: e.isa, "cuda": lambda e: "cuda"}
    return [pytest.param(e, id=ids[device](e)) for e in table.entries(PRODUCT) if kind in e.keys and e.device == device] \
        + [pytest.param(table.reference(PRODUCT), id="reference")]


def runnable(entry: table.Entry, device: str = "cpu") -> None:
    """Skip, naming the entry and why, where this machine cannot run it (its ISA, KVCLI_ISA, its toolchain)."""
    reason = "" if entry.device == "any" else table.why_not(entry, device)
    if reason:
        pytest.skip(f"{entry.name}: {reason}")


def product(entry: table.Entry, form, x: torch.Tensor) -> torch.Tensor:
    """The entry's product for a form, or for a view of one (Rows, Concat: their parts' products, as their matmul)."""
    if isinstance(form, Rows):
        return product(entry, form.form, x)[..., form.start : form.start + form.n]
    if isinstance(form, Concat):
        return torch.cat([product(entry, p, x) for p in form.parts], -1)
    return entry.run(form, x)


def block_scales(form) -> torch.Tensor:
    """|scale| of each element's block (N, K) as the form's codes step (Int8: its high halves' 16 d)."""
    if isinstance(form, (Rows, Concat)):
        return block_scales(form.form)[form.start : form.start + form.n] if isinstance(form, Rows) \
            else torch.cat([block_scales(p) for p in form.parts])
    if isinstance(form, Int4):
        s = form.sz[:, : form.n, 0].T.float()
    elif isinstance(form, Int8):
        s = 16 * form.d.float()
    else:  # Blocks
        s = form.scale.float()
    return s.abs().repeat_interleave(32, 1)


def product_bound(entry: table.Entry, form, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the entry's product may differ from x @ w.T (w: dequantize(), f64) by, per output: an entry on bf16
    operands (Entry.tol above f32's: torch's int4 GEMV, bf16 slabs, bf16 scales) 2^-7 of sum |x| |w| (x, the scales and
    the output each rounded to 8 bits), one on f32 2^-18; plus, per 32-column block of x, its largest |x| times
    (|w| + 136 s) at 2^-14 (bf16) or 2^-20 (f32): the int8-dot kernel's x in 15-bit integers (2^-16 of the block's
    largest) and f32's roundings of the codes' sums s sx (xi . q) and (z - 8 s) sx sum xi."""
    xa = x.reshape(-1, x.shape[-1]).double().abs()
    bmax = xa.unflatten(-1, (-1, 32)).amax(-1, keepdim=True).expand(-1, -1, 32).flatten(-2)
    rel, blk = (2.0**-7, 2.0**-14) if entry.tol > 1e-4 else (2.0**-18, 2.0**-20)
    b = rel * (xa @ w.abs().T) + blk * (bmax @ (w.abs() + 136 * block_scales(form).double()).T) + 1e-30
    return b.view(*x.shape[:-1], -1)


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


def q4_k_bytes(d, dmin, sc, m, codes) -> np.ndarray:
    """Q4_K super-blocks laid out as llama.cpp's block_q4_K (ggml-common.h, get_scale_min_k4):
    d, dmin (N, K / 256) f16; sc, m (N, K / 256, 8) uint8 0..63; codes (N, K) uint8 0..15 ->
    (N, K / 256 * 144) bytes: d, dmin, 12 bytes of scales and mins, 128 of codes."""
    N, nb = d.shape
    top = lambda v: (v[..., 4:] >> 4) << 6  # sub-blocks 4-7 keep their top 2 bits in bytes 0-7's top bits
    scales = np.concatenate([sc[..., :4] | top(sc), m[..., :4] | top(m),
                             (sc[..., 4:] & 15) | (m[..., 4:] & 15) << 4], -1)  # (N, K / 256, 12)
    c = codes.reshape(N, nb, 4, 2, 32)  # bytes 32j..32j+31: sub-block 2j low nibbles, 2j + 1 high
    qs = (c[..., 0, :] | c[..., 1, :] << 4).reshape(N, nb, 128)
    halves = [np.asarray(v, "<f2").reshape(N, nb, 1).view(np.uint8) for v in (d, dmin)]
    return np.concatenate([*halves, scales, qs], -1).reshape(N, -1)


def q4_k_quantize(w: np.ndarray):
    """A plain round-to-nearest Q4_K quantizer (gguf-py has none) -> (d, dmin, sc, m, codes) for
    q4_k_bytes: each sub-block of 32 spans min(0, its min) .. its max in 15 steps; step and -min
    in 6 bits of the super-block's d, dmin."""
    N, K = w.shape
    x = w.reshape(N, K // 256, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(-1), 0)
    step = (x.max(-1) - lo) / 15  # (N, K / 256, 8)
    d, dmin = (step.max(-1) / 63).astype(np.float16), ((-lo).max(-1) / 63).astype(np.float16)
    with np.errstate(divide="ignore", invalid="ignore"):  # all-zero blocks: d = 0, codes 0
        sc = np.nan_to_num(np.rint(step / d.astype(np.float32)[..., None])).clip(0, 63)
        m = np.nan_to_num(np.rint(-lo / dmin.astype(np.float32)[..., None])).clip(0, 63)
        scale, neg_min = (d[..., None] * sc)[..., None], (dmin[..., None] * m)[..., None]
        q = np.nan_to_num(np.rint((x + neg_min) / scale)).clip(0, 15)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q.reshape(N, K).astype(np.uint8)


def adversarial_q4_k(N: int, K: int, seed: int = 0):
    """(d, dmin, sc, m, codes) of Q4_K super-blocks: d and dmin across f16's range (subnormal to
    65504, zero, negative), 6-bit scales and mins all 0 or all 63, rows of codes all 0 or all 15."""
    rng = np.random.default_rng(seed)
    nb = K // 256
    d = (np.exp(rng.uniform(-16, 11, (N, nb))) * rng.choice([1, 1, 1, -1], (N, nb))).astype(np.float16)
    dmin = np.exp(rng.uniform(-16, 11, (N, nb))).astype(np.float16)
    d[0, 0], d[1, 0], dmin[2, 0], d[3, 0], dmin[3, 0] = 65504, 6e-8, 65504, 0, 0
    sc, m = (rng.integers(0, 64, (N, nb, 8), dtype=np.uint8) for _ in range(2))
    sc[4], m[4], sc[5], m[5], m[6] = 63, 63, 0, 63, 0
    codes = rng.integers(0, 16, (N, K), dtype=np.uint8)
    codes[0], codes[1], codes[4] = 15, 0, 15
    return d, dmin, sc, m, codes


def _check(entry, form, ref_w: torch.Tensor, rows=(1, 3, 64, 128)):
    """The entry's product against x @ ref_w.T for decode and prefill row counts, per output column."""
    for M in rows:
        x = torch.randn(M, ref_w.shape[1], generator=torch.Generator().manual_seed(M))
        ref = x @ ref_w.T
        # bf16 error bound per output: 2^-8 of sum |x| |w| (each term rounded), not of the result
        bound = 2 * BF16 * (x.abs() @ ref_w.abs().T) + 1e-6
        assert ((product(entry, form, x) - ref).abs() <= bound).all(), (entry.name, M)


ROW_COUNTS = (1, 4, 8, 16, 33, 48, 512)  # the int8-dot kernel's, torch's GEMV's (Int8 to 32), bf16 slabs', f32 slabs'


def _adversarial_form(kind: str, N: int, K: int):
    if kind == "int4":
        return Int4.from_codes(*adversarial_blocks(N, K, seed=5))
    g = torch.Generator().manual_seed(6)
    q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    q[0], q[1] = 127, -128
    return Int8.from_codes(q, torch.exp(torch.empty(N, K // 32).uniform_(-12, 4, generator=g)).half())


@needs_int4
@pytest.mark.parametrize("kind, entry", [pytest.param(kind, *p.values, id=f"{kind}-{p.id}")
                                         for kind in ("int4", "int8") for p in product_params(kind)])
def test_each_product_entry_equals_dequantized_f64(kind, entry):
    """Each PRODUCT entry of Int4 and Int8 against W = dequantize() times x in f64, at every path's row counts (1, 4,
    8, 33, 512 and between), x (1, M, K) with a zero block and columns of different scales; N off the tile width."""
    N, K = 200, 576
    runnable(entry)
    form = _adversarial_form(kind, N, K)
    assert_products_near_f64(entry, form, form.dequantize().double(), ROW_COUNTS,
                             lambda x, w: product_bound(entry, form, x, w))


def assert_products_near_f64(entry: table.Entry, form, w: torch.Tensor, row_counts, bound) -> None:
    """The entry's product of `form` (N, K) at each row count against x @ w.T in f64 (w the form's values), x (1, M, K)
    with a zero block and columns of different scales, within bound(x, w) (1, M, N) per output."""
    N, K = w.shape
    g = torch.Generator().manual_seed(7)
    for M in row_counts:
        x = torch.randn(1, M, K, generator=g) * torch.logspace(-2, 2, K)
        x[..., 32:64] = 0
        got = entry.run(form, x)
        assert got.shape == (1, M, N) and got.dtype == torch.float32
        err = (got.double() - x.double() @ w.T).abs()
        b = bound(x, w)
        assert (err <= b).all(), (entry.name, M, (err / b).max().item())


@needs_int4
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_form_binds_its_entry_once(kind, monkeypatch):
    """A form asks the table at its first product and keeps the entry's run: no lookup at the next products, at any
    row count; the entry is the table's choice for its kind on this machine."""
    form = _adversarial_form(kind, 64, 64)
    asked = []
    choose = table.choose
    monkeypatch.setattr(table, "choose", lambda *a, **k: asked.append(a) or choose(*a, **k))
    for M in (1, 1, 3, 9, 40, 300):
        form.matmul(torch.randn(M, 64))
    assert [a[:3] for a in asked if a[0] == PRODUCT] == [(PRODUCT, "cpu", kind)]
    assert form.product is choose(PRODUCT, "cpu", kind).run


@needs_int4
@pytest.mark.parametrize("entry", product_params("int4"))
@pytest.mark.parametrize("N,K", [(64, 64), (40, 96), (96, 32), (128, 576)])  # N, K off the tile width too
def test_int4_product_equals_dequantized(N, K, entry):
    runnable(entry)
    codes, scale, zero = adversarial_blocks(N, K)
    form = Int4.from_codes(codes, scale, zero)
    w = form.dequantize()
    exact = ((codes.float() - 8).view(N, -1, 32) * scale[..., None] + zero[..., None]).view(N, K)
    # dequantize differs from the file's values only by the bf16 rounding of scale and zero point
    assert ((w - exact).abs() <= BF16 * ((codes.float() - 8).abs().view(N, -1, 32) * scale[..., None]
                                         + zero.abs()[..., None]).view(N, K) + 1e-12).all()
    _check(entry, form, w)
    assert form.nbytes == form.packed.numel() + 2 * form.sz.numel()


@needs_int4
@pytest.mark.parametrize("entry", product_params("int4"))
@pytest.mark.parametrize("N", [200, 6 * 64])  # padded to whole tiles, and whole tiles
def test_int4_batch_product_in_slabs_is_the_dequantized_gemm(N, entry, monkeypatch):
    """A batch above int4_gemv_rows() multiplies W dequantized slab by slab into a reused buffer: the same
    values as dequantize(), so the same GEMM, whatever the slab size; batched x (B, T, K) too."""
    import kvcli.weights as weights

    runnable(entry)
    K = 96
    form = Int4.from_codes(*adversarial_blocks(N, K, seed=3))
    x = torch.randn(2, weights.int4_gemv_rows(), K, generator=torch.Generator().manual_seed(0))
    ref = x @ form.dequantize().T
    for elems in (weights.SLAB_ELEMS, 2 * tile_width() * K):  # one slab; two tiles a slab
        monkeypatch.setattr(weights, "SLAB_ELEMS", elems)
        y = entry.run(form, x)
        assert y.shape == (2, weights.int4_gemv_rows(), N) and y.is_contiguous()
        assert torch.allclose(y, ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))


@needs_int4
@pytest.mark.parametrize("entry", product_params("int8"))
@pytest.mark.parametrize("N,K", [(64, 64), (40, 96), (49, 32)])
def test_int8_product_and_rows(N, K, entry):
    runnable(entry)
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    q[0] = 127
    d = torch.exp(torch.empty(N, K // 32).uniform_(-12, 4, generator=g)).half()
    form = Int8.from_codes(q, d)
    w = (q.float().view(N, -1, 32) * d.float()[..., None]).view(N, K)
    assert torch.equal(form.dequantize(), w)  # exact: f16 scales times int8 codes
    ids = torch.tensor([[N - 1, 0], [2, 2]])
    assert torch.equal(form.rows(ids), w[ids])
    _check(entry, form, w)


@needs_int4
@pytest.mark.parametrize("entries", [pytest.param((a.values[0], b.values[0]), id=a.id)
                                     for a, b in zip(product_params("int4"), product_params("int8"))])
def test_cat_and_narrow_keep_products(entries):
    for entry in entries:
        runnable(entry)
    int4, int8 = entries
    T = tile_width()  # 32 (AVX2) or 64 (AVX-512): parts of whole tiles but the last
    parts = [Int4.from_codes(*adversarial_blocks(n, 64, seed=n)) for n in (2 * T, T, T + 8)]
    whole = cat(parts)
    ref = torch.cat([p.dequantize() for p in parts])
    assert isinstance(whole, Int4)  # joined in place: one product
    _check(int4, whole, ref, rows=(1,))
    for start, n in ((2 * T, 2 * T + 8), (0, 2 * T), (T, T + 8), (2 * T + 6, 10)):  # tile-aligned views, a split tile
        _check(int4, whole.narrow(start, n), ref[start : start + n], rows=(1,))
    g = torch.Generator().manual_seed(4)
    parts = [Int8.from_codes(torch.randint(-128, 128, (n, 128), generator=g, dtype=torch.int8),
                             torch.rand(n, 4, generator=g).half()) for n in (2 * T, T, T + 8)]
    whole = cat(parts)
    ref = torch.cat([p.dequantize() for p in parts])
    assert isinstance(whole, Int8)  # joined in place
    _check(int8, whole, ref, rows=(1,))
    for start, n in ((2 * T, 2 * T + 8), (0, 2 * T), (T, T + 8), (2 * T + 6, 10)):
        _check(int8, whole.narrow(start, n), ref[start : start + n], rows=(1,))
    dense = cat([Dense(torch.randn(8, 32)), Dense(torch.randn(4, 32))])
    assert torch.equal(dense.narrow(8, 4).w, dense.w[8:])


@needs_int4
@pytest.mark.parametrize("entry", product_params("int4"))
@pytest.mark.parametrize("blocks", ["adversarial", "quantized"])
@pytest.mark.parametrize("N,K", [(64, 256), (40, 512)])  # N off the tile width too
def test_q4_k_form_equals_gguf_py(tmp_path, blocks, N, K, entry):
    """A Q4_K tensor's int4 form against gguf-py's dequantization of the same bytes, and its product."""
    runnable(entry)
    if blocks == "adversarial":
        d, dmin, sc, m, codes = adversarial_q4_k(N, K)
    else:
        d, dmin, sc, m, codes = q4_k_quantize(np.random.default_rng(N).standard_normal((N, K)) * 0.02)
    w = gguf.GGUFWriter(str(tmp_path / "q4_k.gguf"), "llama")
    w.add_tensor("w", q4_k_bytes(d, dmin, sc, m, codes), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    t = gguf.GGUFReader(tmp_path / "q4_k.gguf").tensors[0]
    form = load(t, "int4")
    ref = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(N, K))
    # Bound: Int4 holds W = (q - 8) s + z per 32 with s = d sc, z = 8 d sc - dmin m (exact here, in
    # f64), each rounded to bf16 (8 significant bits: |x - bf16(x)| <= 2^-8 |x| / (1 + 2^-8)), so
    # |err| <= 2^-8 (|q - 8| |s| + |z|); the 2^-16 left over covers f32's roundings (< 2^-21).
    s = (d.astype(np.float64)[..., None] * sc).reshape(N, -1, 1)
    z = 8 * s - (dmin.astype(np.float64)[..., None] * m).reshape(N, -1, 1)
    bound = torch.from_numpy(BF16 * (np.abs(codes.reshape(N, -1, 32) - 8.0) * np.abs(s) + np.abs(z)).reshape(N, K))
    assert ((form.dequantize() - ref).abs() <= bound).all()
    assert torch.equal(form.rows(torch.arange(N)), form.dequantize())
    _check(entry, form, form.dequantize())


def test_q4_k_nan_scale_is_refused(tmp_path):
    from kvcli.errors import KvcliError

    d, dmin, sc, m, codes = adversarial_q4_k(32, 256)
    dmin[3, 0] = np.nan
    w = gguf.GGUFWriter(str(tmp_path / "q4_k.gguf"), "llama")
    w.add_tensor("w", q4_k_bytes(d, dmin, sc, m, codes), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(KvcliError, match="NaN/Inf"):
        load(gguf.GGUFReader(tmp_path / "q4_k.gguf").tensors[0], "int4")


def _quantized_model(tmp_path, qtype, tied):
    """A tiny model with every matrix quantized to qtype by gguf-py (Q4_K, which gguf-py cannot
    quantize: by q4_k_quantize, 256 wide for its super-blocks); norms stay f32."""
    q4_k = qtype == gguf.GGMLQuantizationType.Q4_K
    model = make_hf_model(n_layers=2, hidden=256 if q4_k else 64, n_ff=256 if q4_k else None, tied=tied, seed=3)
    path = write_gguf(model, tmp_path / "f32.gguf")
    g = open_gguf(path)
    quantize = (lambda w: q4_k_bytes(*q4_k_quantize(w))) if q4_k else (lambda w: gguf.quants.quantize(w, qtype))
    raw = {n: (quantize(read_tensor(g, n)), qtype) for n, t in g.tensors.items() if len(t.shape) == 2}
    return write_gguf(model, tmp_path / f"{qtype.name}.gguf", raw=raw)


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1,
                                   gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_K])
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
                                   gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_K])
@pytest.mark.parametrize("tied", [True, False])
def test_tiny_quantized_model_native_equals_f32(tmp_path, qtype, tied):
    path = _quantized_model(tmp_path, qtype, tied)
    native = Llama(path, ctx_size=64, dtype="f32", cache_type_k="f32", cache_type_v="f32")
    exact = Llama(path, ctx_size=64, dtype="f32", cache_type_k="f32", cache_type_v="f32", weights="f32")
    kinds = {f.kind for f in native.model.forms().values()}
    form = kvcli.weights.resident_form(qtype.name, "native", "f32", "cpu")
    # ggml: the file's blocks; ggml_tiles: regrouped 8 rows at a time (a matrix whose rows are not whole tiles: ggml)
    want = {form} if form in ("int4", "int8") else {"ggml_tiles", "ggml"} if form.endswith("x8") else {"ggml"}
    assert kinds <= want and (form in ("int4", "int8") or "ggml_tiles" not in want or "ggml_tiles" in kinds) \
        or tile_width() is None
    ids = list(range(5, 45))  # 40 tokens: one prefill batch (packed products: under int4_gemv_rows()) and decode below
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


def rows_params(kind: str) -> list:
    return [pytest.param(e, id=e.name.split(" ")[0]) for e in table.entries(ROWS) if kind in e.keys] \
        + [pytest.param(table.reference(ROWS), id="reference")]


@needs_int4
@pytest.mark.parametrize("entry", rows_params("int4"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_slab_entries_equal_torchs_dequantization(entry, dtype):
    """Each ROWS entry of Int4 that takes the dtype (the compiled bf16 slab, kvcli/kernels/cpu/dequantize.py; the
    reference, torch's ops) gives the reference's bits, whole and from a middle tile on, and W.T as dequantize()
    rounds it; a batch through its slabs equals the f32 slabs' product to the dtype's precision."""
    runnable(entry)
    if not entry.covers(dtype=dtype):
        pytest.skip(f"{entry.name}: not for {dtype} slabs (the reference makes them)")
    g = torch.Generator().manual_seed(0)
    T = tile_width()
    N, K = 3 * T - 5, 96
    form = Int4.from_codes(torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8),
                           torch.rand(N, K // 32, generator=g) * 0.1, torch.randn(N, K // 32, generator=g) * 0.05)
    Np, ref = form.packed.shape[0], table.reference(ROWS)
    whole = entry.run(form, 0, Np, dtype).clone()
    middle = entry.run(form, T, Np, dtype).clone()
    assert whole.shape == (K, Np) and whole.dtype == dtype
    assert torch.equal(whole, ref.run(form, 0, Np, dtype))
    assert torch.equal(middle, whole[:, T:])
    assert torch.equal(whole[:, :N], form.dequantize().T.to(dtype))
    x = torch.randn(48, K, generator=g)
    want = x @ form.dequantize().T
    got = kvcli.weights._slab_products(form, x.to(dtype), dtype, lambda s, e, dt: entry.run(form, s, e, dt)).float()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


@needs_int4
def test_forms_bind_their_slab_entry_per_dtype():
    """An Int4 batch's slabs come from the ROWS entry the table chose for the dtype, kept on the form."""
    form = Int4.from_codes(*adversarial_blocks(64, 64))
    for dtype in (torch.bfloat16, torch.float32):
        form.slab(0, form.packed.shape[0], dtype)
        assert form.slabs[dtype] is table.choose(ROWS, "cpu", "int4", dtype=dtype).run


def test_kernel_lines_name_every_kind_and_why():
    """kvcli info's lines: each form kind's PRODUCT and ROWS entry, with why the others do not run."""
    lines = kvcli.weights.kernel_lines()
    text = "\n".join(lines)
    for kind in ("int4 product", "int8 product", "int4_cuda product", "int8_cuda product", "dense product",
                 "int4 bfloat16 slabs", "int4 float32 slabs", "rms_norm"):
        assert kind in text
    chosen = table.choose(PRODUCT, "cpu", "int4")
    assert any(line.startswith("int4 product") and chosen.name in line for line in lines)
    for e in table.entries(PRODUCT):
        if "int4" in e.keys and e is not chosen:
            assert any(line.startswith(f"  not {e.name}: ") for line in lines), e.name
    if not table.has(table.AVX512):
        assert "needs avx512" in text


def test_warm_up_loads_the_chosen_entrys_kernel(monkeypatch):
    """warm_up(model, rows) loads the kernel of the entry the model's Int4 / Int8 forms chose (once, whatever the
    kinds), and nothing where that entry has none."""
    loaded = []
    for kind in ("int4", "int8"):
        run = table.choose(PRODUCT, "cpu", kind).run
        if hasattr(run, "warm_up"):
            monkeypatch.setattr(run, "warm_up", lambda rows: loaded.append(rows))
    forms = {"a": Int4.from_codes(*adversarial_blocks(64, 64)) if tile_width() else Dense(torch.zeros(2, 32)),
             "b": Dense(torch.zeros(4, 32))}
    model = type("M", (), {"forms": lambda self: forms})()
    kvcli.weights.warm_up(model, 4)
    assert loaded == ([4] if tile_width() and hasattr(table.choose(PRODUCT, "cpu", "int4").run, "warm_up") else [])
