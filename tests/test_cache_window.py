"""The recent window (kvcli/cache/window.py, issue 16): the newest N positions of each layer in f16,
each quantized into its store exactly once, by the time it leaves (decode writes the window in
batches); a query at position i reads i-N+1..i in
f16 and older positions from the store, in a batched prefill as in decode; its bytes counted."""

from __future__ import annotations

import math
import os
import re

import pytest
import torch
from typer.testing import CliRunner

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import kvcli.attention
from kvcli.cache import STORAGE_TYPES, CacheSpec, HiddenCache, KVCache, cache_bytes
from kvcli.cache.ggml_blocks import GGML_BLOCKS
from kvcli.cache.window import Ring
from kvcli.cli import app
from kvcli.memory import MIB
from kvcli.sweep import parse_sweep
from kvcli.attention import Attention

from cli_checks import assert_clean_error

QUANTIZED = [name for name, cls in STORAGE_TYPES.items() if not cls.dense]
B, HKV, D = 2, 2, 32
# (pos, T) batches: a prefill longer than the window, decode steps, short and long batches mid-sequence
SCHEDULE = [(0, 12), *((p, 1) for p in range(12, 17)), (17, 3), (20, 9), (29, 1), (30, 4)]


def _vectors(n: int, seed: int) -> torch.Tensor:
    return torch.randn(B, n, HKV, D, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    """A tiny random GQA Llama with head size 64 (4 query heads, 2 KV heads), which every type takes."""
    from tiny import make_hf_model, write_gguf

    return write_gguf(make_hf_model(n_heads=4, n_kv_heads=2, hidden=256, n_layers=2),
                      tmp_path_factory.mktemp("w64") / "w64.gguf")


def _llm(path, **kw):
    from kvcli.llama import Llama

    return Llama(path, **{"ctx_size": 48, "dtype": "f32", **kw})


IDS = [(i * 37 + 11) % 250 + 3 for i in range(40)]


# ---- hand-over: each position into the store once, by the time it leaves ----

def _spy(cache: KVCache, calls: list) -> None:
    """Record (start, vectors) of every write into the K store, whichever method the cache uses."""
    k = cache.k
    store, store_pair = k.store, k.store_pair
    k.store = lambda layer, x, pos: (calls.append((layer, pos, x.clone())), store(layer, x, pos))[1]
    k.store_pair = lambda other, layer, x, y, pos: (calls.append((layer, pos, x.clone())),
                                                    store_pair(other, layer, x, y, pos))[1]


@pytest.mark.parametrize("types", [("q4_0", "q4_0"), ("q8_0", "q4_1")])
def test_each_position_is_stored_once_by_the_time_it_leaves(types):
    N, n = 5, 34
    cache = KVCache(2, B, HKV, 40, D, *types, window=N, attention=Attention())
    calls = []
    _spy(cache, calls)
    k, v = _vectors(n, 1), _vectors(n, 2)
    written = {0: [], 1: []}  # layer -> positions in write order
    for pos, T in SCHEDULE:
        for layer in (0, 1):
            before = len(calls)
            cache.store(layer, k[:, pos : pos + T], v[:, pos : pos + T], pos)
            got = []
            for _, start, x in calls[before:]:
                got += list(range(start, start + x.shape[1]))
                # quantized from the f16 copy, whether it leaves the ring or the batch itself
                assert torch.equal(x, k[:, start : start + x.shape[1]].half().float())
            if T > 1:  # a batch writes exactly the positions that leave with it (older than its last N)
                assert all(p < pos + T - N for p in got), (pos, T, got)
            elif got:  # decode: the leaving position with the whole window, one write every N + 1 steps
                assert got == list(range(pos - N, pos + 1)), (pos, got)
            written[layer] += got
            # every position that has left is in the store: a query reads it there from now on
            assert len(written[layer]) >= pos + T - N
    for layer in (0, 1):
        assert written[layer] == list(range(len(written[layer]))), written[layer]  # each once, in order
        assert len(written[layer]) < n  # the newest ones never: they have not left


@pytest.mark.parametrize("name", ["tq4", "tq3", "tq2", "q4_hadamard", "q4_0"])
def test_decode_writes_in_batches_the_bytes_of_one_position_at_a_time(name):
    """Decode's batched writes (the leaving position with the window) store what writing each position as it
    leaves would: the same bytes through the store's batched path as through its one-position path."""
    N, n, D64 = 5, 40, 64
    g = torch.Generator().manual_seed(12)
    k, v = torch.randn(B, n, HKV, D64, generator=g), torch.randn(B, n, HKV, D64, generator=g)
    k16, v16 = k.half().float(), v.half().float()
    batched = KVCache(1, B, HKV, n, D64, name, name, window=N, attention=Attention())
    one = KVCache(1, B, HKV, n, D64, name, name, attention=Attention())  # no window: given each position as it leaves
    batched.store(0, k[:, :12], v[:, :12], 0)
    one.store(0, k16[:, : 12 - N], v16[:, : 12 - N], 0)  # the prefill's leaving positions, one batch
    for pos in range(12, n):
        batched.store(0, k[:, pos : pos + 1], v[:, pos : pos + 1], pos)
        one.store(0, k16[:, pos - N : pos - N + 1], v16[:, pos - N : pos - N + 1], pos - N)
    for a, b in ((batched.k, one.k), (batched.v, one.v)):
        assert torch.equal(a.load(0, 0, n - N), b.load(0, 0, n - N))


def test_no_window_writes_each_batch_as_it_comes():
    """Window 0 (llama.cpp's types by default): every batch goes into the store at once, unrounded."""
    cache = KVCache(1, B, HKV, 40, D, "q8_0", "q8_0", attention=Attention())
    calls = []
    _spy(cache, calls)
    k = _vectors(12, 3)
    assert cache.store(0, k, k, 0) is None and cache.ring is None
    assert [(start, x.shape[1]) for _, start, x in calls] == [(0, 12)] and torch.equal(calls[0][2], k)


# ---- what a query reads: the f16 window for its newest N positions, the store for older ones ----

def _expected(q, k16, v16, kq, vq, pos, lims):
    """Attention of q (B, T, H, D) at positions pos..pos+T-1, written out per query: row i reads keys
    j < lims[i] from the dequantized kq/vq (B, n, Hkv, D) and lims[i]..i from the f16 k16/v16."""
    G = q.shape[2] // k16.shape[2]
    out = []
    for t, lim in enumerate(lims):
        i = pos + t
        keys = torch.cat([kq[:, :lim], k16[:, lim : i + 1]], 1).repeat_interleave(G, 2)  # (B, i + 1, H, D)
        vals = torch.cat([vq[:, :lim], v16[:, lim : i + 1]], 1).repeat_interleave(G, 2)
        p = torch.softmax(torch.einsum("bhd,bjhd->bhj", q[:, t], keys) / math.sqrt(q.shape[-1]), -1)
        out.append(torch.einsum("bhj,bjhd->bhd", p, vals).flatten(1))
    return torch.stack(out, 1)  # (B, T, H * D)


def _dequantized(types, k16, v16):
    """What the stores give back for the f16-rounded vectors (B, n, Hkv, D): the values read below a row's limit."""
    n = k16.shape[1]
    plain = KVCache(1, B, HKV, n, D, *types, attention=Attention())
    plain.store(0, k16, v16, 0)
    return [s.from_storage(s.load(0, 0, n)).transpose(1, 2) for s in (plain.k, plain.v)]


@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("small_chunks", [False, True])
@pytest.mark.parametrize("types", [("q4_0", "q4_0"), ("q8_0", "q4_1"), ("f16", "f16")])
def test_each_query_reads_its_window_in_f16(monkeypatch, types, flash, small_chunks):
    if small_chunks:  # many chunks of the store and blocks of rows: the online softmax and the materialized path
        monkeypatch.setattr(kvcli.attention, "MIN_CHUNK", 4)
        monkeypatch.setattr(kvcli.attention, "CHUNK_BYTES", 0)
        monkeypatch.setattr(kvcli.attention, "ROW_BLOCK", 5)  # dense stores (f16 here) in blocks of 5 rows
    N, n = 5, 34
    k, v, q = _vectors(n, 4), _vectors(n, 5), torch.randn(B, n, 2 * HKV, D, generator=torch.Generator().manual_seed(6))
    k16, v16 = k.half().float(), v.half().float()
    kq, vq = _dequantized(types, k16, v16)
    cache = KVCache(1, B, HKV, 40, D, *types, attention=kvcli.attention.Attention(flash=flash), window=N)
    for pos, T in SCHEDULE:
        out = cache.attention(0, q[:, pos : pos + T], k[:, pos : pos + T], v[:, pos : pos + T], None, pos)
        lims = [max(0, i - N + 1) for i in range(pos, pos + T)]
        torch.testing.assert_close(out, _expected(q[:, pos : pos + T], k16, v16, kq, vq, pos, lims),
                                   rtol=1e-5, atol=1e-5)


def test_a_rewind_reads_what_the_ring_no_longer_holds_from_the_store(monkeypatch):
    """A chat keeps a common prefix and re-evaluates from inside it: positions whose f16 copy the ring
    has overwritten left the window before, so they are read from the store, never from stale slots."""
    N, types = 5, ("q4_0", "q4_0")
    k, v, q = _vectors(33, 7), _vectors(33, 8), torch.randn(B, 33, 2 * HKV, D, generator=torch.Generator().manual_seed(9))
    k2, v2 = _vectors(33, 10), _vectors(33, 11)  # the new timeline from position 25
    cache = KVCache(1, B, HKV, 40, D, *types, window=N, attention=Attention())
    for pos, T in [(0, 20), *((p, 1) for p in range(20, 30))]:
        cache.store(0, k[:, pos : pos + T], v[:, pos : pos + T], pos)
    k[:, 25:], v[:, 25:] = k2[:, 25:], v2[:, 25:]
    k16, v16 = k.half().float(), v.half().float()
    kq, vq = _dequantized(types, k16, v16)  # the store's positions below 25 are the common prefix's
    for (pos, T), lims in [((25, 3), [25, 25, 25]), ((28, 1), [25]), ((29, 1), [25]), ((30, 3), [26, 27, 28])]:
        out = cache.attention(0, q[:, pos : pos + T], k[:, pos : pos + T], v[:, pos : pos + T], None, pos)
        torch.testing.assert_close(out, _expected(q[:, pos : pos + T], k16, v16, kq, vq, pos, lims),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("types, N", [(("q4_hadamard", "q4_hadamard"), 4), (("q4_0", "q4_0"), 3),
                                      (("q8_0", "q4_0"), 0), (("q4_hadamard", "q8_0"), 0), (("f16", "q4_0"), 0),
                                      (("tq4", "tq4"), 4), (("tq3", "tq3"), 0), (("tq2", "tq3"), 5)],
                         ids=lambda v: "-".join(v) if isinstance(v, tuple) else f"window{v}")
def test_rows_at_their_own_positions_store_and_attend_as_each_alone(monkeypatch, flash, types, N):
    """The server's slots are rows of one cache (KVCache.rows): a step's decode tokens, one per row at its own
    position (a young row inside its window, a row rewound to a prefix), store the bytes and attend to what
    each row's own cache would; with a window each row writes it to the store at its own steps
    (Ring.push_rows), without one the stores write each row at its position (q4_hadamard: row by row while a
    row is in its sinks)."""
    monkeypatch.setattr(kvcli.attention, "MIN_CHUNK", 4)  # many store chunks: the online softmax over them
    monkeypatch.setattr(kvcli.attention, "CHUNK_BYTES", 0)
    H, Dh = 2, 64
    assert KVCache.has_rows(*types)
    attend = kvcli.attention.Attention(flash=flash)
    base = KVCache(1, 4, H, 48, Dh, *types, attention=attend, window=N)
    solo = [KVCache(1, 1, H, 48, Dh, *types, attention=attend, window=N) for _ in range(4)]
    g = torch.Generator().manual_seed(12)
    kv = lambda b, n: (torch.randn(b, n, H, Dh, generator=g), torch.randn(b, n, H, Dh, generator=g))  # noqa: E731
    for b, n in enumerate([2, 7, 11, 14]):
        k, v = kv(1, n)
        base.rows(b, b + 1).store(0, k, v, 0)
        solo[b].store(0, k, v, 0)
    k, v = kv(1, 1)  # row 3 keeps 8 of its 14 positions and goes on from a new one
    base.rows(3, 4).store(0, k, v, 8)
    solo[3].store(0, k, v, 8)
    rows, pos = base.rows(0, 4), [2, 7, 11, 9]
    for step in range(14):
        (k, v), q = kv(4, 1), torch.randn(4, 1, 2 * H, Dh, generator=g)
        out = rows.attention(0, q, k, v, None, torch.tensor(pos))
        for b in range(4):
            alone = solo[b].attention(0, q[b : b + 1], k[b : b + 1], v[b : b + 1], None, pos[b])
            torch.testing.assert_close(out[b : b + 1], alone, rtol=1e-5, atol=1e-5)
            for mine, its in ((base.k, solo[b].k), (base.v, solo[b].v)):
                for name in mine.batched:
                    assert torch.equal(getattr(mine, name)[:, b], getattr(its, name)[:, 0]), (step, b, name)
            if N:
                assert torch.equal(base.ring.data[:, b], solo[b].ring.data[:, 0])
                assert ((base.ring.held[0][b], base.ring.stored[0][b])
                        == (solo[b].ring.held[0][0], solo[b].ring.stored[0][0]))
        pos = [p + 1 for p in pos]


def test_rows_need_both_types_to_give_them(monkeypatch):
    assert all(KVCache.has_rows(t, "q8_0") for t in STORAGE_TYPES)  # every type today
    monkeypatch.setattr(STORAGE_TYPES["tq3"], "batched", ())  # a type that names no (L, B, ...) tensors
    assert KVCache.has_rows("q8_0", "f16") and not KVCache.has_rows("tq3", "q8_0")


# ---- through the model: prefill equals decode, a window over the whole context is f16 ----

@pytest.mark.parametrize("flash", [True, False])
@pytest.mark.parametrize("mode, types", [("kv", dict(cache_type_k="q4_0", cache_type_v="q4_0")),
                                         ("kv", dict(cache_type_k="q8_0", cache_type_v="iq4_nl")),
                                         ("kv", dict(cache_type_k="q8_0=0+q4_0", cache_type_v="q4_0=0+iq4_nl")),
                                         ("hidden", dict(cache_type_h="q4_0"))])
def test_batched_prefill_equals_token_by_token_decode(tiny64, mode, types, flash):
    llm = _llm(tiny64, cache_mode=mode, cache_window=6, flash_attn=flash, **types)
    assert llm.cache.window == 6
    prefill = llm.logits(IDS)  # one batch
    for step in (1, 7):  # decode, and batches that straddle the window mid-sequence
        llm.reset()
        got = torch.cat([_eval_all(llm, IDS[i : i + step]) for i in range(0, len(IDS), step)])
        torch.testing.assert_close(got, prefill, rtol=0, atol=2e-4)
    # the window matters: without it the same type gives other logits
    assert (_llm(tiny64, cache_mode=mode, cache_window=0, **types).logits(IDS) - prefill).abs().max() > 1e-3


def _eval_all(llm, ids) -> torch.Tensor:
    """Append ids to sequence 0 and return the logits of every one of them (T, V)."""
    t = torch.as_tensor(ids)[None]
    logits = llm.model(t, llm.cache, llm.n_past)
    llm.n_past += len(ids)
    return logits[0]


@pytest.mark.parametrize("name", QUANTIZED)
def test_a_window_over_the_whole_context_is_the_f16_cache(tiny64, name):
    """N >= the context: nothing is ever quantized, so every quantized type gives f16's logits."""
    ref = _llm(tiny64).logits(IDS)
    for mode, types in [("kv", dict(cache_type_k=name, cache_type_v=name)), ("hidden", dict(cache_type_h=name))]:
        f16 = ref if mode == "kv" else _llm(tiny64, cache_mode="hidden", cache_type_h="f16").logits(IDS)
        llm = _llm(tiny64, cache_mode=mode, cache_window=48, **types)
        torch.testing.assert_close(llm.logits(IDS), f16, rtol=0, atol=1e-4)
        llm.reset()
        torch.testing.assert_close(torch.cat([_eval_all(llm, [i]) for i in IDS]), f16, rtol=0, atol=1e-4)


# ---- defaults and bytes ----

def test_defaults_leave_llama_cpp_types_alone():
    for name in GGML_BLOCKS:
        assert STORAGE_TYPES[name].default_window == 0 and CacheSpec("kv", name, name).window == 0
    for name in ("f32", "f16", "bf16"):  # dense: a window is dropped, even when asked for
        assert CacheSpec("kv", name, name, window=16).window == 0 and CacheSpec("hidden", type_h=name, window=8).window == 0
    q4h = STORAGE_TYPES["q4_hadamard"].default_window
    assert q4h > 0 and CacheSpec("kv", "q4", "q4").window == q4h
    assert CacheSpec("kv", "q8_0", "q4_hadamard").window == q4h  # a pair takes the larger default
    assert CacheSpec("kv", "q4_hadamard", "q4_hadamard", window=0).window == 0
    with pytest.raises(Exception, match="--cache-window"):
        CacheSpec(window=-1)


def test_hidden_cache_takes_the_types_default_window():
    tq3, tq4 = STORAGE_TYPES["tq3"], STORAGE_TYPES["tq4"]
    assert CacheSpec("hidden", type_h="tq3").window == tq3.default_window == CacheSpec("kv", "tq3", "tq3").window
    assert CacheSpec("hidden", type_h="tq4").window == tq4.default_window
    assert CacheSpec("hidden", type_h="tq3", window=16).window == 16  # asked for: as asked


def test_bytes_count_the_window(tiny64):
    from types import SimpleNamespace

    L, n_ctx, N, kv = 3, 100, 16, HKV * D
    cache = KVCache(L, B, HKV, n_ctx, D, "q4_0", "q8_0", window=N, attention=Attention())
    ring = 2 * L * B * N * kv * 2  # K and V, f16
    assert cache.window_nbytes() == ring == Ring.nbytes_for(L, B, 2 * kv, N)
    assert cache.nbytes() == cache.k.nbytes() + cache.v.nbytes() + ring
    config = SimpleNamespace(n_layers=L, n_kv_heads=HKV, head_dim=D, kv_dim=kv, n_embd=2 * kv)
    assert cache_bytes(config, CacheSpec("kv", "q4_0", "q8_0", window=N), n_ctx, B) == cache.nbytes()
    line = cache.describe()
    assert float(re.search(r"size = +([\d.]+) MiB", line).group(1)) == round(cache.nbytes() / MIB, 2)
    assert re.search(rf", window {N} \(f16\): +{ring / MIB:.2f} MiB$", line), line
    # the hidden-state cache: one window, of x
    llm = _llm(tiny64, cache_mode="hidden", cache_type_h="q8_0", cache_window=N)
    c = llm.config
    assert llm.cache.window_nbytes() == c.n_layers * N * c.n_embd * 2
    assert llm.cache.nbytes() == cache_bytes(c, llm.cache_spec, 48) == HiddenCache.bytes_needed(
        c.n_layers, 1, c.n_embd, 48, "q8_0", N)
    assert f"window {N} (f16)" in llm.cache.describe()


# ---- the flag ----

runner = CliRunner()


def test_the_flag_on_every_command(tiny64, tmp_path):
    run = ["run", "-m", str(tiny64), "-p", "the cat", "-n", "2", "--temp", "0", "-c", "32"]
    r = runner.invoke(app, [*run, "-ctk", "q4_0", "-ctv", "q4_0", "--cache-window", "4"])
    assert r.exit_code == 0, r.output
    assert re.search(r"V \(q4_0\): +[\d.]+ MiB, window 4 \(f16\): +[\d.]+ MiB", r.stderr), r.stderr
    r = runner.invoke(app, [*run, "-ctk", "q4"])  # q4_hadamard's default window, unasked
    assert r.exit_code == 0 and f"window {STORAGE_TYPES['q4_hadamard'].default_window} (f16)" in r.stderr, r.output
    r = runner.invoke(app, [*run, "-ctk", "q8_0", "-ctv", "q8_0"])  # llama.cpp's types: none
    assert r.exit_code == 0 and "window" not in r.stderr, r.output
    r = runner.invoke(app, [*run, "-cw", "8"])  # f16: nothing to keep a window for
    assert r.exit_code == 0 and "note: --cache-window 8 ignored" in r.stderr and "window 8 (f16)" not in r.stderr
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat and the dog ran far away from the old town " * 4)
    out = tmp_path / "s.json"
    r = runner.invoke(app, ["perplexity", "-m", str(tiny64), "-f", str(text), "-c", "16", "--chunks", "2",
                            "--sweep", "q4_0,q4_0@4,hidden:q8_0@2", "--json", str(out)])
    assert r.exit_code == 0, r.output
    import json

    rows = json.loads(out.read_text())["rows"]
    assert [(x["cache"], x["window"]) for x in rows] == [("f16", 0), ("q4_0", 0), ("q4_0@4", 4), ("hidden:q8_0@2", 2)]
    assert rows[2]["mean_kld"] < rows[1]["mean_kld"]
    r = runner.invoke(app, ["perplexity", "-m", str(tiny64), "-f", str(text), "-c", "16", "--chunks", "1",
                            "-ctk", "q4_0", "-ctv", "q4_0", "-cw", "4"])
    assert r.exit_code == 0 and "window 4 (f16)" in r.stderr, r.output
    r = runner.invoke(app, ["bench", "-m", str(tiny64), "-p", "4", "-n", "2", "-r", "1", "-ctk", "q4_0,f16",
                            "-ctv", "q4_0", "-cw", "0,4", "-o", "json"])
    assert r.exit_code == 0, r.output
    got = [(x["type_k"], x["window"], x["test"]) for x in json.loads(r.stdout)]
    assert got == [("q4_0", 0, "pp4"), ("q4_0", 0, "tg2"), ("q4_0", 4, "pp4"), ("q4_0", 4, "tg2"),
                   ("f16", 0, "pp4"), ("f16", 0, "tg2"), ("f16", 4, "pp4"), ("f16", 4, "tg2")]
    for command in (["info"], ["fit", "--mem", "1GiB", "--ctx", "64"]):
        r = runner.invoke(app, [command[0], "-m", str(tiny64), *command[1:], "-cw", "32"])
        assert r.exit_code == 0 and "window" in r.stdout, r.output
        assert re.search(r"kv q4_0/q4_0 +│ +32 │", r.stdout), r.stdout


@pytest.mark.parametrize("command", [["run", "-p", "hi"], ["perplexity", "-f", "TEXT"], ["fit", "--mem", "1GiB"],
                                     ["info"]])
@pytest.mark.parametrize("value", ["-3", "abc", "1.5"])
def test_bad_window_values_give_one_line(tiny64, tmp_path, monkeypatch, command, value):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "TEXT").write_text("the cat sat on the mat " * 20)
    r = runner.invoke(app, [command[0], "-m", str(tiny64), *command[1:], "--cache-window", value])
    assert_clean_error(r, "--cache-window", code=2)


def test_bad_window_lists_give_one_line(tiny64):
    assert_clean_error(runner.invoke(app, ["bench", "-m", str(tiny64), "-cw", "4,-1"]), "-cw/--cache-window")
    with pytest.raises(Exception, match="@ takes a window"):
        parse_sweep("q4_0@x")
    assert parse_sweep("q4_0@8,q4_0,all@0", window=3)[:2] == [CacheSpec("kv", "q4_0", "q4_0", window=8),
                                                             CacheSpec("kv", "q4_0", "q4_0", window=3)]


def test_a_window_goes_to_the_kv_kernel_not_the_hidden_one(monkeypatch):
    """With a window the table's CUDA attention entry (the Triton kernel, run by the interpreter on CPU tensors) reads
    the window (tests/test_kernels.py compares it with the reference); the hidden-state cache's kernel reads none,
    so there the table picks the reference."""
    from kvcli import kernel_table
    from tests.triton_cpu import cuda_entries_on_cpu

    cache = KVCache(1, B, HKV, 16, D, "q8_0", "q8_0", window=4, attention=Attention())
    k, q = _vectors(6, 12), torch.randn(B, 6, 2 * HKV, D, generator=torch.Generator().manual_seed(13))
    ref = cache.attention(0, q, k, k, None, 0)
    cuda_entries_on_cpu(monkeypatch)
    cache = KVCache(1, B, HKV, 16, D, "q8_0", "q8_0", window=4, attention=Attention())
    torch.testing.assert_close(cache.attention(0, q, k, k, None, 0), ref, rtol=1e-4, atol=1e-5)
    assert cache.kernels[(False, False, "cuda", True)] is kvcli.attention.attend_triton
    hidden = kernel_table.choose(kernel_table.HIDDEN, "cuda", 1, decode=True, window=True, head_dim=32,
                                 dense_kv=True, linear_kv=True)
    assert hidden is kernel_table.reference(kernel_table.HIDDEN)
