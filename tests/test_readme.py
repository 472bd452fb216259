"""Every `kvcli` command in the README runs as written (issue 14), in a scratch folder laid out
as the README assumes: models/X.gguf, prompt.txt, wiki.test.raw and path/to/hf-model.

Only sizes are shrunk so that CI stays short (-n, bench's -p/-d and repetitions, perplexity's
--chunks); the chat examples get their user turns on stdin. The Python example is run by
tests/test_api.py."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import WIKITEXT

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    """The README's `kvcli ...` command lines (indented code), without their trailing comments."""
    out = []
    for line in (ROOT / "README.md").read_text().splitlines():
        if not line.startswith("    "):
            continue
        line = line.strip().split("&&")[-1].strip()  # `./setup.sh && kvcli run ...`
        if line.startswith("kvcli "):
            out.append(re.sub(r"\s+#.*$", "", line))
    return out


SHRINK = {  # command -> {flag: value}: sizes only; every other flag stays as written
    "run": {"-n": "4"},
    "bench": {"-p": "8", "-n": "2", "-d": "0,16", "-r": "1"},
    "perplexity": {"-c": "128", "--chunks": "1"},
}


def shrunk(argv: list[str]) -> list[str]:
    sizes = dict(SHRINK.get(argv[1], {}))
    out = []
    for i, a in enumerate(argv):
        if i > 0 and argv[i - 1] in sizes:
            a = sizes.pop(argv[i - 1])
        out.append(a)
    for flag, value in sizes.items():  # not written: add it (a run without -n would go on to the end)
        out += [flag, value]
    return out


def is_chat(argv: list[str]) -> bool:
    return argv[1] == "run" and "-no-cnv" not in argv and ("-cnv" in argv or not {"-p", "-f"} & set(argv))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, default_model):
    """The files the README's examples name, in one folder shared by them (in README order: the
    --sweep example writes the sweep.json that `kvcli fit` reads)."""
    d = tmp_path_factory.mktemp("readme")
    (d / "models").mkdir()
    (d / "models" / "X.gguf").symlink_to(default_model)
    (d / "prompt.txt").write_text("The three primary colors are")
    if WIKITEXT.is_file():
        (d / "wiki.test.raw").symlink_to(WIKITEXT)
    from test_convert import CASES, VOCAB, _save
    from tiny import make_hf_model

    kwargs, tokenizer = CASES["mha-tied-bpe"]
    _save(d / "path" / "to" / "hf-model", make_hf_model(**kwargs, vocab=VOCAB), tokenizer)
    return d


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command(command, workdir, default_model):
    argv = shlex.split(command)
    if "wiki.test.raw" in argv and not (workdir / "wiki.test.raw").exists():
        pytest.skip(f"WikiText-2 test file absent at {WIKITEXT}")
    if "sweep.json" in argv and argv[1] == "fit" and not (workdir / "sweep.json").exists():
        pytest.skip("needs the sweep.json that the README's --sweep all example writes")
    if argv[1] == "convert":
        (workdir / "model.gguf").unlink(missing_ok=True)
    env = dict(os.environ, KVCLI_MODELS=str(default_model.parent))
    kvcli = shutil.which("kvcli", path=str(Path(sys.executable).parent)) or "kvcli"
    if argv[1] == "serve":
        return _check_server([kvcli, *argv[1:]], workdir, env)
    r = subprocess.run([kvcli, *shrunk(argv)[1:]], cwd=workdir, env=env, capture_output=True, text=True,
                       input="Say hello.\nAnd goodbye.\n" if is_chat(argv) else "", timeout=600)
    assert r.returncode == 0, f"{command}\n{r.stdout}\n{r.stderr}"
    assert "Traceback" not in r.stderr
    if is_chat(argv):
        assert "chat mode" in r.stderr and r.stdout.strip(), r.stderr


def _check_server(argv: list[str], workdir: Path, env: dict) -> None:
    """`kvcli serve` runs until stopped: started as written on a free port, healthy (bounded), then Ctrl-C: exit 0."""
    import signal
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([*argv, "--port", str(port)], cwd=workdir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline, status = time.monotonic() + 120, None
        while time.monotonic() < deadline and proc.poll() is None and status != 200:
            try:
                status = urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status
            except OSError:
                time.sleep(0.2)
        assert status == 200, "the server did not become healthy"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log = proc.communicate()[0]
    assert proc.returncode == 0 and "KV cache: size =" in log and "Traceback" not in log, log
