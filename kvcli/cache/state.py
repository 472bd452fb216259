"""The state file: one sequence of a cache, saved as its packed bytes and restored bit for bit (issue 43).

Every cache type and mode (K/V stores of any type, per-layer mixes, the recent window, sinks, offsets, the keys'
means, the hidden-state cache) is walked into one list of named parts, each a tensor of what sequence `row` holds
for its first n positions: views of the stores' own bytes (positions past n left out, a part that does not grow
with the positions whole), and small tensors of the bookkeeping beside them. Nothing is re-quantized either way.

File layout (little-endian):
    magic b"KVCSTATE", u32 format version, u64 header length, the header (UTF-8 JSON: the model's identity, the
    cache's, the token ids, and each part's name, dtype and shape), each part's bytes in order, then the SHA-256
    of everything before it.
Written to a temporary file beside the target and renamed (a crash leaves the old file). Read with every length
checked against the header, and the header's parts against the running cache's, before anything is allocated;
the parts are read and the checksum checked before the cache is touched, so a refused file leaves it as it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from typing import Callable

import torch

from kvcli.cache.base import KVCache, Store
from kvcli.cache.hidden import HiddenCache
from kvcli.cache.layers import LayeredKV
from kvcli.cache.window import Ring
from kvcli.errors import KvcliError

MAGIC = b"KVCSTATE"
VERSION = 1
_HEAD = struct.Struct("<8sIQ")  # magic, version, header length
HEADER_MAX = 64 << 20  # a header past this is damage, not token ids
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.uint8, torch.int64, torch.float16, torch.bfloat16,
                                                      torch.float32)}


@dataclass
class Part:
    """One named piece of a sequence's state: `tensor` holds it now; put(t) writes t back in its place."""

    name: str
    tensor: torch.Tensor
    put: Callable[[torch.Tensor], None]


def _view(name: str, view: torch.Tensor) -> Part:
    return Part(name, view, view.copy_)


