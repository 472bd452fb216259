"""Layer (c): tiny random Qwen2/Qwen3 models (transformers' own classes) through `kvcli convert`, against
transformers: f32 logits in one prefill and token by token, KV and hidden-state caches, YaRN past the
original context; the converted layout as llama.cpp writes it; unsupported architectures and RoPE types."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvcli.config import ModelConfig
from kvcli.convert import convert_hf
from kvcli.errors import KvcliError
from kvcli.gguf_file import read_tensor
from kvcli.llama import Llama
from kvcli.rope import rope_table
from tiny import make_hf_qwen, qwen_tokenizer

VOCAB = 300
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}  # Qwen2.5's config.json form
CASES = {  # name -> make_hf_qwen kwargs
    "qwen2": dict(arch="qwen2"),
    "qwen3-mqa-tied": dict(arch="qwen3", n_kv_heads=1, tied=True),
    "qwen2-yarn": dict(arch="qwen2", rope_scaling=YARN, max_pos=64),
}
# 40 positions: past the YaRN case's original context of 16, inside its 64
IDS = [5, 77, 200, 13, 9, 150, 42, 42, 3, 99, 250, 1, 64, 128, 7, 31, 180, 222, 17, 80,
       11, 290, 4, 4, 160, 73, 38, 205, 99, 12, 6, 140, 260, 33, 71, 8, 190, 55, 27, 240]
WORDS = "the quick brown fox jumps over a lazy dog hello world qwen cache token key value rope head".split()


def _corpus(n: int = 400) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) + rng.choice([".", ",", "!", " 42."])
            for _ in range(n)]


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: one torch thread (two threads' hand-offs cost more than the products; conftest
    restores the count after each test)."""
    torch.set_num_threads(1)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(name, transformers model, converted f32 GGUF path, HF directory)."""
    model = make_hf_qwen(**CASES[request.param], vocab=VOCAB, seed=len(request.param))
    d = tmp_path_factory.mktemp(request.param) / "hf"
    model.save_pretrained(d)
    qwen_tokenizer(d, VOCAB, _corpus())
    path = convert_hf(d, d.parent / "m.gguf", outtype="f32", progress=False, log=lambda line: None)
    return request.param, model, path, d


def _reference(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


KV = dict(cache_type_k="f32", cache_type_v="f32")
HIDDEN = dict(cache_mode="hidden", cache_type_h="f32")
KEYS_LESS_BIAS = dict(KV, cache_key_bias="on")  # kvcli/cache/key_bias.py over f32: the same logits
CACHES = pytest.mark.parametrize("cache", [KV, HIDDEN, KEYS_LESS_BIAS], ids=["kv", "hidden", "kv-keys-less-bias"])


@CACHES
def test_logits_equal_transformers(case, cache):
    """One prefill, then the same ids token by token: both within 1e-4 of transformers."""
    _, model, path, _ = case
    ref = _reference(model)
    llm = Llama(path, ctx_size=64, dtype="f32", **cache)
    assert (llm.logits(IDS) - ref).abs().max().item() <= 1e-4
    steps = torch.stack([llm.eval([t]) for t in IDS])
    assert (steps - ref).abs().max().item() <= 1e-4


@CACHES
def test_small_batches_and_chunked_attention(case, cache, monkeypatch):
    """3-token batches over 8-position attention chunks: the hidden cache's values add bv times each
    chunk's own sum of p (the online softmax rescales chunks, so a bias added once would be wrong)."""
    import kvcli.attention

    _, model, path, _ = case
    monkeypatch.setattr(kvcli.attention, "CHUNK_BYTES", 1)  # -> the 256-position minimum
    monkeypatch.setattr(kvcli.attention, "MIN_CHUNK", 8)
    monkeypatch.setattr(kvcli.attention, "ROW_BLOCK", 2)  # query rows in blocks (one block over a hidden cache)
    llm = Llama(path, ctx_size=64, dtype="f32", batch_size=3, **cache)
    llm.eval(IDS[:7])
    steps = [llm.eval(IDS[7:12])] + [llm.eval([t]) for t in IDS[12:]]
    ref = _reference(model)
    assert (steps[0] - ref[11]).abs().max().item() <= 1e-4
    assert (torch.stack(steps[1:]) - ref[12:]).abs().max().item() <= 1e-4


def test_hidden_window_rebuilds_with_bias(case):
    """The hidden cache's recent window rebuilds its own K/V (bias, head norms included): a window holding
    every position gives the logits of plain f16 x."""
    _, _, path, _ = case
    plain = Llama(path, ctx_size=64, dtype="f32", cache_mode="hidden", cache_type_h="f16").logits(IDS)
    windowed = Llama(path, ctx_size=64, dtype="f32", cache_mode="hidden", cache_type_h="q8_0",
                     cache_window=64).logits(IDS)
    assert (plain - windowed).abs().max().item() <= 1e-5


