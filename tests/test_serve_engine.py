"""The server's engine without HTTP (issue 18, point 3): a batched decode of slots at different positions
equals each slot decoding alone; a slot reuses its cached prefix; a slot's context end finishes "length";
waiting requests are bounded. The real default model, f32 weights, compute and cache."""

from __future__ import annotations

import time

import pytest
import torch

from kvcli.cache import CacheSpec, make_cache
from kvcli.errors import KvcliError
from kvcli.sampler import Sampler
from kvcli.llama import Llama
from kvcli.rope import apply_rope
from kvcli.serve.engine import Done, Engine, Failed, Piece, QueueFull, Request, partial_stop
from kvcli.serve.slots import Slots


@pytest.fixture(scope="module")
def llm(default_model):
    return Llama(default_model, ctx_size=64, dtype="f32", weights="f32", cache_type_k="f32", cache_type_v="f32",
                 threads=1)  # one thread: the cores are shared, and torch threads that wait on a busy core crawl


def _drain(engine: Engine, events: dict, steps: int = 400) -> None:
    """Step until every request reported Done or Failed (bounded)."""
    for _ in range(steps):
        if all(e and isinstance(e[-1], (Done, Failed)) for e in events.values()):
            return
        with engine.cond:
            engine._assign()
        engine.step()
    raise AssertionError(f"requests did not finish in {steps} steps")


def _submit(engine: Engine, events: dict, key, prompt, **kw) -> Request:
    events[key] = []
    req = Request(list(prompt), events[key].append, **kw)
    engine.submit(req)
    return req


def _text(events: list) -> str:
    return "".join(e.text for e in events if isinstance(e, Piece))


def _forward_slots(llm, ids: list[list[int]], caches: list, positions: list[int]) -> torch.Tensor:
    """One batched step as the engine takes it: the segments ids[i] to caches[i] at positions[i].."""
    return llm.model.forward_slots(ids, Slots(caches, positions, [len(t) for t in ids]), positions)


@pytest.mark.parametrize("neox", [False, True])
def test_rope_with_a_position_per_row(neox):
    """rot (B, T, D/2), each row its own positions, rotates row b as rot[b] (T, D/2) alone (llama and NEOX pairs)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 1, 4, 16, generator=g)  # (B, T, H, D)
    rot = torch.polar(torch.ones(3, 1, 8), torch.randn(3, 1, 8, generator=g))  # (B, T, D/2)
    rows = torch.cat([apply_rope(x[b : b + 1], rot[b], neox) for b in range(3)])
    assert torch.equal(apply_rope(x, rot, neox), rows)


def test_batched_decode_equals_each_slot_alone(llm):
    """Four slots at positions 5, 9, 14, 20: one forward_slots step gives each slot's solo logits."""
    engine = Engine(llm, 4)
    prompts = [llm.tokenize(t) for t in ("Hi there", "The capital of France is a city",
                                         "Once upon a time, in a land far away, there",
                                         "def add(a, b):\n    return a + b\n\nprint(add(2,")]
    assert len({len(p) for p in prompts}) == 4
    solo = []
    for s, p in zip(engine.slots, prompts):
        llm.model(torch.tensor([p[:-1]]), s.cache, 0)
        solo.append(llm.model(torch.tensor([p[-1:]]), s.cache, len(p) - 1)[0, -1])
    batched = _forward_slots(llm, [p[-1:] for p in prompts], [s.cache for s in engine.slots],
                             [len(p) - 1 for p in prompts])
    for b in range(4):
        torch.testing.assert_close(batched[b], solo[b], rtol=1e-4, atol=1e-4)
        assert int(batched[b].argmax()) == int(solo[b].argmax())


