"""Plan memory before allocating it: refuse a run that would not fit, with the figure needed."""

from __future__ import annotations

import functools
import math
import mmap

from kvcli.errors import KvcliError

MIB = 1024**2  # the one definition of the binary units kvcli prints
GIB = 1024**3
# Activations, logits and attention scratch beside weights and cache.
WORKING_BYTES = 256 * MIB


def return_freed_memory() -> None:
    """glibc keeps freed heap pages (a load's temporaries, the tokenizer's work on a whole text, a long input's
    batches) in the process; hand them back so they do not add to the peak. A no-op elsewhere."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def libc():
    """The C library's functions (malloc_trim, madvise), looked up once, or None where the process has none."""
    import ctypes

    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def _malloc_trim():
    """glibc's malloc_trim (it runs between a long input's batches), or None (not glibc)."""
    return getattr(libc(), "malloc_trim", None)


def lazy_zeros(shape: tuple[int, ...], dtype, device="cpu"):
    """Zeros whose pages the OS commits on first write (an anonymous memory map): a cache sized for a
    long context is resident only as its positions fill, as llama.cpp's would be without its clear.
    Small tensors and other devices: torch.zeros."""
    import torch

    nbytes = math.prod(shape) * dtype.itemsize
    if str(device) != "cpu" or nbytes < MIB:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(_anonymous_map(nbytes), dtype=dtype).view(shape)  # the tensor keeps the map alive


def _anonymous_map(nbytes: int) -> mmap.mmap:
    """nbytes of zeros the OS commits page by page on first write, the process's own (RssAnon), and gives back whole
    when dropped; 4 KB pages (numpy's own large allocations ask for transparent huge pages, whose synchronous
    compaction made Qwen2.5's 373 MiB of tiles take 0.8-1.1 s to write here, against 0.2 s)."""
    if hasattr(mmap, "MAP_PRIVATE"):
        return mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return mmap.mmap(-1, max(nbytes, 1))  # Windows: the paging file's, committed as written


def mapped_empty(shape: tuple[int, ...], dtype) -> "np.ndarray":
    """An uninitialized numpy array over an anonymous map (_anonymous_map): a load's large copies (the weights' tiles)."""
    import numpy as np

    count = math.prod(shape)
    return np.frombuffer(_anonymous_map(count * np.dtype(dtype).itemsize), dtype, count).reshape(shape)


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


def largest_context(config, spec, room_bytes: int, n_seq: int = 1) -> int:
    """The most tokens n whose cache (kvcli.cache.CacheSpec `spec` for this model, n_seq sequences)
    takes at most room_bytes: exact at the byte. The bytes are affine in n past a few sink cells
    (padded types step), so an affine estimate from two sizes, then stepped down while it does not fit."""
    if room_bytes <= 0:
        return 0
    lo, hi = spec.nbytes(config, 1024, n_seq), spec.nbytes(config, 2048, n_seq)
    per_token = (hi - lo) / 1024
    n = max(0, int((room_bytes - (lo - 1024 * per_token)) // per_token))
    while n > 0 and spec.nbytes(config, n, n_seq) > room_bytes:  # guard the rounding
        n -= 1
    return n


def check_fits(weight_bytes: int, config, spec, n_ctx: int, n_seq: int, what: str) -> None:
    """Refuse before allocating an n_ctx-token cache of `spec` beside the weights, naming the largest
    context that would fit (largest_context, the number `kvcli fit` prints)."""
    cache_bytes = spec.nbytes(config, n_ctx, n_seq)
    need = weight_bytes + cache_bytes + WORKING_BYTES
    have = available_bytes()
    if have is None or need <= have:
        return
    message = (f"{what} does not fit in memory: needs {need / GIB:.2f} GiB (weights {weight_bytes / GIB:.2f} GiB, "
               f"KV cache {cache_bytes / GIB:.2f} GiB, working buffers {WORKING_BYTES / GIB:.2f} GiB), "
               f"{have / GIB:.2f} GiB available")
    room = have - weight_bytes - WORKING_BYTES
    if room < 0:
        raise KvcliError(message + "; the weights alone do not fit, whatever the context")
    n = largest_context(config, spec, room, n_seq)
    if n > 0:
        raise KvcliError(message + f"; the largest context that fits is {n} tokens (-c {n}), "
                                   f"or use a smaller --cache-type-k/-v")
    raise KvcliError(message + "; use a smaller --ctx-size or a smaller --cache-type-k/-v")
