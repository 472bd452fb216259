"""Layer (d): the real SmolLM2-135M-Instruct GGUF against transformers' GGUF loader (f32)."""

import pytest
import torch

from kvcli.sampler import Sampler
from kvcli.llama import Llama

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWhat is 12 times 7?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def hf_tok(default_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model.parent, gguf_file=default_model.name)


@pytest.fixture(scope="module", params=["f32", "f16"])
def llm(request, default_model):
    return Llama(default_model, ctx_size=256, dtype="f32", cache_type_k=request.param, cache_type_v=request.param,
                 weights="f32")  # the exact reference path


def test_logits_match_transformers(llm, hf_default_model, hf_tok):
    ids = hf_tok("The quick brown fox jumps over the lazy dog. " * 4)["input_ids"]
    with torch.no_grad():
        ref = hf_default_model(torch.tensor([ids])).logits[0]
    tol = 1e-3 if llm.cache.k.name == "f32" else 0.1  # f16 cache: K/V rounded to 11 bits
    assert (llm.logits(ids) - ref).abs().max().item() <= tol


@pytest.fixture(scope="module")
def hf_continuations(hf_default_model, hf_tok):
    """transformers' greedy 32-token continuation of each prompt (computed once)."""
    out = {}
    for prompt in PROMPTS:
        ids = hf_tok(prompt)["input_ids"]
        with torch.no_grad():
            gen = hf_default_model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                            eos_token_id=None, pad_token_id=0)
        out[prompt] = (ids, gen[0, len(ids):].tolist())
    return out


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_continuation_matches_transformers(llm, hf_continuations, prompt):
    ids, ref = hf_continuations[prompt]
    llm.reset()
    got = list(llm.generate(ids, n_predict=32, sampler=Sampler(temp=0), stop_at_eog=False))
    assert got == ref