@pytest.mark.parametrize("flash", [True, False])
def test_slots_rows_of_one_cache_decode_as_one_batch(llm, monkeypatch, flash):
    """Dense slots are rows of one cache: the decode tokens of rows 2 and 3 attend as one batch, each at its
    own position (row 0 alone: not next to them), beside a prompt for row 1, over chunks of 4 positions
    (online softmax with flash, materialized without): each as its solo run."""
    import kvcli.attention

    monkeypatch.setattr(kvcli.attention, "MIN_CHUNK", 4)
    monkeypatch.setattr(kvcli.attention, "CHUNK_BYTES", 1)
    monkeypatch.setattr(llm, "attention", kvcli.attention.Attention(flash=flash))
    engine = Engine(llm, 4)
    caches = [s.cache for s in engine.slots]
    assert all(c.base is caches[0].base and c.row0 == i for i, c in enumerate(caches))
    prompts = [llm.tokenize(t) for t in ("Hi there", "The capital of France is a city", "Once upon a time, in a land",
                                         "def add(a, b):\n    return")]
    solo = []
    for i, p in enumerate(prompts):
        c = make_cache(llm.config, llm.cache_spec, llm.n_ctx, 1, attention=llm.attention)
        if i == 1:  # prefilled whole in the step
            solo.append(llm.model(torch.tensor([p]), c, 0)[0, -1])
            continue
        llm.model(torch.tensor([p[:-1]]), c, 0)
        llm.model(torch.tensor([p[:-1]]), caches[i], 0)
        solo.append(llm.model(torch.tensor([p[-1:]]), c, len(p) - 1)[0, -1])
    order = [0, 2, 3, 1]
    ids = [prompts[i] if i == 1 else prompts[i][-1:] for i in order]
    batched = _forward_slots(llm, ids, [caches[i] for i in order], [0 if i == 1 else len(prompts[i]) - 1 for i in order])
    for b, i in enumerate(order):
        torch.testing.assert_close(batched[b], solo[i], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("flash, kind", [(True, "q4_hadamard"), (False, "q4_hadamard"), (True, "tq3")])
def test_quantized_rows_with_a_window_decode_as_one_batch(llm, monkeypatch, flash, kind):
    """q4_hadamard (and tq3) slots with a 4-position window are rows of one cache too: over 8 steps, four rows
    at their own positions (one young, inside its window; one rewound to a prefix, as a slot reuses one) decode
    as one batch, each writing its window to the store at its own steps, and each gives its solo logits and
    tokens (where its two best logits are further apart than the tolerance).
    Not bit for bit: a batched forward rounds differently and a rounding can move a 4-bit code by a step,
    which later steps carry (tests/test_cache_window.py shows equal bytes from equal inputs)."""
    import kvcli.attention

    monkeypatch.setattr(kvcli.attention, "MIN_CHUNK", 4)
    monkeypatch.setattr(kvcli.attention, "CHUNK_BYTES", 1)
    attend = kvcli.attention.Attention(flash=flash)
    spec = CacheSpec("kv", kind, kind, window=4)
    base = make_cache(llm.config, spec, llm.n_ctx, 4, attention=attend)
    rows = [base.rows(i, i + 1) for i in range(4)]
    solo = [make_cache(llm.config, spec, llm.n_ctx, 1, attention=attend) for _ in range(4)]
    assert sum(r.nbytes() for r in rows) == base.nbytes() == 4 * solo[0].nbytes()
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11, 12, 13], [5] * 11, list(range(20, 34))]
    for r, c in zip(rows, solo):
        for cache in (r, c):
            p = prompts[rows.index(r)]
            llm.model(torch.tensor([p]), cache, 0)
    for cache in (rows[3], solo[3]):  # row 3 keeps 8 of its 14 positions and goes on from a new token
        llm.model(torch.tensor([[40]]), cache, 8)
    pos = [3, 7, 11, 9]
    tokens = [[50 + b] for b in range(4)]
    for step in range(8):
        batched = _forward_slots(llm, tokens, rows, pos)
        for b in range(4):
            alone = llm.model(torch.tensor([tokens[b]]), solo[b], pos[b])[0, -1]
            # logits span about 30; a code moved by a step moved one by up to 0.20 (0.03-0.20 over six prompt sets)
            torch.testing.assert_close(batched[b], alone, rtol=0, atol=0.25)
            top = alone.topk(2).values
            if top[0] - top[1] > 0.5:  # the same token, unless the two best are within the logits' tolerance
                assert int(batched[b].argmax()) == int(alone.argmax())
        tokens = [[int(batched[b].argmax())] for b in range(4)]
        pos = [p + 1 for p in pos]
    for b in range(4):  # each row's window bookkeeping is its solo cache's
        assert base.ring.held[0][b] == solo[b].ring.held[0][0] and base.ring.stored[0][b] == solo[b].ring.stored[0][0]


