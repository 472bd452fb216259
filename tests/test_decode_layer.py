"""The compiled decode layer (kvcli/decode_layer.py) gives the op-by-op path's bits: each decode token's logits equal,
on the files whose blocks it takes (every matrix in ggml_tiles' form), at one and two threads, in one call over the
cache types it writes itself (dense, q8_0; the rotated types' window between its flushes) and in two around the
cache's attention for the others (a flush, other types, mixed K/V kinds, the hidden-state cache); and it steps aside
for a batch."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import kvcli.decode_layer
from kvcli.llama import Llama

DATA = Path(__file__).parent / "data"
MODELS = Path(__file__).parent.parent / "models"
PROMPT = [7, 100, 33, 250, 12, 5, 9]


@pytest.fixture(scope="module")
def qwen2_q8_0(tmp_path_factory) -> Path:
    """A tiny random qwen2 (q, k, v biases, NEOX pairs; head size 64) converted to Q8_0."""
    from kvcli.convert import convert_hf
    from tiny import make_hf_qwen, qwen_tokenizer

    d = tmp_path_factory.mktemp("qwen2") / "hf"
    make_hf_qwen(arch="qwen2", hidden=256, vocab=300, seed=3).save_pretrained(d)
    rng = random.Random(0)
    qwen_tokenizer(d, 300, ["".join(rng.choice("abcdefgh ijklmnop.qrstuvwxyz") for _ in range(60)) for _ in range(400)])
    return convert_hf(d, d.parent / "m.gguf", outtype="q8_0", progress=False, log=lambda line: None)


def _files() -> list:
    out = [pytest.param(DATA / "tiny-Q4_K_M.gguf", id="tiny-Q4_K_M"), pytest.param("qwen2_q8_0", id="qwen2-q8_0")]
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


def _op_by_op(llm: Llama, monkeypatch) -> None:
    """No compiled layer from here on (the plans made so far forgotten)."""
    monkeypatch.setattr(kvcli.decode_layer, "plan", lambda block, cache=None, rows=False: None)
    for b in llm.model.blocks:
        b._plan_for, b._halves, b._rows_for = None, None, None


def _planned(llm: Llama) -> bool:
    return all(b._plan is not None for b in llm.model.blocks)


ONE_CALL = ("f16", "f32", "bf16", "q8_0")
# the default suite keeps one case of each mode (f16 and q8_0 in one call, tq4's window, two calls around tq3/f16 and
# the hidden state); each further dense type or rotated kind compiles the layer again: `-m slow`
SLOW = pytest.mark.slow


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cache", ["f16", "q8_0", "tq4", "tq3/f16", "hidden", pytest.param("f32", marks=SLOW),
                                   pytest.param("bf16", marks=SLOW), pytest.param("q4_0", marks=SLOW),
                                   pytest.param("q4_hadamard", marks=SLOW)])
@pytest.mark.parametrize("path", _files())
def test_compiled_layer_gives_the_op_by_op_bits(path, cache, threads, monkeypatch, request):
    path = request.getfixturevalue(path) if isinstance(path, str) else path
    kw = dict(cache_mode="hidden") if cache == "hidden" else dict(zip(("cache_type_k", "cache_type_v"),
                                                                      (cache.split("/") * 2)[:2]))
    llm = Llama(path, ctx_size=128, threads=threads, **kw)
    fused = _decode_logits(llm, steps=70 if "tq" in cache else 6)  # past a window's flush (tq4: 64 positions)
    if not _planned(llm):
        pytest.skip(f"{path.name}: the compiled layer does not apply on this machine (no AVX2 tiles)")
    assert all((b._plan.views is not None) == (cache in ONE_CALL) for b in llm.model.blocks)
    assert all((b._plan.window is not None) == (cache in ("tq4", "q4_hadamard")) for b in llm.model.blocks)
    _op_by_op(llm, monkeypatch)
    plain = _decode_logits(llm, steps=len(fused))
    assert not any(b._plan is not None for b in llm.model.blocks)
    for a, b in zip(fused, plain):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cache", ["f16", "tq4"])
def test_compiled_layer_in_the_scaled_basis(cache, monkeypatch):
    """Keys scaled for the queries (--key-scales on, kvcli/cache/key_scale.py): the compiled layer scales q and k as the
    cache's attention does, in one call (f16) and over tq4's window: the op-by-op bits."""
    llm = Llama(DATA / "tiny-Q4_K_M.gguf", ctx_size=128, threads=1, cache_type_k=cache, cache_type_v=cache,
                cache_key_scales="on")
    fused = _decode_logits(llm, steps=70 if cache == "tq4" else 6)
    if not _planned(llm):
        pytest.skip("the compiled layer does not apply on this machine (no AVX2 tiles)")
    assert all(b._plan.weights[6].size == (llm.config.n_heads + llm.config.n_kv_heads) * llm.config.head_dim
               for b in llm.model.blocks)  # the layer's multipliers handed to the compiled call
    _op_by_op(llm, monkeypatch)
    for a, b in zip(fused, _decode_logits(llm, steps=len(fused))):
        assert torch.equal(a, b)


def test_it_steps_aside_for_a_batch():
    llm = Llama(DATA / "tiny-Q4_K_M.gguf", ctx_size=64, threads=1, n_seq=2)
    cache = llm.new_cache(llm.cache_spec)
    llm.model(torch.tensor([PROMPT, PROMPT]), cache, 0)
    llm.model(torch.tensor([[3], [4]]), cache, len(PROMPT))
    assert all(b._plan_for is None or b._plan_for() is not cache for b in llm.model.blocks)  # (the load's scratch's)


@pytest.mark.parametrize("cache,threads,scales", [("f16", 1, "off"), ("q8_0", 2, "off"), ("f16", 1, "on")])
def test_a_server_step_gives_the_op_by_op_bits(monkeypatch, cache, threads, scales):
    """Slots' steps (Transformer.forward_slots): three prompts in one step of 15 tokens through the compiled halves
    around Slots' attention, then a decode token each in one call over the rows (DecodeLayer.rows): the op-by-op
    logits (keys scaled for the queries too: the rows' call scales q and k as the cache does)."""
    from kvcli.serve.slots import Slots

    llm = Llama(DATA / "tiny-Q4_K_M.gguf", ctx_size=64, threads=threads, n_seq=3, cache_type_k=cache,
                cache_type_v=cache, cache_key_scales=scales)
    prompts = [PROMPT, PROMPT[:3], PROMPT[2:]]

    def steps() -> list[torch.Tensor]:
        cache = llm.new_cache(llm.cache_spec)
        rows = [cache.rows(b, b + 1) for b in range(3)]
        n = [len(p) for p in prompts]
        first = llm.model.forward_slots(prompts, Slots(rows, [0] * 3, n), [0] * 3)
        return [first, llm.model.forward_slots([[4], [5], [6]], Slots(rows, n, [1] * 3), n)]

    fused = steps()
    if not all(b._halves for b in llm.model.blocks):
        pytest.skip("the compiled layer does not apply on this machine (no AVX2 tiles)")
    assert all(b._rows_plan is not None for b in llm.model.blocks)  # the decode step: one call a layer
    _op_by_op(llm, monkeypatch)
    for a, b in zip(fused, steps()):
        assert torch.equal(a, b)
