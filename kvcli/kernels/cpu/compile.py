"""What the CPU kernels (numba) share: the compile flags, numba's on-disk cache, fixed-order sums. Every llvmlite
line (the intrinsics: 16-bit floats, exp, prefetch, vector products) is in vectors.py.

A row's sums run in one fixed order whatever shares the call: LANES partial sums added in order (`dot`), or
LLVM's reassociation of a compiled loop (jit_reassociating: one order per loop as compiled), so the server's
sequences get the same bits alone and beside others.

Under KVCLI_ISA=portable|x86|avx2 (kvcli/kernel_table.py: the switch that makes a CPU with more act as one with
less), numba compiles for that level's CPU (NUMBA_CPU_NAME and _FEATURES, set here before numba loads unless
given; numba's cache keys on them): the
kernels' generic LLVM vectors then become the instructions such a CPU has, not this one's.
"""

from __future__ import annotations

import hashlib
import os
import platform
import struct
import threading
from pathlib import Path

import numpy as np

# KVCLI_ISA -> LLVM's CPU name and features (x86-64): without features numba adds the host's own (AVX-512 here)
_LLVM_CPU = {"portable": ("x86-64", "+sse2"), "x86": ("x86-64-v2", "+ssse3,+sse4.2,+popcnt"),
             "avx2": ("haswell", "+avx2,+fma,+f16c,+bmi2")}
if (os.environ.get("KVCLI_ISA", "").lower() in _LLVM_CPU and "NUMBA_CPU_NAME" not in os.environ
        and platform.machine().lower() in ("x86_64", "amd64")):
    os.environ["NUMBA_CPU_NAME"], os.environ["NUMBA_CPU_FEATURES"] = _LLVM_CPU[os.environ["KVCLI_ISA"].lower()]

try:  # an optional speed-up: without numba, attention runs torch's reference path
    import numba
except ImportError:  # pragma: no cover - numba is a dependency; kept optional for odd platforms
    numba = None


def drop_stale_kernels(folder: Path = Path(__file__).resolve().parent) -> None:
    """numba keys a kernel's cache on its own file's time stamp only: a kernel compiled against an older version of
    what it calls in another file (the shared intrinsics and flags, vectors.py and this file; another kernel's
    functions, as decode_layer.py compiles ggml_tiles.py's into its own) would load as it was (a `git pull` that
    changes only those; seen here: an attention kernel returning wrong values, and a decode layer keeping an old
    tile layout). So the compiled kernels in this folder's __pycache__ are dropped whenever any of its files'
    contents change (a stamp of them kept there). A read-only install is left alone: installing wrote every file
    anew, and its caches live elsewhere. The one place numba's cache is handled."""
    stamp = hashlib.sha1(b"".join(f.read_bytes() for f in sorted(folder.glob("*.py"))))
    mark = folder / "__pycache__" / "kernels.stamp"
    try:
        if mark.read_text() == stamp.hexdigest():
            return
    except OSError:
        pass
    try:
        for f in (folder / "__pycache__").glob("*.nb[ic]"):
            f.unlink(missing_ok=True)
        mark.parent.mkdir(exist_ok=True)
        mark.write_text(stamp.hexdigest())
    except OSError:
        pass