def test_prompt_chunks_and_decode_tokens_in_one_step_equal_each_alone(llm):
    """One forward over two decoding slots and two slots' whole prompts: each segment's last logits are its
    solo ones (the weights read once for all of them, RoPE and attention per segment)."""
    prompts = [llm.tokenize(t) for t in ("Hi there", "The capital of France is a city", "Once upon a time, in a land",
                                         "def add(a, b):")]
    make = lambda: make_cache(llm.config, llm.cache_spec, llm.n_ctx, 1, attention=llm.attention, model=llm.model)  # noqa: E731
    caches = [make() for _ in prompts]
    solo = []
    for i, p in enumerate(prompts):
        c = make()
        if i < 2:  # decoding: the prompt but its last token already in the cache
            llm.model(torch.tensor([p[:-1]]), c, 0)
            llm.model(torch.tensor([p[:-1]]), caches[i], 0)
            solo.append(llm.model(torch.tensor([p[-1:]]), c, len(p) - 1)[0, -1])
        else:  # prefilled whole in the step
            solo.append(llm.model(torch.tensor([p]), c, 0)[0, -1])
    ids = [prompts[0][-1:], prompts[1][-1:], prompts[2], prompts[3]]
    batched = _forward_slots(llm, ids, caches, [len(prompts[0]) - 1, len(prompts[1]) - 1, 0, 0])
    assert batched.shape == (4, llm.config.vocab_size)
    for b in range(4):
        torch.testing.assert_close(batched[b], solo[b], rtol=1e-4, atol=1e-4)
        assert int(batched[b].argmax()) == int(solo[b].argmax())
    for i in (2, 3):  # the prefilled slots continue from what the step stored
        c = make()
        llm.model(torch.tensor([prompts[i]]), c, 0)
        torch.testing.assert_close(llm.model(torch.tensor([[5]]), caches[i], len(prompts[i]))[0, -1],
                                   llm.model(torch.tensor([[5]]), c, len(prompts[i]))[0, -1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec", [CacheSpec("kv", "q4_hadamard", "q8_0", window=4), CacheSpec("hidden", type_h="q8_0"),
                                  CacheSpec("hidden", type_h="f16", window=4)], ids=lambda s: s.label)
def test_batched_decode_per_cache_type(llm, spec):
    """Each slot's cache stores and attends as alone, whatever its type, window or mode."""
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [5] * 11]
    make = lambda: make_cache(llm.config, spec, llm.n_ctx, 1, attention=llm.attention, model=llm.model)  # noqa: E731
    solo, caches = [], [make() for _ in prompts]
    for p in prompts:
        c = make()
        llm.model(torch.tensor([p[:-1]]), c, 0)
        solo.append(llm.model(torch.tensor([p[-1:]]), c, len(p) - 1)[0, -1])
    for c, p in zip(caches, prompts):
        llm.model(torch.tensor([p[:-1]]), c, 0)
    batched = _forward_slots(llm, [p[-1:] for p in prompts], caches, [len(p) - 1 for p in prompts])
    for b in range(len(prompts)):  # a batched product's last-bit rounding can move a quantized code by one step
        torch.testing.assert_close(batched[b], solo[b], rtol=0, atol=5e-3)
        assert int(batched[b].argmax()) == int(solo[b].argmax())


def test_four_concurrent_requests_equal_their_solo_runs(llm):
    engine = Engine(llm, 4)
    prompts = [llm.tokenize(t, special=True) for t in ("Hello", "The sky is", "One, two, three,", "My name is")]
    solo = {}
    for i, p in enumerate(prompts):
        ev = {}
        _submit(engine, ev, i, p, max_tokens=8)
        _drain(engine, ev)
        solo[i] = _text(ev[i])
    engine = Engine(llm, 4)
    ev = {}
    for i, p in enumerate(prompts):
        _submit(engine, ev, i, p, max_tokens=8)
    _drain(engine, ev)
    assert {i: _text(ev[i]) for i in ev} == solo
    assert all(ev[i][-1].predicted_n == 8 and ev[i][-1].finish_reason == "length" for i in ev)


def test_prefix_reuse_evaluates_only_new_tokens(llm):
    engine = Engine(llm, 2)
    first = llm.tokenize("The quick brown fox jumps over the lazy dog.", special=True)
    ev = {}
    _submit(engine, ev, "a", first, max_tokens=4)
    _drain(engine, ev)
    second = first + llm.tokenize(" Then it", add_bos=False)
    _submit(engine, ev, "b", second, max_tokens=8)
    _drain(engine, ev)
    done = ev["b"][-1]
    assert done.cache_n == len(first) and done.prompt_n == len(second) - len(first)
    assert engine.slots[0].cached[:len(second)] == second  # the slot that held the prefix took it
    fresh = Engine(llm, 1)
    ev2 = {}
    _submit(fresh, ev2, "b", second, max_tokens=8)
    _drain(fresh, ev2)
    assert ev2["b"][-1].cache_n == 0 and _text(ev2["b"]) == _text(ev["b"])


