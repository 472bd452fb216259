"""Every llvmlite line of the CPU kernels: numba intrinsics written as LLVM IR, one helper per idea.

Scalars the kernels read and write (16-bit floats, exp, prefetch), vector helpers (an address, a load, a splat, a
widening of bf16, sums kept in registers over a loop), and the kernels' vector bodies built from them. Generic LLVM
vectors (VEC f32 lanes) run on any CPU LLVM targets (AVX-512: one register; AVX2: two; others: more); an
x86-specific intrinsic is named as such where it is used, and its kernel's table entry says which ISA it needs.
"""

from __future__ import annotations

import os

import gguf
import numpy as np

from .compile import VEC, numba

if numba is not None:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic, overload


def target_has(feature: str) -> bool:
    """The CPU numba compiles for has LLVM's `feature` (e.g. "avx512vnni"): NUMBA_CPU_FEATURES where set (KVCLI_ISA's
    level), else the host's. A kernel's code may use an instruction only where this says so (numba's cache keys on
    the same name and features)."""
    if os.environ.get("NUMBA_CPU_NAME"):
        return f"+{feature}" in os.environ.get("NUMBA_CPU_FEATURES", "").split(",")
    from llvmlite import binding  # numba's own: only where numba is

    try:
        return bool(binding.get_host_cpu_features().get(feature))
    except RuntimeError:
        return False


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
    def fma_f32(typingctx, a, b, c):
        """a b + c rounded once (LLVM's fma): what torch's addcmul computes, for a kernel that must give its bits."""

        def codegen(context, builder, signature, args):
            f32 = ir.FloatType()
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32] * 3), "llvm.fma.f32")
            return builder.call(fma, list(args))

        return types.float32(types.float32, types.float32, types.float32), codegen

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

    class _OrderedLoad(ir.instructions.LoadInstr):
        """A volatile load: LLVM keeps such loads in program order (llvmlite's builder has no volatile flag)."""

        def descr(self, buf):
            [ptr] = self.operands
            buf.append(f"load volatile {self.type}, {ptr.type} {ptr.get_reference()}, align 1\n")

    def ir_load_ordered(builder, addr, ty):
        """ir_load that stays in program order among such loads: a stream read in the order its bytes lie, so the
        CPU's prefetchers follow it (ggml_tile_dots: LLVM's own order of a Q6_K block's loads halved its rate from
        DRAM)."""
        load = _OrderedLoad(builder.block, builder.inttoptr(addr, ty.as_pointer()))
        builder._insert(load)
        return load

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


# ---- the rotated types' products over 4-bit codes, u standing for d (u - mid) (attention_rotated.py) ----
TABLE_LANES = VEC  # positions one table_scores call adds to


def table_scores(tab, i, q, g0, s, col):
    """Compiled only (table_scores1..4, a group of 1-4 query heads g0..): s[g0 + g, col + TABLE_LANES i + l] +=
    sum_e q[g0 + g, e] tab[i, e, l] for l < TABLE_LANES: q (G, D) f32 against block i of tab (n / TABLE_LANES, D,
    TABLE_LANES) f32 (the RoPE table of keys stored less their turning mean, kvcli/cache/key_bias.py, TABLE_LANES
    positions a block: read in order), the sums in vector registers over e."""
    raise NotImplementedError


NIBBLE_BYTES = VEC  # code bytes one vector step reads: two nibbles each


def nibble_key_scores(kt, k, c, q, qsum, g0, dk, s, col, mid):
    """Compiled only (nibble_key_scores1..4, a group of 1-4 query heads g0..): block k's part of the scores of
    2 NIBBLE_BYTES positions of a key tile kt (D, T / 2): with p_l = sum over the block's dimensions e = 32 k + i of
    q[g0 + g, e] times the low nibble of kt[e, NIBBLE_BYTES c + l] (high: h_l), s[g0 + g, col + NIBBLE_BYTES c + l] += d_l (p_l - mid
    qsum[g0 + g, k]) and s[g0 + g, col + T / 2 + NIBBLE_BYTES c + l] += d'_l (h_l - mid qsum[g0 + g, k]), d and d' the
    positions' block-k scales in dk (T,) bf16 bits (int16), the tile's. The codes are widened once for the group;
    the sums stay in vector registers."""
    raise NotImplementedError


def nibble_value_sums(vt, t0, t1, c, s, col_s, dlo, dhi, g0, acc, col, mid):
    """Compiled only (nibble_value_sums1..4, a group of 1-4 query heads g0..): over positions t0 <= t < t1 of a
    value tile vt (n_pad, W / 2), with p = s[g0 + g, col_s + t] (the position's weight), acc[g0 + g, col + NIBBLE_BYTES c + l]
    += p dlo[t] (u - mid) for u the low nibble of vt[t, NIBBLE_BYTES c + l], and acc[g0 + g, col + W / 2 + NIBBLE_BYTES c + l] the
    high nibble's with dhi[t]; dlo, dhi (n_pad,) the blocks' scales, bf16 bits (int16). The sums stay in vector
    registers over the positions."""
    raise NotImplementedError


if numba is not None:
    _F32, _I8, _I32, _I64 = ir.FloatType(), ir.IntType(8), ir.IntType(32), ir.IntType(64)
    _BYTES = ir.VectorType(_I8, NIBBLE_BYTES)

    def _nibbles(builder, addr):
        """NIBBLE_BYTES code bytes at addr -> their low and high nibbles as f32 vectors."""
        wide = builder.zext(ir_load(builder, addr, _BYTES), INTS)
        return [builder.sitofp(builder.and_(wide, ir.Constant(INTS, [15] * NIBBLE_BYTES)), FLOATS),
                builder.sitofp(builder.lshr(wide, ir.Constant(INTS, [4] * NIBBLE_BYTES)), FLOATS)]

    def _sums_loop(builder, count, groups, step):
        """ir_sums_loop of a low and a high sum for each of `groups` query heads."""
        return ir_sums_loop(builder, count, 2 * groups, step)

    def _key_codegen(ng: int):
        def codegen(context, builder, sig, args):
            kt, q, qsum, dk, sc = (context.make_array(sig.args[j])(context, builder, args[j]) for j in (0, 3, 4, 6, 7))
            k, c, g0, col = args[1], args[2], args[5], args[8]
            col_c = builder.mul(c, ir.Constant(_I64, NIBBLE_BYTES))
            e0 = builder.mul(k, ir.Constant(_I64, 32))
            fma = ir_fma(builder)
            rows = [builder.add(g0, ir.Constant(_I64, g)) for g in range(ng)]

            def step(i, sums):
                e = builder.add(e0, i)
                lo, hi = _nibbles(builder, ir_at(builder, kt, e, col_c))
                out = []
                for g in range(ng):
                    qe = ir_splat(builder, ir_load(builder, ir_at(builder, q, rows[g], e), _F32))
                    out += [builder.call(fma, [qe, lo, sums[2 * g]]), builder.call(fma, [qe, hi, sums[2 * g + 1]])]
                return out

            sums = _sums_loop(builder, ir.Constant(_I64, 32), ng, step)
            half = cgutils.unpack_tuple(builder, kt.shape)[1]
            for j, at in enumerate((col_c, builder.add(half, col_c))):  # the low nibbles' positions, the high ones'
                d = ir_bf16(builder, ir_at(builder, dk, at))  # the positions' scales
                for g in range(ng):
                    qk = ir_load(builder, ir_at(builder, qsum, rows[g], k), _F32)
                    bias = builder.fmul(args[9], qk)
                    addr = ir_at(builder, sc, rows[g], builder.add(col, at))
                    p = builder.fsub(sums[2 * g + j], ir_splat(builder, bias))
                    ir_store(builder, builder.call(fma, [d, p, ir_load(builder, addr, FLOATS)]), addr)
            return context.get_dummy_value()

        return codegen

    def _bf16(builder, addr):
        """The bf16 (int16 bits) at addr as f32."""
        bits = builder.zext(ir_load(builder, addr, ir.IntType(16)), _I32)
        return builder.bitcast(builder.shl(bits, ir.Constant(_I32, 16)), _F32)

    def _value_codegen(ng: int):
        def codegen(context, builder, sig, args):
            vt, sc, dlo, dhi, acc = (context.make_array(sig.args[j])(context, builder, args[j])
                                     for j in (0, 4, 6, 7, 9))
            t0, t1, c, col_s, g0, col = (args[j] for j in (1, 2, 3, 5, 8, 10))
            byte = builder.mul(c, ir.Constant(_I64, NIBBLE_BYTES))
            fma = ir_fma(builder)
            rows = [builder.add(g0, ir.Constant(_I64, g)) for g in range(ng)]
            mid = ir_splat(builder, args[11])

            def step(i, sums):
                t = builder.add(t0, i)
                lo, hi = (builder.fsub(u, mid) for u in _nibbles(builder, ir_at(builder, vt, t, byte)))
                d = [_bf16(builder, ir_at(builder, a, t)) for a in (dlo, dhi)]
                out = []
                for g in range(ng):
                    p = ir_load(builder, ir_at(builder, sc, rows[g], builder.add(col_s, t)), _F32)
                    wl, wh = (ir_splat(builder, builder.fmul(p, x)) for x in d)
                    out += [builder.call(fma, [wl, lo, sums[2 * g]]), builder.call(fma, [wh, hi, sums[2 * g + 1]])]
                return out

            sums = _sums_loop(builder, builder.sub(t1, t0), ng, step)
            half = cgutils.unpack_tuple(builder, vt.shape)[1]
            for g in range(ng):
                for j, at in enumerate((builder.add(col, byte), builder.add(builder.add(col, half), byte))):
                    addr = ir_at(builder, acc, rows[g], at)
                    ir_store(builder, builder.fadd(ir_load(builder, addr, FLOATS), sums[2 * g + j]), addr)
            return context.get_dummy_value()

        return codegen

    def _key_intrinsic(ng: int):
        def typer(typingctx, kt, k, c, q, qsum, g0, dk, s, col, mid):
            return (types.none(kt, types.int64, types.int64, q, qsum, types.int64, dk, s, types.int64, types.float32),
                    _key_codegen(ng))

        return intrinsic(typer)

    def _value_intrinsic(ng: int):
        def typer(typingctx, vt, t0, t1, c, s, col_s, dlo, dhi, g0, acc, col, mid):
            return (types.none(vt, types.int64, types.int64, types.int64, s, types.int64, dlo, dhi, types.int64, acc,
                               types.int64, types.float32), _value_codegen(ng))

        return intrinsic(typer)

    nibble_key_scores1, nibble_key_scores2, nibble_key_scores3, nibble_key_scores4 = (_key_intrinsic(g) for g in (1, 2, 3, 4))
    nibble_value_sums1, nibble_value_sums2, nibble_value_sums3, nibble_value_sums4 = (_value_intrinsic(g) for g in (1, 2, 3, 4))

    def _table_codegen(ng: int):
        def codegen(context, builder, sig, args):
            tab, q, sc = (context.make_array(sig.args[j])(context, builder, args[j]) for j in (0, 2, 4))
            i, g0, col = args[1], args[3], args[5]
            fma = ir_fma(builder)
            rows = [builder.add(g0, ir.Constant(_I64, g)) for g in range(ng)]
            zero = ir.Constant(_I64, 0)

            def step(e, sums):
                v = ir_load(builder, ir_at(builder, tab, i, e, zero), FLOATS)
                return [builder.call(fma, [ir_splat(builder, ir_load(builder, ir_at(builder, q, rows[g], e), _F32)), v,
                                           sums[g]]) for g in range(ng)]

            sums = ir_sums_loop(builder, cgutils.unpack_tuple(builder, q.shape)[1], ng, step)
            for g in range(ng):
                addr = ir_at(builder, sc, rows[g], builder.add(col, builder.mul(i, ir.Constant(_I64, VEC))))
                ir_store(builder, builder.fadd(ir_load(builder, addr, FLOATS), sums[g]), addr)
            return context.get_dummy_value()

        return codegen

    def _table_intrinsic(ng: int):
        def typer(typingctx, tab, i, q, g0, s, col):
            return types.none(tab, types.int64, q, types.int64, s, types.int64), _table_codegen(ng)

        return intrinsic(typer)

    table_scores1, table_scores2, table_scores3, table_scores4 = (_table_intrinsic(g) for g in (1, 2, 3, 4))