def test_converted_layout_as_llama_cpp(case):
    """Tensor and key names as llama.cpp's Qwen2Model/Qwen3Model write them: Hugging Face's Q/K rows
    unpermuted (NEOX RoPE), biases or head norms in F32, no rope.dimension_count; the vocabulary's
    pre-tokenizer is qwen2 and kvcli tokenizes as the tokenizer.json does."""
    from tokenizers import Tokenizer

    name, model, path, d = case
    llm = Llama(path, ctx_size=16, dtype="f32")
    meta, tensors, arch = llm.gguf.metadata, llm.gguf.tensors, name[:5]
    assert meta["general.architecture"] == arch and f"{arch}.rope.dimension_count" not in meta
    attn = model.model.layers[0].self_attn
    assert np.array_equal(read_tensor(llm.gguf, "blk.0.attn_q.weight"), attn.q_proj.weight.detach().numpy())
    assert np.array_equal(read_tensor(llm.gguf, "blk.0.attn_k.weight"), attn.k_proj.weight.detach().numpy())
    extra = {"qwen2": ["attn_q.bias", "attn_k.bias", "attn_v.bias"], "qwen3": ["attn_q_norm.weight",
                                                                             "attn_k_norm.weight"]}[arch]
    for n in extra:
        assert tensors[f"blk.1.{n}"].tensor_type.name == "F32"
    if arch == "qwen2":
        assert np.array_equal(read_tensor(llm.gguf, "blk.0.attn_k.bias"), attn.k_proj.bias.detach().numpy())
    else:
        assert meta["qwen3.attention.key_length"] == 16  # config.json names head_dim
    assert ("output.weight" in tensors) == (not model.config.tie_word_embeddings)
    if "yarn" in name:
        assert meta["qwen2.rope.scaling.type"] == "yarn" and meta["qwen2.rope.scaling.factor"] == 4.0
        assert meta["qwen2.rope.scaling.original_context_length"] == 16
    else:
        assert f"{arch}.rope.scaling.type" not in meta
    assert meta["tokenizer.ggml.pre"] == "qwen2"
    text = "Hello world, it's the 42nd fox!\n\n  jumps"
    assert llm.tokenize(text, add_bos=False) == Tokenizer.from_file(str(d / "tokenizer.json")).encode(text).ids


def test_yarn_table_equals_transformers(case):
    """kvcli's rotations at every position are transformers' cos/sin (its YaRN inv_freq and attention scaling)."""
    name, model, path, _ = case
    c = Llama(path, ctx_size=16, dtype="f32").config
    n, D = 64, c.head_dim
    x = torch.zeros(1, n, D)
    cos, sin = model.model.rotary_emb(x, torch.arange(n)[None])  # (1, n, D): rotate_half layout, halves equal
    rot = rope_table(c, n)  # (n, D/2) complex
    assert (rot.real - cos[0, :, : D // 2]).abs().max().item() <= 1e-5
    assert (rot.imag - sin[0, :, : D // 2]).abs().max().item() <= 1e-5
    assert (c.rope_scaling == "yarn") == ("yarn" in name)


def _meta(arch: str, **extra) -> dict:
    keys = {"block_count": 1, "embedding_length": 64, "feed_forward_length": 128, "attention.head_count": 4}
    return {"general.architecture": arch} | {f"{arch}.{k}": v for k, v in (keys | extra).items()}


@pytest.mark.parametrize("meta, message", [
    (_meta("gemma2"), "unsupported architecture 'gemma2' (kvcli runs: llama, qwen2, qwen3)"),
    (_meta("qwen2", **{"rope.scaling.type": "longrope", "rope.scaling.factor": 4.0}),
     "rope scaling 'longrope' is not supported (kvcli supports none, linear, yarn)"),
], ids=["arch", "rope-type"])
def test_gguf_refusals_are_one_line(meta, message):
    with pytest.raises(KvcliError) as e:
        ModelConfig.from_metadata(meta, vocab_size=VOCAB)
    assert str(e.value) == message


@pytest.mark.parametrize("edit, message", [
    (lambda cfg: cfg.update(architectures=["Qwen2MoeForCausalLM"]), "unsupported architecture 'Qwen2MoeForCausalLM'"),
    (lambda cfg: cfg.update(rope_scaling={"rope_type": "longrope", "factor": 4.0}),
     "RoPE scaling 'longrope' is not supported (convert supports default, linear, llama3, yarn)"),
], ids=["arch", "rope-type"])
def test_convert_refusals_are_one_line(tmp_path, edit, message):
    """Refused from config.json alone, before any weight is read."""
    import json

    from transformers import Qwen2Config

    Qwen2Config(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=1).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text()) | {"architectures": ["Qwen2ForCausalLM"]}
    cfg.pop("rope_parameters", None)
    edit(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KvcliError) as e:
        convert_hf(tmp_path, tmp_path / "m.gguf", progress=False, log=lambda line: None)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "m.gguf").exists()