def _store_parts(prefix: str, store: Store, row: int, n: int) -> list[Part]:
    """A store's bytes of sequence row at positions 0..n-1 (whole steps of its position axes), then its row_state."""
    axes = store.position_axes()
    parts = []
    for name in store.batched:
        t = getattr(store, name)[:, row]
        if name in axes:
            axis, step = axes[name]
            t = t.narrow(axis, 0, -(-n // step))
        parts.append(_view(f"{prefix}.{name}", t))
    parts.append(Part(f"{prefix}.row_state", store.row_state(row), lambda t: store.restored(row, t)))
    return parts


def _ring_parts(prefix: str, ring: Ring, row: int, n: int) -> list[Part]:
    """The window of sequence row: the slots its positions 0..n-1 may lie in (position p in slot p % N), and what it
    holds, (L, 3) lo, hi, stored, below n (a rewound sequence's later positions are not its state)."""
    b = ring.row0 + row
    marks = torch.tensor([[min(lo, n), min(hi, n), min(ring.stored[l][b], n)] for l, (lo, hi) in
                          enumerate(held[b] for held in ring.held)], dtype=torch.int64)

    def put(t: torch.Tensor) -> None:
        for l, (lo, hi, stored) in enumerate(t.tolist()):
            ring.held[l][b], ring.stored[l][b] = (lo, hi), stored

    return [_view(f"{prefix}.data", ring.data[:, row].narrow(2, 0, min(ring.size, n))),
            Part(f"{prefix}.marks", marks, put)]


def _kv_parts(prefix: str, cache: KVCache, row: int, n: int) -> list[Part]:
    parts = _store_parts(f"{prefix}k", cache.k, row, n) + _store_parts(f"{prefix}v", cache.v, row, n)
    if cache.ring is not None:
        parts += _ring_parts(f"{prefix}window", cache.ring, row, n)
    if cache.key_bias is not None:
        parts.append(_view(f"{prefix}key_mean", cache.key_bias.mean[:, row]))
    return parts


def parts(cache, row: int, n: int) -> list[Part]:
    """Sequence row's state at n positions, in file order."""
    if isinstance(cache, KVCache):
        return _kv_parts("", cache, row, n)
    if isinstance(cache, LayeredKV):
        return [p for i, (part, _) in enumerate(cache.parts) for p in _kv_parts(f"group{i}.", part, row, n)]
    if isinstance(cache, HiddenCache):
        out = _store_parts("h", cache.h, row, n)
        if cache.ring is not None:
            out += _ring_parts("window", cache.ring, row, n)
        return out
    raise KvcliError(f"a {type(cache).__name__} cannot be saved")


def cache_identity(cache) -> dict:
    """What a restoring cache must share with the saving one: its types, their layouts, the window and key means."""
    if isinstance(cache, HiddenCache):
        stores, window, means, scaled = [cache.h], cache.window, False, False
    else:
        groups = cache.parts if isinstance(cache, LayeredKV) else [(cache, None)]
        stores = [s for part, _ in groups for s in (part.k, part.v)]
        window, means = cache.window, any(part.key_bias is not None for part, _ in groups)
        scaled = any(part.qk_scale is not None for part, _ in groups)
    found = {"mode": "hidden" if isinstance(cache, HiddenCache) else "kv",
             "types": "/".join(s.name for s in stores),  # K/V of each group of layers (x alone for hidden)
             "tiles": "/".join(str(getattr(s, "tile", "-")) for s in stores),  # the rotated types' tile widths
             "layers": cache.n_layers, "window": window, "keys less their mean": means}
    if scaled:  # the basis keys are kept in (kvcli/cache/key_scale.py); files of caches without keep their identity
        found["keys scaled for the queries"] = True
    return found


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())


def save(path: str | os.PathLike, model: dict, cache, row: int, tokens: list[int], extra: dict | None = None) -> int:
    """Write sequence row of cache (its first len(tokens) positions hold `tokens`) to path, atomically.
    model: the model's identity (GGUFModel.identity); extra: kept in the header as given (JSON), returned by load.
    Returns the file's size in bytes."""
    path = os.fspath(path)
    n = len(tokens)
    pieces = parts(cache, row, n)
    header = json.dumps({"model": model, "cache": cache_identity(cache), "tokens": list(map(int, tokens)),
                         "extra": extra or {},
                         "parts": [[p.name, str(p.tensor.dtype).removeprefix("torch."), list(p.tensor.shape)]
                                   for p in pieces]}).encode()
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".kvcli-state-", dir=folder)
    except OSError as e:
        raise KvcliError(f"cannot write a state file in {folder}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            digest = hashlib.sha256()
            for chunk in [_HEAD.pack(MAGIC, VERSION, len(header)), header, *(_bytes(p.tensor) for p in pieces)]:
                digest.update(chunk)
                f.write(chunk)
            f.write(digest.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        os.unlink(tmp)
        if isinstance(e, OSError):
            raise KvcliError(f"cannot write the state file {path}: {e.strerror}") from None
        raise
    return os.path.getsize(path)


def _differs(what: str, saved: dict, here: dict) -> str | None:
    for key in [*here, *(k for k in saved if k not in here)]:  # in the order this run names them
        if saved.get(key) != here.get(key):
            a, b = (str(v)[:16] + "..." if isinstance(v, str) and len(v) > 19 else v for v in (saved.get(key), here.get(key)))
            return f"{what} {key} {a}, this run's {b}"
    return None


def load(path: str | os.PathLike, model: dict, cache, row: int, vocab_size: int) -> tuple[list[int], dict]:
    """Read a state file into sequence row of cache; returns the token ids its positions hold and the extra it was
    saved with. A KvcliError of one
    line naming the difference for a file of another model, cache, format version, or a damaged one; the cache is
    then as it was."""
    path = os.fspath(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise KvcliError(f"cannot read the state file {path}: {e.strerror}") from None
    with f:
        size = os.fstat(f.fileno()).st_size

        def fail(why: str) -> KvcliError:
            return KvcliError(f"state file {path} refused: {why}")

        head = f.read(_HEAD.size)
        if len(head) < _HEAD.size or head[:8] != MAGIC:
            raise fail("not a kvcli state file (bad magic)")
        _, version, n_header = _HEAD.unpack(head)
        if version != VERSION:
            raise fail(f"format version {version}, this kvcli reads version {VERSION}")
        if n_header > min(HEADER_MAX, size - _HEAD.size - 32):
            raise fail(f"its header claims {n_header} bytes, the file has {size} (truncated or damaged)")
        header_bytes = f.read(n_header)
        try:
            header = json.loads(header_bytes)
            tokens, saved_parts, extra = header["tokens"], header["parts"], header["extra"]
            if not (isinstance(tokens, list) and all(isinstance(t, int) for t in tokens)):
                raise TypeError("token ids")
            if not isinstance(extra, dict):
                raise TypeError("extra")
        except (ValueError, TypeError, KeyError) as e:
            raise fail(f"damaged header ({e})") from None
        why = _differs("its", header.get("model"), model) if isinstance(header.get("model"), dict) else "none named"
        if why:
            raise fail(f"saved from another model ({why})")
        here = cache_identity(cache)
        why = _differs("its", header.get("cache"), here) if isinstance(header.get("cache"), dict) else "none named"
        if why:
            raise fail(f"saved with another cache ({why})")
        n = len(tokens)
        if n > cache.n_ctx:
            raise fail(f"it holds {n} tokens, more than this run's {cache.n_ctx}-token context")
        if tokens and (min(tokens) < 0 or max(tokens) >= vocab_size):
            raise fail(f"a token id outside this model's vocabulary (0..{vocab_size - 1})")
        pieces = parts(cache, row, n)
        expected = [[p.name, str(p.tensor.dtype).removeprefix("torch."), list(p.tensor.shape)] for p in pieces]
        if saved_parts != expected:
            bad = next((s, e) for s, e in zip(saved_parts + [None] * len(expected), expected + [None] * len(saved_parts))
                       if s != e)
            raise fail(f"its layout differs: part {bad[0]} where this cache has {bad[1]}")
        lengths = [p.tensor.numel() * p.tensor.element_size() for p in pieces]
        end = _HEAD.size + n_header + sum(lengths) + 32
        if size != end:
            raise fail(f"{size} bytes where its header makes {end} ({'truncated' if size < end else 'trailing bytes'})")
        digest = hashlib.sha256(head + header_bytes)
        read = []
        for p, length in zip(pieces, lengths):
            buf = bytearray(f.read(length))
            if len(buf) != length:
                raise fail("truncated while reading")
            digest.update(buf)
            read.append(torch.frombuffer(buf, dtype=torch.uint8).view(p.tensor.dtype).view(p.tensor.shape)
                        if length else torch.zeros(p.tensor.shape, dtype=p.tensor.dtype))
        if f.read(32) != digest.digest():
            raise fail("checksum mismatch (the file is damaged)")
    put(cache, pieces, read)
    return tokens, extra


def put(cache, pieces: list[Part], tensors: list[torch.Tensor]) -> None:
    """Write tensors (as pieces' own, same shapes) back in pieces' places: a saved state into the cache."""
    for p, t in zip(pieces, tensors):
        p.put(t.to(p.tensor.device))
    if isinstance(cache, HiddenCache):
        cache._x_key = None  # the chunk of x it kept is of the old bytes