def test_slot_context_end_finishes_with_length(llm):
    engine = Engine(llm, 1)
    prompt = llm.tokenize("1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,", special=True)
    ev = {}
    _submit(engine, ev, 0, prompt, max_tokens=1000, sampler=Sampler(temp=0, banned=llm.tokenizer.eog_ids))
    _drain(engine, ev)
    done = ev[0][-1]
    assert done.finish_reason == "length" and len(prompt) + done.predicted_n == llm.n_ctx + 1
    assert len(engine.slots[0].cached) == llm.n_ctx  # the last token is sampled, never evaluated


def test_stop_string_ends_the_text_before_it(llm):
    engine = Engine(llm, 1)
    ev = {}
    prompt = llm.tokenize("1, 2, 3, 4, 5,", special=True)
    _submit(engine, ev, 0, prompt, max_tokens=20)
    _drain(engine, ev)
    full = _text(ev[0])
    assert " 8" in full
    _submit(engine, ev, 1, prompt, max_tokens=20, stop=(" 8",))
    _drain(engine, ev)
    assert _text(ev[1]) == full[: full.index(" 8")] and ev[1][-1].finish_reason == "stop"
    assert partial_stop("abc 8", (" 8,",)) == 2 and partial_stop("abc", ("x",)) == 0


def test_bad_requests_and_a_full_queue_are_refused(llm):
    engine = Engine(llm, 1, queue_size=1)
    with pytest.raises(KvcliError, match=f"{llm.n_ctx + 5} tokens.*{llm.n_ctx} tokens"):
        engine.submit(Request([1] * (llm.n_ctx + 5), print))
    ev = {}
    _submit(engine, ev, 0, [1, 2], max_tokens=2)  # the idle slot's
    _submit(engine, ev, 1, [1, 2], max_tokens=2)  # the queue's one place
    with pytest.raises(QueueFull, match="busy"):
        _submit(engine, ev, 2, [1, 2], max_tokens=2)
    del ev[2]
    _drain(engine, ev)
    assert [e[-1].predicted_n for e in ev.values()] == [2, 2]


def test_cancelled_request_frees_its_slot_and_stop_fails_the_rest(llm):
    engine = Engine(llm, 1)
    ev = {}
    req = _submit(engine, ev, 0, llm.tokenize("Hello", special=True), max_tokens=50)
    for _ in range(3):
        with engine.cond:
            engine._assign()
        engine.step()
    assert engine.processing() == 1
    req.cancelled = True
    engine.step()
    assert engine.processing() == 0
    _submit(engine, ev, 1, [1, 2], max_tokens=50)
    engine.stop()
    engine.run()  # returns at once, failing what waits
    assert isinstance(ev[1][-1], Failed) and ev[1][-1].code == 503
    assert engine.cache_stats()["cells_in_use"] > 0


def test_an_idle_engine_prefills_a_burst_together(llm, monkeypatch):
    """Requests being prepared (Engine.preparing) when an idle engine gets the first: their prompts share its forward."""
    import threading

    from kvcli.serve import engine as engine_mod

    monkeypatch.setattr(engine_mod, "GATHER_S", 60.0)  # the second submit ends the wait, not the clock
    engine = Engine(llm, 2)
    forwards, done = [], threading.Event()
    launch = engine._launch
    monkeypatch.setattr(engine, "_launch", lambda seg: (forwards.append([len(ids) for _, ids in seg]), launch(seg))[1])
    ev = {0: [], 1: []}

    def emit(key):
        def put(e):
            ev[key].append(e)
            if all(v and isinstance(v[-1], (Done, Failed)) for v in ev.values()):
                done.set()
        return put

    runner = threading.Thread(target=engine.run, daemon=True)
    runner.start()
    with engine.preparing() as first, engine.preparing() as second:
        engine.submit(Request([1, 2, 3], emit(0), max_tokens=2), first)
        time.sleep(0.05)  # the engine, awake, waits for the announced second
        assert forwards == []
        engine.submit(Request([4, 5], emit(1), max_tokens=2), second)
    assert done.wait(60)
    engine.stop()
    runner.join(10)
    assert forwards[0] == [3, 2] and engine.announced == 0
    assert [e[-1].predicted_n for e in ev.values()] == [2, 2]
