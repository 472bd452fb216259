"""The state file (issue 43, kvcli/cache/state.py): a sequence's cache saved and restored bit for bit for every
registered type and both modes, in this process and in a fresh one; hostile files refused in one line with the
cache left as it was; a save killed midway leaves the previous file; `kvcli run --prompt-cache` as llama.cpp's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from cli_checks import assert_clean_error, run
from kvcli.cache import STORAGE_TYPES, state
from kvcli.errors import KvcliError
from kvcli.llama import Llama
from tiny import make_hf_model, write_gguf

PROMPT, DECODED, AFTER = 150, 20, (3, 5)  # prefill 150 (3 batches), 20 decode steps, then 3 steps and a batch of 5
BUILTIN = [t for t in STORAGE_TYPES if not t.startswith("toy")]  # every type kvcli registers
# kwargs of Llama: each registered type as K and V (its default window), and the other shapes of a cache
CASES = {**{t: dict(cache_type_k=t, cache_type_v=t) for t in BUILTIN},
         "q8_0/tq3, window 16": dict(cache_type_k="q8_0", cache_type_v="tq3", cache_window=16),
         "per-layer mix": dict(cache_type_k="q8_0=0+tq3", cache_type_v="tq3=1+q4_0"),
         "q4_0, keys less their mean": dict(cache_type_k="q4_0", cache_type_v="q4_0", cache_key_bias="on"),
         "hidden f16": dict(cache_mode="hidden", cache_type_h="f16"),
         "hidden tq3": dict(cache_mode="hidden", cache_type_h="tq3")}


@pytest.fixture(scope="module")
def model64(tmp_path_factory) -> Path:
    """A tiny llama with head size 64 (every type's blocks fit), 2 layers, 4/2 heads."""
    return write_gguf(make_hf_model(n_heads=4, n_kv_heads=2, hidden=256, n_layers=2),
                      tmp_path_factory.mktemp("state") / "m64.gguf")


def _llm(path, **kw) -> Llama:
    """One thread: the same bits in every process (another thread count sums the products in another order)."""
    return Llama(path, ctx_size=256, batch_size=64, dtype="f32", threads=1, **kw)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _fill(llm: Llama) -> None:
    """A prompt in batches, then decode steps one token at a time (the window flushes, tiles and groups cross)."""
    llm.eval(_ids(PROMPT, 1))
    for t in _ids(DECODED, 2):
        llm.eval([t])


def _go_on(llm: Llama) -> list[torch.Tensor]:
    """What comes after: single steps, then a batch; the logits of each."""
    steps = [llm.eval([t]) for t in _ids(AFTER[0], 3)]
    return steps + [llm.eval(_ids(AFTER[1], 4))]


def _snapshot(llm: Llama) -> list[torch.Tensor]:
    return [p.tensor.clone() for p in state.parts(llm.cache, 0, llm.n_ctx)] + [torch.tensor(llm.n_past)]


@pytest.mark.parametrize("case", list(CASES))
def test_restore_continues_as_if_never_stopped(model64, tmp_path, case):
    a = _llm(model64, **CASES[case])
    _fill(a)
    path = tmp_path / "s.kvs"
    size = a.save_state(path)
    in_use = sum(p.tensor.numel() * p.tensor.element_size() for p in state.parts(a.cache, 0, a.n_past))
    print(f"{case}: file {size} bytes, cache bytes in use {in_use}, whole cache {a.cache.nbytes()}")
    assert in_use < size < in_use + 8192  # the header: identities, part table and 170 token ids
    want = _go_on(a)
    b = _llm(model64, **CASES[case])
    tokens, _ = b.load_state(path)
    assert tokens == _ids(PROMPT, 1) + _ids(DECODED, 2) and b.n_past == PROMPT + DECODED
    for got, ref in zip(_go_on(b), want):
        assert torch.equal(got, ref)


FRESH = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_state import CASES, _fill, _go_on, _llm
folder = {folder!r}
if sys.argv[1] == "save":  # run to N tokens, save, and go on: what never stopping gives
    refs = {{}}
    for i, (case, kw) in enumerate(CASES.items()):
        a = _llm({model!r}, **kw)
        _fill(a)
        a.save_state(folder + "/" + str(i))
        refs[case] = _go_on(a)
    torch.save(refs, folder + "/refs.pt")
else:  # restore each file and go on the same way
    refs = torch.load(folder + "/refs.pt")
    for i, (case, kw) in enumerate(CASES.items()):
        b = _llm({model!r}, **kw)
        b.load_state(folder + "/" + str(i))
        same = all(torch.equal(g, r) for g, r in zip(_go_on(b), refs[case]))
        print(case, "equal" if same else "DIFFERENT", flush=True)
"""


def test_restore_in_a_fresh_process(model64, tmp_path):
    """Saved in one process, restored in another: both fresh, so that what the suite did before in this one (a
    kernel path a test forced) cannot make the two differ."""
    code = FRESH.format(tests=str(Path(__file__).parent), model=str(model64), folder=str(tmp_path))
    for mode in ("save", "restore"):
        out = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == [f"{case} equal" for case in CASES], out.stdout


@pytest.fixture(scope="module")
def saved(model64, tmp_path_factory):
    """A tq3 file (window, sinks, offsets, key means: every kind of part) and its sections' byte offsets."""
    a = _llm(model64, cache_type_k="tq3", cache_type_v="tq3")
    _fill(a)
    path = tmp_path_factory.mktemp("hostile") / "s.kvs"
    a.save_state(path)
    data = path.read_bytes()
    n_header = int.from_bytes(data[12:20], "little")
    header = json.loads(data[20 : 20 + n_header])
    ends, at = [], 20 + n_header
    for name, dtype, shape in header["parts"]:
        at += int(torch.empty(shape, dtype=getattr(torch, dtype)).nbytes)
        ends.append((name, at))
    assert at + 32 == len(data)
    return data, n_header, ends


def _refused(llm: Llama, path: Path, *words: str) -> None:
    """The file is refused in one line naming words, and the running cache is as it was."""
    before = _snapshot(llm)
    with pytest.raises(KvcliError) as e:
        llm.load_state(path)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
    assert all(torch.equal(x, y) for x, y in zip(before, _snapshot(llm)))


def test_truncated_files_are_refused_at_every_section(model64, saved, tmp_path):
    data, n_header, ends = saved
    target = _llm(model64, cache_type_k="tq3", cache_type_v="tq3")
    target.eval(_ids(40, 9))  # a cache holding something of its own
    cuts = [0, 5, 8, 12, 19, 20, 20 + n_header // 2, 20 + n_header] + [at - 1 for _, at in ends] + [at for _, at in ends]
    cuts += [len(data) - 32, len(data) - 1]
    for cut in sorted(set(cuts)):
        (tmp_path / "t").write_bytes(data[:cut])
        _refused(target, tmp_path / "t", "refused")


def test_a_flipped_byte_in_any_section_is_refused(model64, saved, tmp_path):
    data, n_header, ends = saved
    target = _llm(model64, cache_type_k="tq3", cache_type_v="tq3")
    target.eval(_ids(40, 9))
    starts = [20 + n_header] + [at for _, at in ends[:-1]]
    spots = {"magic": 3, "version": 9, "header length": 13, "header": 20 + n_header - 3, "checksum": len(data) - 5}
    spots.update({name: (lo + at) // 2 for (name, at), lo in zip(ends, starts) if at > lo})
    for section, at in spots.items():
        bad = bytearray(data)
        bad[at] ^= 0x10
        (tmp_path / "t").write_bytes(bad)
        _refused(target, tmp_path / "t", "refused")


def test_another_model_type_version_or_context_is_refused(model64, saved, tmp_path):
    data, _, _ = saved
    (tmp_path / "s").write_bytes(data)
    other = write_gguf(make_hf_model(n_heads=4, n_kv_heads=2, hidden=256, n_layers=2, seed=7), tmp_path / "o.gguf")
    _refused(_llm(other, cache_type_k="tq3", cache_type_v="tq3"), tmp_path / "s", "another model", "sha256")
    _refused(_llm(model64, cache_type_k="q8_0", cache_type_v="tq3"), tmp_path / "s", "another cache", "q8_0")
    _refused(_llm(model64, cache_type_k="tq3", cache_type_v="tq3", cache_window=16), tmp_path / "s", "window")
    short = Llama(model64, ctx_size=128, batch_size=64, dtype="f32", cache_type_k="tq3", cache_type_v="tq3")
    _refused(short, tmp_path / "s", "170 tokens", "128-token context")
    future = bytearray(data)
    future[8:12] = (2).to_bytes(4, "little")
    (tmp_path / "f").write_bytes(future)
    _refused(_llm(model64, cache_type_k="tq3", cache_type_v="tq3"), tmp_path / "f", "format version 2")
    with pytest.raises(KvcliError, match="cannot read"):
        _llm(model64).load_state(tmp_path / "missing")


KILLED = """
import sys
sys.path.insert(0, {tests!r})
from test_state import _llm
a = _llm({model!r}, cache_type_k="f32", cache_type_v="f32")
a.eval(list(range(1, 250)))
print("ready", flush=True)
while True:
    a.save_state({path!r})
"""


def test_kill_9_during_a_save_leaves_the_previous_file(model64, tmp_path):
    path = tmp_path / "s.kvs"
    first = _llm(model64, cache_type_k="f32", cache_type_v="f32")
    first.eval(list(range(1, 250)))
    first.save_state(path)
    code = KILLED.format(tests=str(Path(__file__).parent), model=str(model64), path=str(path))
    for delay in (0.05, 0.2, 0.5):
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "ready"
            time.sleep(delay)
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
        finally:
            p.kill()
        tokens, _ = _llm(model64, cache_type_k="f32", cache_type_v="f32").load_state(path)
        assert tokens == list(range(1, 250))


def test_two_saves_at_once_do_not_interleave(model64, tmp_path):
    a = _llm(model64, cache_type_k="tq3", cache_type_v="tq3")
    a.eval(_ids(200, 5))
    path = tmp_path / "s.kvs"
    errors = []

    def save():
        try:
            for _ in range(10):
                a.save_state(path)
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=save) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    tokens, _ = _llm(model64, cache_type_k="tq3", cache_type_v="tq3").load_state(path)
    assert tokens == _ids(200, 5)
    assert [f for f in os.listdir(tmp_path) if f != "s.kvs"] == []  # no temporary file left behind


# ---- kvcli run --prompt-cache ----

def _output(result) -> str:
    return result.stdout


def _header(path: Path) -> dict:
    data = path.read_bytes()
    return json.loads(data[20 : 20 + int.from_bytes(data[12:20], "little")])


def test_prompt_cache_reuses_the_prompt_and_gives_the_same_text(model64, tmp_path):
    f = tmp_path / "p.kvs"
    args = ("-m", model64, "-p", "the the the", "-n", 6, "--temp", 0, "--prompt-cache", f, "-ctk", "tq3", "-ctv", "tq3")
    first = run(*args)
    assert first.exit_code == 0 and f.exists(), first.output
    assert "does not exist yet" in first.stderr
    saved = f.read_bytes()
    again = run(*args)
    assert again.exit_code == 0, again.output
    assert _output(again) == _output(first)
    assert "tokens restored" in again.stderr and "prompt eval time" in again.stderr
    assert " /     1 tokens" in again.stderr  # only the last prompt token is evaluated again
    assert f.read_bytes() == saved  # a file holding the whole prompt is not written again
    n_prompt = len(_header(f)["tokens"])
    longer = run(*args[:3], "the the the the", *args[4:], "--prompt-cache-all")
    assert longer.exit_code == 0 and "reused" in longer.stderr, longer.output
    assert len(_header(f)["tokens"]) > n_prompt + 1 and "saved to" in longer.stderr  # the generated ones too
    ro = run(*args, "--prompt-cache-ro")
    assert ro.exit_code == 0 and "saved to" not in ro.stderr


def test_prompt_cache_bad_uses_are_one_line(model64, tmp_path):
    f = tmp_path / "p.kvs"
    assert_clean_error(run("-m", model64, "-p", "the", "--prompt-cache-all"), "--prompt-cache")
    assert_clean_error(run("-m", model64, "-p", "the", "--prompt-cache", f, "--prompt-cache-all", "--prompt-cache-ro"),
                       "--prompt-cache-ro")
    assert_clean_error(run("-m", model64, "-p", "the", "--prompt-cache", f, "--prompt-cache-ro"), "does not exist")
    assert_clean_error(run("-m", model64, "-p", "the", "--prompt-cache", tmp_path / "no" / "p.kvs"), "cannot write")
    assert run("-m", model64, "-p", "the", "-n", 2, "--prompt-cache", f).exit_code == 0
    saved = f.read_bytes()
    assert_clean_error(run("-m", model64, "-p", "the", "-n", 2, "--prompt-cache", f, "-ctk", "q8_0"),
                       "refused", "another cache")
    f.write_bytes(saved[:-10])
    assert_clean_error(run("-m", model64, "-p", "the", "-n", 2, "--prompt-cache", f), "refused", "truncated")
    assert f.read_bytes() == saved[:-10]  # a refused file is left as it was


def test_chat_keeps_its_conversation_in_the_prompt_cache(default_model, tmp_path):
    f = tmp_path / "chat.kvs"
    args = ("-m", default_model, "-cnv", "-n", 8, "--temp", 0, "--prompt-cache", f)
    first = run(*args, input="Hi, I am Ada.\n")
    assert first.exit_code == 0 and f.exists(), first.output
    assert [m["role"] for m in _header(f)["extra"]["messages"]] == ["user", "assistant"]
    again = run(*args, input="What is my name?\n")
    assert again.exit_code == 0, again.output
    assert "goes on after its 2 messages" in again.stderr
    assert [m["role"] for m in _header(f)["extra"]["messages"]] == ["user", "assistant"] * 2
