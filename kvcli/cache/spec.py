"""What cache a run asks for (`CacheSpec`), what it will cost (`cache_bytes`) and how it is
built (`make_cache`): the one constructor `run`, `perplexity` (and its sweep), `bench`, `fit`
and the server share, so every command plans and builds a cache the same way."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcli.cache import layers
from kvcli.cache.base import KVCache, resolve_type, window_for
from kvcli.cache.key_bias import KEY_BIAS, KeyBias, treats
from kvcli.cache.key_scale import KEY_SCALES, model_scales, scales_keys
from kvcli.cache.hidden import HiddenCache
from kvcli.errors import KvcliError
from kvcli.rope import rope_table

CACHE_MODES = ("kv", "hidden", "auto")


@dataclass(frozen=True)
class CacheSpec:
    """A cache choice: mode kv (K and V of type_k / type_v), hidden (each layer's normed input
    as type_h) or auto (hidden only where it is smaller than K+V at these types). window: the newest
    positions kept in f16 (kvcli/cache/window.py); None: the types' default. Once the mode is kv or
    hidden it holds the window the cache keeps: 0 where every type is dense (f32, f16, bf16). type_k and type_v
    may differ by layer (kvcli/cache/layers.py: `q8_0=0-1+tq3`); one window then serves every layer whose
    types are not both dense. key_bias: auto, on or off, whether keys are stored less their turning mean (the K
    bias and the projections' mean, kvcli/cache/key_bias.py; auto: for kvcli's rotated types). key_scales: auto, on or
    off, whether keys are scaled for the queries (kvcli/cache/key_scale.py; auto: rotated types, where the model's
    weights predict a gain)."""

    mode: str = "kv"
    type_k: str = "f16"
    type_v: str = "f16"
    type_h: str = "f16"
    window: int | None = None
    key_bias: str = "auto"
    key_scales: str = "auto"

    def __post_init__(self):
        if self.mode not in CACHE_MODES:
            raise KvcliError(f"--cache-mode takes kv, hidden or auto, not {self.mode!r}")
        if self.key_bias not in KEY_BIAS:
            raise KvcliError(f"--key-bias takes auto, on or off, not {self.key_bias!r}")
        if self.key_scales not in KEY_SCALES:
            raise KvcliError(f"--key-scales takes auto, on or off, not {self.key_scales!r}")
        w = self.window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 0):
            raise KvcliError(f"--cache-window takes a count of positions, 0 or more, not {w!r}")
        # canonical names (aliases such as q4 resolved); unknown names fail here, before any loading
        for field in ("type_k", "type_v"):
            object.__setattr__(self, field, layers.canonical(getattr(self, field)))
        if layers.is_mixed(self.type_h):
            raise KvcliError(f"-cth {self.type_h!r}: the hidden-state cache takes one type for every layer")
        object.__setattr__(self, "type_h", resolve_type(self.type_h).name)
        if self.mode != "auto":  # canonical window too: a choice equals the same choice spelled out
            types = (self.type_h,) if self.mode == "hidden" else layers.all_types(self.type_k, self.type_v)
            object.__setattr__(self, "window", window_for(types, w))

    @property
    def label(self) -> str:
        if self.mode == "hidden":
            return f"hidden {self.type_h}"
        return f"kv {self.type_k}/{self.type_v}" if self.mode == "kv" else f"auto {self.type_k}/{self.type_v}/{self.type_h}"

    def nbytes(self, config, n_ctx: int, n_seq: int = 1) -> int:
        """cache_bytes(config, self, n_ctx, n_seq): what a cache of this choice allocates."""
        return cache_bytes(config, self, n_ctx, n_seq)

    @property
    def mixed(self) -> bool:
        """K or V types differ by layer."""
        return layers.is_mixed(self.type_k) or layers.is_mixed(self.type_v)

    def bits_per_element(self, n_layers: int | None = None) -> float:
        """Bits per cached element (hidden: of x; kv: the mean of K's and V's, over the model's n_layers where the
        types differ by layer)."""
        if self.mode == "hidden":
            return resolve_type(self.type_h).bits_per_element()
        return (layers.bits_per_element(self.type_k, n_layers) + layers.bits_per_element(self.type_v, n_layers)) / 2

    def resolved(self, config, n_ctx: int) -> "CacheSpec":
        """auto -> kv or hidden for this model and context."""
        if self.mode != "auto":
            return self
        kv, hidden = (CacheSpec(m, self.type_k, self.type_v, self.type_h, self.window, self.key_bias, self.key_scales)
                      for m in ("kv", "hidden"))
        return hidden if cache_bytes(config, hidden, n_ctx) < cache_bytes(config, kv, n_ctx) else kv


def validate_cache_flags(cache_mode: str, k_given: bool, v_given: bool, h_given: bool) -> None:
    """KvcliError for a mode/type-flag combination that would be silently ignored."""
    if cache_mode not in CACHE_MODES:
        raise KvcliError(f"--cache-mode takes kv, hidden or auto, not {cache_mode!r}")
    if cache_mode == "hidden" and (k_given or v_given):
        raise KvcliError("-ctk/-ctv set the K/V cache types, but --cache-mode hidden stores no K/V; "
                         "use -cth/--cache-type-h for the hidden state's type")
    if cache_mode == "kv" and h_given:
        raise KvcliError("-cth/--cache-type-h sets the hidden-state cache type; it needs --cache-mode hidden or auto")


def resolve_cache_mode(config, n_ctx: int, cache_mode: str, type_k: str = "f16", type_v: str = "f16",
                       type_h: str = "f16") -> str:
    """'kv' or 'hidden'; auto picks hidden only where its bytes are below K+V's at the given types."""
    return CacheSpec(cache_mode, type_k, type_v, type_h).resolved(config, n_ctx).mode


