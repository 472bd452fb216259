"""A model's layers over several processes (issue 44, kvcli/pipeline.py), gloo on 127.0.0.1: the logits of 1, 2 and
3 stages equal the single process's (f32 weights and cache, the hidden-state cache, a quantized type with a window),
greedy text equal through `kvcli run --pipeline`, a killed rank ends the run in one line, a mismatched rank is refused.
The ranks are started as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), one process each."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cli_checks import assert_clean_error, free_port, run
from kvcli.errors import KvcliError
from kvcli.llama import Llama
from kvcli.pipeline import split
from tiny import make_hf_model, write_gguf

TESTS = Path(__file__).parent
CASES = {"f32": dict(cache_type_k="f32", cache_type_v="f32"),
         "hidden f32": dict(cache_mode="hidden", cache_type_h="f32"),
         "tq3, window 16": dict(cache_type_k="tq3", cache_type_v="tq3", cache_window=16),
         "per-layer mix": dict(cache_type_k="q8_0=0-1+tq3", cache_type_v="tq3")}


@pytest.fixture(scope="module")
def model4(tmp_path_factory) -> Path:
    """A tiny llama of 4 layers, head size 64 (every cache type fits), untied head."""
    return write_gguf(make_hf_model(n_heads=4, n_kv_heads=2, hidden=256, n_layers=4),
                      tmp_path_factory.mktemp("pipe") / "m4.gguf")


def _ranks(argvs: list[list[str]], **kw) -> list[subprocess.Popen]:
    """One process per rank, with torchrun's environment."""
    port = str(free_port())
    procs = []
    for rank, argv in enumerate(argvs):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(len(argvs)),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
        procs.append(subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, **kw))
    return procs


def _finish(procs: list[subprocess.Popen], timeout: float = 300) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=timeout)
        finally:
            p.kill()
        out.append((p.returncode, o, e))
    return out


STAGES = """
import torch
from kvcli.cache import CacheSpec
from kvcli.llama import Llama
from kvcli.pipeline import start
from test_pipeline import CASES, _steps
stages, log = start({model!r}, {split!r}, CacheSpec(), 256, "f32", "f32", "cpu")
got = {{}}
for case, kw in CASES.items():  # one model and cache after another through the same stages
    llm = Llama({model!r}, ctx_size=256, batch_size=64, dtype="f32", weights="f32", threads=1, pipeline=stages, **kw)
    if stages[0].first:
        got[case] = _steps(llm)
        llm.pipe.stop()
    else:
        llm.pipe.serve()
if stages[0].first:
    torch.save(got, {out!r})
stages[1].close()
"""


