"""Decode attention read straight from 4-bit blocks: no dequantized copy of the cache, even per chunk.

For q4_0, element e of a stored head vector is  v[e] = d[b] (u[e] - 8), b = e // 32,
with u the nibble (byte j of a block: element j low, j + 16 high).
So for a query row q and a probability row p over positions t
    q . v_t          = sum_b d[t, b] (q_b . u_t,b  -  bias sum(q_b))            (scores)
    sum_t p_t v_t[e] = sum_t (p_t d[t, b]) u_t[e]  -  bias sum_t p_t d[t, b]     (weighted sum)
and the codes are used nearly as they lie: the row bytes widened to (low nibble, high nibble)
pairs. The header columns (the fp16 scales) hold garbage that gets zero weight or is never picked.
  * Scores run as int8 x int8 -> int32 matmuls (torch._int_mm: VNNI/AMX on x86 CPUs), each
    32-element block of q split into two int8 parts, q ~ s0 i0 + s1 i1, good to 1/64516 of
    the block's largest |q| (finer than rounding q to f16; llama.cpp rounds q to one int8 part).
  * Weighted sums run in f32 (the probabilities are too uneven for int8), on the bytes and their
    high nibbles as floats (low = byte - 16 high), stacked back into the plane's column order.
Used for decode (few query rows) where kvcli/cache/dense_decode.py's compiled kernel does not run
(no numba, a window, several threads deep in the context); with many rows, dequantizing a chunk once
costs less. q8_0 keeps the dequantizing path here (one cast, so reading its bytes did not pay).
A model's few massive activation dimensions make the query split hardest (SmolLM2 is the test
case). Speed and KL figures: benchmarks/README.md. (q4_hadamard, whose layout is kvcli's own,
stores its codes where torch's int4 GEMM reads them: kvcli/cache/int4_gemm.py.)
"""

from __future__ import annotations

import functools

import torch

MAX_ROWS = 16  # query rows per (sequence, KV head) up to which this path is taken


@functools.cache
def int_mm_fast() -> bool:
    """Does torch._int_mm have a fast int8 kernel on this CPU? Only with VNNI (or AMX) instructions:
    on an AVX2 CPU without them it ran 17x slower than the f32 matmul of the same shape (490 us against
    29 us for 32 x 64 x 256), and the scores dequantize instead. Read from the CPU's flags, not timed:
    a timing at start-up is at the mercy of thread start and other load."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:  # not Linux: torch's own dispatch level
        return torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & set(flags))


def split_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., n) f32 -> i (..., 2, n) int8 and s (..., 2) f32 with x ~ s[0] i[0] + s[1] i[1]."""
    s = x.abs().amax(-1, keepdim=True).clamp_min_(1e-30).div_(127)  # (..., 1)
    y = x / s  # in [-127, 127]
    hi = y.round()
    lo = (y - hi).mul_(254).round_()  # the remainder, in [-0.5, 0.5], at 254 times finer steps
    return torch.stack([hi, lo], -2).to(torch.int8), torch.cat([s, s / 254], -1)


class BlockCodes:
    """Where the q4_0 block layout (fp16 d, then byte j: element j low, j + 16 high) keeps its codes,
    for one head size. Its rows are read as one int8 "plane" of (byte & 15, byte >> 4) pairs, twice
    as wide as the row: plane column c holds the code of element elem[c], or header garbage."""

    bias = 8

    def __init__(self, head_dim: int, block_bytes: int = 18):
        nb = head_dim // 32
        self.n_blocks, self.block_bytes = nb, block_bytes
        self.width = width = 2 * nb * block_bytes
        elem = torch.full((width,), -1, dtype=torch.long)
        for b in range(nb):
            for j in range(block_bytes - 2):
                c = b * block_bytes + 2 + j
                elem[2 * c], elem[2 * c + 1] = 32 * b + j, 32 * b + 16 + j
        code = elem >= 0
        self.within = torch.where(code, elem % 32, 0)  # (width,): column -> its element within the block
        self.in_block = (code & (elem // 32 == torch.arange(nb)[:, None])).to(torch.int8)  # (nb, width)
        at = torch.empty(head_dim, dtype=torch.long)
        at[elem[code]] = torch.arange(width)[code]
        self.pick = at + torch.arange(head_dim) // 32 * width  # (D,): element -> (block row, column), flat

    def to(self, device) -> "BlockCodes":
        for name in ("within", "in_block", "pick"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    def plane(self, rows: torch.Tensor) -> torch.Tensor:
        """(n, t, rb) uint8 -> the nibbles u (n, t, width) int8."""
        b = rows.to(torch.int16)  # per byte, low + 256 high = byte + 240 high: the pair, little-endian
        return torch.add(b, b >> 4, alpha=240).view(torch.int8)

    def scales(self, rows: torch.Tensor) -> torch.Tensor:
        """(n, t, rb) uint8 -> (n, nb, t) fp16, a view: the d at byte 0 of each block."""
        return rows.view(torch.float16)[..., :: self.block_bytes // 2].transpose(1, 2)


def scores(q: torch.Tensor, rows: torch.Tensor, codes: BlockCodes) -> torch.Tensor:
    """q (n, R, D) f32 against rows (n, t, rb) uint8 -> (n, R, t) f32."""
    n, R, D = q.shape
    nb, t = codes.n_blocks, rows.shape[1]
    i, s = split_int8(q.view(n, R, nb, 32))  # (n, R, nb, 2, 32), (n, R, nb, 2)
    # weights (n, M, width), M = R * nb * 2 rows (r, b, part): block b's part at b's code columns
    w = (i[..., codes.within] * codes.in_block.view(nb, 1, -1)).view(n, -1, codes.width)
    acc = torch.empty(n, w.shape[1], t, dtype=torch.int32, device=q.device)
    for w_j, u_j, acc_j in zip(w, codes.plane(rows).transpose(1, 2), acc):  # (M, width) @ (width, t)
        torch._int_mm(w_j, u_j, out=acc_j)  # a transposed plane is the layout _int_mm is fastest with
    # u - 8: subtract 8 * (the part's sum over its block), exact in int32
    acc = torch.sub(acc, i.sum(-1, dtype=torch.int32).view(n, -1, 1), alpha=codes.bias)
    sd = s[..., None] * codes.scales(rows)[:, None, :, None]  # (n, R, nb, 2, t): s_part d[t, b]
    return (acc.view(n, R, -1, t) * sd.view(n, R, -1, t)).sum(2)


def weighted_sum(p: torch.Tensor, rows: torch.Tensor, codes: BlockCodes, skip: int = 0) -> torch.Tensor:
    """p (n, R, t) f32 over rows (n, t, rb) uint8 -> (n, R, D) f32. The first `skip` positions get
    no weight (q4_hadamard adds its full-precision sinks itself)."""
    n, R, t = p.shape
    w = p[:, :, None] * codes.scales(rows)[:, None]  # (n, R, nb, t): p_t d[t, b]
    if skip:
        w[..., :skip] = 0
    w = w.reshape(n, -1, t)
    # f32 copies of the bytes and their high nibbles: low = byte - 16 high
    u_hi = torch.bmm(w, (rows >> 4).float())  # (n, R * nb, rb)
    u = torch.stack([torch.baddbmm(u_hi, w, rows.float(), beta=-16), u_hi], -1)  # (low, high) pairs
    out = u.view(n, R, -1)[..., codes.pick]  # (n, R, D): element e from its block's row, as in the plane
    return out.view(n, R, -1, 32).sub_(w.view(n, R, -1, t).sum(-1, keepdim=True), alpha=codes.bias).view(n, R, -1)