def elf_defined_symbols(obj: bytes) -> set[str] | None:
    """The names an ELF64 little-endian object defines (functions, data; not files or sections), from its symbol
    table, or None for another format. The same set numba reads from the kernel's parsed IR (checked on the decode
    layer's kernels) in a hundredth of the time."""
    if obj[:6] != b"\x7fELF\x02\x01":
        return None
    (shoff,), (entsize, count) = struct.unpack_from("<Q", obj, 0x28), struct.unpack_from("<HH", obj, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", obj, shoff + i * entsize) for i in range(count)]
    names = set()
    for _, kind, _, _, offset, size, link, *_ in sections:
        if kind != 2:  # SHT_SYMTAB
            continue
        strings = sections[link][4]
        for at in range(offset, offset + size, 24):
            name, info, _, section = struct.unpack_from("<IBBH", obj, at)
            if name and section != 0 and (info & 15) not in (3, 4):  # defined; not STT_SECTION / STT_FILE
                names.add(obj[strings + name : obj.index(b"\0", strings + name)].decode())
    return names


def keep_linking_ir_as_bitcode() -> bool:
    """numba loads a cached kernel by parsing its LLVM IR (the "shared module": for the names it defines, and kept to
    link the kernel into a caller compiled later) beside the machine code it runs: ~0.6 s of a run's load and ~100
    MB held for the decode layer's three kernels (Qwen2.5: RssAnon 796 -> 686 MiB). Here the names come from the
    machine code's symbol table and the IR stays bitcode (a few MB), parsed only where a caller links it. False
    (numba as it is) where numba's code library lacks the parts this relies on."""
    from numba.core import codegen

    cls = getattr(codegen, "JITCodeLibrary", None)
    parts = ("_unserialize", "_get_module_for_linking", "enable_object_caching", "_set_compiled_object",
             "_finalize_final_module")
    if cls is None or not all(hasattr(cls, n) for n in parts):
        return False
    if getattr(cls, "_kvcli_bitcode", False):
        return True
    unserialize, for_linking = cls._unserialize.__func__, cls._get_module_for_linking

    def _unserialize(klass, codegen_, state):
        name, kind, data = state
        symbols = elf_defined_symbols(data[0]) if kind == "object" else None
        engine = getattr(codegen_, "_engine", None)
        if symbols is None or not isinstance(getattr(engine, "_defined_symbols", None), set):
            library = unserialize(klass, codegen_, state)  # numba's own way: the IR parsed for the names
            if kind == "object":
                library._kvcli_linking_bitcode, library._shared_module = data[1], None
            return library
        library = codegen_.create_library(name)  # numba's steps for an object, less the parse
        library.enable_object_caching()
        library._set_compiled_object(data[0])
        library._kvcli_linking_bitcode = data[1]
        library._finalize_final_module()
        engine._defined_symbols |= symbols
        return library

    def _get_module_for_linking(library):
        bitcode = getattr(library, "_kvcli_linking_bitcode", None)
        if library._shared_module is None and bitcode is not None:
            library._shared_module = codegen.ll.parse_bitcode(bitcode)
        return for_linking(library)

    cls._unserialize = classmethod(_unserialize)
    cls._get_module_for_linking = _get_module_for_linking
    cls._kvcli_bitcode = True
    return True


def array_math_without_scipy() -> None:
    """numba's array math, which its first kernel loads, imports scipy's BLAS to decide whether np.vdot and np.inner
    call it (0.15-0.3 s of a run's load here, for functions no kvcli kernel uses): imported here with that one import
    refused, so those two take numba's own loop. np.dot and np.linalg still import it where a kernel compiles them."""
    import sys

    if "numba.np.arraymath" in sys.modules or "scipy.linalg" in sys.modules:
        return
    sys.modules["scipy.linalg"] = None  # an import of it or of its parts raises ImportError
    try:
        import numba.np.arraymath  # noqa: F401
    finally:
        del sys.modules["scipy.linalg"]


if numba is not None:
    drop_stale_kernels()
    keep_linking_ir_as_bitcode()
    array_math_without_scipy()


def available() -> bool:
    return numba is not None


def _openmp() -> bool:
    """numba's OpenMP threading layer loads: a parallel region is cheap there (its threads spin between regions), and
    in numba's own workqueue (they sleep) too slow for decode's short products (benchmarks/README.md)."""
    try:
        from numba.np.ufunc import omppool  # noqa: F401
    except ImportError:
        return False
    return True


THREADED = numba is not None and _openmp()
if THREADED:
    numba.config.THREADING_LAYER = "omp"

_numba_count = threading.local()  # the thread count set for the calling thread (numba keeps one per thread)


def numba_threads(threads: int) -> int:
    """Run the calling thread's parallel regions in `threads` (torch's -t), at most numba's own maximum -> that count.
    numba's count is per calling thread and its default every core: left alone, a region at -t 1 waits on a thread
    of a busy core (the server's engine thread and the CLI's each set theirs)."""
    count = min(threads, numba.config.NUMBA_NUM_THREADS)
    if getattr(_numba_count, "n", 0) != count:
        numba.set_num_threads(count)
        _numba_count.n = count
    return count


# LLVM's fast-math flags less "no infinities" and "no NaNs" (masked scores are -inf) and reassociation
FAST = {"contract", "arcp", "nsz", "afn"}
LANES = 16  # a sum's partial sums: a fixed order (the same bits for any batch) that still fills a vector
VEC = 16  # f32 lanes of the intrinsics' vectors (ir_*): one AVX-512 register


def jit(f):
    return numba.njit(cache=True, nogil=True, fastmath=FAST)(f) if numba is not None else f


def jit_reassociating(f):
    """jit, with sums reassociated as LLVM likes (vectorized): still one fixed order per compiled loop, so a row's
    bits stay the same whatever shares the call (the tests check it)."""
    return numba.njit(cache=True, nogil=True, fastmath=FAST | {"reassoc"})(f) if numba is not None else f


def jit_threaded(f):
    """jit with numba.prange loops run in threads (OpenMP): only where THREADED."""
    return numba.njit(cache=True, nogil=True, fastmath=FAST, parallel=True)(f) if THREADED else f


def exact_jit(f):
    """numba without reassociation, reciprocals or contraction: divisions divided, products rounded apart from the
    sums, as torch's ops (what a test reproduces bit for bit). numpy's error model: a division is not checked for
    zero (that check keeps a loop from vectorizing; the callers' divisors are never zero)."""
    if numba is None:
        return f
    return numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"nnan", "ninf", "nsz"})(f)


# v + RNE - RNE is v rounded half to even for |v| < 2^22: a vector op, where np.rint is a libm call an element
RNE = np.float32(1.5 * 2**23)


@jit
def dot(x, y, n, lanes):
    """sum_e x[e] y[e] over e < n (n a multiple of LANES) in LANES partial sums, added in order; lanes: scratch."""
    lanes[:] = 0
    for e0 in range(0, n, LANES):
        for l in range(LANES):
            lanes[l] += x[e0 + l] * y[e0 + l]
    a = np.float32(0)
    for l in range(LANES):
        a += lanes[l]
    return a
