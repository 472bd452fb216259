"""Layer (c): tiny random Llama models, GGUF-written like llama.cpp's converter, against transformers."""

import pytest
import torch

from kvcli.llama import Llama
from tiny import make_hf_model, write_gguf

CASES = {"gqa": dict(n_heads=4, n_kv_heads=2), "mha": dict(n_heads=4, n_kv_heads=4),
         "mqa-tied": dict(n_heads=4, n_kv_heads=1, tied=True)}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    hf = make_hf_model(**CASES[request.param], seed=len(request.param))
    path = write_gguf(hf, tmp_path_factory.mktemp("tiny") / "tiny.gguf")
    return hf, path


def reference(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


IDS = [5, 77, 200, 13, 9, 150, 42, 42, 3, 99, 250, 1, 64, 128, 7, 31, 180, 222, 17, 80]


def test_prefill_logits_equal(pair):
    hf, path = pair
    llm = Llama(path, ctx_size=64, dtype="f32", cache_type_k="f32", cache_type_v="f32")
    assert (llm.logits(IDS) - reference(hf, IDS)).abs().max().item() <= 1e-4


def test_token_by_token_logits_equal(pair):
    hf, path = pair
    llm = Llama(path, ctx_size=64, dtype="f32", cache_type_k="f32", cache_type_v="f32")
    steps = torch.stack([llm.eval([t]) for t in IDS])
    assert (steps - reference(hf, IDS)).abs().max().item() <= 1e-4


def test_small_batches_and_chunked_attention(pair, monkeypatch):
    """Prefill in 3-token batches with 8-position attention chunks (online softmax path) and blocks of 4 query rows."""
    import kvcli.attention

    hf, path = pair
    monkeypatch.setattr(kvcli.attention, "CHUNK_BYTES", 1)  # -> the 256-position minimum
    monkeypatch.setattr(kvcli.attention, "MIN_CHUNK", 8)
    monkeypatch.setattr(kvcli.attention, "ROW_BLOCK", 4)
    llm = Llama(path, ctx_size=64, dtype="f32", cache_type_k="f32", cache_type_v="f32", batch_size=3)
    llm.eval(IDS[:7])
    steps = [llm.eval(IDS[7:12])] + [llm.eval([t]) for t in IDS[12:]]
    ref = reference(hf, IDS)
    assert (steps[0] - ref[11]).abs().max().item() <= 1e-4
    assert (torch.stack(steps[1:]) - ref[12:]).abs().max().item() <= 1e-4


def test_batch_of_sequences(pair):
    hf, path = pair
    llm = Llama(path, ctx_size=32, dtype="f32", cache_type_k="f32", cache_type_v="f32", n_seq=2)
    a, b = IDS[:10], IDS[10:]
    got = llm.logits([a, b])
    assert (got[0] - reference(hf, a)).abs().max().item() <= 1e-4
    assert (got[1] - reference(hf, b)).abs().max().item() <= 1e-4


def test_f16_compute_close(pair):
    """f16 weights and cache: rounding only (weights ~1e-3 relative), far below a logit's spread."""
    hf, path = pair
    llm = Llama(path, ctx_size=64, dtype="f16")
    assert (llm.logits(IDS) - reference(hf, IDS)).abs().max().item() <= 2e-2
