"""`kvcli convert` (convert/): tiny random Hugging Face Llama checkpoints -> GGUF -> kvcli vs transformers."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
import torch
import typer
from typer.testing import CliRunner

from kvcli.convert import convert_hf
from kvcli.commands.convert import convert_command
from kvcli.convert.hf_to_gguf import permute_qk
from kvcli.errors import KvcliError
from kvcli.llama import Llama
from tiny import llama_permute, make_hf_model

VOCAB = 300
WORDS = "the quick brown fox jumps over a lazy dog hello world llama cache token key value rope head".split()
IDS = [5, 77, 200, 13, 9, 150, 42, 42, 3, 99, 250, 1, 64, 128, 7, 31, 180, 222, 17, 80]
TEXTS = ["Hello world", "the quick brown fox", " leading space", "two  spaces\nand a new line",
         "ünïcödé 🦙 12345 3.14", "x"]


def _corpus(n: int = 400) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))) + rng.choice([".", ",", "!", " 42."])
            for _ in range(n)]


def _spm_tokenizer(d):
    """A Llama-style SentencePiece model: BPE, byte fallback, no normalisation (as Llama 2's)."""
    import sentencepiece

    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_corpus()), model_prefix=str(d / "tokenizer"), vocab_size=VOCAB, model_type="bpe",
        byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, normalization_rule_name="identity",
        remove_extra_whitespaces=False, minloglevel=2)
    (d / "tokenizer.vocab").unlink()
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False, "legacy": False,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}))