def cache_bytes(config, spec: CacheSpec, n_ctx: int, n_seq: int = 1) -> int:
    """The bytes `make_cache(config, spec, n_ctx, n_seq)` allocates: the memory plan, `kvcli fit`,
    `kvcli info`, the sweep's table and the printed size all come from here."""
    c, s = config, spec.resolved(config, n_ctx)
    if s.mode == "hidden":
        return HiddenCache.bytes_needed(c.n_layers, n_seq, c.n_embd, n_ctx, s.type_h, s.window)
    means = len(treats_keys(c, s)) * n_seq * c.kv_dim * 4  # keys less their mean: each sequence's m, f32
    if s.mixed:
        return layers.bytes_needed(c.n_layers, n_seq, c.kv_dim, n_ctx, s.type_k, s.type_v, s.window) + means
    return KVCache.bytes_needed(c.n_layers, n_seq, c.kv_dim, n_ctx, s.type_k, s.type_v, s.window) + means


def make_cache(config, spec: CacheSpec, n_ctx: int, n_seq: int = 1, device: str = "cpu",
               *, attention, model=None):
    """A KVCache or a HiddenCache (the latter needs `model`, the Transformer, already on `device`; so does a K/V
    cache that stores keys less their mean, spec.key_bias, on a model with a K bias: else, without the model, the
    config's RoPE table); attention: how it attends (kvcli.attention.Attention,
    the -fa choice)."""
    c, s = config, spec.resolved(config, n_ctx)
    if s.mode == "hidden":
        return HiddenCache(c, n_seq, n_ctx, s.type_h, device=device, attention=attention, model=model,
                           window=s.window)

    def qk_scale(layer_ids: list[int], type_k: str) -> torch.Tensor | None:
        """These layers' key scales (kvcli/cache/key_scale.py), (len(layer_ids), H + Hkv, D) on the device, or None."""
        if not scales_keys(s.key_scales, resolve_type(type_k), model):
            return None
        return model_scales(model)[0][layer_ids].to(device)

    def qk_gain(layer_ids: list[int], type_k: str) -> float | None:
        """The share of the score error these layers' key scales are predicted to leave, or None."""
        if not scales_keys(s.key_scales, resolve_type(type_k), model):
            return None
        return float(model_scales(model)[1][layer_ids].mean())

    def key_bias(layer_ids: list[int], type_k: str) -> KeyBias | None:
        """The treatment of these layers' keys, of type type_k: None where the policy leaves this type's keys as
        they come."""
        if not treats(s.key_bias, resolve_type(type_k)):
            return None
        if model is not None:  # the bias in the basis the cache keeps keys in
            scaled = scales_keys(s.key_scales, resolve_type(type_k), model)
            return KeyBias.from_model(model, layer_ids, model_scales(model)[0][layer_ids, -c.n_kv_heads :] if scaled
                                      else None)
        if getattr(c, "qkv_bias", False):
            raise ValueError("a cache of keys less their mean needs the model (its K bias and RoPE table)")
        return KeyBias(torch.zeros(len(layer_ids), c.n_kv_heads, c.head_dim), rope_table(c, n_ctx), c.rope_neox)

    if s.mixed:
        return layers.LayeredKV(c.n_layers, n_seq, c.n_kv_heads, n_ctx, c.head_dim, s.type_k, s.type_v,
                                device=device, attention=attention, window=s.window, key_bias=key_bias,
                                qk_scale=qk_scale, qk_gain=qk_gain)
    every = list(range(c.n_layers))
    return KVCache(c.n_layers, n_seq, c.n_kv_heads, n_ctx, c.head_dim, s.type_k, s.type_v, device=device,
                   attention=attention, window=s.window, key_bias=key_bias(every, s.type_k),
                   qk_scale=qk_scale(every, s.type_k), qk_gain=qk_gain(every, s.type_k))


def treats_keys(config, spec: CacheSpec) -> list[int]:
    """The layers whose keys a cache of this choice stores less their mean (make_cache's rule)."""
    if spec.mode != "kv":
        return []
    return [i for i, t in enumerate(layers.per_layer(spec.type_k, config.n_layers))
            if treats(spec.key_bias, resolve_type(t))]


def scaled_keys(model, spec: CacheSpec) -> list[int]:
    """The layers whose keys a cache of this choice keeps scaled for the queries on this model (make_cache's rule)."""
    if spec.mode != "kv" or model is None:
        return []
    return [i for i, t in enumerate(layers.per_layer(spec.type_k, model.c.n_layers))
            if scales_keys(spec.key_scales, resolve_type(t), model)]


def has_rows(spec: CacheSpec) -> bool:
    """Can the server's slots be rows of one cache of this choice (KVCache.has_rows, every type of every layer)?"""
    return spec.mode == "kv" and all(KVCache.has_rows(t, t) for t in layers.all_types(spec.type_k, spec.type_v))
