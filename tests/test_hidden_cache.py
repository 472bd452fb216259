"""The hidden-state cache (issue 6): exactness against the KV cache, byte counts, auto mode,
CLI flag checks, the Triton decode kernel against its reference, and the GQA -> MHA rewrite.

Tiny random models: MHA 2/2 heads (n_embd 64, head 32) and GQA 4/2 heads (n_embd 128, head 32),
so the kernel's tl.dot tiles (>= 16 per side) apply to both.
"""

import os
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import gguf
import pytest
import torch
from typer.testing import CliRunner

from kvcli.cache import CacheSpec, HiddenCache, KVCache, STORAGE_TYPES, make_cache, resolve_cache_mode
from kvcli.cache.hadamard import N_SINK
from kvcli.cli import app
from kvcli.llama import Llama
from kvcli.attention import Attention
from tiny import make_hf_model, write_gguf

IDS = [5, 71, 200, 33, 9, 250, 17, 64, 101, 3, 88, 140]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("hidden")
    return {"mha": write_gguf(make_hf_model(n_heads=2, n_kv_heads=2, hidden=64, seed=1), d / "mha.gguf"),
            "gqa": write_gguf(make_hf_model(n_heads=4, n_kv_heads=2, hidden=128, seed=2), d / "gqa.gguf")}


def _llm(path, **kw):
    kw = {"ctx_size": 32, "dtype": "f32", "cache_type_k": "f32", "cache_type_v": "f32", **kw}
    return Llama(path, **kw)


def _stepwise(llm, ids):
    """Prefill ids[:4], then one token at a time: the logits after each step (len(ids) - 3, V)."""
    llm.reset()
    out = [llm.eval(ids[:4])]
    out += [llm.eval([t]) for t in ids[4:]]
    return torch.stack(out)


@pytest.mark.parametrize("small_chunks", [False, True])
@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("kind", ["mha", "gqa"])
def test_hidden_f32_equals_kv_f32(models, kind, flash, small_chunks, monkeypatch):
    if small_chunks:  # chunks of 4 positions: the online softmax / streamed-V paths over many chunks
        import kvcli.attention

        monkeypatch.setattr(kvcli.attention, "CHUNK_BYTES", 1)
        monkeypatch.setattr(kvcli.attention, "MIN_CHUNK", 4)
    kv = _llm(models[kind], flash_attn=flash)
    hidden = _llm(models[kind], flash_attn=flash, cache_mode="hidden", cache_type_h="f32", cache_type_k="f16",
                  cache_type_v="f16")
    assert isinstance(hidden.cache, HiddenCache) and isinstance(kv.cache, KVCache)
    assert (kv.logits(IDS) - hidden.logits(IDS)).abs().max() <= 1e-4  # prefill
    assert (_stepwise(kv, IDS) - _stepwise(hidden, IDS)).abs().max() <= 1e-4  # token by token


def test_lossy_hidden_types_run_and_stay_close(models):
    kv = _llm(models["mha"])
    ref = kv.logits(IDS)
    for t, tol in (("f16", 1e-2), ("q8_0", 0.1), ("q4_hadamard", 1.0)):
        got = _llm(models["mha"], cache_mode="hidden", cache_type_h=t).logits(IDS)
        assert torch.isfinite(got).all() and (got - ref).abs().max() <= tol, t


@pytest.mark.parametrize("type_h", ["f32", "f16", "bf16", "q8_0", "q4_0", "q5_1", "iq4_nl", "q4_hadamard"])
def test_cache_bytes_are_layers_ctx_embd_bits(models, type_h):
    llm = _llm(models["gqa"], ctx_size=64)
    c = llm.config
    cache = make_cache(c, CacheSpec("hidden", type_h=type_h), 64, model=llm.model, attention=Attention())
    expect = c.n_layers * 64 * c.n_embd * STORAGE_TYPES[type_h].bits_per_element() / 8
    if type_h == "q4_hadamard":  # the f16 sink positions and the f32 offset, per layer
        expect += c.n_layers * c.n_embd * (N_SINK * 2 + 4)
    window = STORAGE_TYPES[type_h].default_window  # the recent window's f16 x, a fixed cost per layer
    expect += c.n_layers * window * c.n_embd * 2
    assert cache.nbytes() == expect == HiddenCache.bytes_needed(c.n_layers, 1, c.n_embd, 64, type_h, window)


