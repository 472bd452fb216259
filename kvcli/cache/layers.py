"""Per-layer cache types: `-ctk q8_0=0-1+tq3` keeps layers 0 and 1's keys at q8_0 and every other layer's at tq3.

A spelling is `+`-joined items TYPE=LAYERS (LAYERS: `3`, `0-2`, or several as `0-1.23`) and at most one bare TYPE,
the type of every layer no item names (f16 where none is bare). ik_llama.cpp keeps first/last layers at other
types with flags of their own; one string per store type reads the same in -ctk/-ctv, in a sweep's choice and in a
sweep row. A cache of mixed types is one KVCache per (K type, V type) group of layers, each with its own kernels,
all behind `LayeredKV`: the model still sees one cache.
"""

from __future__ import annotations

import torch

from kvcli.cache.base import KVCache, resolve_type, scaled_keys_note, window_for
from kvcli.errors import KvcliError
from kvcli.memory import MIB


def is_mixed(spelling: str) -> bool:
    return "=" in spelling or "+" in spelling


def _layers(text: str, spelling: str) -> list[int]:
    out = []
    for part in text.split("."):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise KvcliError(f"cache type {spelling!r}: layers are N, N-M or several joined by '.', not {text!r}")
        a, b = int(lo), int(hi) if hi else int(lo)
        if b < a:
            raise KvcliError(f"cache type {spelling!r}: the range {part!r} runs backwards")
        out += range(a, b + 1)
    return out


def parse(spelling: str) -> tuple[str, dict[int, str]]:
    """'q8_0=0-1+tq3' -> ('tq3', {0: 'q8_0', 1: 'q8_0'}): the default type and the layers named otherwise, every type
    canonical (aliases resolved); a KvcliError naming the problem for a bad spelling."""
    default, named = None, {}
    for item in spelling.split("+"):
        name, at, layers = item.strip().partition("=")
        if not name:
            raise KvcliError(f"cache type {spelling!r}: an empty item")
        name = resolve_type(name).name
        if not at:
            if default is not None:
                raise KvcliError(f"cache type {spelling!r}: two types for the other layers ({default}, {name})")
            default = name
            continue
        for layer in _layers(layers, spelling):
            if layer in named and named[layer] != name:
                raise KvcliError(f"cache type {spelling!r}: layer {layer} given twice ({named[layer]}, {name})")
            named[layer] = name
    return default or "f16", named


def canonical(spelling: str) -> str:
    """One spelling per choice: the named layers by type in first-layer order, ranges joined, then the default;
    a plain type is its canonical name."""
    default, named = parse(spelling)
    groups: dict[str, list[int]] = {}
    for layer in sorted(named):
        if named[layer] != default:
            groups.setdefault(named[layer], []).append(layer)
    items = [f"{name}={_ranges(layers)}" for name, layers in groups.items()]
    return "+".join(items + [default])


