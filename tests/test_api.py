"""The Python API (kvcli.Llama): the README's example as written, from another directory, and
every mistake a caller can make raising KvcliError with one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvcli import KvcliError, Llama, Sampler

ROOT = Path(__file__).resolve().parents[1]


def _readme_python_example() -> str:
    """The indented block after "From Python:" in the README."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"From Python:\n\n((?:    .*\n|\n)+)", text).group(1)
    return "\n".join(line[4:] for line in block.rstrip().splitlines())


def test_readme_python_example_runs_from_any_directory(default_model, tmp_path):
    code = _readme_python_example()
    assert "Llama(" in code and "generate(" in code
    # KVCLI_MODELS names the folder that holds the default model, so nothing is fetched.
    env = dict(os.environ, KVCLI_MODELS=str(default_model.parent),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout, r.stdout  # SmolLM2's greedy continuation of "The capital of France is"


def one_line_error(call, *words) -> str:
    with pytest.raises(KvcliError) as e:
        call()
    message = str(e.value)
    assert message and "\n" not in message, message
    for w in words:
        assert w in message, message
    return message


@pytest.fixture(scope="module")
def llm(tiny):
    return Llama(tiny, ctx_size=32, dtype="f32")


def test_no_path_is_the_default_model_but_none_is_an_error(tiny, monkeypatch):
    import kvcli.llama

    monkeypatch.setattr(kvcli.llama, "pull_default", lambda log: tiny)  # what `kvcli run` without -m loads
    assert Llama(ctx_size=16).gguf.path == os.fspath(tiny)
    one_line_error(lambda: Llama(None), "model_path", "None", "default model")
    one_line_error(lambda: Llama(model_path=None), "model_path")
    one_line_error(lambda: Llama(42), "model_path", "42")
    one_line_error(lambda: Llama(tiny, ctx_size=-5), "ctx_size", "-5")
    one_line_error(lambda: Llama(tiny, n_seq=0), "n_seq")
    one_line_error(lambda: Llama(tiny, threads=-2), "threads", "-2")


def test_bad_model_paths(tmp_path):
    one_line_error(lambda: Llama(tmp_path / "nope.gguf"), "not found", "nope.gguf")
    one_line_error(lambda: Llama(tmp_path), "directory")
    text = tmp_path / "notes[1].gguf"
    text.write_text("not a model at all\n")
    one_line_error(lambda: Llama(str(text)), "not a GGUF", "notes[1].gguf")


def test_generate_takes_text_or_ids(llm):
    greedy = Sampler(temp=0)
    from_text = list(llm.generate("the the", n_predict=3, sampler=greedy))
    llm.reset()
    from_ids = list(llm.generate(llm.tokenize("the the", special=True), n_predict=3, sampler=greedy))
    assert len(from_text) == 3 and from_text == from_ids


def test_empty_or_bad_prompts_raise_at_the_call(llm):
    llm.reset()
    # raised by the call itself, before any iteration
    one_line_error(lambda: llm.generate([]), "empty")
    one_line_error(lambda: llm.generate(""), "empty")
    one_line_error(lambda: llm.generate([1, 10**7]), "10000000", "0..")
    one_line_error(lambda: llm.generate([-3]), "-3")
    one_line_error(lambda: llm.generate(list(range(5)) * 10), "do not fit", "32-token context")
    one_line_error(lambda: llm.eval([]), "empty")


def test_logits_refuses_what_it_cannot_run(llm):
    one_line_error(lambda: llm.logits([]), "empty")
    one_line_error(lambda: llm.logits([[1, 2], [3]]), "(B, T)")
    one_line_error(lambda: llm.logits([[[1]]]), "shape (1, 1, 1)")
    one_line_error(lambda: llm.logits([5, 10**7]), "10000000")
    assert llm.logits("the the").shape == (len(llm.tokenize("the the", special=True)), llm.config.vocab_size)


def test_detokenize_names_an_id_outside_the_vocabulary(llm):
    n = llm.tokenizer.vocab_size
    assert llm.detokenize(llm.tokenize("the the")) == "the the"
    for bad in (10**7, n, -1):
        one_line_error(lambda: llm.detokenize([bad]), str(bad), f"0..{n - 1}")
    one_line_error(lambda: llm.tokenizer.stream().push(-1), "-1")


def test_public_methods_are_documented():
    for name in ("__init__", "tokenize", "detokenize", "generate", "logits", "eval", "reset", "new_cache"):
        assert getattr(Llama, name).__doc__, name
    assert "Raises KvcliError" in Llama.__init__.__doc__ and "model_path" in Llama.__init__.__doc__


@pytest.mark.parametrize("threads", [1, 2])
def test_the_thread_count_holds_after_the_load(tiny, threads):
    """numba's OpenMP pool, started when the kernels load, set the OpenMP runtime torch shares to numba's count: -t 1
    ran on two cores. The count asked for (or set before the load, as `kvcli bench -t` does) holds after it."""
    import torch

    Llama(tiny, ctx_size=16, threads=threads)
    assert torch.get_num_threads() == threads
    torch.set_num_threads(threads)
    Llama(tiny, ctx_size=16)
    assert torch.get_num_threads() == threads
