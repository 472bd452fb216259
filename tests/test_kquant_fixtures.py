"""K-quant files made by llama.cpp's llama-quantize (tests/data/make_kquant_fixtures.py): each loads,
keeps Q4_K packed (int4) under native weights, and gives the same greedy tokens and close logits as
its own dequantized f32 weights, in kvcli and in transformers."""

from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kvcli.cli import app
from kvcli.sampler import Sampler
from kvcli.gguf_file import read_tensor
from kvcli.llama import Llama
from kvcli.shapes import weight_bytes
from kvcli.weights import FILE_BLOCKS, tensor_form
from tests.tiny import gguf_names, llama_permute, llama_unpermute

DATA = Path(__file__).parent / "data"
FIXTURES = sorted(p.name for p in DATA.glob("tiny-*.gguf"))
KW = dict(ctx_size=64, dtype="f32", cache_type_k="f32", cache_type_v="f32")
PROMPT, N_PREDICT = [7, 100, 33, 250, 12], 16
# Native against f32 weights: only Q4_K's bf16 scale/zero rounding and the bf16 decode products
# differ; logits here spread about +-1 (the measured differences: benchmarks/README.md).
NATIVE_BOUND = 0.03
HF_BOUND = 1e-4  # kvcli f32 against transformers f32: summation order only


def native_form(tensors: dict, name: str) -> str:
    """The resident form a matrix should get under native weights at --dtype f32: Q4_K as int4 tiles where torch's
    int4 GEMM is the best there is (no AVX2), regrouped by 8 rows where ggml_tiles' AVX2 kernel runs and its rows are whole tiles (not an embedding only looked up), the others in
    the file's own blocks."""
    return tensor_form(tensors, name, "native", "f32", "cpu") if tensors[name].tensor_type.name in FILE_BLOCKS \
        else "f32"


def hf_model(llm: Llama):
    """transformers' LlamaForCausalLM in f32 holding the file's dequantized weights, Q/K rows
    un-permuted back to Hugging Face's rotate-half order."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c, g = llm.config, llm.gguf
    tied = "output.weight" not in g.tensors
    cfg = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.n_embd, intermediate_size=c.n_ff,
                      num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
                      head_dim=c.head_dim, max_position_embeddings=c.context_length, rms_norm_eps=c.rms_eps,
                      rope_theta=c.rope_base, tie_word_embeddings=tied)
    sd = {}
    for hf_name, g_name in gguf_names(c.n_layers, tied).items():
        w = read_tensor(g, g_name)
        if g_name.endswith("attn_q.weight"):
            w = llama_unpermute(w, c.n_heads)
        elif g_name.endswith("attn_k.weight"):
            w = llama_unpermute(w, c.n_kv_heads)
        sd[hf_name] = torch.from_numpy(w)
    if tied:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    model = LlamaForCausalLM(cfg).eval()
    model.load_state_dict(sd, strict=True)
    return model


def greedy_hf(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def greedy(llm: Llama) -> list[int]:
    llm.reset()
    return list(llm.generate(PROMPT, n_predict=N_PREDICT, sampler=Sampler(temp=0), stop_at_eog=False))


def assert_same_greedy(got: list[int], want: list[int], ref: torch.Tensor, bound: float) -> None:
    """got == want, or they part at a step where the reference logits' best two lie within 2 bound
    (a near tie that logits good to `bound` may break either way); ref (T, V) over PROMPT + want."""
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is None:
        assert len(got) == len(want)
        return
    top2 = ref[len(PROMPT) - 1 + i].topk(2).values
    assert top2[0] - top2[1] <= 2 * bound, (i, got, want)


def test_unpermute_inverts_permute():
    w = np.arange(8 * 3 * 5, dtype=np.float32).reshape(8 * 3, 5)
    assert np.array_equal(llama_unpermute(llama_permute(w, 3), 3), w)


@pytest.fixture(scope="module", params=FIXTURES)
def fixture(request):
    path = DATA / request.param
    native, exact = Llama(path, **KW), Llama(path, weights="f32", **KW)
    return path, native, exact


def test_fixtures_are_there():
    assert FIXTURES == ["tiny-IQ4_XS.gguf", "tiny-Q2_K.gguf", "tiny-Q4_K_M.gguf", "tiny-Q5_K_M.gguf",
                        "tiny-Q6_K.gguf"]


def test_native_forms(fixture):
    """Each ggml type as native_form says; fused projections join their parts' forms."""
    _, native, _ = fixture
    tensors = native.gguf.tensors
    parts = {"wqkv": ("attn_q", "attn_k", "attn_v"), "wo": ("attn_output",), "w_gate_up": ("ffn_gate", "ffn_up"),
             "w_down": ("ffn_down",)}
    want = {"tok_embd": native_form(tensors, "token_embd.weight"), "output": native_form(tensors, "output.weight")}
    for i in range(native.config.n_layers):
        for k, names in parts.items():
            want[f"blk.{i}.{k}"] = "+".join(sorted({native_form(tensors, f"blk.{i}.{n}.weight") for n in names}))
    assert {n: f.name for n, f in native.model.forms().items()} == want


def test_greedy_and_logits_equal_f32_weights_and_transformers(fixture):
    path, native, exact = fixture
    hf = hf_model(exact)
    want = greedy_hf(hf, PROMPT, N_PREDICT)
    ids = PROMPT + want
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert_same_greedy(greedy(exact), want, ref, HF_BOUND)
    assert_same_greedy(greedy(native), want, ref, NATIVE_BOUND)
    assert (exact.logits(ids) - ref).abs().max().item() <= HF_BOUND
    assert (native.logits(ids) - ref).abs().max().item() <= NATIVE_BOUND  # one prefill batch
    native.reset()
    steps = torch.stack([native.eval([t]) for t in ids])  # decode: the int4 GEMM, bf16 activations
    assert (steps - ref).abs().max().item() <= NATIVE_BOUND


def test_weight_bytes_planned_equal_loaded(fixture):
    _, native, exact = fixture
    types = {n: t.tensor_type.name for n, t in native.gguf.tensors.items()}
    for llm, w in ((native, "native"), (exact, "f32")):
        assert weight_bytes(llm.config, "f32", True, w, types) == llm.model.weight_bytes()


def test_info_lists_resident_forms(fixture):
    path, native, _ = fixture
    r = CliRunner().invoke(app, ["info", str(path), "--dtype", "f32"])
    assert r.exit_code == 0, r.output
    rows = [[c.strip() for c in line.split("│")[1:-1]] for line in r.stdout.splitlines() if line.count("│") == 6]
    rows = [row for row in rows if row[2].isdigit()]  # the per-type table (tensors counted), not the others
    got = {(t, form, int(n)) for t, form, n, *_ in rows}
    counts: dict[tuple[str, str], int] = {}
    for name, t in native.gguf.tensors.items():
        key = (t.tensor_type.name, "f32" if t.tensor_type.name == "F32" else native_form(native.gguf.tensors, name))
        counts[key] = counts.get(key, 0) + 1
    assert got == {(t, form, n) for (t, form), n in counts.items()}
