"""A step's slots as one cache: the server's caches (a sequence each) behind the one cache a forward takes
(Transformer.forward_slots), so that a step runs every slot's tokens through the weights once; and one stage's part of
such a step (stage_step, step_logits), as the server runs it alone or over pipeline stages (kvcli/pipeline.py)."""

from __future__ import annotations

import torch


class Slots:
    """Several one-sequence caches as one for Block.forward: a (1, sum n_i, ...) batch whose i-th segment of
    n_i tokens goes to caches[i] at positions[i].., and each cache stores and attends as it would alone (every
    cache type, window and kernel unchanged). The block's projections, norms and MLP run over the whole batch.
    Decode tokens (n_i = 1) of consecutive rows of one cache (KVCache.rows: the server's slots) attend
    as one batch through a view of those rows, each at its own position: one set of ops, not one a slot."""

    def __init__(self, caches: list, positions: list[int], lengths: list[int]):
        self.runs: list[tuple] = []  # (cache, pos, first token, tokens); pos a (k,) tensor for k rows' decode tokens
        group: list[tuple] = []  # decode segments (cache, pos, first token) of consecutive rows of one cache
        a = 0
        for c, p, n in zip(caches, positions, lengths):
            row = n == 1 and getattr(c, "base", None) is not None
            if group and not (row and c.base is group[0][0].base and c.row0 == group[-1][0].row0 + 1):
                self._close(group)
            if row:
                group.append((c, p, a))
            else:
                self.runs.append((c, p, a, n))
            a += n
        self._close(group)
        # a step of decode tokens only, of consecutive rows of one cache: (that cache, the rows' view, their positions
        # (k,) int64), for the compiled decode layer's one call (kvcli/decode_layer.py DecodeLayer.rows); else None
        c, p, _, _ = self.runs[0]
        self.decode_rows = (c.base, c, p) if len(self.runs) == 1 and torch.is_tensor(p) else None

    def _close(self, group: list[tuple]) -> None:
        if len(group) == 1:
            c, p, a = group[0]
            self.runs.append((c, p, a, 1))
        elif group:
            c, _, a = group[0]
            pos = torch.tensor([p for _, p, _ in group], device=c.k.data.device)
            self.runs.append((c.base.rows(c.row0, c.row0 + len(group)), pos, a, len(group)))
        group.clear()

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, x: torch.Tensor,
                  pos: int) -> torch.Tensor:
        """q (1, N, H, D), k/v (1, N, Hkv, D), x (1, N, n_embd) -> (1, N, H * D); pos unused (each segment's own)."""
        out = []
        for c, p, a, n in self.runs:
            if torch.is_tensor(p):  # n sequences, a token each: (n, 1, ...) views
                rows = [t.transpose(0, 1) if n == t.shape[1] else t[0, a : a + n, None] for t in (q, k, v, x)]
                out.append(c.attention(layer, *rows, p).view(1, n, -1))
            else:
                out.append(c.attention(layer, q[:, a : a + n], k[:, a : a + n], v[:, a : a + n], x[:, a : a + n], p))
        return out[0] if len(out) == 1 else torch.cat(out, 1)  # one run (all rows decoding): no copy


def step_tokens(ids: list[list[int]], device) -> torch.Tensor:
    """A step's segments' token ids as one batch row: (1, N) long."""
    return torch.tensor([[t for seg in ids for t in seg]], dtype=torch.long, device=device)


@torch.inference_mode()
def run_step(model, caches: list, ids: list[list[int]], positions: list[int]) -> torch.Tensor:
    """A server step through the whole model in this process: segment i, the tokens ids[i] for caches[i] at
    positions[i].. -> logits (len(ids), vocab) f32 of each segment's last token."""
    lengths = [len(t) for t in ids]
    h = model.tok_embd.rows(step_tokens(ids, model.rot.device))
    return step_logits(model, stage_step(model, caches, positions, lengths, h), lengths)


def stage_step(model, caches: list, positions: list[int], lengths: list[int], h: torch.Tensor) -> torch.Tensor:
    """One model's (or pipeline stage's) part of a server step: h (1, N, n_embd) f32, segment i of lengths[i] tokens
    for caches[i] at positions[i].., through its blocks. One segment: the plain forward (as fast as `kvcli run`)."""
    if len(caches) == 1:
        return model.run_blocks(h, caches[0], positions[0])
    return model.run_slot_blocks(h, Slots(caches, positions, lengths), positions, lengths)


def step_logits(model, h: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The last stage's head over stage_step's h -> logits (len(lengths), vocab) f32 of each segment's last token."""
    if len(lengths) == 1:
        return model.head(h, last_only=True)[0]
    return model.slots_head(h, lengths)
