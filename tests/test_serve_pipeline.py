"""`kvcli serve --pipeline` (issue 44): the server's steps over pipeline stages (gloo on 127.0.0.1). Concurrent greedy
requests give the single process's text and log-probabilities (the slots' steps cross the stages as one batch, in
micro-batches while more than one slot is busy), a killed rank ends the server in one line, flags that do not hold over
stages are refused."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from cli_checks import app, assert_clean_error, free_port, runner
from test_pipeline import _finish, _ranks, kill_rank_1, model4  # noqa: F401  (model4: the fixture)

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are"]


def _serve_argv(model, port: int, *flags) -> list[str]:
    return ["-m", "kvcli.cli", "serve", "-m", str(model), "--port", str(port), "-t", "1", *map(str, flags)]


def _healthy(procs: list[subprocess.Popen], base: str, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"a rank exited with {p.returncode}:\n{p.stderr.read()[-3000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"the server did not become healthy in {seconds} s")


def _completions(base: str, n_tokens: int, logprobs: int | None = None) -> list[dict]:
    """The PROMPTS at once (greedy), each its own request -> each one's first choice."""
    out: list = [None] * len(PROMPTS)

    def one(i: int) -> None:
        body = {"prompt": PROMPTS[i], "max_tokens": n_tokens, "temperature": 0} | (
            {"logprobs": logprobs} if logprobs else {})
        r = httpx.post(base + "/v1/completions", json=body, timeout=300)
        out[i] = r.json()["choices"][0] if r.status_code == 200 else r.text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _served(argvs: list[list[str]], port: int, n_tokens: int, logprobs: int | None = None) -> list[dict]:
    """Start the ranks (one: the single process), run the PROMPTS at once, stop the server: every rank exits 0."""
    procs = _ranks(argvs) if len(argvs) > 1 else [subprocess.Popen([sys.executable, *argvs[0]], stdout=subprocess.PIPE,
                                                                   stderr=subprocess.PIPE, text=True)]
    try:
        _healthy(procs, f"http://127.0.0.1:{port}")
        got = _completions(f"http://127.0.0.1:{port}", n_tokens, logprobs)
        procs[0].send_signal(signal.SIGINT)
        results = _finish(procs, timeout=60)
    finally:
        for p in procs:
            p.kill()
    assert [r[0] for r in results] == [0] * len(procs), [r[2][-2000:] for r in results]
    return got


def test_two_stages_serve_the_single_process_text(default_model):
    """SmolLM2, 4 slots, 4 requests at once: over 2 stages (micro-batches of 2 slots) the same greedy text."""
    port = free_port()
    flags = ("-np", 4, "-c", 2048)
    alone = _served([_serve_argv(default_model, port, *flags)], port, 32)
    port = free_port()
    staged = _served([_serve_argv(default_model, port, *flags, "--pipeline")] * 2, port, 32)
    assert all(isinstance(c, dict) for c in alone), alone
    assert [c["text"] for c in staged] == [c["text"] for c in alone]


@pytest.mark.parametrize("cache", [("-ctk", "f32", "-ctv", "f32"), ("--cache-mode", "hidden", "-cth", "f32")],
                         ids=["kv f32", "hidden f32"])
def test_three_stages_serve_the_single_process_logprobs(model4, cache):
    """f32 weights and cache (K/V: the slots rows of one cache; hidden: a cache each), 3 stages split 1,2,1 and 3 slots
    for 4 requests: each token's log-probabilities (and its top 3) within 1e-6 of the single process's."""
    flags = ("-np", 3, "-c", 384, "--weights", "f32", "--dtype", "f32", *cache)
    port = free_port()
    alone = _served([_serve_argv(model4, port, *flags)], port, 12, logprobs=3)
    port = free_port()
    staged = _served([_serve_argv(model4, port, *flags, "--pipeline", "--layer-split", "1,2,1")] * 3, port, 12,
                     logprobs=3)
    for a, s in zip(alone, staged):
        assert s["text"] == a["text"]
        la, ls = a["logprobs"], s["logprobs"]
        assert ls["tokens"] == la["tokens"]
        worst = max(abs(x - y) for x, y in zip(ls["token_logprobs"], la["token_logprobs"]))
        for ta, ts in zip(la["top_logprobs"], ls["top_logprobs"]):
            assert ta.keys() == ts.keys()
            worst = max([worst] + [abs(ta[k] - ts[k]) for k in ta])
        assert worst <= 1e-6, worst


@pytest.mark.parametrize("when", ["idle", "decoding"])
def test_a_killed_rank_ends_the_server_in_one_line(default_model, when):
    port = free_port()
    procs = _ranks([_serve_argv(default_model, port, "-np", 2, "--pipeline")] * 2)

    def serving() -> None:
        _healthy(procs, f"http://127.0.0.1:{port}")
        if when == "decoding":  # a long request in flight when the rank dies
            body = {"prompt": "the", "max_tokens": 100000, "temperature": 0, "stream": True}
            threading.Thread(target=lambda: httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                                                       timeout=120), daemon=True).start()
            time.sleep(3)

    took, error = kill_rank_1(procs, serving)
    print(f"{when}: rank 0's server ended {took:.2f} s after rank 1 was killed: {error}")


def test_serve_pipeline_flags_are_checked(model4, tmp_path):
    def serve(*flags):
        return runner.invoke(app, ["serve", "-m", str(model4), *map(str, flags)])

    assert_clean_error(serve("--pipeline", "--cache-ram", "100"), "--cache-ram")
    assert_clean_error(serve("--pipeline", "--slot-save-path", tmp_path), "--slot-save-path")
    assert_clean_error(serve("--layer-split", "2,2"), "--pipeline")
    results = _finish(_ranks([_serve_argv(model4, free_port(), "--pipeline", "-np", 2, "-c", 1024),
                              _serve_argv(model4, free_port(), "--pipeline", "-np", 4, "-c", 2048)]))
    for code, _, err in results:
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 1 and len(errors) == 1 and "rank 1 was started with another slots" in errors[0], err[-2000:]
