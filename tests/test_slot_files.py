"""llama-server's slot files on a live `kvcli serve` (issue 43, kvcli/serve/slot_files.py): a conversation saved,
the server restarted, restored, and the next reply equal to the uninterrupted one at temperature 0; the routes'
errors (bad names, missing files, a busy slot, damaged files) with the slot left as it was."""

from __future__ import annotations

import time

import httpx
import pytest

from test_serve import KEY, _post, _start, _stop

openai = pytest.importorskip("openai")

FLAGS = ("-c", 1024, "-np", 2, "--api-key", KEY, "-ctk", "tq3", "-ctv", "tq3", "-t", 1)
TURN1 = [{"role": "user", "content": "Name a fruit."}]


def _client(base: str):
    return openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _slots(base: str) -> list[dict]:
    r = httpx.get(base + "/slots", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _ask(client, messages: list[dict]):
    return client.chat.completions.create(model="x", messages=messages, temperature=0, max_tokens=12)


def test_a_conversation_outlives_a_restart(default_model, tmp_path):
    folder = tmp_path / "slots"
    proc, base = _start(default_model, *FLAGS, "--slot-save-path", folder)
    try:
        client = _client(base)
        first = _ask(client, TURN1)
        turn2 = TURN1 + [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "And a vegetable?"}]
        saved = _post(base, "/slots/0?action=save", {"filename": "conv.bin"})
        assert saved.status_code == 200, saved.text
        s = saved.json()
        assert s["id_slot"] == 0 and s["filename"] == "conv.bin" and s["n_saved"] == _slots(base)[0]["tokens_cached"]
        assert s["n_written"] == (folder / "conv.bin").stat().st_size and "save_ms" in s["timings"]
        print(f"slot file: {s['n_saved']} tokens, {s['n_written']} bytes, "
              f"slot cache in use {_slots(base)[0]['cache_bytes_in_use']} bytes")
        uninterrupted = _ask(client, turn2)
    finally:
        log = _stop(proc)
    assert "Traceback" not in log, log

    proc, base = _start(default_model, *FLAGS, "--slot-save-path", folder)
    try:
        assert _slots(base)[0]["tokens_cached"] == 0
        r = _post(base, "/slots/0?action=restore", {"filename": "conv.bin"})
        assert r.status_code == 200, r.text
        assert r.json()["n_restored"] == s["n_saved"] and r.json()["n_read"] == s["n_written"]
        assert _slots(base)[0]["tokens_cached"] == s["n_saved"]
        again = _ask(_client(base), turn2)
        assert again.choices[0].message.content == uninterrupted.choices[0].message.content
        t = again.model_extra["timings"]
        assert t["cache_n"] >= first.usage.prompt_tokens  # the restored prefix was not evaluated again
        _errors(base, folder)
    finally:
        log = _stop(proc)
    assert "Traceback" not in log, log


def _errors(base: str, folder) -> None:
    before = _slots(base)
    for name in ("../conv.bin", "a/b", "/etc/passwd", ".hidden", "", None, 5):
        r = _post(base, "/slots/0?action=save", {"filename": name})
        assert r.status_code == 400 and r.json()["error"]["param"] == "filename", r.text
    r = _post(base, "/slots/0?action=restore", {"filename": "absent.bin"})
    assert r.status_code == 404, r.text
    assert _post(base, "/slots/9?action=save", {"filename": "x.bin"}).status_code == 404
    assert _post(base, "/slots/0?action=dance", {"filename": "x.bin"}).status_code == 400
    assert _post(base, "/slots/0?action=save", {"filename": "x.bin"}, key=None).status_code == 401
    assert httpx.get(base + "/slots", timeout=10).status_code == 401
    (folder / "bad.bin").write_bytes((folder / "conv.bin").read_bytes()[:-7])
    r = _post(base, "/slots/0?action=restore", {"filename": "bad.bin"})
    assert r.status_code == 400 and "truncated" in r.json()["error"]["message"], r.text
    assert _slots(base) == before  # refused: the slot is as it was
    with httpx.stream("POST", base + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 400,
                                                             "stream": True, "ignore_eos": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # streaming: its slot is busy now
        busy = [s["id"] for s in _slots(base) if s["is_processing"]]
        assert len(busy) == 1
        r = _post(base, f"/slots/{busy[0]}?action=restore", {"filename": "conv.bin"})
        assert r.status_code == 409, r.text
    for _ in range(100):  # the stream's slot is freed at the engine's next step after the client left
        erased = _post(base, "/slots/0?action=erase", {})
        if erased.status_code != 409:
            break
        time.sleep(0.1)
    assert erased.status_code == 200 and erased.json()["id_slot"] == 0, erased.text
    assert _slots(base)[0]["tokens_cached"] == 0


LONG_SYSTEM = ("You are a careful assistant for a small bakery. You answer questions about bread, flour, ovens, "
               "opening hours and prices, briefly and politely, and you never invent facts you were not given.")


def test_cache_ram_gives_another_slot_a_finished_conversations_prefix(default_model):
    proc, base = _start(default_model, *FLAGS, "--cache-ram", 64)
    try:
        client = _client(base)
        convo = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "When do you open?"}]
        first = _ask(client, convo)  # slot 0; kept in RAM when it finishes
        assert first.model_extra["timings"]["cache_n"] == 0
        with httpx.stream("POST", base + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 400,
                                                                 "stream": True, "ignore_eos": True},
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as stream:
            lines = stream.iter_lines()  # held: a dropped iterator closes the stream (the client gone)
            next(line for line in lines if line.startswith("data:"))  # slot 0 is busy with it now
            busy = [s["id"] for s in _slots(base) if s["is_processing"]]
            turn2 = convo + [{"role": "assistant", "content": first.choices[0].message.content},
                             {"role": "user", "content": "And on Sundays?"}]
            second = _ask(client, turn2)  # on the other slot, from the conversation kept in RAM
        t = second.model_extra["timings"]
        assert busy == [0] and t["cache_n"] >= first.usage.prompt_tokens, t
        assert t["prompt_n"] == second.usage.prompt_tokens - t["cache_n"] < second.usage.prompt_tokens // 2
        props = httpx.get(base + "/props", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
        ram = props["prompt_cache_ram"]
        assert ram["hits"] >= 1 and ram["entries"] >= 1 and 0 < ram["bytes"] <= 64 << 20, ram
        metrics = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
        assert "kvcli:prompt_cache_ram_bytes" in metrics and "kvcli:prompt_cache_ram_hit_rate" in metrics
    finally:
        log = _stop(proc)
    assert "Traceback" not in log, log