def _bpe_tokenizer(d):
    """A GPT-2 style byte-level BPE trained here, written as tokenizer.json (ids 0..VOCAB-1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    assert tok.get_vocab_size() == VOCAB
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}))


def _save(d, model, tokenizer, **save_kw):
    d.mkdir(parents=True, exist_ok=True)
    special = (1, 2) if tokenizer is _spm_tokenizer else (0, 0)  # <s>, </s> / <|endoftext|>
    for cfg in (model.config, model.generation_config):
        cfg.bos_token_id, cfg.eos_token_id = special
    model.save_pretrained(d, **save_kw)
    tokenizer(d)
    return d


CASES = {  # name -> (make_hf_model kwargs, tokenizer)
    "gqa-untied-spm": (dict(n_heads=4, n_kv_heads=2, tied=False), _spm_tokenizer),
    "mha-tied-bpe": (dict(n_heads=4, n_kv_heads=4, tied=True), _bpe_tokenizer),
    "mqa-untied-bpe": (dict(n_heads=4, n_kv_heads=1, tied=False, n_layers=1), _bpe_tokenizer),
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    kw, tokenizer = CASES[request.param]
    model = make_hf_model(**kw, vocab=VOCAB, seed=len(request.param))
    d = _save(tmp_path_factory.mktemp(request.param) / "hf", model, tokenizer)
    return request.param, model, d


def _reference(model, ids=IDS):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _kvcli(path, ctx=64):
    return Llama(path, ctx_size=ctx, dtype="f32", cache_type_k="f32", cache_type_v="f32")


def _meta(path):
    return _kvcli(path).gguf.metadata


def test_permutation_matches_llama_cpp():
    w = np.random.default_rng(0).standard_normal((8 * 16, 24)).astype(np.float32)
    assert np.array_equal(permute_qk(w, 8), llama_permute(w, 8))
    assert np.array_equal(permute_qk(w[:32], 2), llama_permute(w[:32], 2))


def test_f32_logits_equal_transformers(checkpoint, tmp_path):
    name, model, d = checkpoint
    out = convert_hf(d, tmp_path / "m.gguf", outtype="f32", progress=False, log=lambda line: None)
    llm = _kvcli(out)
    assert (llm.logits(IDS) - _reference(model)).abs().max().item() <= 1e-4
    names = set(llm.gguf.tensors)
    assert ("output.weight" in names) == (not model.config.tie_word_embeddings)
    q = model.model.layers[0].self_attn.q_proj.weight.detach().numpy()
    from kvcli.gguf_file import read_tensor
    n_heads = model.config.num_attention_heads
    assert np.array_equal(read_tensor(llm.gguf, "blk.0.attn_q.weight"), llama_permute(q, n_heads))
    assert all(llm.gguf.tensors[n].tensor_type.name == "F32" for n in names if n.endswith("norm.weight"))


# Weight rounding bounds the error: f16 keeps 11 significant bits (relative error <= 2**-11 per
# weight), bf16 8 bits (2**-8), q8_0 stores each 32-weight block as int8 times a block scale (error
# <= max|w|/254 per weight). Through 1-2 layers these independent errors partly cancel: measured max
# |diff| here is ~2.6e-4 (f16), ~2e-3 (bf16), ~7e-3 (q8_0) on logits spanning +-0.6..1.5, so each
# tolerance is 3-8x the measured error and still far below what a wrong tensor or permutation gives.
@pytest.mark.parametrize("outtype, tol", [("f16", 2e-3), ("bf16", 1e-2), ("q8_0", 2e-2)])
def test_lossy_outtypes_close_to_transformers(checkpoint, tmp_path, outtype, tol):
    name, model, d = checkpoint
    out = convert_hf(d, tmp_path / "m.gguf", outtype=outtype, progress=False, log=lambda line: None)
    llm = _kvcli(out)
    ref = _reference(model)
    assert ref.abs().max().item() > 0.1  # the tolerance is small against the logits it checks
    assert (llm.logits(IDS) - ref).abs().max().item() <= tol
    types = {t.name: t.tensor_type.name for t in llm.gguf.tensors.values()}
    assert types["blk.0.ffn_up.weight"] == outtype.upper() and types["output_norm.weight"] == "F32"


def test_q4_0_runs_and_keeps_output_head_q8_0(checkpoint, tmp_path):
    name, model, d = checkpoint
    out = convert_hf(d, tmp_path / "m.gguf", outtype="q4_0", progress=False, log=lambda line: None)
    llm = _kvcli(out)
    types = {t.name: t.tensor_type.name for t in llm.gguf.tensors.values()}
    head = "token_embd.weight" if model.config.tie_word_embeddings else "output.weight"
    assert types["blk.0.attn_q.weight"] == "Q4_0" and types[head] == "Q8_0"
    got, ref = llm.logits(IDS), _reference(model)
    # 4-bit weights: not close elementwise, but the logits must still follow the original's
    assert torch.corrcoef(torch.stack([got.flatten(), ref.flatten()]))[0, 1].item() > 0.9


def test_token_ids_equal_original_tokenizer(checkpoint, tmp_path):
    name, model, d = checkpoint
    out = convert_hf(d, tmp_path / "m.gguf", outtype="f16", progress=False, log=lambda line: None)
    llm = _kvcli(out)
    if name.endswith("spm"):
        # transformers 5's LlamaTokenizer needs protobuf to read tokenizer.model (not installed here), so
        # the reference is the sentencepiece model itself, with BOS as tokenizer_config.json asks.
        import sentencepiece

        sp = sentencepiece.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
        reference = lambda text: [sp.bos_id()] + sp.encode(text)  # noqa: E731
        assert llm.tokenizer.chat_template is not None
    else:
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))
        reference = lambda text: hf(text)["input_ids"]  # noqa: E731
        assert llm.gguf.metadata["tokenizer.ggml.pre"] == "gpt-2"
    for text in TEXTS:
        assert llm.tokenize(text) == reference(text), text
    assert llm.tokenizer.eos_id == model.config.eos_token_id


def test_sharded_checkpoint_converts(tmp_path):
    model = make_hf_model(n_heads=4, n_kv_heads=2, vocab=VOCAB, seed=3)
    d = _save(tmp_path / "hf", model, _bpe_tokenizer, max_shard_size="40KB")
    assert len(list(d.glob("*.safetensors"))) > 2 and (d / "model.safetensors.index.json").is_file()
    out = convert_hf(d, tmp_path / "m.gguf", outtype="f32", progress=False, log=lambda line: None)
    assert (_kvcli(out).logits(IDS) - _reference(model)).abs().max().item() <= 1e-4


def test_pytorch_bin_bf16_checkpoint(tmp_path):
    """pytorch_model.bin (read with weights_only=True) holding bf16 weights: f32 output is exact."""
    model = make_hf_model(n_heads=4, n_kv_heads=2, tied=True, vocab=VOCAB, seed=4)
    model = model.to(torch.bfloat16).float()  # the reference sees the same bf16-rounded weights
    d = _save(tmp_path / "hf", model, _bpe_tokenizer)
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    (d / "model.safetensors").unlink()
    torch.save(state, d / "pytorch_model.bin")
    out = convert_hf(d, tmp_path / "m.gguf", outtype="f32", progress=False, log=lambda line: None)
    assert (_kvcli(out).logits(IDS) - _reference(model)).abs().max().item() <= 1e-4


def test_llama3_rope_and_mistral(tmp_path):
    """rope_type llama3 -> a rope_freqs tensor; MistralForCausalLM without a sliding window."""
    from transformers import MistralConfig, MistralForCausalLM

    model = make_hf_model(n_heads=4, n_kv_heads=2, vocab=VOCAB, seed=5)
    model.config.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 16}
    d = _save(tmp_path / "llama3", model, _bpe_tokenizer)
    model = type(model).from_pretrained(d).eval()  # rebuilt with the llama3 rotary embedding
    out = convert_hf(d, tmp_path / "l3.gguf", outtype="f32", progress=False, log=lambda line: None)
    llm = _kvcli(out)
    assert "rope_freqs.weight" in llm.gguf.tensors  # (llama3 vs plain RoPE moves these logits by ~6e-3)
    assert (llm.logits(IDS) - _reference(model)).abs().max().item() <= 1e-4

    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        sliding_window=None, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(6)
    mistral = MistralForCausalLM(cfg).eval()
    d = _save(tmp_path / "mistral", mistral, _bpe_tokenizer)
    out = convert_hf(d, tmp_path / "mi.gguf", outtype="f32", progress=False, log=lambda line: None)
    assert (_kvcli(out).logits(IDS) - _reference(mistral)).abs().max().item() <= 1e-4


def test_unrecognized_bpe_pre_tokenizer_warns_and_writes_default(tmp_path):
    from tokenizers import Tokenizer, pre_tokenizers

    model = make_hf_model(n_heads=4, n_kv_heads=2, vocab=VOCAB, seed=7)
    d = _save(tmp_path / "hf", model, _bpe_tokenizer)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.save(str(d / "tokenizer.json"))
    lines = []
    out = convert_hf(d, tmp_path / "m.gguf", outtype="f16", progress=False, log=lines.append)
    assert _meta(out)["tokenizer.ggml.pre"] == "default"
    assert any(line.startswith("warning: BPE pre-tokenizer not recognized") for line in lines)


# --- failure leaves nothing behind ----------------------------------------------------------------

@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("small") / "hf", make_hf_model(vocab=VOCAB, seed=8), _bpe_tokenizer)


class Boom(Exception):
    pass


@pytest.mark.parametrize("existing", [False, True], ids=["fresh", "force-over-existing"])
def test_interrupted_convert_leaves_no_output_and_no_temp(small_dir, tmp_path, monkeypatch, existing):
    import kvcli.convert.hf_to_gguf as hf_to_gguf

    real, calls = hf_to_gguf._encode, []

    def failing(item):  # fail on the 5th tensor: the header and 4 tensors are already on disk
        calls.append(item.name)
        if len(calls) == 5:
            assert any(tmp_path.glob(".m.gguf.*.tmp"))
            raise Boom("disk full")
        return real(item)

    monkeypatch.setattr(hf_to_gguf, "_encode", failing)
    out = tmp_path / "m.gguf"
    if existing:
        out.write_bytes(b"old")
    with pytest.raises(Boom):
        convert_hf(small_dir, out, outtype="q8_0", force=existing, progress=False, log=lambda line: None)
    assert len(calls) == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == (["m.gguf"] if existing else [])
    if existing:
        assert out.read_bytes() == b"old"


# --- the CLI ------------------------------------------------------------------------------------------

def _cli(*args):
    app = typer.Typer()
    app.command()(convert_command)
    return CliRunner().invoke(app, [str(a) for a in args])


def _error_line(result) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.output
    return lines[0]


def _broken_copy(small_dir, tmp_path, edit=None):
    d = tmp_path / "hf"
    shutil.copytree(small_dir, d)
    if edit:
        cfg = json.loads((d / "config.json").read_text())
        edit(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_cli_converts_and_refuses_to_overwrite(small_dir, tmp_path):
    out = tmp_path / "m.gguf"
    result = _cli(small_dir, "-o", out, "--outtype", "q8_0")
    assert result.exit_code == 0, result.output
    assert out.is_file() and "wrote" in result.output
    before = out.read_bytes()
    assert "--force" in _error_line(_cli(small_dir, "-o", out))
    assert out.read_bytes() == before
    assert _cli(small_dir, "-o", out, "--outtype", "f32", "--force").exit_code == 0
    assert _meta(out)["general.file_type"] == 0  # ALL_F32
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def _set(key, value):
    return lambda cfg: cfg.__setitem__(key, value)


@pytest.mark.parametrize("edit, message", [
    (_set("architectures", ["GPT2LMHeadModel"]), "unsupported architecture 'GPT2LMHeadModel'"),
    (_set("intermediate_size", 100), "has shape [192, 64], config.json implies [100, 64]"),
    (_set("num_attention_heads", "four"), "num_attention_heads must be a positive integer"),
    (lambda cfg: cfg.update(architectures=["MistralForCausalLM"], sliding_window=64), "sliding_window 64"),
    (_set("rope_parameters", {"rope_type": "longrope", "factor": 4.0}), "RoPE scaling 'longrope' is not supported"),
    (_set("num_hidden_layers", 1), "unexpected tensor model.layers.1."),
    (_set("num_hidden_layers", 3), "checkpoint lacks tensor model.layers.2."),
], ids=["arch", "shape", "type", "sliding-window", "rope", "extra-tensor", "missing-tensor"])
def test_cli_config_errors(small_dir, tmp_path, edit, message):
    d = _broken_copy(small_dir, tmp_path, edit)
    assert message in _error_line(_cli(d, "-o", tmp_path / "m.gguf"))
    assert not (tmp_path / "m.gguf").exists()


def test_cli_file_errors(small_dir, tmp_path):
    out = tmp_path / "m.gguf"
    assert "model directory not found" in _error_line(_cli(tmp_path / "nope", "-o", out))
    assert "unknown --outtype 'q5_k'" in _error_line(_cli(small_dir, "-o", out, "--outtype", "q5_k"))
    assert "output directory does not exist" in _error_line(_cli(small_dir, "-o", tmp_path / "no" / "m.gguf"))

    d = _broken_copy(small_dir, tmp_path)
    (d / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    assert "malformed config.json" in _error_line(_cli(d, "-o", out))
    (d / "config.json").unlink()
    assert "config.json not found" in _error_line(_cli(d, "-o", out))

    d = _broken_copy(small_dir, tmp_path / "b")
    (d / "tokenizer.json").unlink()
    assert "no tokenizer" in _error_line(_cli(d, "-o", out))
    (d / "model.safetensors").unlink()
    assert "no weights" in _error_line(_cli(d, "-o", out))


def test_cli_unsupported_dtype(small_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _broken_copy(small_dir, tmp_path)
    state = load_file(d / "model.safetensors")
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"].double()
    save_file(state, d / "model.safetensors")
    assert "unsupported dtype F64" in _error_line(_cli(d, "-o", tmp_path / "m.gguf"))


def test_cli_refuses_pickled_code(small_dir, tmp_path):
    """pytorch_model.bin is read with weights_only=True: anything but tensors is refused, not run."""
    import argparse

    from safetensors.torch import load_file

    d = _broken_copy(small_dir, tmp_path)
    state = dict(load_file(d / "model.safetensors"), extra=argparse.Namespace(x=1))
    (d / "model.safetensors").unlink()
    torch.save(state, d / "pytorch_model.bin")
    assert "refusing to unpickle" in _error_line(_cli(d, "-o", tmp_path / "m.gguf"))


def test_library_errors_are_kvcli_errors(small_dir, tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"")
    with pytest.raises(KvcliError, match="exists; pass --force"):
        convert_hf(small_dir, tmp_path / "m.gguf", progress=False)
    with pytest.raises(KvcliError, match="not a directory"):
        convert_hf(small_dir / "config.json", tmp_path / "x.gguf", progress=False)


def test_out_type_rules():
    """llama.cpp's choices: 1-D stays F32; a row length the block does not divide falls back to F16."""
    from kvcli.convert.hf_to_gguf import _out_type

    class H:
        tied = False

    assert _out_type("q8_0", "blk.0.attn_norm.weight", (64,), H).name == "F32"
    assert _out_type("q8_0", "blk.0.ffn_up.weight", (192, 64), H).name == "Q8_0"
    assert _out_type("q8_0", "blk.0.ffn_down.weight", (64, 200), H).name == "F16"
    assert _out_type("q4_0", "output.weight", (300, 64), H).name == "Q8_0"
    assert _out_type("bf16", "blk.0.ffn_down.weight", (64, 200), H).name == "BF16"