# ---- ggml blocks widened to f32 (attention.py) ----
def widen_block(rows, t, col, buf, bt, bcol, d, *fields):
    """Compiled only (widen_q8_0, widen_nibbles, widen_iq4_nl): buf[bt, bcol : bcol + 32] = the 32 elements of the
    ggml block whose codes start at byte col of rows[t] (rows (n, row_bytes), a row's bytes contiguous; buf (n', D)
    f32), as LLVM vectors (numba's own loop over a block stays scalar at these strides): widen_q8_0(..., d): 32 int8
    codes times d; widen_nibbles(..., d, m, bias, qh): 16 bytes, their low nibbles (elements 0..15) then their high
    ones (16..31), each with bit j of qh (the block's fifth bits; 0 where the type has none) as its bit 4, as
    d (u - bias) + m in one fma; widen_iq4_nl(..., d, tab): the nibbles looked up in the int8 codebook tab (16 bytes)
    by one byte shuffle (SSSE3's pshufb: x86 only), times d."""
    raise NotImplementedError


if numba is not None:

    def _block_codegen(kind: str):
        """widen_block's body for kind "q8_0", "nibbles" or "iq4_nl"."""

        def codegen(context, builder, sig, args):
            f32, i8, i32, i64 = ir.FloatType(), ir.IntType(8), ir.IntType(32), ir.IntType(64)
            rows, buf = (context.make_array(sig.args[j])(context, builder, args[j]) for j in (0, 3))
            t, col, bt, bcol, d = args[1], args[2], args[4], args[5], args[6]
            rs, bs = cgutils.unpack_tuple(builder, rows.strides, 2), cgutils.unpack_tuple(builder, buf.strides, 2)
            src = builder.add(builder.ptrtoint(rows.data, i64), builder.add(builder.mul(t, rs[0]), col))
            dst = builder.add(builder.ptrtoint(buf.data, i64),
                              builder.add(builder.mul(bt, bs[0]), builder.mul(bcol, ir.Constant(i64, 4))))
            n = 32 if kind == "q8_0" else 16
            vi, vf = ir.VectorType(i32, n), ir.VectorType(f32, n)

            def splat(x, ty):
                v = builder.insert_element(ir.Constant(ty, None), x, ir.Constant(i32, 0))
                return builder.shuffle_vector(v, v, ir.Constant(vi, [0] * n))

            def const(v):
                return ir.Constant(vi, v if isinstance(v, list) else [v] * n)

            codes = builder.load(builder.inttoptr(src, ir.VectorType(i8, n).as_pointer()), align=1)
            dv = splat(d, vf)
            if kind == "q8_0":
                parts = [builder.fmul(builder.sitofp(builder.sext(codes, vi), vf), dv)]
            elif kind == "iq4_nl":  # pshufb: byte l of the table at each nibble
                vb = ir.VectorType(i8, n)
                shuffle = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vb, [vb, vb]),
                                                         "llvm.x86.ssse3.pshuf.b.128")
                table = builder.load(builder.bitcast(context.make_array(sig.args[7])(context, builder, args[7]).data,
                                                     vb.as_pointer()), align=1)
                low = builder.and_(codes, ir.Constant(vb, [15] * n))
                high = builder.lshr(codes, ir.Constant(vb, [4] * n))
                parts = [builder.fmul(builder.sitofp(builder.sext(builder.call(shuffle, [table, h]), vi), vf), dv)
                         for h in (low, high)]
            else:
                m, bias, qh = args[7], builder.trunc(args[8], i32), splat(builder.trunc(args[9], i32), vi)
                wide = builder.zext(codes, vi)
                halves = [builder.and_(wide, const(15)), builder.lshr(wide, const(4))]
                mv, bv = splat(m, vf), splat(bias, vi)
                fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fma.v{n}f32")
                parts = []
                for j, h in enumerate(halves):  # element 16 j + l takes bit 16 j + l of qh as its bit 4
                    fifth = builder.shl(builder.and_(builder.lshr(qh, const(list(range(16 * j, 16 * j + n)))),
                                                     const(1)), const(4))
                    u = builder.sitofp(builder.sub(builder.or_(h, fifth), bv), vf)
                    parts.append(builder.call(fma, [dv, u, mv]))
            for j, part in enumerate(parts):
                at = builder.inttoptr(builder.add(dst, ir.Constant(i64, 4 * n * j)), vf.as_pointer())
                builder.store(part, at, align=4)
            return context.get_dummy_value()

        return codegen

    @intrinsic
    def widen_q8_0(typingctx, rows, t, col, buf, bt, bcol, d):
        return types.none(rows, types.int64, types.int64, buf, types.int64, types.int64, types.float32), \
            _block_codegen("q8_0")

    @intrinsic
    def widen_iq4_nl(typingctx, rows, t, col, buf, bt, bcol, d, tab):
        return types.none(rows, types.int64, types.int64, buf, types.int64, types.int64, types.float32, tab), \
            _block_codegen("iq4_nl")

    @intrinsic
    def widen_nibbles(typingctx, rows, t, col, buf, bt, bcol, d, m, bias, qh):
        return types.none(rows, types.int64, types.int64, buf, types.int64, types.int64, types.float32,
                          types.float32, types.int64, types.int64), _block_codegen("nibbles")


def widen_bits(rows, t, col, shift, mask, hcol, hshift, hmask, hpos, buf, bt, bcol, d, m):
    """Compiled only: buf[bt, bcol : bcol + 16] = d u + m (one fma) for the 16 bytes lo at col and hi at hcol of
    rows[t] (rows (n, row_bytes) uint8, buf (n', D) f32), u = ((lo >> shift) & mask) | (((hi >> hshift) & hmask) <<
    hpos): a K-quant's 16 codes whose low bits lie in one byte array and high bits in another (hmask 0: none), as
    LLVM vectors (numba's own loop over them stays scalar)."""
    raise NotImplementedError


if numba is not None:

    def _bits_codegen(context, builder, sig, args):
        i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
        rows, buf = (context.make_array(sig.args[j])(context, builder, args[j]) for j in (0, 9))
        t, col, shift, mask, hcol, hshift, hmask, hpos, _, bt, bcol, d, m = args[1:]
        vi = ir.VectorType(i32, 16)

        def splat(x, ty):
            v = builder.insert_element(ir.Constant(ty, None), x, ir.Constant(i32, 0))
            return builder.shuffle_vector(v, v, ir.Constant(vi, [0] * 16))

        def codes(at):
            addr = builder.add(ir_at(builder, rows, t), at)
            return builder.zext(builder.load(builder.inttoptr(addr, ir.VectorType(i8, 16).as_pointer()), align=1), vi)

        def bits(v, sh, mk):
            return builder.and_(builder.lshr(v, splat(builder.trunc(sh, i32), vi)), splat(builder.trunc(mk, i32), vi))

        high = builder.shl(bits(codes(hcol), hshift, hmask), splat(builder.trunc(hpos, i32), vi))
        u = builder.sitofp(builder.or_(bits(codes(col), shift, mask), high), ir.VectorType(_F32, 16))
        vf = ir.VectorType(_F32, 16)
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3), "llvm.fma.v16f32")
        out = builder.add(ir_at(builder, buf, bt), builder.mul(bcol, ir.Constant(i64, 4)))
        builder.store(builder.call(fma, [splat(d, vf), u, splat(m, vf)]), builder.inttoptr(out, vf.as_pointer()),
                      align=4)
        return context.get_dummy_value()

    @intrinsic
    def widen_bits(typingctx, rows, t, col, shift, mask, hcol, hshift, hmask, hpos, buf, bt, bcol, d, m):
        i = types.int64
        return types.none(rows, i, i, i, i, i, i, i, i, buf, i, i, types.float32, types.float32), _bits_codegen


def widen_q6_k(rows, t, o, buf, bt, bcol, d):
    """Compiled only: buf[bt, bcol : bcol + 256] = the Q6_K super-block at byte o of rows[t] (rows (n, row_bytes)
    uint8, buf (n', D) f32; d its f16 scale as f32): ql[128], qh[64], scales[16] int8; element l + 32 q of a half of
    128 is (ql[l + 32 (q & 1)] >> 4 (q >> 1)) & 15 | ((qh[l] >> 2 q) & 3) << 4, less 32, times d sc[its 16]. The
    codes are made in byte lanes (32 at a time: a register's worth), each 16 widened to f32 once, times d sc."""
    raise NotImplementedError


