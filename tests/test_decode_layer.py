"""The compiled decode layer (kvcli/decode_layer.py) gives the op-by-op path's bits: each decode token's logits equal,
on the files whose blocks it takes (every matrix in ggml_tiles' form), over the cache types it writes (dense, q8_0),
at one and two threads; and it steps aside where it does not apply (a window, another quantized type, a batch)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvcli.decode_layer
from kvcli.llama import Llama

DATA = Path(__file__).parent / "data"
MODELS = Path(__file__).parent.parent / "models"
PROMPT = [7, 100, 33, 250, 12, 5, 9]


def _files() -> list:
    out = [pytest.param(DATA / "tiny-Q4_K_M.gguf", id="tiny-Q4_K_M")]
    real = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
    out.append(pytest.param(real, id="smollm2", marks=pytest.mark.skipif(not real.exists(), reason=f"no {real}")))
    return out


def _decode_logits(llm: Llama, steps: int = 6) -> list[torch.Tensor]:
    """The prompt prefilled, then `steps` tokens one at a time (the greedy ones): each step's logits."""
    cache, model = llm.new_cache(llm.cache_spec), llm.model
    logits = model(torch.tensor([PROMPT]), cache, 0, last_only=True)
    out, pos = [], len(PROMPT)
    for _ in range(steps):
        token = int(logits[0, -1].argmax())
        logits = model(torch.tensor([[token]]), cache, pos)
        out.append(logits.clone())
        pos += 1
    return out


def _planned(llm: Llama) -> bool:
    return all(b._plan is not None for b in llm.model.blocks)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cache", ["f16", "f32", "bf16", "q8_0"])
@pytest.mark.parametrize("path", _files())
def test_compiled_layer_gives_the_op_by_op_bits(path, cache, threads, monkeypatch):
    llm = Llama(path, ctx_size=64, cache_type_k=cache, cache_type_v=cache, threads=threads)
    fused = _decode_logits(llm)
    if not _planned(llm):
        pytest.skip(f"{path.name}: the compiled layer does not apply on this machine (no AVX2 tiles)")
    monkeypatch.setattr(kvcli.decode_layer, "plan", lambda block, cache: None)
    for b in llm.model.blocks:
        b._plan_for = None
    plain = _decode_logits(llm)
    assert not any(b._plan is not None for b in llm.model.blocks)
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kw", [dict(cache_type_k="q4_0", cache_type_v="q4_0"), dict(cache_window=16,
                                cache_type_k="q4_hadamard", cache_type_v="q4_hadamard"), dict(n_seq=2)],
                         ids=["q4_0", "window", "two-sequences"])
def test_it_steps_aside_where_it_does_not_apply(kw):
    llm = Llama(DATA / "tiny-Q4_K_M.gguf", ctx_size=64, threads=1, **kw)
    _decode_logits(llm, steps=1)
    assert all(b._plan is None for b in llm.model.blocks)