def test_cli_without_o_names_the_output_as_llama_cpp(small_dir, tmp_path):
    """No -o: the file goes into the model directory, named as convert_hf_to_gguf.py names it
    (gguf-py's naming convention): `<dir name>[-<size label>]-<OUTTYPE>.gguf`."""
    d = tmp_path / "tinyllama"
    shutil.copytree(small_dir, d)
    result = _cli(d)
    assert result.exit_code == 0, result.output
    out = d / "tinyllama-137K-F16.gguf"  # 137,024 parameters, counted as llama.cpp does
    assert out.is_file() and f"wrote {out}" in result.output, (sorted(p.name for p in d.iterdir()), result.output)
    assert _meta(out)["general.file_type"] == 1  # MOSTLY_F16
    # As with -o: an existing file is refused in one line unless --force.
    before = out.read_bytes()
    assert f"{out} exists; pass --force" in _error_line(_cli(d))
    assert out.read_bytes() == before
    assert _cli(d, "--force").exit_code == 0

    # A name that already carries a size label keeps it; the type is upper case, as llama.cpp's;
    # -o DIR puts that name in DIR (llama.cpp's --outfile DIR).
    d, dest = tmp_path / "Tiny-1.5B-Chat", tmp_path / "ggufs"
    shutil.copytree(small_dir, d)
    dest.mkdir()
    result = _cli(d, "--outtype", "q8_0", "-o", dest)
    assert result.exit_code == 0, result.output
    assert [p.name for p in dest.iterdir()] == ["Tiny-1.5B-Chat-Q8_0.gguf"]