def test_auto_picks_hidden_for_mha_and_kv_for_gqa(models):
    f16 = {"cache_mode": "auto", "cache_type_k": "f16", "cache_type_v": "f16", "cache_type_h": "f16"}
    mha, gqa = _llm(models["mha"], **f16), _llm(models["gqa"], **f16)
    assert isinstance(mha.cache, HiddenCache) and mha.cache_mode == "hidden"
    assert isinstance(gqa.cache, KVCache) and gqa.cache_mode == "kv"
    # at the chosen types: q4 K/V (4.5 + 4.5 bits x n_embd) beats f16 hidden (16 bits x n_embd) even for MHA
    assert resolve_cache_mode(mha.config, 32, "auto", "q4_0", "q4_0", "f16") == "kv"
    assert resolve_cache_mode(gqa.config, 32, "auto", "f32", "f32", "f16") == "hidden"
    assert resolve_cache_mode(gqa.config, 32, "auto", "f16", "f16", "q4_0") == "hidden"


def test_describe_shows_kv_size_and_warns_for_gqa(models):
    lines = []
    _llm(models["gqa"], cache_mode="hidden", cache_type_h="f16", log=lines.append)
    text = "\n".join(lines)
    # GQA 4/2 with n_embd 128: kv_dim 64, so hidden (128 wide) equals K+V (2 x 64): no warning
    assert "hidden cache: size =" in text and "an f16 K+V cache would take" in text
    assert text.count("warning:") == 0  # n_embd 128 == 2 * kv_dim 64: equal, not larger
    lines.clear()
    _llm(models["mha"], cache_mode="hidden", log=lines.append)
    assert "warning" not in "\n".join(lines)


def test_describe_warns_once_where_hidden_is_larger(tmp_path):
    path = write_gguf(make_hf_model(n_heads=4, n_kv_heads=1, hidden=128, seed=3), tmp_path / "gqa41.gguf")
    lines = []
    llm = _llm(path, cache_mode="hidden", cache_type_h="f16", log=lines.append)
    text = "\n".join(lines)
    assert text.count("warning:") == 1 and "4/1 heads" in text
    mib = llm.cache.nbytes() / 2**20
    assert f"({mib:.2f} MiB) is larger than an f16 K+V cache ({mib / 2:.2f} MiB)" in text


runner = CliRunner()


def _run(*args):
    return runner.invoke(app, ["run", *map(str, args)])


@pytest.mark.parametrize("args, words", [
    (["--cache-mode", "hidden", "-ctk", "q8_0"], ["-ctk/-ctv", "hidden"]),
    (["--cache-mode", "hidden", "-ctv", "f16"], ["-ctk/-ctv", "hidden"]),
    (["-cth", "q8_0"], ["-cth", "hidden or auto"]),
    (["--cache-mode", "kv", "--cache-type-h", "f16"], ["-cth"]),
    (["--cache-mode", "both"], ["--cache-mode"]),
    (["--cache-mode", "hidden", "-cth", "q3_k"], ["unknown cache type"]),
])
def test_cli_flag_errors(models, args, words):
    r = _run("-m", models["mha"], "-p", "hi", "-n", 1, "-c", 32, *args)
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, r.stderr
    for w in words:
        assert w in errors[0], errors[0]


def test_cli_hidden_run_equals_kv_run(models):
    common = ("-m", models["mha"], "-p", "the the", "-n", 6, "--temp", 0, "-c", 32, "--dtype", "f32")
    kv = _run(*common, "-ctk", "f32", "-ctv", "f32")
    hidden = _run(*common, "--cache-mode", "hidden", "-cth", "f32")
    auto = _run(*common, "--cache-mode", "auto", "-cth", "f32")
    assert kv.exit_code == hidden.exit_code == auto.exit_code == 0, hidden.output
    assert kv.stdout == hidden.stdout == auto.stdout
    # 2 layers x 32 cells x 64 x 4 bytes = 16 KiB; an f16 K+V cache: the same
    assert "hidden cache: size =    0.02 MiB (    32 cells,   2 layers" in hidden.stderr
    assert "x (f32):    0.02 MiB; an f16 K+V cache would take    0.02 MiB" in hidden.stderr


