"""Tiny random Llama models written to GGUF the way llama.cpp's converter does (for tests)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from kvcli.bpe import bytes_to_unicode


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face rotate-half rows -> GGUF adjacent-pair rows (llama.cpp's `permute`)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """GGUF adjacent-pair rows -> Hugging Face rotate-half rows: the inverse of llama_permute."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_vocab() -> tuple[list[str], list[int]]:
    """A GPT-2 byte-level vocab: the 256 byte symbols, a few merges' results, one control token."""
    tokens = list(bytes_to_unicode().values()) + ["Ġt", "he", "Ġthe", "<|endoftext|>"]
    types = [1] * (len(tokens) - 1) + [3]
    return tokens, types


def make_hf_model(n_heads=4, n_kv_heads=2, tied=False, n_layers=2, hidden=64, seed=0, vocab=None, n_ff=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = vocab or len(byte_vocab()[0])
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=n_ff or hidden * 3,
                      num_hidden_layers=n_layers,
                      num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, max_position_embeddings=256,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied, bos_token_id=vocab - 1,
                      eos_token_id=vocab - 1)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norms so a wrong norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def gguf_names(n_layers: int, tied: bool) -> dict[str, str]:
    """Hugging Face Llama parameter name -> GGUF tensor name (llama.cpp's converter)."""
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not tied:
        names["lm_head.weight"] = "output.weight"
    for i in range(n_layers):
        hf, g = f"model.layers.{i}.", f"blk.{i}."
        names |= {hf + "input_layernorm.weight": g + "attn_norm.weight",
                  hf + "self_attn.q_proj.weight": g + "attn_q.weight",
                  hf + "self_attn.k_proj.weight": g + "attn_k.weight",
                  hf + "self_attn.v_proj.weight": g + "attn_v.weight",
                  hf + "self_attn.o_proj.weight": g + "attn_output.weight",
                  hf + "post_attention_layernorm.weight": g + "ffn_norm.weight",
                  hf + "mlp.gate_proj.weight": g + "ffn_gate.weight",
                  hf + "mlp.up_proj.weight": g + "ffn_up.weight",
                  hf + "mlp.down_proj.weight": g + "ffn_down.weight"}
    return names


def write_gguf(model, path: Path, arch: str = "llama", drop: str | None = None, overrides: dict | None = None,
               raw: dict | None = None) -> Path:
    """Write `model` (a LlamaForCausalLM) as an f32 GGUF. `drop` leaves a tensor out, `overrides`
    replaces tensors by GGUF name, `raw` maps a GGUF name to (bytes ndarray, GGMLQuantizationType)."""
    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    names = gguf_names(cfg.num_hidden_layers, cfg.tie_word_embeddings)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta if hasattr(cfg, "rope_theta") else cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    tokens, types = byte_vocab()
    if cfg.vocab_size == len(tokens):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(["Ġ t", "h e", "Ġt he"])
        w.add_bos_token_id(len(tokens) - 1)
        w.add_eos_token_id(len(tokens) - 1)
        w.add_add_bos_token(False)
    for hf_name, g_name in names.items():
        if g_name == drop:
            continue
        t = sd[hf_name]
        if g_name.endswith("attn_q.weight"):
            t = llama_permute(t, cfg.num_attention_heads)
        elif g_name.endswith("attn_k.weight"):
            t = llama_permute(t, cfg.num_key_value_heads)
        if overrides and g_name in overrides:
            t = overrides[g_name]
        if raw and g_name in raw:
            data, qtype = raw[g_name]
            w.add_tensor(g_name, data, raw_dtype=qtype)
        else:
            w.add_tensor(g_name, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def make_hf_qwen(arch: str = "qwen2", n_heads=4, n_kv_heads=2, tied=False, n_layers=2, hidden=64, head_dim=16,
                 seed=0, vocab=300, rope_scaling: dict | None = None, max_pos=256):
    """A tiny random Qwen2ForCausalLM / Qwen3ForCausalLM (transformers' own classes), f32. Norms, Qwen2's
    q,k,v biases and Qwen3's head norms are random too (transformers starts biases at 0, norms at 1),
    so that a dropped or misplaced one shows in the logits."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    extra = {"head_dim": head_dim} if arch == "qwen3" else {}  # Qwen3's default head_dim is 128
    cfg = config_cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3, num_hidden_layers=n_layers,
                     num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, max_position_embeddings=max_pos,
                     rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0,
                     rope_scaling=rope_scaling, **extra)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    return model


# Qwen2's pre-tokenizer regex, as Qwen2.5's tokenizer.json has it (a Split before a regex-less ByteLevel).
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")


def qwen_tokenizer(d: Path, vocab: int, corpus: list[str]) -> None:
    """A byte-level BPE of `vocab` ids trained on corpus with Qwen2's pre-tokenizer and its three control
    tokens (<|endoftext|> first: id 0), written to d as tokenizer.json + tokenizer_config.json."""
    import json

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.decoder = decoders.ByteLevel()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_REGEX), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab, special_tokens=special, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.get_vocab_size() == vocab, tok.get_vocab_size()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|endoftext|>",
        "add_bos_token": False}))