def _ranges(layers: list[int]) -> str:
    runs, start = [], layers[0]
    for a, b in zip(layers, layers[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ".".join(runs)


def per_layer(spelling: str, n_layers: int) -> list[str]:
    """The type of each of n_layers layers; a KvcliError for a layer past the model's."""
    default, named = parse(spelling)
    past = [layer for layer in named if layer >= n_layers]
    if past:
        raise KvcliError(f"cache type {spelling!r}: layer {max(past)} is past this model's {n_layers} layers (0-{n_layers - 1})")
    return [named.get(i, default) for i in range(n_layers)]


def for_layers(spelling: str, n_layers: int, layers: range) -> str:
    """The spelling for a model of only `layers` (a pipeline stage, kvcli/pipeline.py), numbered from 0 there."""
    types = per_layer(spelling, n_layers)[layers.start : layers.stop]
    default = max(set(types), key=types.count)
    return canonical("+".join([f"{t}={j}" for j, t in enumerate(types) if t != default] + [default]))


def all_types(*spellings: str) -> tuple[str, ...]:
    """Every type a spelling names (its default included), in order, once."""
    out = []
    for s in spellings:
        default, named = parse(s)
        out += [default, *named.values()]
    return tuple(dict.fromkeys(out))


def bits_per_element(spelling: str, n_layers: int | None = None) -> float:
    """Mean bits per element over the model's n_layers layers (needed only where the types differ by layer)."""
    if not is_mixed(spelling):
        return resolve_type(spelling).bits_per_element()
    if n_layers is None:
        raise ValueError(f"the bits of {spelling!r} depend on the model's layer count")
    types = per_layer(spelling, n_layers)
    return sum(resolve_type(t).bits_per_element() for t in types) / n_layers


def groups(type_k: str, type_v: str, n_layers: int) -> dict[tuple[str, str], list[int]]:
    """(K type, V type) -> its layers, in first-layer order."""
    out: dict[tuple[str, str], list[int]] = {}
    for i, pair in enumerate(zip(per_layer(type_k, n_layers), per_layer(type_v, n_layers))):
        out.setdefault(pair, []).append(i)
    return out


def bytes_needed(n_layers: int, batch: int, kv_dim: int, n_ctx: int, type_k: str, type_v: str, window: int) -> int:
    """LayeredKV's bytes: each group's KVCache at its layers (its window: none where both its types are dense)."""
    return sum(KVCache.bytes_needed(len(layers), batch, kv_dim, n_ctx, tk, tv, window_for((tk, tv), window))
               for (tk, tv), layers in groups(type_k, type_v, n_layers).items())


class _Side:
    """K's (or V's) stores over every group, as the size lines read a store: a name and bytes."""

    def __init__(self, name: str, stores: list):
        self.name, self.stores = name, stores

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.stores)


class LayeredKV:
    """One cache over layers of different K/V types: a KVCache per (K type, V type) group, each layer routed to
    its group's cache at its index there. The model, the server and the planner see the Cache protocol."""

    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, n_ctx: int, head_dim: int,
                 type_k: str, type_v: str, device: str = "cpu", *, attention, window: int = 0, key_bias=None,
                 qk_scale=None, qk_gain=None):
        """key_bias(layers, type_k) -> a group's KeyBias or None, qk_scale(layers, type_k) -> its key scales or None,
        qk_gain(layers, type_k) -> the score error they are predicted to leave (kvcli/cache/spec.py make_cache); None:
        no group's."""
        self.n_layers, self.batch, self.n_ctx, self.window = n_layers, batch, n_ctx, window
        self.type_k, self.type_v = canonical(type_k), canonical(type_v)
        self.parts = [(KVCache(len(layers), batch, n_kv_heads, n_ctx, head_dim, tk, tv, device,
                               attention=attention, window=window_for((tk, tv), window),
                               key_bias=key_bias(layers, tk) if key_bias else None,
                               qk_scale=qk_scale(layers, tk) if qk_scale else None,
                               qk_gain=qk_gain(layers, tk) if qk_gain else None), layers)
                      for (tk, tv), layers in groups(type_k, type_v, n_layers).items()]  # [(KVCache, its layers)]
        self._index()

    def _index(self) -> None:
        self.route = [None] * self.n_layers  # model layer -> (its group's cache, its index there)
        for cache, layers in self.parts:
            for j, layer in enumerate(layers):
                self.route[layer] = (cache, j)
        self.k = _Side(self.type_k, [cache.k for cache, _ in self.parts])
        self.v = _Side(self.type_v, [cache.v for cache, _ in self.parts])

    def rows(self, start: int, stop: int) -> "LayeredKV":
        view = LayeredKV.__new__(LayeredKV)
        view.__dict__.update(self.__dict__)
        view.batch = stop - start
        view.parts = [(cache.rows(start, stop), layers) for cache, layers in self.parts]
        view._index()
        return view

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor,
                  pos: int | torch.Tensor) -> torch.Tensor:
        cache, j = self.route[layer]
        return cache.attention(j, q, k, v, x, pos)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: int | torch.Tensor):
        cache, j = self.route[layer]
        return cache.store(j, k, v, pos)

    def qk_scales(self, layer: int) -> torch.Tensor | None:
        cache, j = self.route[layer]
        return cache.qk_scales(j)

    def window_nbytes(self) -> int:
        return sum(cache.window_nbytes() for cache, _ in self.parts)

    def nbytes(self) -> int:
        return sum(cache.nbytes() for cache, _ in self.parts)

    def describe(self) -> str:
        """llama.cpp's start-up line, then each group's layers and bytes."""
        line = (f"KV cache: size = {self.nbytes() / MIB:7.2f} MiB ({self.n_ctx:6d} cells, {self.n_layers:3d} layers, "
                f"{self.batch}/{self.batch} seqs), K ({self.type_k}): {self.k.nbytes() / MIB:7.2f} MiB, "
                f"V ({self.type_v}): {self.v.nbytes() / MIB:7.2f} MiB")
        if self.window_nbytes():
            line += f", window {self.window} (f16): {self.window_nbytes() / MIB:7.2f} MiB"
        for cache, layers in self.parts:
            line += (f"\n  layer{'s' if len(layers) > 1 else ''} {_ranges(layers)}: K {cache.k.name}, V {cache.v.name}, "
                     f"{cache.nbytes() / MIB:.2f} MiB" + (", keys less their mean" if cache.key_bias else "")
                     + (scaled_keys_note(cache.qk_gain) if cache.qk_scale is not None else ""))
        return line
