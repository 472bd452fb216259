"""Plan memory before allocating it: refuse a run that would not fit, with the figure needed."""

from __future__ import annotations

from kvcli.errors import KvcliError

GIB = 1024**3
MIB = 1024**2
# Activations, logits and attention scratch beside weights and cache.
WORKING_BYTES = 256 * MIB


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where the OS does not say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def largest_context(weight_bytes: int, per_token_bytes: int, have: int) -> int:
    """The most tokens whose cache fits beside the weights and working buffers (0: none), rounded
    down to a multiple of 256 as llama.cpp pads its context."""
    room = have - weight_bytes - WORKING_BYTES
    if per_token_bytes <= 0 or room <= 0:
        return 0
    n = room // per_token_bytes
    return n - n % 256 if n >= 256 else n


def check_fits(weight_bytes: int, cache_bytes: int, what: str, per_token_bytes: int = 0) -> None:
    """Refuse before allocating. per_token_bytes (the cache's bytes per context token, all layers)
    lets the message name the largest context that would fit."""
    need = weight_bytes + cache_bytes + WORKING_BYTES
    have = available_bytes()
    if have is None or need <= have:
        return
    message = (f"{what} does not fit in memory: needs {need / GIB:.2f} GiB (weights {weight_bytes / GIB:.2f} GiB, "
               f"KV cache {cache_bytes / GIB:.2f} GiB, working buffers {WORKING_BYTES / GIB:.2f} GiB), "
               f"{have / GIB:.2f} GiB available")
    if weight_bytes + WORKING_BYTES > have:
        raise KvcliError(message + "; the weights alone do not fit, whatever the context")
    n = largest_context(weight_bytes, per_token_bytes, have) if per_token_bytes > 0 else 0
    if n > 0:
        raise KvcliError(message + f"; the largest context that fits is {n} tokens (-c {n}), "
                                   f"or use a smaller --cache-type-k/-v")
    raise KvcliError(message + "; use a smaller --ctx-size or a smaller --cache-type-k/-v")