# ---- the Triton decode kernel, under TRITON_INTERPRET=1 on CPU ----

@pytest.mark.parametrize("type_h, dtype, tol", [("f32", "f32", 1e-4), ("f16", "f32", 1e-4), ("f16", "f16", 2e-3)])
@pytest.mark.parametrize("kind", ["mha", "gqa"])
def test_triton_kernel_equals_reference(models, kind, type_h, dtype, tol):
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set")
    from kvcli import kernel_table as table
    from kvcli.attention import attend_hidden_triton, attend_reference

    llm = _llm(models[kind], ctx_size=48, cache_mode="hidden", cache_type_h=type_h, dtype=dtype)
    cache, c = llm.cache, llm.config
    g = torch.Generator().manual_seed(0)
    pos = 40  # 41 keys: two 32-position tiles, the second partial
    for layer in range(c.n_layers):
        cache.h.store(layer, torch.randn(1, pos, cache.h.n_heads, cache.h.head_dim, generator=g), 0)
    x = torch.randn(1, 1, c.n_embd, generator=g)
    q = torch.randn(1, 1, c.n_heads, c.head_dim, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        cache.attention(0, q, None, None, x, pos)  # stores x at pos (CPU: the reference path)
        block = cache.block_kv[0]
        entry = table.choose(table.HIDDEN, "cuda", cache.h.kernel_layout().kind, decode=True, window=False,
                             head_dim=c.head_dim, dense_kv=hasattr(block.wkv, "w"), linear_kv=block.linear_kv)
        assert entry.run is attend_hidden_triton  # the table's CUDA entry covers this cache
        ref = attend_reference(q, cache, 0, pos)
        for splits in (1, 2):
            got = attend_hidden_triton(q, cache, 0, pos, num_splits=splits, block_n=32, block_e=32)
            assert got.shape == ref.shape
            assert (got - ref).abs().max() <= tol, (splits, (got - ref).abs().max())


# ---- GQA -> MHA rewrite ----

def test_mha_rewrite_gives_the_same_logits(models, tmp_path):
    from kvcli.convert.mha import gqa_to_mha

    dst = gqa_to_mha(models["gqa"], tmp_path / "mha.gguf")
    src_r, dst_r = gguf.GGUFReader(models["gqa"]), gguf.GGUFReader(dst)
    assert dst_r.fields["llama.attention.head_count_kv"].contents() == 4
    assert dst_r.fields["tokenizer.ggml.tokens"].contents() == src_r.fields["tokenizer.ggml.tokens"].contents()
    gqa, mha = _llm(models["gqa"]), _llm(dst)
    assert mha.config.n_kv_heads == mha.config.n_heads == 4
    assert (gqa.logits(IDS) - mha.logits(IDS)).abs().max() <= 1e-4
    # and the MHA form is where the hidden cache is half of K+V
    assert resolve_cache_mode(mha.config, 32, "auto") == "hidden"


def test_mha_rewrite_keeps_quantized_tensors(models, tmp_path):
    """attn_k/attn_v stored as Q8_0 are repeated block-row by block-row, type kept."""
    from kvcli.convert.mha import gqa_to_mha

    hf = make_hf_model(n_heads=4, n_kv_heads=2, hidden=128, seed=2)
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    from tiny import llama_permute

    raw = {"blk.0.attn_k.weight": (gguf.quants.quantize(llama_permute(sd["model.layers.0.self_attn.k_proj.weight"], 2),
                                                        gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0),
           "blk.0.attn_v.weight": (gguf.quants.quantize(sd["model.layers.0.self_attn.v_proj.weight"],
                                                        gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0)}
    src = write_gguf(hf, tmp_path / "q8.gguf", raw=raw)
    dst = gqa_to_mha(src, tmp_path / "q8_mha.gguf")
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(dst).tensors}
    assert types["blk.0.attn_k.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert (_llm(src).logits(IDS) - _llm(dst).logits(IDS)).abs().max() <= 1e-4
