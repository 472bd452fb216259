"""What the CPU kernels (numba) share: the compile flags, fixed-order sums and 16-bit floats read and written.

A row's sums run in one fixed order whatever shares the call: LANES partial sums added in order (`dot`), or
LLVM's reassociation of a compiled loop (jit_reassociating: one order per loop as compiled), so the server's
sequences get the same bits alone and beside others.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

try:  # an optional speed-up: without numba, attention runs torch's reference path
    import numba
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic, overload
except ImportError:  # pragma: no cover - numba is a dependency; kept optional for odd platforms
    numba = None


def drop_stale_kernels(package: Path = Path(__file__).resolve().parents[1]) -> None:
    """numba keys a kernel's cache on its own file's time stamp only: a kernel compiled against an older version of
    this file's intrinsics and flags would load as it was (a `git pull` that changes only this file; seen here: an
    attention kernel returning wrong values). So the compiled kernels in the package's __pycache__ folders are dropped
    whenever this file's contents change (a stamp of them kept there). A read-only install is left alone: installing
    wrote every file anew, and its caches live elsewhere."""
    stamp = hashlib.sha1(Path(__file__).read_bytes()).hexdigest()
    mark = package / "__pycache__" / "cpu_jit.stamp"
    try:
        if mark.read_text() == stamp:
            return
    except OSError:
        pass
    try:
        for folder in (package / "__pycache__", package / "cache" / "__pycache__"):
            for f in folder.glob("*.nb[ic]"):
                f.unlink(missing_ok=True)
        mark.parent.mkdir(exist_ok=True)
        mark.write_text(stamp)
    except OSError:
        pass


if numba is not None:
    drop_stale_kernels()


def available() -> bool:
    return numba is not None


def _openmp() -> bool:
    """numba's OpenMP threading layer loads: a parallel region costs ~2 us there (its threads spin between regions),
    ~100 us in numba's own workqueue (they sleep), far too slow for decode's products of tens of microseconds."""
    try:
        from numba.np.ufunc import omppool  # noqa: F401
    except ImportError:
        return False
    return True


THREADED = numba is not None and _openmp()
if THREADED:
    numba.config.THREADING_LAYER = "omp"


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


def to_f32(x):
    """An element of a dense store as f32: f32 as is, f16 (passed as uint16 bits, numba has no float16 on CPUs)
    through LLVM's half type (vectorized as the CPU's conversion instruction), bf16 (int16 bits) shifted."""
    raise NotImplementedError  # compiled only (the overload below)


def exp_f32(x):
    """e^x in f32 for x <= 0 (a softmax's exponents; -inf gives 0) as plain arithmetic, so that a loop of them
    vectorizes (np.exp is a libm call an element: 15x the time). Within 2 ulp of e^x; 0 below x ~ -87.4, where
    e^x leaves f32's normal range."""
    raise NotImplementedError  # compiled only (the overload below)


def prefetch(a, i):
    """Ask for the cache line of element i of the contiguous array a (LLVM's prefetch: read, kept in every level): no
    result, no fault past the end or anywhere else. For reads the CPU's own prefetcher does not see coming (another
    stream's start)."""
    raise NotImplementedError  # compiled only (the intrinsic below)


def hadamard16(x, i):
    """x[i:i+16] <- H16 x[i:i+16] in place (Sylvester's Hadamard matrix of order 16, unnormalised; x f32, C order): four
    butterfly levels as vector shuffles (a numba loop over them stays scalar), the last levels of a longer transform."""
    raise NotImplementedError  # compiled only (the intrinsic below)


def butterfly16(x, j, d):
    """x[j + l], x[j + d + l] <- their sum, their difference for l < 16 (x f32, C order): one level of a longer
    Walsh-Hadamard transform, 16 pairs as two vectors."""
    raise NotImplementedError  # compiled only (the intrinsic below)


def from_f32(x, like):
    """f32 x as an element of the dense store whose elements are like `like`: f32 as is, f16 bits (uint16)
    through LLVM's half type and bf16 bits (int16), both rounded to nearest even as torch's conversions."""
    raise NotImplementedError  # compiled only (the overload below)


if numba is not None:

    @intrinsic
    def _f32_from_f16(typingctx, x):
        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

        return types.float32(types.uint16), codegen

    @intrinsic
    def _f32_from_bf16(typingctx, x):
        def codegen(context, builder, signature, args):
            w = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
            return builder.bitcast(w, ir.FloatType())

        return types.float32(types.int16), codegen

    @intrinsic
    def bf16_from_f32(typingctx, x):
        """f32 -> bf16 bits (uint16), rounded to nearest even as torch's conversion rounds (finite values)."""

        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            u = builder.bitcast(args[0], i32)
            odd = builder.and_(builder.lshr(u, ir.Constant(i32, 16)), ir.Constant(i32, 1))
            r = builder.add(builder.add(u, ir.Constant(i32, 0x7FFF)), odd)
            return builder.trunc(builder.lshr(r, ir.Constant(i32, 16)), ir.IntType(16))

        return types.uint16(types.float32), codegen

    @intrinsic
    def _f16_from_f32(typingctx, x):
        def codegen(context, builder, signature, args):
            return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

        return types.uint16(types.float32), codegen

    @intrinsic
    def _bf16_bits_signed(typingctx, x):
        def codegen(context, builder, signature, args):
            return args[0]  # the same 16 bits, typed as a bf16 store's int16

        return types.int16(types.uint16), codegen

    @intrinsic
    def _exp_f32(typingctx, x):
        def codegen(context, builder, signature, args):
            f32, i32 = ir.FloatType(), ir.IntType(32)
            c = lambda v: ir.Constant(f32, v)  # noqa: E731
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32] * 3), "llvm.fma.f32")
            x = args[0]
            x = builder.select(builder.fcmp_ordered(">", x, c(-104.0)), x, c(-104.0))  # -inf too
            x = builder.select(builder.fcmp_ordered("<", x, c(88.0)), x, c(88.0))
            # x = n ln2 + r, |r| <= ln2 / 2; n by llvm.rint (a vector round; the 1.5 2^23 trick would not survive the
            # reassociating kernels' fast-math, which numba puts on every instruction of a function)
            rint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32]), "llvm.rint.f32")
            n = builder.call(rint, [builder.fmul(x, c(1.4426950408889634))])
            r = builder.call(fma, [n, c(-0.693145751953125), x])  # ln2's high part: n ln2_hi exact
            r = builder.call(fma, [n, c(-1.4286068203094172e-06), r])
            p = c(1 / 720)  # e^r's Taylor series to r^6 (its remainder < 1.3e-7 of it)
            for k in (120, 24, 6, 2, 1, 1):
                p = builder.call(fma, [p, r, c(1 / k)])
            ni = builder.fptosi(n, i32)
            two_n = builder.bitcast(builder.shl(builder.add(ni, ir.Constant(i32, 127)), ir.Constant(i32, 23)), f32)
            tiny = builder.icmp_signed("<", ni, ir.Constant(i32, -126))  # 2^n below f32's normals
            return builder.select(tiny, c(0.0), builder.fmul(p, two_n))

        return types.float32(types.float32), codegen

    @intrinsic
    def _prefetch(typingctx, a, i):
        def codegen(context, builder, signature, args):
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                                "llvm.prefetch")
            at = builder.bitcast(builder.gep(data, [args[1]]), i8p)
            builder.call(fn, [at, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])  # read, keep, data
            return context.get_dummy_value()

        return types.none(a, types.int64), codegen

    @intrinsic
    def _hadamard16(typingctx, x, i):
        def codegen(context, builder, signature, args):
            f32, i1, i32 = ir.FloatType(), ir.IntType(1), ir.IntType(32)
            vf = ir.VectorType(f32, 16)
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            at = builder.bitcast(builder.gep(data, [args[1]]), vf.as_pointer())
            v = builder.load(at, align=4)
            for d in (1, 2, 4, 8):  # lane l pairs with l ^ d: the lower one takes a + b, the upper a - b
                p = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, 16), [l ^ d for l in range(16)]))
                lower = ir.Constant(ir.VectorType(i1, 16), [int(not l & d) for l in range(16)])
                v = builder.select(lower, builder.fadd(v, p), builder.fsub(p, v))
            builder.store(v, at, align=4)
            return context.get_dummy_value()

        return types.none(x, types.int64), codegen

    @intrinsic
    def _butterfly16(typingctx, x, j, d):
        def codegen(context, builder, signature, args):
            vf = ir.VectorType(ir.FloatType(), 16)
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            lo = builder.bitcast(builder.gep(data, [args[1]]), vf.as_pointer())
            hi = builder.bitcast(builder.gep(data, [builder.add(args[1], args[2])]), vf.as_pointer())
            a, c = builder.load(lo, align=4), builder.load(hi, align=4)
            builder.store(builder.fadd(a, c), lo, align=4)
            builder.store(builder.fsub(a, c), hi, align=4)
            return context.get_dummy_value()

        return types.none(x, types.int64, types.int64), codegen

    @overload(butterfly16, inline="always")
    def _butterfly16_overload(x, j, d):
        if isinstance(x, types.Array) and x.dtype == types.float32 and x.layout == "C" and x.ndim == 1:
            return lambda x, j, d: _butterfly16(x, np.int64(j), np.int64(d))
        return None

    @overload(hadamard16, inline="always")
    def _hadamard16_overload(x, i):
        if isinstance(x, types.Array) and x.dtype == types.float32 and x.layout == "C" and x.ndim == 1:
            return lambda x, i: _hadamard16(x, np.int64(i))
        return None

    @overload(prefetch, inline="always")
    def _prefetch_overload(a, i):
        if isinstance(a, types.Array):  # i counts from the first element in memory (a hint: any address is safe)
            return lambda a, i: _prefetch(a, np.int64(i))
        return None

    @overload(exp_f32, inline="always")
    def _exp_f32_overload(x):
        if isinstance(x, types.Float):
            return lambda x: _exp_f32(np.float32(x))
        return None

    @overload(from_f32, inline="always")
    def _from_f32(x, like):
        if like == types.float32:
            return lambda x, like: x
        if like == types.uint16:
            return lambda x, like: _f16_from_f32(x)
        if like == types.int16:
            return lambda x, like: _bf16_bits_signed(bf16_from_f32(x))
        return None

    @overload(to_f32, inline="always")
    def _to_f32(x):
        if x == types.float32:
            return lambda x: x
        if x == types.uint16:
            return lambda x: _f32_from_f16(x)
        if x == types.int16:
            return lambda x: _f32_from_bf16(x)
        return None

    # ---- LLVM vector IR for the kernels' intrinsics (hadamard_decode): VEC f32 lanes at a time ----
    _F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
    FLOATS, INTS = ir.VectorType(_F32, VEC), ir.VectorType(_I32, VEC)

    def ir_at(builder, arr, *index):
        """The address (i64) of arr[index...] (an array's leading indices: what follows is contiguous)."""
        addr = builder.ptrtoint(arr.data, _I64)
        for i, stride in zip(index, cgutils.unpack_tuple(builder, arr.strides)):
            addr = builder.add(addr, builder.mul(i, stride))
        return addr

    def ir_load(builder, addr, ty):
        return builder.load(builder.inttoptr(addr, ty.as_pointer()), align=1)

    def ir_store(builder, value, addr):
        builder.store(value, builder.inttoptr(addr, value.type.as_pointer()), align=1)

    def ir_splat(builder, x):
        """f32 x in every lane."""
        v = builder.insert_element(ir.Constant(FLOATS, None), x, ir.Constant(_I32, 0))
        return builder.shuffle_vector(v, v, ir.Constant(INTS, [0] * VEC))

    def ir_fma(builder):
        return cgutils.get_or_insert_function(builder.module, ir.FunctionType(FLOATS, [FLOATS] * 3),
                                              f"llvm.fma.v{VEC}f32")

    def ir_bf16(builder, addr):
        """VEC bf16 values (int16 bits) at addr as f32: each shifted into an f32's high half."""
        bits = ir_load(builder, addr, ir.VectorType(ir.IntType(16), VEC))
        return builder.bitcast(builder.shl(builder.zext(bits, INTS), ir.Constant(INTS, [16] * VEC)), FLOATS)

    def ir_sums_loop(builder, count, n, step):
        """n vector sums kept in registers over a loop of `count` (i64) steps: step(i, sums) -> the new sums.
        Returns the final sums (zeros where count is 0)."""
        zero = ir.Constant(FLOATS, [0.0] * VEC)
        slots = [cgutils.alloca_once(builder, FLOATS) for _ in range(n)]  # promoted to registers by LLVM
        for a in slots:
            builder.store(zero, a)
        with cgutils.for_range(builder, count) as loop:
            new = step(loop.index, [builder.load(a) for a in slots])
            for a, v in zip(slots, new):
                builder.store(v, a)
        return [builder.load(a) for a in slots]