def _steps(llm: Llama) -> list[torch.Tensor]:
    """A prompt's logits (3 batches of 64), then decode steps' logits."""
    ids = torch.randint(0, 250, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    out = [llm.logits(ids)]
    llm.eval(ids)
    return out + [llm.eval([t]) for t in (5, 17, 99, 3)]


def test_stages_equal_the_single_process(model4, tmp_path):
    want = {case: _steps(Llama(model4, ctx_size=256, batch_size=64, dtype="f32", weights="f32", threads=1, **kw))
            for case, kw in CASES.items()}
    for n, layer_split in ((1, None), (2, None), (3, "1,2,1")):
        out = tmp_path / f"{n}.pt"
        code = STAGES.format(model=str(model4), split=layer_split, out=str(out))
        results = _finish(_ranks([["-c", code]] * n))
        assert all(r[0] == 0 for r in results), [r[2][-2000:] for r in results]
        got = torch.load(out)
        for case in CASES:
            worst = max((g - w).abs().max().item() for g, w in zip(got[case], want[case]))
            print(f"{n} stages, {case}: largest logit difference {worst:.3g}")
            assert worst <= 1e-6, (n, case, worst)


def _run_argv(model, *flags) -> list[str]:
    return ["-m", "kvcli.cli", "run", "-m", str(model), "--temp", "0", "-t", "1", *map(str, flags)]


def test_greedy_text_through_kvcli_run(default_model):
    flags = ("-p", "The three primary colors are", "-n", 24, "--ignore-eos")
    alone = subprocess.run([sys.executable, *_run_argv(default_model, *flags)], capture_output=True, text=True,
                           timeout=300)
    assert alone.returncode == 0, alone.stderr
    results = _finish(_ranks([_run_argv(default_model, *flags, "--pipeline")] * 2))
    assert [r[0] for r in results] == [0, 0], [r[2][-2000:] for r in results]
    assert results[0][1] == alone.stdout and results[1][1] == ""  # rank 0 writes the text, the other nothing
    assert "rank 1 of 2: layers 15-29, output" in results[1][2] and "[rank 1] KV cache" in results[1][2]


def test_a_killed_rank_ends_the_run_in_one_line(default_model):
    procs = _ranks([_run_argv(default_model, "-p", "the", "-n", 100000, "-c", 100000, "--ignore-eos", "--pipeline",
                              "--no-display-prompt")] * 2)

    def writing() -> None:
        ready, _, _ = select.select([procs[0].stdout], [], [], 300)
        assert ready and os.read(procs[0].stdout.fileno(), 100), "no tokens from rank 0"

    took, error = kill_rank_1(procs, writing)
    print(f"rank 0 ended {took:.2f} s after rank 1 was killed: {error}")


def kill_rank_1(procs: list[subprocess.Popen], first) -> tuple[float, str]:
    """Once first() returns, SIGKILL rank 1: rank 0 must end within 30 s with one error line naming it, no traceback
    -> (seconds, line). Every rank is killed on the way out."""
    try:
        first()
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        _, err = procs[0].communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert procs[0].returncode == 1 and len(errors) == 1 and "rank 1" in errors[0], err[-2000:]
    assert "Traceback" not in err and took < 30
    return took, errors[0]


def test_a_mismatched_rank_is_refused_before_the_first_token(model4, tmp_path):
    other = write_gguf(make_hf_model(n_heads=4, n_kv_heads=2, hidden=256, n_layers=4, seed=3), tmp_path / "o.gguf")
    for second, words in (([*_run_argv(model4, "-p", "ab", "-n", 2, "--pipeline", "-ctk", "q8_0")], "cache"),
                          ([*_run_argv(other, "-p", "ab", "-n", 2, "--pipeline")], "model file")):
        results = _finish(_ranks([_run_argv(model4, "-p", "ab", "-n", 2, "--pipeline"), second]))
        for code, out, err in results:
            errors = [line for line in err.splitlines() if line.startswith("error:")]
            assert code == 1 and out == "" and len(errors) == 1, err[-2000:]
            assert "rank 1 was started with another " + words in errors[0], errors[0]


def test_pipeline_flags_are_checked(model4):
    env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k in os.environ}
    try:
        assert_clean_error(run("-m", model4, "-p", "ab", "--pipeline"), "torchrun")
    finally:
        os.environ.update(env)
    assert_clean_error(run("-m", model4, "-p", "ab", "--layer-split", "2,2"), "--pipeline")
    assert split(24, 2) == [range(0, 12), range(12, 24)] and split(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    assert split(24, 2, "10,14") == [range(0, 10), range(10, 24)]
    for bad in ("10,10", "a,b", "24", "0,24"):
        with pytest.raises(KvcliError, match="--layer-split"):
            split(24, 2, bad)


def test_perplexity_over_stages_equals_one_process(model4, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    argv = ["-m", "kvcli.cli", "perplexity", "-m", str(model4), "-f", str(text), "-c", 128, "--chunks", 3, "-t", 1,
            "-ctk", "tq3", "-ctv", "tq3"]
    argv = list(map(str, argv))
    alone = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0, alone.stderr[-2000:]
    final = [ln for ln in alone.stdout.splitlines() if ln.startswith("Final estimate")]
    results = _finish(_ranks([argv + ["--pipeline", "--layer-split", "3,1"]] * 2))
    assert [r[0] for r in results] == [0, 0], [r[2][-2000:] for r in results]
    assert final and [ln for ln in results[0][1].splitlines() if ln.startswith("Final estimate")] == final


def test_fit_plans_each_rank(model4):
    from typer.testing import CliRunner

    from kvcli.cli import app
    from kvcli.fit import stages_table, weight_bytes
    from kvcli.gguf_file import open_gguf

    g = open_gguf(model4)
    one = weight_bytes(g, "f16")
    rows, best, ranks = stages_table(g, "f16", "native", "cpu", 300 << 20, 256, {}, None, 2, "3,1")
    assert [list(s.layers) for s, _ in ranks] == [[0, 1, 2], [3]]
    assert ranks[0][1] + ranks[1][1] == one  # untied: the embedding on the first, the head on the last, once each
    r = CliRunner().invoke(app, ["fit", "-m", str(model4), "--mem", "300MiB", "--stages", "2", "--layer-split", "3,1"])
    assert r.exit_code == 0, r.output
    assert "rank 0 of 2: layers 0-2, embedding: weights" in r.output and "--pipeline --layer-split 3,1" in r.output


def test_prompt_cache_over_stages(model4, tmp_path):
    """--prompt-cache with --pipeline: a file a rank (rank 1's beside rank 0's), restored by the next run over the same
    stages (the single process's text); a rank's missing file, or rank 0's file in one process, refused in one line."""
    f = tmp_path / "p.state"
    first, longer = "the quick brown fox", "the quick brown fox jumps over the lazy"
    flags = ("-n", 6, "-c", 256, "--prompt-cache", f, "--pipeline", "--no-display-prompt")
    results = _finish(_ranks([_run_argv(model4, "-p", first, *flags)] * 2))
    assert [r[0] for r in results] == [0, 0], [r[2][-2000:] for r in results]
    assert f.exists() and (tmp_path / "p.state.rank1").exists()
    alone = subprocess.run([sys.executable, *_run_argv(model4, "-p", longer, "-n", 6, "-c", 256, "--no-display-prompt")],
                           capture_output=True, text=True, timeout=300)
    results = _finish(_ranks([_run_argv(model4, "-p", longer, *flags)] * 2))
    assert [r[0] for r in results] == [0, 0], [r[2][-2000:] for r in results]
    assert results[0][1] == alone.stdout and "tokens restored from" in results[0][2]
    (tmp_path / "p.state.rank1").unlink()
    results = _finish(_ranks([_run_argv(model4, "-p", longer, *flags)] * 2))
    errors = [line for line in results[0][2].splitlines() if line.startswith("error:")]
    assert results[0][0] == 1 and len(errors) == 1 and "rank 1" in errors[0] and "p.state.rank1" in errors[0], \
        results[0][2][-2000:]
    assert_clean_error(run("-m", model4, "-p", longer, "-n", 2, "-c", 256, "--prompt-cache", f), "stage")
