"""The recent window: each layer's newest N positions kept in f16 beside a quantized store, and
quantized into it only when they leave (KIVI's residual, arXiv 2402.02750). Written once here for
every storage type: a KVCache holds one Ring for K and V, a HiddenCache one for x.

The query at position i reads positions i-N+1..i from the f16 copy and every older one from the
store (kvcli/attention.py, `Recent`), so perplexity's batched prefill sees what decode sees. A
position is quantized exactly once, from its f16 copy, whether it leaves from the ring (decode) or
straight out of a batch longer than the window (prefill): both write the same bytes.

Decode writes in batches: when a position leaves and the store lacks it, it goes in together with
the whole window (the N positions that leave over the next N steps), so a store takes one write of
N + 1 positions every N + 1 steps instead of one small write per step (a write's cost is mostly its
fixed number of ops). What attention reads is unchanged: a position's bytes do not depend on when
they are made, and the store is read only below the window.

A rewind (a chat keeping only a common prefix) can ask for positions whose f16 copy was already
overwritten; they left the window before, so the store holds them and attention reads them there.
How many positions the window keeps per storage type is `Store.default_window` (kvcli/cache/base.py), the
hidden-state cache's included.

The server's slots may be rows of one cache (KVCache.rows), each at its own position: the ring keeps
what it holds and what the store holds per sequence, and `push_rows` takes one decode token per row.
Attention then reads each row's whole ring in slot order (a softmax ignores the order of its keys),
masking the slots outside the positions that row reads here. Every decode token on the CPU goes this
way (KVCache._decode_positions): the ring is read where it lies, in f16, by the decode kernel.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

from kvcli.kernels.layout import Kind, KernelLayout


_F16 = KernelLayout(Kind.F16)  # the ring's elements, as its writer takes them


@dataclass(frozen=True)
class RowsWindow:
    """What `Ring.push_rows` gives attention: ring (B, H, N, D) f16, each row's whole ring in slot order (the
    layer's own, not a copy); masked (B, 1, 1, N), True where a slot holds no position its row reads here; lim
    (B, 1, 1, 1): row b reads the store below lim[b] (the positions lim[b]..pos[b] are here); low, high: the
    smallest and largest lim."""

    ring: torch.Tensor
    masked: torch.Tensor
    lim: torch.Tensor
    low: int
    high: int


class Ring:
    """One window: (L, B, H, N, D) f16, position p in slot p % N. The KV cache keeps K's and V's heads
    side by side in one (H = 2 Hkv: one write per layer), the hidden-state cache x's."""

    row0 = 0  # a `rows` view's first sequence in the ring it was made from
    writer = None  # push_rows' write of f16 vectors (the kernel table's WRITE, bound by the cache); None: torch's

    def __init__(self, n_layers: int, batch: int, n_heads: int, size: int, head_dim: int, device: str = "cpu"):
        self.size, self.batch = size, batch
        self.data = torch.zeros(n_layers, batch, n_heads, size, head_dim, dtype=torch.float16, device=device)
        # per layer and sequence: the positions lo..hi-1 whose f16 copies are here; positions below `stored`
        # are in the store (a `rows` view shares these lists and reads its rows row0..row0+batch-1)
        self.held = [[(0, 0)] * batch for _ in range(n_layers)]
        self.stored = [[0] * batch for _ in range(n_layers)]
        self._masks: dict = {}  # push_rows' masks by (positions, limits): the same for every layer of a step
        self.seqs = torch.arange(batch, device=device)  # for push_rows' per-row writes
        self._halves: dict = {}  # per layer: the CPU's numpy views of the ring's two halves (push_rows' writes)

    @staticmethod
    def nbytes_for(n_layers: int, batch: int, width: int, size: int) -> int:
        """The bytes of a window of `size` positions of `width` (heads x head size) f16 elements."""
        return n_layers * batch * size * width * 2

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def device(self) -> torch.device:
        return self.data.device

    def kernel_layout(self) -> KernelLayout:
        return _F16

    def rows(self, start: int, stop: int) -> Ring:
        """Sequences start..stop-1 as a ring of their own over the same bytes and bookkeeping (a view)."""
        view = copy.copy(self)
        view.data, view.batch, view.row0 = self.data[:, start:stop], stop - start, self.row0 + start
        view._masks, view.seqs, view._halves = {}, torch.arange(view.batch, device=self.data.device), {}
        return view

    def _slots(self, start: int, end: int) -> list[tuple[int, int]]:
        """The slot ranges of positions start..end-1 (at most N of them), in order: one, or two where they wrap."""
        s, n = start % self.size, end - start
        if s + n <= self.size:
            return [(s, s + n)] if n else []
        return [(s, self.size), (0, s + n - self.size)]

    def _reads_from(self, layer: int, row: int, pos: int) -> int:
        """a: a batch at pos reads positions a..pos-1 from here (those still held; a rewind may have lost some)."""
        lo, hi = self.held[layer][row]
        return min(pos, max(lo, pos - self.size)) if pos <= hi else pos

    def push(self, layer: int, x: torch.Tensor, pos: int) -> tuple[torch.Tensor | None, int, torch.Tensor, int]:
        """Write x (B, T, H, D), positions pos..pos+T-1 of every row -> (write, w0, recent, r0):
        write (B, m, H, D) f32: positions w0..w0+m-1 for the store now (None if none): those that leave the
        window with this batch and are not in the store yet, and at decode (T = 1) the window with them;
        recent (B, H, n, D) f32: positions r0..pos+T-1 in f16, what this batch's queries may read here."""
        N, T, ring = self.size, x.shape[1], self.data[layer]  # ring (B, H, N, D)
        rows = slice(self.row0, self.row0 + self.batch)  # all alike: row0's bookkeeping stands for them
        a = self._reads_from(layer, self.row0, pos)  # positions a..pos-1 are read from here
        new = x.transpose(1, 2).to(torch.float16)  # (B, H, T, D)
        span = torch.cat([ring[:, :, s0:s1] for s0, s1 in self._slots(a, pos)] + [new], 2).float()  # a..pos+T-1
        keep = max(pos, pos + T - N)  # the newest N positions stay
        i = keep - pos
        for s0, s1 in self._slots(keep, pos + T):
            ring[:, :, s0:s1] = new[:, :, i : i + s1 - s0]
            i += s1 - s0
        self.held[layer][rows] = [(max(a, pos + T - N), pos + T)] * self.batch
        r0 = max(a, pos - N + 1)
        recent = span[:, :, r0 - a :]
        # positions below pos + T - N have left (their slots now hold new ones); a rewind drops what the
        # store held from pos on
        done, gone = min(self.stored[layer][self.row0], pos), pos + T - N
        if gone <= done:
            self.stored[layer][rows] = [done] * self.batch
            return None, done, recent, r0
        w0, w1 = max(a, done), pos + 1 if T == 1 else gone  # decode: with the window, leaving over N steps
        self.stored[layer][rows] = [w1] * self.batch
        return span[:, :, w0 - a : w1 - a].transpose(1, 2).contiguous(), w0, recent, r0

    def push_rows(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                  pos: list[int]) -> tuple[list[tuple[int, torch.Tensor, int]], RowsWindow]:
        """Decode: k, v (B, 1, H / 2, D), row b's token at position pos[b] (their heads side by side are the ring's)
        -> (writes, window): writes, (b, write, w0) per row that writes to the store now, as `push` (write (1, m, H,
        D) f32: positions w0.. of row b); window: what the rows' queries read here (RowsWindow)."""
        N, ring = self.size, self.data[layer]
        writes, lims = [], []
        for b, p in enumerate(pos):
            row = self.row0 + b
            a = self._reads_from(layer, row, p)
            lims.append(max(a, p - N + 1))
            self.held[layer][row] = (max(a, p + 1 - N), p + 1)
            done = min(self.stored[layer][row], p)
            if p + 1 - N <= done:
                self.stored[layer][row] = done
                continue
            w0 = max(a, done)  # positions w0..p-1 leave over the next steps: into the store with p now
            # p from its f16 copy, as in `push`: a position is quantized from what the window holds
            new = torch.cat([k[b : b + 1, 0], v[b : b + 1, 0]], 1).to(torch.float16)[:, :, None]  # (1, H, 1, D)
            span = [ring[b : b + 1, :, s0:s1] for s0, s1 in self._slots(w0, p)] + [new]
            writes.append((b, torch.cat(span, 2).transpose(1, 2).float(), w0))
            self.stored[layer][row] = p + 1
        self._put(layer, ring, k, v, pos)  # after the writes read the slots
        masked, lim, _ = self._mask(pos, lims)
        return writes, RowsWindow(ring, masked, lim, min(lims), max(lims))

    def _mask(self, pos: list[int], lims: list[int]) -> tuple:
        """_rows_mask's, and masked as a CPU kernel reads it ((B, N) numpy, or None off the CPU), made once a step (the
        first layer's) and kept for the others."""
        key = (tuple(pos), tuple(lims))
        if key not in self._masks:
            masked, lim = self._rows_mask(pos, lims, self.data.device)
            flat = masked.view(len(pos), -1).numpy() if masked.device.type == "cpu" else None
            self._masks = {key: (masked, lim, flat)}  # one step's: the newest only
        return self._masks[key]

    def step_one(self, layer: int, p: int) -> tuple[int, torch.Tensor] | None:
        """push_rows' bookkeeping for one sequence's token at p (row row0) where it writes nothing to the store:
        -> (lim, masked (1, N) numpy), the caller then puts the token in slot p % N itself (a compiled decode
        layer, kvcli/decode_layer.py); None, and nothing changed, where positions are due in the store (push_rows)."""
        row = self.row0
        a = self._reads_from(layer, row, p)
        done = min(self.stored[layer][row], p)
        if p + 1 - self.size > done:
            return None
        lim = max(a, p - self.size + 1)
        self.held[layer][row] = (max(a, p + 1 - self.size), p + 1)
        self.stored[layer][row] = done
        return lim, self._mask([p], [lim])[2]

    def halves(self, layer: int) -> tuple:
        """A layer's ring as f16 bits (numpy, made once per layer): (K's heads, V's heads (B, H / 2, N, D), both)."""
        views = self._halves.get(layer)
        if views is None:
            bits = self.data[layer].view(torch.uint16)
            h = bits.shape[1] // 2
            views = self._halves[layer] = (bits[:, :h].numpy(), bits[:, h:].numpy(), bits.numpy())
        return views

    def _put(self, layer: int, ring: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: list[int]) -> None:
        """Row b's k, v (B, 1, H / 2, D) f32 into its slot pos[b] % N as f16: through the bound writer over the ring's
        halves where there is one (the same rounding as torch's), else one index write."""
        if self.writer is not None:
            halves = self.halves(layer)[:2]
            slots = np.array([p % self.size for p in pos], np.int64)
            self.writer(_F16, halves, (k[:, 0], v[:, 0]), np.arange(len(pos), dtype=np.int64), slots)
            return
        slots = torch.tensor([p % self.size for p in pos], device=ring.device)
        ring[self.seqs, :, slots] = torch.cat([k, v], 2)[:, 0].to(torch.float16)

    def _rows_mask(self, pos: list[int], lims: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
        """(masked (B, 1, 1, N), lim (B, 1, 1, 1)): slot s of row b holds position q = p - (p - s) mod N, read
        here where q >= lim[b] (q <= p always; a young row's unwritten slots have q < 0)."""
        N = self.size
        masked = [[p - (p - s) % N < lo for s in range(N)] for p, lo in zip(pos, lims)]
        B = len(pos)
        return (torch.tensor(masked, device=device).view(B, 1, 1, N),
                torch.tensor(lims, device=device).view(B, 1, 1, 1))


class Recent:
    """A batch's f16 window (kvcli/cache/window.py), as attention reads it: k and v (B, Hkv, n, D) f32
    of positions start..start+n-1 (the batch's last position is start+n-1), in the model's space. The
    query at position i reads positions max(i - size + 1, start)..i from here, older ones from the store.
    Rows at their own positions (a (B,) pos at decode, kvcli/cache/window.py `push_rows`): k and v hold each
    row's whole ring in slot order (n = size); masked (B, 1, 1, n) is True where row b reads no slot, and
    row b reads the store below lim[b] (B, 1, 1, 1); start and high: the smallest and largest lim. There
    kv16 is the ring itself, (B, 2 Hkv, n, D) f16, K's heads then V's: a kernel reads it as it is, and k and v
    are widened from it only when asked for (the reference's path)."""

    def __init__(self, k: torch.Tensor | None, v: torch.Tensor | None, start: int, size: int,
                 masked: torch.Tensor | None = None, lim: torch.Tensor | None = None, high: int = 0,
                 kv16: torch.Tensor | None = None):
        self._k, self._v, self.start, self.size = k, v, start, size
        self.masked, self.lim, self.high, self.kv16 = masked, lim, high, kv16

    @property
    def k(self) -> torch.Tensor:
        if self._k is None:
            self._widen()
        return self._k

    @property
    def v(self) -> torch.Tensor:
        if self._v is None:
            self._widen()
        return self._v

    def _widen(self) -> None:
        kv = self.kv16.float()
        h = kv.shape[1] // 2
        self._k, self._v = kv[:, :h], kv[:, h:]
