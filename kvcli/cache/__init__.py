"""Cache storage types; importing this package registers all of them."""

from kvcli.cache import dense  # noqa: F401  (registers f32, f16, bf16)
from kvcli.cache import ggml_blocks  # noqa: F401  (registers q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl)
from kvcli.cache import hadamard  # noqa: F401  (registers q4_hadamard)
from kvcli.cache import turbo  # noqa: F401  (registers tq4, tq3, tq2)
from kvcli.cache.base import ALIASES, STORAGE_TYPES, KVCache, Store, resolve_type
from kvcli.cache.hidden import HiddenCache
from kvcli.cache.spec import CACHE_MODES, CacheSpec, cache_bytes, make_cache, resolve_cache_mode, validate_cache_flags

ALIASES.update({"q8": "q8_0", "q4": "q4_hadamard", "turbo4": "tq4", "turbo3": "tq3", "turbo2": "tq2"})

__all__ = ["ALIASES", "CACHE_MODES", "CacheSpec", "STORAGE_TYPES", "HiddenCache", "KVCache", "Store", "cache_bytes", "make_cache",
           "resolve_cache_mode", "resolve_type", "validate_cache_flags"]
