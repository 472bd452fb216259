"""Cache storage types; importing this package registers all of them."""

from kvcli.cache import dense  # noqa: F401  (registers f32, f16, bf16)
from kvcli.cache.base import ALIASES, STORAGE_TYPES, KVCache, Store, resolve_type

__all__ = ["ALIASES", "STORAGE_TYPES", "KVCache", "Store", "resolve_type"]
