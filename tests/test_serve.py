"""`kvcli serve` against a live server on 127.0.0.1 (issue 18): the official `openai` client, streamed and
not, chat and completion, greedy text equal to `kvcli run --temp 0`; four concurrent streams equal to
their solo runs; every fault of point 4; /metrics through prometheus_client's parser; the flags."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from importlib import resources
from pathlib import Path

import httpx
import pytest

from cli_checks import assert_clean_error, free_port, runner
from kvcli.cli import app

openai = pytest.importorskip("openai")
parser = pytest.importorskip("prometheus_client.parser")

KEY = "test-key"
SLOT = 256  # -c 1024 over -np 4
# f32 weights, compute and cache: a batched step and a solo one, or a prompt's last token evaluated alone
# (a reused prefix) and within its prompt, agree to rounding, so greedy texts match (the packed Q4_1
# product of native weights rounds differently for one row than for many)
EXACT = ["--dtype", "f32", "--weights", "f32", "-ctk", "f32", "-ctv", "f32", "-t", "1"]
SYSTEM = "You are a helpful assistant."


def _kvcli() -> str:
    return shutil.which("kvcli", path=str(Path(sys.executable).parent)) or "kvcli"


def _start(model: Path, *flags) -> tuple[subprocess.Popen, str]:
    """`kvcli serve` on a free port; returns once /health says ok (bounded), with its base URL."""
    port = free_port()
    proc = subprocess.Popen([_kvcli(), "serve", "-m", str(model), "--port", str(port), *map(str, flags)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"kvcli serve exited with {proc.returncode}:\n{proc.stdout.read()}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("kvcli serve did not become healthy in 120 s")


def _stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.stdout.read()


@pytest.fixture(scope="module")
def server(default_model, kvcli_run):  # the kvcli run comparisons start first and run beside it
    proc, base = _start(default_model, "-c", 4 * SLOT, "-np", 4, "--queue", 1, "--api-key", KEY, *EXACT)
    yield base
    log = _stop(proc)  # SIGINT: exit code 0 (test_sigterm_ends_streams_and_exits_0 sends SIGTERM mid-stream)
    assert proc.returncode == 0 and "Traceback" not in log, log


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _post(base: str, path: str, body, key: str | None = KEY, **kw) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, (dict, list)):
        return httpx.post(base + path, json=body, headers=headers, timeout=60, **kw)
    return httpx.post(base + path, content=body, headers=headers | {"Content-Type": "application/json"},
                      timeout=60, **kw)


def _metrics(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    return {s.name: s.value for fam in parser.text_string_to_metric_families(text) for s in fam.samples}


def _wait_metric(base: str, name: str, value: float, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _metrics(base)[name] == value:
            return
        time.sleep(0.05)
    raise AssertionError(f"{name} did not reach {value} in {seconds} s: {_metrics(base)[name]}")


CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]
COMPLETION = "The three primary colors are"


@pytest.fixture(scope="module")
def kvcli_run(default_model):
    """What `kvcli run --temp 0` prints on stdout with the server's settings (one slot's context), for the
    chat (-cnv -p: the system prompt, the user turn on stdin) and the completion; started at once, in
    the background, while the server loads."""
    common = [_kvcli(), "run", "-m", str(default_model), "--temp", "0", "-c", str(SLOT), "-n", "16", *EXACT]
    runs = {"chat": (common + ["-cnv", "-p", SYSTEM], CHAT[1]["content"] + "\n"),
            "completion": (common + ["-p", COMPLETION, "--no-display-prompt"], "")}
    procs = {k: subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, (argv, _) in runs.items()}

    def result(kind: str) -> str:
        out, err = procs[kind].communicate(runs[kind][1], timeout=300)
        assert procs[kind].returncode == 0, err
        return out

    yield result
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.communicate()


# ---- the openai client, greedy, against kvcli run ----

def test_chat_equals_kvcli_run(server, client, kvcli_run):
    r = client.chat.completions.create(model="x", messages=CHAT, temperature=0, max_tokens=16)
    text = r.choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="x", messages=CHAT, temperature=0, max_tokens=16, stream=True) if c.choices)
    assert text and text == streamed == kvcli_run("chat").removesuffix("\n")  # the reply, then a newline
    assert r.usage.completion_tokens <= 16 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model_extra["timings"]["predicted_n"] == r.usage.completion_tokens


def test_completion_equals_kvcli_run(server, client, kvcli_run):
    r = client.completions.create(model="x", prompt=COMPLETION, temperature=0, max_tokens=16)
    chunks = list(client.completions.create(model="x", prompt=COMPLETION, temperature=0, max_tokens=16, stream=True))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    expected = kvcli_run("completion").removesuffix("\n").removesuffix(" [end of text]")
    assert r.choices[0].text and r.choices[0].text == streamed == expected
    last = chunks[-1].model_dump()  # the final chunk carries the finish, usage and timings
    assert last["choices"][0]["finish_reason"] in ("stop", "length") and last["usage"]["completion_tokens"] > 0
    assert last["timings"]["prompt_n"] + last["timings"]["cache_n"] == last["usage"]["prompt_tokens"]


def test_second_turn_reuses_the_cached_prefix(server, client):
    messages = [{"role": "user", "content": "Name a fruit."}]
    first = client.chat.completions.create(model="x", messages=messages, temperature=0, max_tokens=8)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And a vegetable?"}]
    second = client.chat.completions.create(model="x", messages=messages, temperature=0, max_tokens=8)
    t = second.model_extra["timings"]
    assert t["cache_n"] >= first.usage.prompt_tokens and t["cache_n"] + t["prompt_n"] == second.usage.prompt_tokens


def test_stop_strings_and_logprobs(server, client):
    r = client.completions.create(model="x", prompt="1, 2, 3, 4, 5,", temperature=0, max_tokens=16, stop=[" 8"])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text.endswith("7,") and " 8" not in r.choices[0].text
    c = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                       max_tokens=4, logprobs=True, top_logprobs=2)
    items = c.choices[0].logprobs.content
    assert len(items) == c.usage.completion_tokens
    for it in items:  # greedy: the token drawn is the most likely one
        assert len(it.top_logprobs) == 2 and it.top_logprobs[0].token == it.token and it.logprob <= 0


def test_ignore_eos_generates_every_token(server, client):
    kw = dict(model="x", messages=[{"role": "user", "content": "What is 2 + 2?"}], temperature=0, max_tokens=48)
    short = client.chat.completions.create(**kw)  # the model ends its answer (an end-of-generation token)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 48
    full = client.chat.completions.create(**kw, extra_body={"ignore_eos": True})  # llama-server's field
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 48
    assert full.choices[0].message.content.startswith(short.choices[0].message.content)


def test_four_concurrent_streams_equal_their_solo_runs(server, client):
    prompts = ["Tell me about the sea.", "What is 2 + 2?", "Write a haiku about snow.", "Who wrote Hamlet?"]

    def ask(p, stream):
        kw = dict(model="x", messages=[{"role": "user", "content": p}], temperature=0, max_tokens=16)
        if not stream:
            return client.chat.completions.create(**kw).choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                       if c.choices)

    solo = [ask(p, False) for p in prompts]
    out = [None] * 4

    def worker(i):
        out[i] = ask(prompts[i], True)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert out == solo


# ---- faults (issue 18, point 4) ----

def test_api_key(server):
    body = {"prompt": "Hi", "max_tokens": 1}
    for key in (None, "wrong"):
        r = _post(server, "/v1/completions", body, key=key)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert _post(server, "/v1/completions", body).status_code == 200
    assert httpx.get(server + "/health", timeout=10).json() == {"status": "ok"}  # open, as llama-server's
    assert httpx.get(server + "/metrics", timeout=10).status_code == 401


@pytest.mark.parametrize("body, words", [
    (b'{"messages": [', "not valid JSON"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": [""]}, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
    ({"messages": "hi"}, "messages"),
    ([1, 2], "body"),
])
def test_bad_requests_are_400_with_an_openai_error(server, body, words):
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400 and words in err["message"], err


def test_prompt_longer_than_a_slot(server, client):
    prompt = "hello " * 400
    n = len(_post(server, "/tokenize", {"content": prompt}).json()["tokens"])
    with pytest.raises(openai.BadRequestError, match=f"{n} tokens.*{SLOT} tokens"):
        client.completions.create(model="x", prompt=prompt, max_tokens=4)
    r = _post(server, "/v1/completions", {"prompt": [0, 10 ** 9]})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    r = httpx.get(server + "/nope", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_slot_context_end_finishes_with_length(server, client):
    numbers, n = "", 0
    while len(_post(server, "/tokenize", {"content": numbers}).json()["tokens"]) < SLOT - 24:
        n += 1
        numbers += f"{n}, "
    r = client.completions.create(model="x", prompt=numbers, temperature=0, max_tokens=1000)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == SLOT + 1  # the last token drawn is never evaluated: the slot holds SLOT


def _open_stream(base: str, max_tokens: int = 200):
    """A streamed completion, its first content chunk read: the request holds a slot."""
    stream = httpx.Client(timeout=60).stream(
        "POST", base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
        json={"prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True, "temperature": 0})
    response = stream.__enter__()
    assert response.status_code == 200
    lines = response.iter_lines()
    assert next(line for line in lines if line.startswith("data: {"))
    return stream, lines


def test_disconnect_frees_the_slot_and_a_full_queue_is_503(server, client):
    streams = [_open_stream(server) for _ in range(4)]  # every slot busy
    assert _metrics(server)["kvcli:requests_processing"] == 4
    waiting = {}
    t = threading.Thread(target=lambda: waiting.update(r=_post(server, "/v1/completions",
                                                              {"prompt": "Hi", "max_tokens": 2})))
    t.start()  # the queue's one place (--queue 1)
    _wait_metric(server, "kvcli:requests_deferred", 1)
    r = _post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 503 and "busy" in r.json()["error"]["message"]
    for stream, _ in streams:  # the clients leave mid-stream
        stream.__exit__(None, None, None)
    t.join(timeout=60)
    assert waiting["r"].status_code == 200
    _wait_metric(server, "kvcli:requests_processing", 0)
    assert client.completions.create(model="x", prompt="Hi", max_tokens=2, temperature=0).usage.completion_tokens


# ---- the other endpoints ----

def test_metrics_parse_and_props(server, client):
    client.completions.create(model="x", prompt="Hello", max_tokens=2)
    text = httpx.get(server + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    families = {f.name: f for f in parser.text_string_to_metric_families(text)}
    for name in ("prompt_tokens", "tokens_predicted", "prompt_tokens_seconds", "predicted_tokens_seconds",
                 "requests_processing", "requests_deferred", "kv_cache_bytes", "kv_cache_bytes_in_use",
                 "kv_cache_cells", "kv_cache_cells_in_use"):
        assert f"kvcli:{name}" in families and families[f"kvcli:{name}"].documentation, name
    m = _metrics(server)
    assert m["kvcli:prompt_tokens_total"] > 0 and m["kvcli:tokens_predicted_total"] >= 2
    props = httpx.get(server + "/props", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    assert set(props) == {"model", "total_slots", "n_ctx", "n_ctx_slot", "cache", "chat_template", "prompt_cache_ram"}
    assert props["prompt_cache_ram"]["budget_bytes"] == 8192 << 20  # llama-server's default --cache-ram
    assert set(props["cache"]) == {"mode", "type_k", "type_v", "type_h", "window", "bytes", "bytes_in_use", "cells",
                                   "cells_in_use"}
    c = props["cache"]
    assert (props["total_slots"], props["n_ctx"], props["n_ctx_slot"]) == (4, 4 * SLOT, SLOT)
    assert (c["mode"], c["type_k"], c["type_v"], c["type_h"], c["window"]) == ("kv", "f32", "f32", None, 0)
    # f32 K and V: 30 layers x 4 slots x 256 cells x kv_dim 192 x 4 bytes x 2, the real allocation
    assert c["bytes"] == m["kvcli:kv_cache_bytes"] == 30 * 4 * SLOT * 192 * 4 * 2 and c["cells"] == 4 * SLOT
    assert 0 < c["cells_in_use"] <= c["cells"] and c["bytes_in_use"] == c["bytes"] * c["cells_in_use"] // c["cells"]
    assert props["model"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and props["chat_template"] is True


def test_slots_and_no_slot_files_without_a_save_path(server, client):
    slots = httpx.get(server + "/slots", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3] and all(s["n_ctx"] == SLOT for s in slots)
    r = _post(server, "/slots/0?action=save", {"filename": "x.bin"})
    assert r.status_code == 501 and "--slot-save-path" in r.json()["error"]["message"]


def test_tokenize_detokenize_and_models(server, client):
    auth = {"Authorization": f"Bearer {KEY}"}
    text = "Hello world, ça va?"
    ids = httpx.post(server + "/tokenize", json={"content": text}, headers=auth, timeout=10).json()["tokens"]
    assert ids and all(isinstance(i, int) for i in ids)
    back = httpx.post(server + "/detokenize", json={"tokens": ids}, headers=auth, timeout=10).json()
    assert back == {"content": text}
    pieces = httpx.post(server + "/tokenize", json={"content": text, "with_pieces": True}, headers=auth,
                        timeout=10).json()["tokens"]
    assert [p["id"] for p in pieces] == ids and any(isinstance(p["piece"], list) for p in pieces)  # ç: 2 tokens
    assert b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode()
                    for p in pieces) == text.encode()
    assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]


def test_chat_page(server):
    if not resources.files("kvcli.serve").joinpath("chat.html").is_file():
        pytest.skip("kvcli/serve/chat.html is not in this checkout (the chat page comes from its own branch)")
    r = httpx.get(server + "/", timeout=10)  # open without the key, as llama-server's page
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html") and "<html" in r.text.lower()


def test_readme_openai_example(server):
    """The README's `openai` example as written, pointed at this server (its key, a short reply)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"With the `openai` client:\n\n((?:    .*\n|\n)+)", readme).group(1)
    code = "\n".join(line[4:] for line in block.rstrip().splitlines())
    code = code.replace("http://127.0.0.1:8080", server).replace('api_key="none"', f'api_key="{KEY}"')
    code = code.replace("temperature=0,", "temperature=0, max_tokens=8,")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr


