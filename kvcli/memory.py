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


def check_fits(weight_bytes: int, cache_bytes: int, what: str) -> None:
    need = weight_bytes + cache_bytes + WORKING_BYTES
    have = available_bytes()
    if have is not None and need > have:
        raise KvcliError(
            f"{what} does not fit in memory: needs {need / GIB:.2f} GiB (weights {weight_bytes / GIB:.2f} GiB, "
            f"KV cache {cache_bytes / GIB:.2f} GiB), {have / GIB:.2f} GiB available; use a smaller --ctx-size "
            f"or a smaller --cache-type-k/-v"
        )
