"""llama-server's slot files: POST /slots/{id}?action=save|restore|erase, a slot's cache kept in a state file
(kvcli/cache/state.py) under --slot-save-path, with llama-server's request and response fields. Each action runs on
the engine thread between two steps (Engine.call), so no step touches the caches meanwhile and two actions on one
slot never interleave. File names are plain names inside the folder: no separators, no leading dot."""

from __future__ import annotations

import re
import time
from pathlib import Path

from kvcli.cache import state
from kvcli.errors import KvcliError
from kvcli.serve.schemas import ApiError

NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")
ACTIONS = ("save", "restore", "erase")


def file_in(folder: Path, filename) -> Path:
    """folder/filename for a plain file name; a 400 for anything else (a path, '..', a hidden name)."""
    if not isinstance(filename, str) or not NAME.fullmatch(filename) or ".." in filename:
        raise ApiError(400, f"invalid filename {str(filename)[:80]!r}: a plain file name of letters, digits, '.', '_' "
                            f"and '-' (no path) is expected", "filename")
    path = folder / filename
    if path.resolve().parent != folder.resolve():  # a link out of the folder
        raise ApiError(400, f"invalid filename {filename!r}: it leads outside the slot save path", "filename")
    return path


def _idle(engine, id_slot: int):
    if not 0 <= id_slot < len(engine.slots):
        raise ApiError(404, f"no slot {id_slot}: slots run 0..{len(engine.slots) - 1}")
    slot = engine.slots[id_slot]
    if slot.req is not None:
        raise ApiError(409, f"slot {id_slot} is busy with a request")
    return slot


def save(engine, id_slot: int, folder: Path, filename) -> dict:
    path = file_in(folder, filename)
    slot = _idle(engine, id_slot)
    t0 = time.perf_counter()
    written = state.save(path, engine.llm.identity(), slot.cache, 0, slot.cached)
    return {"id_slot": id_slot, "filename": filename, "n_saved": len(slot.cached), "n_written": written,
            "timings": {"save_ms": (time.perf_counter() - t0) * 1000}}


def restore(engine, id_slot: int, folder: Path, filename) -> dict:
    path = file_in(folder, filename)
    if not path.is_file():
        raise ApiError(404, f"no slot file {filename!r} in the slot save path")
    slot = _idle(engine, id_slot)
    t0 = time.perf_counter()
    try:
        tokens, _ = state.load(path, engine.llm.identity(), slot.cache, 0, engine.llm.config.vocab_size)
    except KvcliError as e:
        raise ApiError(400, str(e).replace(str(path), repr(filename))) from None
    slot.cached = list(tokens)
    return {"id_slot": id_slot, "filename": filename, "n_restored": len(tokens), "n_read": path.stat().st_size,
            "timings": {"restore_ms": (time.perf_counter() - t0) * 1000}}


def erase(engine, id_slot: int) -> dict:
    slot = _idle(engine, id_slot)
    n = len(slot.cached)
    slot.cached = []
    return {"id_slot": id_slot, "n_erased": n}