if numba is not None:

    def _q6_k_codegen(context, builder, sig, args):
        i8, i32, i64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
        rows, buf = (context.make_array(sig.args[j])(context, builder, args[j]) for j in (0, 3))
        t, o, bt, bcol, d = args[1], args[2], args[4], args[5], args[6]
        v32, v8, v16f, v16i = ir.VectorType(i8, 32), ir.VectorType(i8, 8), ir.VectorType(_F32, 16), ir.VectorType(i32, 16)
        base = builder.add(ir_at(builder, rows, t), o)
        out = builder.add(ir_at(builder, buf, bt), builder.mul(bcol, ir.Constant(i64, 4)))

        def load(at, ty):
            return builder.load(builder.inttoptr(builder.add(base, ir.Constant(i64, at)), ty.as_pointer()), align=1)

        def b(v):
            return ir.Constant(v32, [v] * 32)

        dv = builder.insert_element(ir.Constant(v16f, None), d, ir.Constant(i32, 0))
        for half in range(2):
            ql0, ql1, qh = load(64 * half, v32), load(64 * half + 32, v32), load(128 + 32 * half, v32)
            # d sc for the half's 8 groups of 16 (the f32 products ggml's d * sc makes, exact)
            scales = builder.fmul(builder.sitofp(builder.sext(load(192 + 8 * half, v8), ir.VectorType(i32, 8)),
                                                 ir.VectorType(_F32, 8)),
                                  builder.shuffle_vector(dv, dv, ir.Constant(ir.VectorType(i32, 8), [0] * 8)))
            for q in range(4):
                low = ql0 if q % 2 == 0 else ql1
                low = builder.and_(low, b(15)) if q < 2 else builder.lshr(low, b(4))
                high = builder.shl(builder.and_(builder.lshr(qh, b(2 * q)), b(3)), b(4))
                codes = builder.sub(builder.or_(low, high), b(32))  # -32..31 in byte lanes
                for g in range(2):
                    part = builder.shuffle_vector(codes, codes, ir.Constant(v16i, list(range(16 * g, 16 * g + 16))))
                    ds = builder.extract_element(scales, ir.Constant(i32, 2 * q + g))
                    dsv = builder.insert_element(ir.Constant(v16f, None), ds, ir.Constant(i32, 0))
                    dsv = builder.shuffle_vector(dsv, dsv, ir.Constant(v16i, [0] * 16))
                    vals = builder.fmul(dsv, builder.sitofp(builder.sext(part, v16i), v16f))
                    at = builder.add(out, ir.Constant(i64, 4 * (128 * half + 32 * q + 16 * g)))
                    builder.store(vals, builder.inttoptr(at, v16f.as_pointer()), align=4)
        return context.get_dummy_value()

    @intrinsic
    def widen_q6_k(typingctx, rows, t, o, buf, bt, bcol, d):
        i = types.int64
        return types.none(rows, i, i, buf, i, i, types.float32), _q6_k_codegen


def dense_key_scores(kc, n, q, g0, s, scale, pf, at, npf):
    """Compiled only (dense_key_scores1..4, a group of 1-4 query heads g0..): s[g0 + g, t] = scale (q[g0 + g] . kc[t])
    for t < n, kc (n', D) a chunk of key rows as they lie (f32, f16 bits as uint16, bf16 bits as int16), q (G, D)
    f32, D a multiple of VEC. A row's VEC elements are loaded and widened once for the group, its sums kept in
    vector registers over D, each summed across its lanes in a tree (halves added, 16 -> 8 -> 4 -> 2 -> 1).
    With row t (t < npf) the first cache line of row at + t of pf (2-d, any type) is asked for (LLVM's prefetch): the
    rows read next, one at a time as the CPU's own prefetcher would not."""
    raise NotImplementedError


def dense_value_sums(vc, n, s, g0, acc, col, pf, at, npf):
    """Compiled only (dense_value_sums1..4, a group of 1-4 query heads g0..): acc[g0 + g, col : col + VEC] += the sum
    over t < n (in order) of s[g0 + g, t] vc[t, col : col + VEC], vc (n', D) a chunk of value rows as they lie (as
    dense_key_scores' keys); the sums kept in vector registers over the positions, a row's VEC elements loaded and
    widened once for the group; pf, at, npf: dense_key_scores' prefetch."""
    raise NotImplementedError


if numba is not None:
    _HALF16 = ir.VectorType(ir.HalfType(), VEC)
    _SHORTS = ir.VectorType(ir.IntType(16), VEC)

    def _row_f32(builder, dtype, rows, t, col):
        """VEC elements rows[t, col:] as f32 (rows: f32, f16 bits as uint16, or bf16 bits as int16)."""
        addr = ir_at(builder, rows, t, col)
        if dtype == types.float32:
            return ir_load(builder, addr, FLOATS)
        if dtype == types.uint16:
            return builder.fpext(builder.bitcast(ir_load(builder, addr, _SHORTS), _HALF16), FLOATS)
        return ir_bf16(builder, addr)

    def _prefetch_row(builder, arr, row, cond):
        """Ask for the first cache line of arr[row] (read, kept in every level) where cond (an i1) holds."""
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch")
        with builder.if_then(cond):
            at = builder.inttoptr(ir_at(builder, arr, row), i8p)
            builder.call(fn, [at, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])  # read, keep, data

    def _lanes_sum(builder, v):
        """v's VEC lanes summed in a tree: the upper half added to the lower, down to one."""
        w = VEC
        while w > 1:
            w //= 2
            lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, w), list(range(w))))
            hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, w), list(range(w, 2 * w))))
            v = builder.fadd(lo, hi)
        return builder.extract_element(v, ir.Constant(_I32, 0))

    def _dense_key_codegen(ng: int):
        def codegen(context, builder, sig, args):
            kc, q, s, pf = (context.make_array(sig.args[j])(context, builder, args[j]) for j in (0, 2, 4, 6))
            n, g0, scale, at, npf = args[1], args[3], args[5], args[7], args[8]
            dtype = sig.args[0].dtype
            fma = ir_fma(builder)
            rows = [builder.add(g0, ir.Constant(_I64, g)) for g in range(ng)]
            blocks = builder.udiv(cgutils.unpack_tuple(builder, q.shape)[1], ir.Constant(_I64, VEC))
            with cgutils.for_range(builder, n) as pos:
                t = pos.index
                _prefetch_row(builder, pf, builder.add(at, t), builder.icmp_signed("<", t, npf))

                def step(i, sums):
                    e = builder.mul(i, ir.Constant(_I64, VEC))
                    k = _row_f32(builder, dtype, kc, t, e)
                    return [builder.call(fma, [ir_load(builder, ir_at(builder, q, rows[g], e), FLOATS), k, sums[g]])
                            for g in range(ng)]

                sums = ir_sums_loop(builder, blocks, ng, step)
                for g in range(ng):
                    ir_store(builder, builder.fmul(_lanes_sum(builder, sums[g]), scale), ir_at(builder, s, rows[g], t))
            return context.get_dummy_value()

        return codegen

    def _dense_value_codegen(ng: int):
        def codegen(context, builder, sig, args):
            vc, s, acc, pf = (context.make_array(sig.args[j])(context, builder, args[j]) for j in (0, 2, 4, 6))
            n, g0, col, at, npf = args[1], args[3], args[5], args[7], args[8]
            dtype = sig.args[0].dtype
            fma = ir_fma(builder)
            rows = [builder.add(g0, ir.Constant(_I64, g)) for g in range(ng)]

            def step(t, sums):
                _prefetch_row(builder, pf, builder.add(at, t), builder.icmp_signed("<", t, npf))
                v = _row_f32(builder, dtype, vc, t, col)
                return [builder.call(fma, [ir_splat(builder, ir_load(builder, ir_at(builder, s, rows[g], t), _F32)), v,
                                           sums[g]]) for g in range(ng)]

            sums = ir_sums_loop(builder, n, ng, step)
            for g in range(ng):
                addr = ir_at(builder, acc, rows[g], col)
                ir_store(builder, builder.fadd(ir_load(builder, addr, FLOATS), sums[g]), addr)
            return context.get_dummy_value()

        return codegen

    def _dense_key_intrinsic(ng: int):
        def typer(typingctx, kc, n, q, g0, s, scale, pf, at, npf):
            return (types.none(kc, types.int64, q, types.int64, s, types.float32, pf, types.int64, types.int64),
                    _dense_key_codegen(ng))

        return intrinsic(typer)

    def _dense_value_intrinsic(ng: int):
        def typer(typingctx, vc, n, s, g0, acc, col, pf, at, npf):
            return (types.none(vc, types.int64, s, types.int64, acc, types.int64, pf, types.int64, types.int64),
                    _dense_value_codegen(ng))

        return intrinsic(typer)

    dense_key_scores1, dense_key_scores2, dense_key_scores3, dense_key_scores4 = (
        _dense_key_intrinsic(g) for g in (1, 2, 3, 4))
    dense_value_sums1, dense_value_sums2, dense_value_sums3, dense_value_sums4 = (
        _dense_value_intrinsic(g) for g in (1, 2, 3, 4))


def out_of_line():
    """Compiled only: the compiled function that calls it is never inlined into its callers (LLVM's noinline): each
    caller then runs one copy of it, optimized once, the same machine code (attention.py's _run, called by the
    one-thread and the threaded kernels: inlined, LLVM is free to compile it otherwise in each, and a sum's bits could
    differ with the thread count)."""
    raise NotImplementedError


if numba is not None:

    @intrinsic
    def _out_of_line(typingctx):
        def codegen(context, builder, sig, args):
            builder.function.attributes.add("noinline")
            return context.get_dummy_value()

        return types.none(), codegen

    @overload(out_of_line, inline="always")
    def _out_of_line_overload():
        return lambda: _out_of_line()


# ---- byte dot products of weight codes (weights.py: AVX512-VNNI) ----
BYTE_DOT_CHUNK = 16  # bytes of a tile row unpacked at a time: 16 rows' codes in the low nibbles and 16 in the high
BYTE_DOT_GROUP = 32  # columns per scale (Int4's)
BYTE_DOT_PREFETCH = 2048  # bytes ahead in a form's codes that a block asks for (1-8 KB measured: 2 KB the best here)
# The kernel's blocks of 4- and 8-bit codes times int8 limbs of x (kvcli/kernels/cpu/weights.py): AVX512-VNNI's byte dot
# products (llvm.x86.avx512.vpdpbusd.512) and AVX512-VBMI's two-table byte permute (llvm.x86.avx512.vpermi2var.qi.512),
# x86 only: its table entry (kvcli/weights.py) asks for kernel_table.AVX512.