# ---- start and stop ----

def test_sigterm_ends_streams_and_exits_0(default_model):
    proc, base = _start(default_model, "-c", 512, "-np", 1, "-t", 1)
    try:
        stream, lines = _open_stream(base, max_tokens=400)
        proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]  # the stream ends: an error event, then [DONE]
        stream.__exit__(None, None, None)
        assert rest[-1] == "data: [DONE]" and "shutting down" in json.dumps(rest), rest[-3:]
        assert proc.wait(timeout=30) == 0
    finally:
        log = _stop(proc)
    assert "listening on http://127.0.0.1:" in log and "KV cache: size =" in log and "Traceback" not in log, log


def test_health_is_503_while_loading():
    from fastapi.testclient import TestClient

    from kvcli.cache import CacheSpec
    from kvcli.serve.app import Server, create_app

    with TestClient(create_app(Server("m.gguf", 1024, 2, CacheSpec(), None))) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = c.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["message"] == "Loading model"


def test_serve_help_and_bad_flags(default_model, tmp_path):
    r = runner.invoke(app, ["serve", "--help"])
    assert r.exit_code == 0 and "--parallel" in r.output and "--api-key" in r.output
    assert_clean_error(runner.invoke(app, ["serve", "-np", "0"]), "-np")
    assert_clean_error(runner.invoke(app, ["serve", "-ctk", "nope"]), "nope")
    assert_clean_error(runner.invoke(app, ["serve", "--port", "70000"]), "--port")
    assert_clean_error(runner.invoke(app, ["serve", "-c", "4", "-np", "4"]), "per slot")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model" * 10)  # found only when loading, after the port is open: one line, exit 1
    assert_clean_error(runner.invoke(app, ["serve", "-m", str(bad), "--port", str(free_port())]), "not a GGUF")
    with socket.socket() as s:  # a port in use: one line, before the model loads
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = runner.invoke(app, ["serve", "-m", str(default_model), "--port", str(s.getsockname()[1])],
                          env={"KVCLI_MODELS": str(default_model.parent), **os.environ})
        assert_clean_error(r, "cannot listen")
