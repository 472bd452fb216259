"""RoPE in place on the CPU (numba; kvcli/rope.py's rope_ for f32 behind it): one compiled pass over q and k.

torch's rope_ is four to six ops (views, products, addcmul) a call, ~25-60 us at decode's one row where the work
is ~1 us; this is one call. Rounded as torch's ops round (adjacent pairs: a complex product, each part's products
rounded, then summed; NEOX: addcmul's single rounding for a cos - b sin), so a token's bits do not depend on which
path rotated it (tests/test_kernels.py checks them equal).
"""

from __future__ import annotations

from .compile import exact_jit, numba

if numba is not None:
    from .vectors import fma_f32


@exact_jit
def rotate(x, rot, neox):
    """x (B, T, H, D) f32, any strides; rot (Br, T, D/2) complex64, Br 1 (shared by the B rows) or B. Pairs (j, j + D/2)
    where neox, else (2j, 2j + 1): (a, b) -> (a cos - b sin, b cos + a sin)."""
    B, T, H, D = x.shape
    half = D // 2
    for b in range(B):
        rb = b if rot.shape[0] > 1 else 0
        for t in range(T):
            for h in range(H):
                for j in range(half):
                    c, s = rot[rb, t, j].real, rot[rb, t, j].imag
                    if neox:
                        a, e = x[b, t, h, j], x[b, t, h, j + half]
                        x[b, t, h, j] = fma_f32(-e, s, a * c)
                        x[b, t, h, j + half] = e * c + a * s
                    else:
                        a, e = x[b, t, h, 2 * j], x[b, t, h, 2 * j + 1]
                        x[b, t, h, 2 * j] = a * c - e * s
                        x[b, t, h, 2 * j + 1] = a * s + e * c

