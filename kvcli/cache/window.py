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
How many positions the window keeps per storage type is `Store.default_window` (kvcli/cache/base.py), and
for the hidden-state cache `Store.default_hidden_window` where a type sets one.
"""

from __future__ import annotations

import torch


class Ring:
    """One window: (L, B, H, N, D) f16, position p in slot p % N. The KV cache keeps K's and V's heads
    side by side in one (H = 2 Hkv: one write per layer), the hidden-state cache x's."""

    def __init__(self, n_layers: int, batch: int, n_heads: int, size: int, head_dim: int, device: str = "cpu"):
        self.size = size
        self.data = torch.zeros(n_layers, batch, n_heads, size, head_dim, dtype=torch.float16, device=device)
        self.held = [(0, 0)] * n_layers  # per layer: the positions lo..hi-1 whose f16 copies are here
        self.stored = [0] * n_layers  # per layer: positions below it are in the store

    @staticmethod
    def nbytes_for(n_layers: int, batch: int, width: int, size: int) -> int:
        """The bytes of a window of `size` positions of `width` (heads x head size) f16 elements."""
        return n_layers * batch * size * width * 2

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def _slots(self, start: int, end: int) -> list[tuple[int, int]]:
        """The slot ranges of positions start..end-1 (at most N of them), in order: one, or two where they wrap."""
        s, n = start % self.size, end - start
        if s + n <= self.size:
            return [(s, s + n)] if n else []
        return [(s, self.size), (0, s + n - self.size)]

    def push(self, layer: int, x: torch.Tensor, pos: int) -> tuple[torch.Tensor | None, int, torch.Tensor, int]:
        """Write x (B, T, H, D), positions pos..pos+T-1 -> (write, w0, recent, r0):
        write (B, m, H, D) f32: positions w0..w0+m-1 for the store now (None if none): those that leave the
        window with this batch and are not in the store yet, and at decode (T = 1) the window with them;
        recent (B, H, n, D) f32: positions r0..pos+T-1 in f16, what this batch's queries may read here."""
        N, T, ring = self.size, x.shape[1], self.data[layer]  # ring (B, H, N, D)
        lo, hi = self.held[layer]
        a = min(pos, max(lo, pos - N)) if pos <= hi else pos  # positions a..pos-1 are read from here
        new = x.transpose(1, 2).to(torch.float16)  # (B, H, T, D)
        span = torch.cat([ring[:, :, s0:s1] for s0, s1 in self._slots(a, pos)] + [new], 2).float()  # a..pos+T-1
        keep = max(pos, pos + T - N)  # the newest N positions stay
        i = keep - pos
        for s0, s1 in self._slots(keep, pos + T):
            ring[:, :, s0:s1] = new[:, :, i : i + s1 - s0]
            i += s1 - s0
        self.held[layer] = (max(a, pos + T - N), pos + T)
        r0 = max(a, pos - N + 1)
        recent = span[:, :, r0 - a :]
        # positions below pos + T - N have left (their slots now hold new ones); a rewind drops what the
        # store held from pos on
        done, gone = min(self.stored[layer], pos), pos + T - N
        if gone <= done:
            self.stored[layer] = done
            return None, done, recent, r0
        w0, w1 = max(a, done), pos + 1 if T == 1 else gone  # decode: with the window, leaving over N steps
        self.stored[layer] = w1
        return span[:, :, w0 - a : w1 - a].transpose(1, 2).contiguous(), w0, recent, r0