if numba is not None:

    def _byte_dot_codegen(M: int, wide: bool):
        """byte_dot_block's code (wide: byte_dot_block8's) for M rows of x."""
        CHUNK, GROUP, PREFETCH = BYTE_DOT_CHUNK, BYTE_DOT_GROUP, BYTE_DOT_PREFETCH

        def codegen(context, builder, sig, args):
            f32, i8, i32, i64 = ir.FloatType(), ir.IntType(8), ir.IntType(32), ir.IntType(64)
            vb, vf, vi = ir.VectorType(i8, CHUNK), ir.VectorType(f32, CHUNK), ir.VectorType(i32, CHUNK)
            quad = ir.VectorType(i8, 4 * CHUNK)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf] * 3), f"llvm.fma.v{CHUNK}f32")
            # acc + the sums of 4 products of unsigned by signed bytes: lane l += sum_c a[4 l + c] b[4 l + c] (VNNI)
            dot = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vi, [vi, vi, vi]),
                                                 "llvm.x86.avx512.vpdpbusd.512")
            c64 = lambda v: ir.Constant(i64, v)  # noqa: E731
            t, sza, xsa, ya = (context.make_array(sig.args[j])(context, builder, args[j]) for j in (0, 5, 6, 7))
            P, _, K, T2 = cgutils.unpack_tuple(builder, t.shape, 4)
            n_pad = cgutils.unpack_tuple(builder, ya.shape, 2)[1]
            G = builder.udiv(K, c64(GROUP))
            ip, ig, g = args[1], args[2], args[3]
            k0 = builder.mul(g, c64(GROUP))
            sP, sNT, sK, _ = cgutils.unpack_tuple(builder, t.strides, 4)  # bytes (a narrowed form's tiles are a view)

            def emit(sK, T2, fixed: bool):  # the block's code for tile rows sK bytes apart, T2 bytes wide
                # 4-bit codes at fixed strides: four columns' 128 bytes (both chunks) in two loads and one byte permute
                # where four loads and three shuffles were (one row's products -7 to -16%, four rows' -3%); one or two
                # rows unroll the two chunks (constant permutes), four keep the loop (unrolled, they ran slower) and
                # move the permute's index by the chunk. An Int8's two halves keep the four loads (faster there).
                unroll = fixed and M <= 2 and not wide
                # byte (p, i, k0, 0)
                row0 = builder.add(builder.add(builder.mul(ip, sP), builder.mul(ig, sNT)), builder.mul(k0, sK))
                # wide: the low halves' columns lie Kp / 2 further on, their block (scale d, zero 0) G / 2 further
                gs = builder.add(g, builder.udiv(G, c64(2))) if wide else g
                rows_l = builder.add(row0, builder.mul(builder.udiv(K, c64(2)), sK)) if wide else None
                zP, zG, _ = cgutils.unpack_tuple(builder, sza.strides, 3)
                z_row = builder.udiv(builder.add(builder.mul(ip, zP), builder.mul(gs, zG)), c64(4))  # sz[p, gs, 0], int32s
                n0 = builder.mul(ig, builder.mul(T2, c64(2)))  # the tile's first row
                xk = builder.add(builder.mul(ip, builder.udiv(K, c64(4))), builder.udiv(k0, c64(4)))
                xq = [builder.gep(context.make_array(sig.args[4].dtype)(context, builder, a).data, [xk])
                      for a in cgutils.unpack_tuple(builder, args[4], 2 * M)]  # x[m]'s limbs' columns k0.. of part p
                pg = builder.add(builder.mul(ip, G), g)  # block g of part p
                lane0 = ir.Constant(vi, [0] * CHUNK)

                def splat(v, ty):
                    v = builder.insert_element(ir.Constant(ty, None), v, ir.Constant(i32, 0))
                    return builder.shuffle_vector(v, v, lane0)

                def vec(ptr, at, ty):
                    return builder.bitcast(builder.gep(ptr, [at]), ty.as_pointer())

                # columns k..k + 3 of CHUNK rows, as loaded one after the other -> row l's four codes in lane l
                pair_up = ir.Constant(ir.VectorType(i32, 2 * CHUNK), list(range(2 * CHUNK)))
                lanes = ir.Constant(ir.VectorType(i32, 4 * CHUNK), [CHUNK * c + l for l in range(CHUNK) for c in range(4)])
                low, four = ir.Constant(quad, [15] * 4 * CHUNK), ir.Constant(quad, [4] * 4 * CHUNK)
                high = ir.Constant(quad, [0xF0] * 4 * CHUNK)

                # byte 4 l + j of a chunk's quad: column k + j of row c + l, at 32 j + c + l in columns k..k + 3's bytes
                picks = [32 * j + l for l in range(CHUNK) for j in range(4)]
                permute = cgutils.get_or_insert_function(builder.module, ir.FunctionType(quad, [quad] * 3),
                                                         "llvm.x86.avx512.vpermi2var.qi.512")
                every = ir.Constant(ir.VectorType(i32, 4 * CHUNK), [0] * 4 * CHUNK)

                def quads(first, c, k):  # four columns k.. from byte row `first` + c: (4 CHUNK,) i8, row l's in lane l
                    if fixed and not wide:  # four columns' 128 bytes (both chunks) in two loads, one byte permute
                        at = builder.add(first, builder.mul(c64(k), sK))
                        b = [builder.load(vec(t.data, builder.add(at, c64(64 * j)), quad), align=1) for j in range(2)]
                        if unroll:  # c a constant
                            return builder.shuffle_vector(b[0], b[1], ir.Constant(
                                ir.VectorType(i32, 4 * CHUNK), [p + c for p in picks]))
                        cb = builder.insert_element(ir.Constant(quad, None), builder.trunc(c, i8), ir.Constant(i32, 0))
                        index = builder.add(ir.Constant(quad, picks), builder.shuffle_vector(cb, cb, every))
                        return builder.call(permute, [b[0], index, b[1]])
                    at = builder.add(builder.add(first, builder.mul(c64(k), sK)), c)
                    b = [builder.load(vec(t.data, builder.add(at, builder.mul(c64(j), sK)), vb), align=1) for j in range(4)]
                    return builder.shuffle_vector(builder.shuffle_vector(b[0], b[1], pair_up),
                                                  builder.shuffle_vector(b[2], b[3], pair_up), lanes)

                # the memory ahead, asked for now: the codes stream from DRAM, which this loop alone does not keep busy
                prefetch = cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(ir.VoidType(), [i8.as_pointer(), i32, i32, i32]), "llvm.prefetch")
                read, keep, data = ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)
                # (wide: its 2 KB runs in order, which the CPU's own prefetcher follows; asking as well made one
                # row 10% slower)
                for k in range(0, GROUP, 2) if not wide else ():  # a line per pair of columns (T = 64)
                    at = builder.add(builder.add(row0, builder.mul(c64(k), sK)), c64(PREFETCH))
                    builder.call(prefetch, [builder.gep(t.data, [at]), read, keep, data])
                for j in range(0, 64, 16):  # the next tile's scales of this block (4 lines for T = 64)
                    at = builder.add(builder.add(z_row, builder.mul(T2, c64(2))), builder.add(n0, c64(j)))
                    line = builder.bitcast(builder.gep(sza.data, [at]), i8.as_pointer())
                    builder.call(prefetch, [line, read, keep, data])
                def chunk(c):  # rows c..c + CHUNK - 1 and T / 2 + c.. of the tile (c a constant where unrolled)
                    cv = c64(c) if unroll else c
                    acc = [[[ir.Constant(vi, [0] * CHUNK)] * 2 for _ in range(2)] for _ in range(M)]  # [m][limb][h]
                    for k in range(0, GROUP, 4):
                        b = quads(row0, c, k)
                        if wide:  # 16 h + l: the high halves' nibbles over the low halves'
                            bl = quads(rows_l, c, k)
                            b = [builder.or_(builder.shl(builder.and_(b, low), four), builder.and_(bl, low)),
                                 builder.or_(builder.and_(b, high), builder.lshr(bl, four))]
                        else:
                            b = [builder.and_(b, low), builder.and_(builder.lshr(b, four), low)]
                        codes = [builder.bitcast(h, vi) for h in b]
                        for m in range(M):  # x[m]'s limbs' int8 columns k0 + k..k0 + k + 3, loaded here (not all held)
                            for limb in (0, 1):
                                xv = splat(builder.load(builder.gep(xq[limb * M + m], [c64(k // 4)])), vi)
                                acc[m][limb] = [builder.call(dot, [acc[m][limb][h], codes[h], xv]) for h in (0, 1)]
                    for h in (0, 1):
                        n = builder.add(builder.add(n0, cv), builder.mul(c64(h), T2))  # rows n.. of W
                        pair = builder.load(vec(sza.data, builder.add(z_row, n), vi), align=4)
                        scale = builder.bitcast(builder.shl(pair, ir.Constant(vi, [16] * CHUNK)), vf)
                        zero = builder.bitcast(builder.and_(pair, ir.Constant(vi, [-65536] * CHUNK)), vf)
                        # x . ((q - bias) s + z) = s sx (xq . q) + (z - bias s) sx sum xq
                        bias = -128.0 if wide else -8.0
                        offset = builder.call(fma, [ir.Constant(vf, [bias] * CHUNK), scale, zero])
                        for m in range(M):
                            at = builder.mul(builder.add(builder.mul(c64(m), builder.mul(P, G)), pg), c64(2))  # xs[m, p, g]
                            sx = splat(builder.load(builder.gep(xsa.data, [at])), vf)
                            sq = splat(builder.load(builder.gep(xsa.data, [builder.add(at, c64(1))])), vf)
                            yp = vec(ya.data, builder.add(builder.mul(c64(m), n_pad), n), vf)
                            whole = builder.add(builder.shl(acc[m][0][h], ir.Constant(vi, [8] * CHUNK)), acc[m][1][h])
                            out = builder.call(fma, [builder.sitofp(whole, vf), builder.fmul(scale, sx),
                                                     builder.load(yp, align=4)])
                            builder.store(builder.call(fma, [sq, offset, out]), yp, align=4)

                if unroll:
                    for c in range(0, 32, CHUNK):
                        chunk(c)
                else:
                    with cgutils.for_range(builder, builder.udiv(T2, c64(CHUNK))) as loop:
                        chunk(builder.mul(loop.index, c64(CHUNK)))

            # T = 64 (AVX-512's tiles): constant strides fold into the loads' offsets (one base pointer, not one a
            # column kept in registers and spilled); other tiles take the general code
            fixed = builder.and_(builder.icmp_unsigned("==", sK, c64(32)), builder.icmp_unsigned("==", T2, c64(32)))
            with builder.if_else(fixed) as (then, otherwise):
                with then:
                    emit(c64(32), c64(32), True)
                with otherwise:
                    emit(sK, T2, False)
            return context.get_dummy_value()

        return codegen

    @intrinsic
    def byte_dot_block(typingctx, tiles, p, i, g, x, sz, xs, y):
        """y[m, T i + n] += s sx[m] (xi[m] . q) + (z - 8 s) sx[m] sum xi[m] over block g's columns k
        (32 g <= k < 32 g + 32) for every row n of tile i: q its codes, s and z its scale and zero point; xi[m] the
        block of x[m] as integers (x ~ sx[m] xi[m], xi = 256 hi + lo). Per chunk of CHUNK bytes of a tile row (its
        rows c.. in the low nibbles, T / 2 + c.. in the high ones), four columns at a time become one vector of 16
        rows' 4 codes each, and each row of x takes it once a limb into int32 sums kept in registers over the
        block's 32 columns (256 (hi . q) + lo . q: below 2^24, exact as f32).
        Part p of a form whose K columns come in P parts of Kp (Int8's; Int4: one); each tile row and each row of sz
        contiguous (a narrowed form's are views), the rest C-contiguous: tiles (P, NT, Kp, T / 2) uint8; x a tuple
        of 2 M (P, Kp / 4) int32 rows, 4 int8 each: the M rows' hi, then their lo; sz (P, Kp / 32, N_pad) int32, bf16
        s (low half) and z (high half); xs (M, P, Kp / 32, 2) f32: each block's sx and sx sum xi; y (M, N_pad) f32."""
        if not isinstance(x, types.UniTuple):
            return None
        return types.none(tiles, p, i, g, x, sz, xs, y), _byte_dot_codegen(x.count // 2, wide=False)

    @intrinsic
    def byte_dot_block8(typingctx, tiles, p, i, g, x, sz, xs, y):
        """byte_dot_block over an Int8 part's 8-bit codes u = q + 128 = 16 h + l, rebuilt from its two halves (h in its
        first Kp / 2 columns, l in the next: block g of h pairs with block g + G / 2 of l, over the same columns of x):
        y[m, n] += d sx (xi . u) - 128 d sx sum xi, d the l block's scale. One vector of 16 rows' four 8-bit codes
        takes the place of two of 4-bit ones: each row of x makes half the byte products it made over the halves.
        The integer sums (below 2^28) are exact, rounded once to f32."""
        if not isinstance(x, types.UniTuple):
            return None
        return types.none(tiles, p, i, g, x, sz, xs, y), _byte_dot_codegen(x.count // 2, wide=True)


# ---- the file's blocks times 16-bit activations (ggml_dot.py): AVX2 integer products, llama.cpp's vec_dot shape ----
DOT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def ggml_row_dots(kind, raw, lo, hi, xi, xs, xsum, g0, y):
    """Compiled only (ggml_row_dots1..4: rows g0.. of x, 1-4 of them): y[g0 + g, n] = x[g0 + g] . W[n] for the rows
    lo <= n < hi of W, whose blocks of type DOT_TYPES[kind] raw (N, row_bytes) uint8 holds; x as integers per 32
    columns, xi (M, K) int16, x = xs[m, c // 32] xi, and xsum[m, b] = xs[m, b] times the sum of block b's xi (both
    (M, K / 32) f32). Each 32 codes are unpacked in byte lanes, widened to 16 bits once for every row of x, and meet
    x's in vpmaddwd (int32 lane sums of pairs: exact), converted to f32 once per 32 codes and added into a vector of
    sums with the block's scale (d, or d sc per sub-block of 16 or 32) times x's; a block's min or offset meets
    xsum. Each row of x keeps its vector of sums in a register over the row of W, summed across lanes at the end: a
    row's bits do not depend on the rows beside it."""
    raise NotImplementedError


if numba is not None:
    _V32B, _V16B, _V4B = ir.VectorType(_I8, 32), ir.VectorType(_I8, 16), ir.VectorType(_I8, 4)
    _V16S, _V8I, _V8F = ir.VectorType(ir.IntType(16), 16), ir.VectorType(_I32, 8), ir.VectorType(_F32, 8)

    def _b32(v):
        return ir.Constant(_V32B, v if isinstance(v, list) else [v] * 32)

    def _call(builder, name, ret, *args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
        return builder.call(fn, list(args))

    def _f16_at(builder, addr):
        return builder.fpext(builder.bitcast(ir_load(builder, addr, ir.IntType(16)), ir.HalfType()), _F32)

    def _byte_at(builder, addr):
        """The uint8 at addr as i32."""
        return builder.zext(ir_load(builder, addr, _I8), _I32)

    def _fifth_bits(builder, qh4):
        """<4 x i8> of 32 bits (bit j: element j's fifth bit) -> <32 x i8> holding 16 where element j's is set."""
        spread = builder.shuffle_vector(qh4, qh4, ir.Constant(ir.VectorType(_I32, 32), [j // 8 for j in range(32)]))
        bit = builder.and_(spread, _b32([1 << (j % 8) for j in range(32)]))
        return builder.select(builder.icmp_unsigned("!=", bit, _b32(0)), _b32(16), _b32(0))

    def _k4_scale_min(builder, at, s):
        """Q4_K / Q5_K's 6-bit scale and min of sub-block s (ggml's get_scale_min_k4) from the 12 bytes at `at`."""
        q = lambda j: _byte_at(builder, builder.add(at, ir.Constant(_I64, j)))  # noqa: E731
        c = lambda v: ir.Constant(_I32, v)  # noqa: E731
        if s < 4:
            return builder.and_(q(s), c(63)), builder.and_(q(s + 4), c(63))
        sc = builder.or_(builder.and_(q(s + 4), c(15)), builder.shl(builder.lshr(q(s - 4), c(6)), c(4)))
        m = builder.or_(builder.lshr(q(s + 4), c(4)), builder.shl(builder.lshr(q(s), c(6)), c(4)))
        return sc, m

    def _type_body(name, builder, blk, emit, mins):
        """One block (a super-block for the K types) of type `name` at address blk: emit(codes <32 x i8>, signed,
        element offset in the block, scale (an f32, or a pair for its two 16s)); mins(coefficient f32, element
        offset): coefficient times xsum of that 32."""
        at = lambda o: builder.add(blk, ir.Constant(_I64, o))  # noqa: E731
        i2f = lambda v: builder.uitofp(v, _F32)  # noqa: E731
        if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
            qs = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[name]
            nib = ir_load(builder, at(qs), _V16B)
            codes = builder.shuffle_vector(builder.and_(nib, ir.Constant(_V16B, [15] * 16)),
                                           builder.lshr(nib, ir.Constant(_V16B, [4] * 16)),
                                           ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
            if name in ("Q5_0", "Q5_1"):
                codes = builder.or_(codes, _fifth_bits(builder, ir_load(builder, at(qs - 4), _V4B)))
            d = _f16_at(builder, at(0))
            emit(codes, False, 0, d)  # unsigned codes: Q4_0 / Q5_0's offset meets xsum as a min would (no sign flips)
            mins(_f16_at(builder, at(2)) if name in ("Q4_1", "Q5_1")
                 else builder.fmul(d, ir.Constant(_F32, -8.0 if name == "Q4_0" else -16.0)), 0)
        elif name == "Q8_0":
            emit(ir_load(builder, at(2), _V32B), True, 0, _f16_at(builder, at(0)))
        elif name in ("Q4_K", "Q5_K"):
            d, dmin = _f16_at(builder, at(0)), _f16_at(builder, at(2))
            qs = 16 if name == "Q4_K" else 48
            qh = ir_load(builder, at(16), _V32B) if name == "Q5_K" else None
            for j in range(4):
                q = ir_load(builder, at(qs + 32 * j), _V32B)
                for h, codes in enumerate((builder.and_(q, _b32(15)), builder.lshr(q, _b32(4)))):
                    s = 2 * j + h
                    if qh is not None:  # bit s of qh[l] is element l's fifth bit
                        codes = builder.or_(codes, builder.shl(builder.and_(builder.lshr(qh, _b32(s)), _b32(1)),
                                                               _b32(4)))
                    sc, m = _k4_scale_min(builder, at(4), s)
                    emit(codes, False, 32 * s, builder.fmul(d, i2f(sc)))
                    mins(builder.fneg(builder.fmul(dmin, i2f(m))), 32 * s)
        elif name == "Q6_K":
            d = _f16_at(builder, at(208))
            for half in range(2):
                ql0, ql1 = ir_load(builder, at(64 * half), _V32B), ir_load(builder, at(64 * half + 32), _V32B)
                qh = ir_load(builder, at(128 + 32 * half), _V32B)
                for q in range(4):
                    low = ql0 if q % 2 == 0 else ql1
                    low = builder.and_(low, _b32(15)) if q < 2 else builder.lshr(low, _b32(4))
                    high = builder.shl(builder.and_(builder.lshr(qh, _b32(2 * q)), _b32(3)), _b32(4))
                    sc = [builder.sitofp(builder.sext(ir_load(builder, at(192 + 8 * half + 2 * q + g), _I8), _I32),
                                         _F32) for g in (0, 1)]
                    emit(builder.sub(builder.or_(low, high), _b32(32)), True, 128 * half + 32 * q,
                         (builder.fmul(d, sc[0]), builder.fmul(d, sc[1])))
        else:
            raise ValueError(name)

    def _kind_switch(builder, kind, names, label, case):
        """A switch over kind: case(name) emitted in a block for each of names (kind k is names[k]), then on."""
        end = builder.append_basic_block(f"{label}.end")
        switch = builder.switch(kind, end)
        for k, name in enumerate(names):
            block = builder.append_basic_block(f"{label}.{name}")
            switch.add_case(ir.Constant(_I64, k), block)
            builder.position_at_end(block)
            case(name)
            builder.branch(end)
        builder.position_at_end(end)

    def _dots_args(context, builder, sig, args, ng: int):
        """The dots intrinsics' arguments (_dots_intrinsic) unpacked for ng rows of x: kind, W's array, lo, hi, K,
        x's rows, their xi / xs / xsum addresses, y, llvm.fma.v8f32 and ng slots of 8 f32 sums."""
        kind, lo, hi, g0 = args[0], args[2], args[3], args[7]
        w, xi, xs, xsum, y = (context.make_array(sig.args[j])(context, builder, args[j]) for j in (1, 4, 5, 6, 8))
        K = cgutils.unpack_tuple(builder, xi.shape, 2)[1]
        rows = [builder.add(g0, ir.Constant(_I64, g)) for g in range(ng)]
        x_i = [ir_at(builder, xi, r) for r in rows]
        x_s, x_sum = [ir_at(builder, xs, r) for r in rows], [ir_at(builder, xsum, r) for r in rows]
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8F, [_V8F] * 3), "llvm.fma.v8f32")
        acc = [cgutils.alloca_once(builder, _V8F) for _ in range(ng)]
        return kind, w, lo, hi, K, rows, x_i, x_s, x_sum, y, fma, acc

    def _row_dots_codegen(ng: int):
        def codegen(context, builder, sig, args):
            kind, raw, lo, hi, K, rows, x_i, x_s, x_sum, y, fma, acc = _dots_args(context, builder, sig, args, ng)
            acc_s = [cgutils.alloca_once(builder, _F32) for _ in range(ng)]
            with cgutils.for_range(builder, builder.sub(hi, lo)) as row:
                n = builder.add(lo, row.index)
                for g in range(ng):
                    builder.store(ir.Constant(_V8F, [0.0] * 8), acc[g])
                    builder.store(ir.Constant(_F32, 0.0), acc_s[g])
                w_row = ir_at(builder, raw, n)

                def blocks(name):
                    qk, bb = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]  # elements, bytes a block
                    with cgutils.for_range(builder, builder.udiv(K, ir.Constant(_I64, qk))) as blk:
                        b = blk.index
                        x0 = builder.mul(b, ir.Constant(_I64, qk))  # the block's first column
                        x32 = builder.udiv(x0, ir.Constant(_I64, 32))

                        def emit(codes, signed, off, scale):
                            ext = builder.sext if signed else builder.zext
                            halves = [ext(builder.shuffle_vector(codes, codes, ir.Constant(ir.VectorType(_I32, 16),
                                                                                           list(range(h, h + 16)))),
                                          _V16S) for h in (0, 16)]
                            def splat(v):
                                one = builder.insert_element(ir.Constant(_V8F, None), v, ir.Constant(_I32, 0))
                                return builder.shuffle_vector(one, one, ir.Constant(_V8I, [0] * 8))

                            for g in range(ng):
                                col = builder.mul(builder.add(x0, ir.Constant(_I64, off)), ir.Constant(_I64, 2))
                                p = [_call(builder, "llvm.x86.avx2.pmadd.wd", _V8I, halves[h],
                                           ir_load(builder, builder.add(x_i[g], builder.add(col, ir.Constant(_I64, 32 * h))),
                                                   _V16S)) for h in (0, 1)]
                                xb = builder.add(x32, ir.Constant(_I64, off // 32))
                                sx = ir_load(builder, builder.add(x_s[g], builder.mul(xb, ir.Constant(_I64, 4))), _F32)
                                a = builder.load(acc[g])
                                if isinstance(scale, tuple):  # two sub-blocks of 16: each half its own scale
                                    for h in (0, 1):
                                        a = builder.call(fma, [builder.sitofp(p[h], _V8F), splat(builder.fmul(scale[h], sx)), a])
                                else:
                                    a = builder.call(fma, [builder.sitofp(builder.add(p[0], p[1]), _V8F),
                                                           splat(builder.fmul(scale, sx)), a])
                                builder.store(a, acc[g])

                        def mins(coef, off):
                            xb = builder.add(x32, ir.Constant(_I64, off // 32))
                            for g in range(ng):
                                v = ir_load(builder, builder.add(x_sum[g], builder.mul(xb, ir.Constant(_I64, 4))), _F32)
                                builder.store(builder.fadd(builder.load(acc_s[g]), builder.fmul(coef, v)), acc_s[g])

                        _type_body(name, builder, builder.add(w_row, builder.mul(b, ir.Constant(_I64, bb))), emit, mins)

                _kind_switch(builder, kind, DOT_TYPES, "dots", blocks)
                for g in range(ng):
                    v = builder.load(acc[g])
                    for w in (4, 2, 1):  # halves added: 8 -> 4 -> 2 -> 1 lanes
                        v = builder.fadd(builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, w), list(range(w)))),
                                         builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, w),
                                                                                  list(range(w, 2 * w)))))
                    total = builder.fadd(builder.extract_element(v, ir.Constant(_I32, 0)), builder.load(acc_s[g]))
                    ir_store(builder, total, ir_at(builder, y, rows[g], n))
            return context.get_dummy_value()

        return codegen

    def _dots_intrinsic(codegen_of, ng: int):
        """ggml_row_dots' and ggml_tile_dots' signature: (kind, W's bytes, lo, hi, xi, xs, xsum, g0, y)."""
        def typer(typingctx, kind, w, lo, hi, xi, xs, xsum, g0, y):
            i = types.int64
            return types.none(i, w, i, i, xi, xs, xsum, i, y), codegen_of(ng)

        return intrinsic(typer)

    ggml_row_dots1, ggml_row_dots2, ggml_row_dots3, ggml_row_dots4 = (_dots_intrinsic(_row_dots_codegen, g)
                                                                      for g in (1, 2, 3, 4))


# ---- 8 rows' blocks interleaved (ggml_tiles.py): the same 16-bit products with 8 rows in one vector's lanes ----
TILE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
WORD_TYPES, QUAD_TYPES = TILE_TYPES[:5], TILE_TYPES[5:]  # x as 16-bit integers (ggml_tile_dots), 8-bit (ggml_quad_dots)
TILE_ROWS = 8  # rows of W a tile interleaves: one int32 / f32 lane each


def tile_order(name: str) -> tuple[tuple[int, ...], ...]:
    """A block's 16-bit units in the order a tile lays them (ggml_tiles.retile), as pieces: a piece of one unit holds
    the 8 rows' copies of it one after another (16 bytes), a piece of two units (QUAD_TYPES' codes) each row's two
    together (row r's 4 bytes at 4 r: 32 bytes, one vector of 8 rows' 4 columns for vpmaddubsw / vpdpbusd). The order
    is the one _tile_body and _quad_body first read them, so that a tile is read front to back. From DRAM the order
    is the rate: a Q6_K block read as its file lays it (d last, three runs 256 and 1024 bytes apart) streamed at 17
    GB/s on 2 cores against 37 in this order with its loads kept in order and no software prefetch (the order alone:
    1.45x; benchmarks/README.md section 14); read in L3 all run alike. Q5_K: its fifth bits beside the codes they
    complete. The other types: as the file, one unit a piece."""
    units = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][1] // 2
    pair = lambda u: ((u, u + 1),)  # noqa: E731  4 bytes of a row: 4 columns' codes
    if name == "Q6_K":  # d (unit 104); per 128: its 4 scale units, then 4 columns of ql's two runs and qh's at a time
        order = ((104,),)
        for n in range(2):
            order += tuple((96 + 4 * n + k,) for k in range(4))
            for c in range(8):
                order += pair(32 * n + 2 * c) + pair(32 * n + 16 + 2 * c) + pair(64 + 16 * n + 2 * c)
        return order
    if name == "Q5_K":  # d, dmin, scales (0-7); qs of the first 64 beside qh (8-23); the rest of qs
        return (tuple((u,) for u in range(8)) + tuple(p for c in range(8) for p in pair(24 + 2 * c) + pair(8 + 2 * c))
                + tuple(p for u in range(40, units, 2) for p in pair(u)))
    if name == "Q4_K":  # d, dmin, scales (0-7); qs
        return tuple((u,) for u in range(8)) + tuple(p for u in range(8, units, 2) for p in pair(u))
    return tuple((u,) for u in range(units))


def tile_places(name: str) -> dict[int, int]:
    """A block's 16-bit unit -> its row 0 copy's unit in the tile block (row r's: + r times its piece's length)."""
    places, at = {}, 0
    for piece in tile_order(name):
        for j, u in enumerate(piece):
            places[u] = 8 * at + j
        at += len(piece)
    return places


def ggml_tile_dots(kind, tiles, lo, hi, xi, xs, xsum, g0, y):
    """Compiled only (ggml_tile_dots1..4: rows g0.. of x, 1-4 of them): y[g0 + g, 8 t + r] = x[g0 + g] . W[8 t + r]
    for the tiles lo <= t < hi of WORD_TYPES[kind], tiles (N / 8, K / 32 blocks x 8 block bytes) uint8 as
    ggml_tiles.retile lays them: per block of 32 columns, the 8 rows' blocks in 16-bit units, unit u of row r at
    unit 8 u + r (Q5_0 / Q5_1's fifth bits regrouped by lane, ggml_tiles). A code run, 16 bytes of one unit of the
    8 rows, widened to 16-bit lanes holds 8 rows' codes of two columns (low nibbles: 2c, 2c + 1; high: those of the
    next sub-block or half); each meets x's pair of columns (one 32-bit word splat) in vpmaddwd, so each row's sum
    stays in its own int32 lane over a sub-block (exact); then one f32 fma for the 8 rows with their scales times
    sx, and one for their mins (or Q4_0 / Q5_0's offset) times xsum. x as in ggml_row_dots."""
    raise NotImplementedError


if numba is not None:

    def _tile_body(name, builder, unit_at, run, f16s, bytes8, madd, scale, mins):
        """One block of 8 rows of type `name`, its 16-bit unit u at unit_at(u) (placed by tile_order, which follows
        the order this body reads them), emitted in the order its codes are made (each run's codes consumed at once:
        nothing held across the block): madd(slot, codes <16 x i16>, column) adds the int32
        sums of codes times x's pair of columns there into the sums `slot`; scale(slot, coef 8 x f32, column) adds
        those sums times coef times sx of the 32 columns at column into the rows' f32 sums (and clears the slot);
        mins(coef, column): coef times xsum of those 32 columns. run(unit): that unit's code run widened (zext) to 16
        lanes; f16s(unit): the 8 rows' f16 there as 8 x f32; bytes8(byte): the 8 rows' byte `byte` of their block
        (zext to 8 x i32)."""
        s16 = lambda v: ir.Constant(_V16S, [v] * 16)  # noqa: E731
        f8 = lambda v: ir.Constant(_V8F, [v] * 8)  # noqa: E731
        i8 = lambda v: ir.Constant(_V8I, [v] * 8)  # noqa: E731
        if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
            d = f16s(0)
            has_min = name in ("Q4_1", "Q5_1")
            first = 1 + has_min + 2 * (name in ("Q5_0", "Q5_1"))  # the first code unit
            if name in ("Q5_0", "Q5_1"):  # lane l's 16 fifth bits: bit c + 8h for run c's half h (ggml_tiles)
                fifth = ir_load_ordered(builder, unit_at(1 + has_min), _V16S)
            for c in range(16 if name == "Q8_0" else 8):
                if name == "Q8_0":
                    raw = ir_load_ordered(builder, unit_at(1 + c), _V16B)
                    madd(0, builder.sext(raw, _V16S), 2 * c)
                    continue
                wide = run(first + c)
                halves = [builder.and_(wide, s16(15)), builder.lshr(wide, s16(4))]
                if name in ("Q5_0", "Q5_1"):  # each half's fifth bit moved to bit 4 by one shift, then masked
                    at_4 = [builder.shl(fifth, s16(4 - c)) if c < 4 else builder.lshr(fifth, s16(c - 4)) if c > 4
                            else fifth, builder.lshr(fifth, s16(c + 4))]
                    halves = [builder.or_(v, builder.and_(f, s16(16))) for v, f in zip(halves, at_4)]
                for h in (0, 1):
                    madd(0, halves[h], 16 * h + 2 * c)
            scale(0, d, 0)
            if has_min:
                mins(f16s(1), 0)
            elif name in ("Q4_0", "Q5_0"):  # unsigned codes: the offset meets xsum as a min would
                mins(builder.fmul(d, f8(-8.0 if name == "Q4_0" else -16.0)), 0)
        else:
            raise ValueError(name)

    def _splat8(builder, v):
        """The f32 v in 8 lanes."""
        one = builder.insert_element(ir.Constant(_V8F, None), v, ir.Constant(_I32, 0))
        return builder.shuffle_vector(one, one, ir.Constant(_V8I, [0] * 8))

    class _TileReads:
        """What one block of a tile's 8 rows reads, for the tiles' codegens: W's units at their places (tile_places),
        in program order (ir_load_ordered), and x's per-column figures of the block's columns."""

        def __init__(self, builder, at, col0, places):
            self.builder, self.at, self.col0, self.places = builder, at, col0, places
            self.loaded = {}  # one-unit pieces bytes8 has read: each loaded once a block (the loads are volatile)

        def unit_at(self, unit):
            """The address of row 0's copy of the block's 16-bit unit `unit`."""
            return self.builder.add(self.at, ir.Constant(_I64, 2 * self.places[unit]))

        def f16s(self, unit):
            """The 8 rows' f16 at `unit` (a one-unit piece) as 8 x f32."""
            v = ir_load_ordered(self.builder, self.unit_at(unit), ir.VectorType(ir.HalfType(), 8))
            return self.builder.fpext(v, _V8F)

        def bytes8(self, byte):
            """The 8 rows' byte `byte` of their blocks (in a one-unit piece: every other byte), zext to 8 x i32."""
            b = self.builder
            if byte // 2 not in self.loaded:
                self.loaded[byte // 2] = ir_load_ordered(b, self.unit_at(byte // 2), _V16B)
            v = self.loaded[byte // 2]
            return b.zext(b.shuffle_vector(v, v, ir.Constant(_V8I, [2 * r + byte % 2 for r in range(8)])), _V8I)

        def per(self, row, col, width):
            """The f32 of x's row figures at address `row` (xs, xsum: one a `width` columns) for the columns at the
            block's col, in 8 lanes."""
            b = self.builder
            at = b.udiv(b.add(self.col0, ir.Constant(_I64, col)), ir.Constant(_I64, width))
            return _splat8(b, ir_load(b, b.add(row, b.mul(at, ir.Constant(_I64, 4))), _F32))

    def _tile_loop(builder, kind, tiles, lo, hi, K, names, acc, y, rows, block):
        """The tiles' kernels' frame: for each tile t of lo..hi-1 (8 rows of W), the 8 rows' f32 sums acc (a slot a
        row of x) cleared, block(name, reads) for each block of the tile's type names[kind] (a switch over them;
        reads: a _TileReads of the block), then acc stored to y[rows[g], 8 t .. 8 t + 7]."""
        c64 = lambda v: ir.Constant(_I64, v)  # noqa: E731
        with cgutils.for_range(builder, builder.sub(hi, lo)) as tile:
            t = builder.add(lo, tile.index)
            for a in acc:
                builder.store(ir.Constant(_V8F, [0.0] * 8), a)
            t_row = ir_at(builder, tiles, t)

            def blocks(name):
                qk, bb = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
                places = tile_places(name)
                with cgutils.for_range(builder, builder.udiv(K, c64(qk))) as blk:
                    at = builder.add(t_row, builder.mul(blk.index, c64(bb * TILE_ROWS)))
                    block(name, _TileReads(builder, at, builder.mul(blk.index, c64(qk)), places))

            _kind_switch(builder, kind, names, "tiles", blocks)
            for g, a in enumerate(acc):
                ir_store(builder, builder.load(a), ir_at(builder, y, rows[g], builder.mul(t, c64(TILE_ROWS))))

    def _tile_codegen(ng: int):
        def codegen(context, builder, sig, args):
            kind, tiles, lo, hi, K, rows, x_i, x_s, x_sum, y, fma, acc = _dots_args(context, builder, sig, args, ng)
            c64 = lambda v: ir.Constant(_I64, v)  # noqa: E731

            def block(name, reads):
                def run(unit):
                    return builder.zext(ir_load_ordered(builder, reads.unit_at(unit), _V16B), _V16S)

                def pair(g, col):
                    addr = builder.add(x_i[g], builder.mul(builder.add(reads.col0, c64(col)), c64(2)))
                    one = builder.insert_element(ir.Constant(_V8I, None), ir_load(builder, addr, _I32),
                                                 ir.Constant(_I32, 0))
                    return builder.bitcast(builder.shuffle_vector(one, one, ir.Constant(_V8I, [0] * 8)), _V16S)

                isums = {}  # slot -> per row of x, the int32 sums so far (None: empty)

                def madd(slot, codes, col):
                    sums = isums.setdefault(slot, [None] * ng)
                    for g in range(ng):
                        p = _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I, codes, pair(g, col))
                        sums[g] = p if sums[g] is None else builder.add(sums[g], p)

                def scale(slot, coef, col):
                    sums = isums.pop(slot)
                    for g in range(ng):
                        builder.store(builder.call(fma, [builder.sitofp(sums[g], _V8F),
                                                         builder.fmul(coef, reads.per(x_s[g], col, 32)),
                                                         builder.load(acc[g])]), acc[g])

                def mins(coef, col):
                    for g in range(ng):
                        builder.store(builder.call(fma, [coef, reads.per(x_sum[g], col, 32), builder.load(acc[g])]),
                                      acc[g])

                _tile_body(name, builder, reads.unit_at, run, reads.f16s, reads.bytes8, madd, scale, mins)

            _tile_loop(builder, kind, tiles, lo, hi, K, WORD_TYPES, acc, y, rows, block)
            return context.get_dummy_value()

        return codegen

    ggml_tile_dots1, ggml_tile_dots2, ggml_tile_dots3, ggml_tile_dots4 = (_dots_intrinsic(_tile_codegen, g)
                                                                          for g in (1, 2, 3, 4))


# ---- the K-quants' tiles times 8-bit activations (ggml_tiles.py): llama.cpp's q8 vec_dot, 8 rows in one vector ----


def ggml_quad_dots(kind, tiles, lo, hi, xq, xs, xsum, xsum16, g0, y):
    """Compiled only (ggml_quad_dots1..4: rows g0.. of x, 1-4 of them): y[g0 + g, 8 t + r] = x[g0 + g] . W[8 t + r]
    for the tiles lo <= t < hi of QUAD_TYPES[kind] as ggml_tiles.retile lays them (tile_order: the codes in pieces of
    4 bytes a row, 8 rows' 4 columns in one 32-byte vector). x as 8-bit integers per 32 columns, xq (M, K) int8,
    x = xs[m, c // 32] xq, xsum (M, K / 32) and xsum16 (M, K / 16) f32: xs times the sums of xq over each 32 and 16
    columns. Each code vector (unsigned) meets x's 4 columns (one 32-bit word splat) in vpmaddubsw, 16-bit sums added
    while they cannot overflow, then widened into int32 lanes, a row each, by vpmaddwd with ones (Q6_K: with each
    row's scale of its 16 columns); where VNNI is compiled for, Q4_K and Q5_K take vpdpbusd (the product and the add
    in one) and Q6_K vpdpwssd. Per 32 columns one f32 fma for the 8 rows with their scales times sx, and one for their
    mins (Q6_K: its -32 offset, a 16-column group at a time) times xsum. Integer sums are exact; a row's bits do not
    depend on the rows beside it."""
    raise NotImplementedError


if numba is not None:
    _V8H = ir.VectorType(ir.IntType(16), 8)

    def _quad_body(name, builder, quad, f16s, bytes8, dot, dot_scaled, scale, mins):
        """One super-block of 8 rows of type `name` (QUAD_TYPES), read in tile_order's order: quad(unit, ordered) the
        8 rows' 4 bytes from `unit` (<32 x i8>; ordered: in program order even where the kernel lets LLVM place its
        loads, the batches' ggml_quad_batch4); f16s(unit), bytes8(byte) as _tile_body's; dot(slot, codes, col, top): the
        integer sums of codes (<32 x i8>, unsigned, at most top) times x's columns col..col+3 added into `slot`;
        dot_scaled(slot, [codes, codes], col, sc): two such runs (columns col..col+3, col+4..col+7) times each row's
        16-bit scale (<16 x i16>, row r in lanes 2r, 2r + 1) into `slot`; scale(slot, coef, col): the slot's sums
        times coef (8 x f32) times sx of the 32 columns at col into the rows' f32 sums; mins(coef, col, width): coef
        times xsum (width 32) or xsum16 (16) there."""
        b32 = lambda v: ir.Constant(_V32B, [v] * 32)  # noqa: E731
        i8 = lambda v: ir.Constant(_V8I, [v] * 8)  # noqa: E731
        if name in ("Q4_K", "Q5_K"):
            d, dmin = f16s(0), f16s(1)
            q = lambda j: bytes8(4 + j)  # noqa: E731  the 12 scale bytes from byte 4
            first = 8 + 16 * (name == "Q5_K")  # qs' first unit (Q5_K: qh's 16 units before)
            top = 15 if name == "Q4_K" else 31
            for j in range(4):
                for h in (0, 1):  # sub-block 2j (low nibbles), then 2j + 1 (high): one slot's sums live at a time
                    for c in range(8):  # columns 4c..4c+3 of the sub-block
                        # its second load (h = 1) in order: merged with the first, the first pass's 8 code vectors
                        # would stay live across it, more than AVX2's 16 registers hold
                        codes = quad(first + 16 * j + 2 * c, ordered=h == 1)
                        v = builder.and_(codes, b32(15)) if h == 0 else builder.lshr(codes, b32(4))
                        if name == "Q5_K":  # qh[l] bit 2j + h: element l of sub-block 2j + h
                            qh = quad(8 + 2 * c)
                            v = builder.or_(v, builder.shl(builder.and_(builder.lshr(qh, b32(2 * j + h)), b32(1)), b32(4)))
                        dot(h, v, 64 * j + 32 * h + 4 * c, top)
                    sb = 2 * j + h
                    if sb < 4:
                        sc, m = builder.and_(q(sb), i8(63)), builder.and_(q(sb + 4), i8(63))
                    else:
                        sc = builder.or_(builder.and_(q(sb + 4), i8(15)), builder.shl(builder.lshr(q(sb - 4), i8(6)), i8(4)))
                        m = builder.or_(builder.lshr(q(sb + 4), i8(4)), builder.shl(builder.lshr(q(sb), i8(6)), i8(4)))
                    scale(h, builder.fmul(d, builder.uitofp(sc, _V8F)), 64 * j + 32 * h)
                    mins(builder.fneg(builder.fmul(dmin, builder.uitofp(m, _V8F))), 64 * j + 32 * h, 32)
        elif name == "Q6_K":
            d = f16s(104)
            m32 = builder.fmul(d, ir.Constant(_V8F, [-32.0] * 8))
            for n in range(2):
                for k in range(4):  # the 32 columns 128n + 32k (scales 8n + 2k + half): one slot's sums live at a time
                    for half in (0, 1):  # columns l of 16 half .. 16 half + 15: each row's int8 scale
                        sc = builder.trunc(bytes8(192 + 8 * n + 2 * k + half), ir.VectorType(_I8, 8))
                        v = builder.sext(sc, _V8H)  # in both 16-bit lanes of its row's 32 (vpmaddwd's)
                        sc16 = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 16),
                                                                         [r // 2 for r in range(16)]))
                        runs = []
                        for c in range(4 * half, 4 * half + 4):  # ql's low nibbles (k < 2) or high, qh's bits 2k, 2k+1
                            ql, qh = quad(32 * n + 16 * (k % 2) + 2 * c), quad(64 + 16 * n + 2 * c)
                            low = builder.and_(ql, b32(15)) if k < 2 else builder.lshr(ql, b32(4))
                            high = builder.shl(builder.and_(builder.lshr(qh, b32(2 * k)), b32(3)), b32(4))
                            runs.append(builder.or_(low, high))
                            if c % 2:  # two runs of 4 columns: 16-bit sums of codes < 64 stay below 2^15
                                dot_scaled(k, runs, 128 * n + 32 * k + 4 * c - 4, sc16)
                                runs = []
                        coef = builder.fmul(m32, builder.sitofp(builder.sext(sc, _V8I), _V8F))  # -32's: d (-32) sc
                        mins(coef, 128 * n + 32 * k + 16 * half, 16)  # times x's sum over the 16 columns
                    scale(k, d, 128 * n + 32 * k)
        else:
            raise ValueError(name)

    def _quad_codegen(ng: int, vnni: bool, placed: bool):
        def codegen(context, builder, sig, args):
            kind, lo, hi, g0 = args[0], args[2], args[3], args[8]
            tiles, xq, xs, xsum, xsum16, y = (context.make_array(sig.args[j])(context, builder, args[j])
                                              for j in (1, 4, 5, 6, 7, 9))
            K = cgutils.unpack_tuple(builder, xq.shape, 2)[1]
            rows = [builder.add(g0, ir.Constant(_I64, g)) for g in range(ng)]
            x_q = [ir_at(builder, xq, r) for r in rows]
            x_s, x_sum, x_sum16 = ([ir_at(builder, a, r) for r in rows] for a in (xs, xsum, xsum16))
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8F, [_V8F] * 3), "llvm.fma.v8f32")
            acc = [cgutils.alloca_once(builder, _V8F) for _ in range(ng)]
            c64 = lambda v: ir.Constant(_I64, v)  # noqa: E731
            ones = ir.Constant(_V16S, [1] * 16)
            zero = ir.Constant(_V8I, [0] * 8)

            def block(name, reads):
                def quad(unit, ordered=False):
                    load = ir_load if placed and not ordered else ir_load_ordered
                    return load(builder, reads.unit_at(unit), _V32B)

                def xquad(g, col):  # x's columns col..col+3 of row g in every 32-bit lane
                    addr = builder.add(x_q[g], builder.add(reads.col0, c64(col)))
                    one = builder.insert_element(ir.Constant(_V8I, None), ir_load(builder, addr, _I32),
                                                 ir.Constant(_I32, 0))
                    return builder.bitcast(builder.shuffle_vector(one, one, ir.Constant(_V8I, [0] * 8)), _V32B)

                wide = {}  # slot -> per row of x its int32 sums (None: none yet)
                narrow = {}  # slot -> (per row of x its 16-bit sums, how many runs they hold)

                def add32(slot, g, v):
                    sums = wide.setdefault(slot, [None] * ng)
                    sums[g] = v if sums[g] is None else builder.add(sums[g], v)

                def flush(slot):
                    sums, _ = narrow.pop(slot, (None, 0))
                    for g in range(ng if sums else 0):
                        add32(slot, g, _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I, sums[g], ones))

                def dot(slot, codes, col, top):
                    if vnni:  # the 4 products of a lane and their sum added in one instruction
                        sums = wide.setdefault(slot, [None] * ng)
                        for g in range(ng):
                            sums[g] = _call(builder, "llvm.x86.avx512.vpdpbusd.256", _V8I,
                                            zero if sums[g] is None else sums[g], builder.bitcast(codes, _V8I),
                                            builder.bitcast(xquad(g, col), _V8I))
                        return
                    if (narrow.get(slot, (None, 0))[1] + 1) * 2 * top * 127 > 32767:  # 16-bit sums would overflow
                        flush(slot)
                    sums, n = narrow.get(slot, ([None] * ng, 0))
                    for g in range(ng):
                        p = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16S, codes, xquad(g, col))
                        sums[g] = p if sums[g] is None else builder.add(sums[g], p)
                    narrow[slot] = (sums, n + 1)

                def dot_scaled(slot, runs, col, sc):
                    sums = wide.setdefault(slot, [None] * ng)
                    for g in range(ng):
                        p = None
                        for i, codes in enumerate(runs):
                            v = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16S, codes, xquad(g, col + 4 * i))
                            p = v if p is None else builder.add(p, v)
                        if vnni:
                            sums[g] = _call(builder, "llvm.x86.avx512.vpdpwssd.256", _V8I,
                                            zero if sums[g] is None else sums[g], builder.bitcast(p, _V8I),
                                            builder.bitcast(sc, _V8I))
                        else:
                            add32(slot, g, _call(builder, "llvm.x86.avx2.pmadd.wd", _V8I, p, sc))

                def scale(slot, coef, col):
                    flush(slot)
                    sums = wide.pop(slot)
                    for g in range(ng):
                        builder.store(builder.call(fma, [builder.sitofp(sums[g], _V8F),
                                                         builder.fmul(coef, reads.per(x_s[g], col, 32)),
                                                         builder.load(acc[g])]), acc[g])

                def mins(coef, col, width):
                    for g in range(ng):
                        at = (x_sum if width == 32 else x_sum16)[g]
                        builder.store(builder.call(fma, [coef, reads.per(at, col, width), builder.load(acc[g])]), acc[g])

                _quad_body(name, builder, quad, reads.f16s, reads.bytes8, dot, dot_scaled, scale, mins)

            _tile_loop(builder, kind, tiles, lo, hi, K, QUAD_TYPES, acc, y, rows, block)
            return context.get_dummy_value()

        return codegen

    def _quad_intrinsic(ng: int, placed: bool = False):
        """ggml_quad_dots' signature: (kind, tiles, lo, hi, xq, xs, xsum, xsum16, g0, y); placed: the code vectors
        loaded where LLVM places them (but those _quad_body asks in order), else all in program order."""
        def typer(typingctx, kind, tiles, lo, hi, xq, xs, xsum, xsum16, g0, y):
            i = types.int64
            return (types.none(i, tiles, i, i, xq, xs, xsum, xsum16, i, y),
                    _quad_codegen(ng, target_has("avx512vnni"), placed))

        return intrinsic(typer)

    ggml_quad_dots1, ggml_quad_dots2, ggml_quad_dots3, ggml_quad_dots4 = (_quad_intrinsic(g) for g in (1, 2, 3, 4))
    # A batch's: its tiles' block is read from L2 by every group of x's rows (ggml_tiles._span8), where the order of
    # the loads leads no prefetcher. The code vectors are then LLVM's to place and to fold into the instructions
    # that use them (a batch's products faster on AVX2: benchmarks/README.md section 14).
    ggml_quad_batch4 = _quad_intrinsic(4, placed=True)
