"""The Llama decoder: RMSNorm, RoPE (kvcli/rope.py), GQA attention, SwiGLU; Qwen2/Qwen3 as switches of it.

It knows nothing of cache formats: each block hands q, its new K/V and its normed input x
to `cache.attention`, which stores what its format keeps (K/V, or x for the hidden-state
cache) and returns the attention output over what the cache holds.
The residual stream, norms, RoPE and softmax run in f32; matrices are resident forms
(kvcli/weights.py: packed int4/int8 codes or dense tensors) whose `matmul` takes and returns f32.
Per architecture (kvcli.config.ARCH_TRAITS, as llama.cpp's graphs): qwen2 adds attn_{q,k,v}.bias,
qwen3 RMS-normalises each Q and K head (attn_{q,k}_norm) before RoPE; both rotate NEOX pairs.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from kvcli import decode_layer
from kvcli.cache.base import Cache
from kvcli.config import ModelConfig
from kvcli.rope import rope_, rope_table
from kvcli.swiglu import swiglu
from kvcli.weights import Dense, cat, rms_norm


def _form(w, dtype: torch.dtype):
    """A resident form as given, or a plain tensor as Dense at the compute dtype."""
    return w if hasattr(w, "matmul") else Dense(w.to(dtype))


# A layer's matrices one product takes fused (wqkv, w_gate_up), in their order: kvcli.llama loads each group's
# tiles into one buffer (weights.joined_buffers), so that joining them is a view.
FUSED = (("attn_q.weight", "attn_k.weight", "attn_v.weight"), ("ffn_gate.weight", "ffn_up.weight"))


class Block(nn.Module):
    def __init__(self, c: ModelConfig, w: dict, i: int, dtype: torch.dtype, layer: int | None = None):
        """i: the file's layer (its tensors' names); layer: the cache's (a pipeline stage's own count, kvcli/pipeline.py;
        i where None)."""
        super().__init__()
        p = f"blk.{i}."
        self.c, self.layer = c, i if layer is None else layer
        # Buffers, not parameters: no autograd, and .to(device) moves them.
        self.register_buffer("attn_norm", w[p + "attn_norm.weight"].float(), persistent=False)
        self.register_buffer("ffn_norm", w[p + "ffn_norm.weight"].float(), persistent=False)
        # Fused projections: one product for q,k,v and one for gate,up (fewer ops per token);
        # forms live on their device already (kvcli.llama loads them there). The matrices are taken
        # out of w, so that each layer's parts are freed once joined (load peak: one layer's copy).
        qkv, gate_up = FUSED
        self.wqkv = cat([_form(w.pop(p + n), dtype) for n in qkv])
        self.wo = _form(w.pop(p + "attn_output.weight"), dtype)
        self.w_gate_up = cat([_form(w.pop(p + n), dtype) for n in gate_up])
        self.w_down = _form(w.pop(p + "ffn_down.weight"), dtype)
        self.dtype = dtype
        # qwen2: one f32 bias for the fused q,k,v rows; qwen3: each Q head's and K head's norm weight, (H + Hkv, D)
        bqkv = torch.cat([w.pop(p + f"attn_{n}.bias").float() for n in "qkv"]) if c.qkv_bias else None
        self.register_buffer("bqkv", bqkv, persistent=False)
        qk_norm = torch.cat([w.pop(p + "attn_q_norm.weight").float().expand(c.n_heads, -1),
                             w.pop(p + "attn_k_norm.weight").float().expand(c.n_kv_heads, -1)]) if c.qk_norm else None
        self.register_buffer("qk_norm", qk_norm, persistent=False)
        self._plan, self._plan_for = None, None  # decode_plan's, and a weak reference to the cache it is for
        self._halves = None  # decode_plan(None)'s (False: none)
        self._rows_plan, self._rows_for = None, None  # decode_plan(cache, rows=True)'s, and its cache's weak reference

    def forms(self) -> dict:
        return {"wqkv": self.wqkv, "wo": self.wo, "w_gate_up": self.w_gate_up, "w_down": self.w_down}

    def decode_plan(self, cache: Cache | None, rows: bool = False):
        """This block's compiled decode layer over `cache` (kvcli/decode_layer.py) or None, made once per cache; for
        cache None, its two compiled halves around any cache's attention, made once; rows: over rows of `cache`, a
        server step's decode tokens (DecodeLayer.rows)."""
        if rows:
            if self._rows_for is None or self._rows_for() is not cache:
                self._rows_plan, self._rows_for = decode_layer.plan(self, cache, rows=True), weakref.ref(cache)
            return self._rows_plan
        if cache is None:
            if self._halves is None:
                self._halves = decode_layer.plan(self) or False
            return self._halves or None
        if self._plan_for is None or self._plan_for() is not cache:
            self._plan, self._plan_for = decode_layer.plan(self, cache), weakref.ref(cache)
        return self._plan

    def forward(self, h: torch.Tensor, cache: Cache, pos: int, rot: torch.Tensor) -> torch.Tensor:
        c = self.c
        B, T, _ = h.shape  # h: (B, T, n_embd) f32 residual stream
        if B == 1 and T <= decode_layer.ROWS and rot.shape == (T, c.head_dim // 2):  # a few tokens: compiled
            rows = getattr(cache, "decode_rows", None)  # a server step of decode tokens of a cache's rows (Slots)
            if rows is not None:
                run = self.decode_plan(rows[0], rows=True)
                if run is not None:
                    return run.rows(h, rows[1], rows[2], rot)
            one = T == 1 and type(pos) is int and pos < getattr(cache, "n_ctx", 0)  # one sequence's decode token
            run = self.decode_plan(cache if one else None)
            if run is not None:
                return run(h, cache, pos, rot)
        x = rms_norm(h, self.attn_norm, c.rms_eps)
        qkv = self.wqkv.matmul(x)  # (B, T, (H + 2*Hkv) * D)
        if self.bqkv is not None:  # qwen2
            qkv.add_(self.bqkv)
        qkv = qkv.view(B, T, c.n_heads + 2 * c.n_kv_heads, c.head_dim)  # (B, T, H + 2*Hkv, D)
        qk = qkv[:, :, : c.n_heads + c.n_kv_heads]
        if self.qk_norm is not None:  # qwen3: each q and k head RMS-normed over its D dims
            qk.copy_(F.rms_norm(qk, (c.head_dim,), eps=c.rms_eps) * self.qk_norm)
        rope_(qk, rot, c.rope_neox)  # q and k rotated where they lie: no copies
        q, k, v = qkv.split((c.n_heads, c.n_kv_heads, c.n_kv_heads), 2)  # (B, T, H, D), (B, T, Hkv, D) x 2
        o = cache.attention(self.layer, q, k, v, x, pos)  # (B, T, H * D) f32
        h = h + self.wo.matmul(o)
        x = rms_norm(h, self.ffn_norm, c.rms_eps)
        return h + self.w_down.matmul(swiglu(self.w_gate_up.matmul(x)))  # silu(gate) * up


class Transformer(nn.Module):
    def __init__(self, c: ModelConfig, weights: dict, dtype: torch.dtype, n_ctx: int, layers: range | None = None,
                 first: bool = True, last: bool = True):
        """weights: GGUF name -> resident form (kvcli.weights) for matrices, or a plain tensor (a
        matrix becomes Dense at `dtype`); norms and rope_freqs are plain tensors, kept f32. The blocks'
        matrices are taken out of it (see Block). A pipeline stage (kvcli/pipeline.py) holds the file's `layers`
        only (numbered from 0 for its cache), the embedding if `first`, the norm and head if `last`."""
        super().__init__()
        self.c, self.dtype = c, dtype
        self.layers = range(c.n_layers) if layers is None else layers
        self.first, self.last = first, last
        # Tied embeddings: without output.weight the head reuses token_embd (as llama.cpp does).
        out = weights.get("output.weight")
        self.untied = out is not None
        embd = _form(weights["token_embd.weight"], dtype) if first or (last and out is None) else None
        self.tok_embd = embd if first else None
        self.output = (embd if out is None else _form(out, dtype)) if last else None
        norm = weights["output_norm.weight"].float() if last else None
        self.register_buffer("output_norm", norm, persistent=False)
        self.blocks = nn.ModuleList(Block(c, weights, i, dtype, j) for j, i in enumerate(self.layers))
        self.register_buffer("rot", rope_table(c, n_ctx, weights.get("rope_freqs.weight")), persistent=False)

    def forms(self) -> dict:
        """Every resident matrix by a name (the tied head once): what `weight_bytes` must count."""
        out = {"tok_embd": self.tok_embd} if self.tok_embd is not None else {}
        if self.output is not None and self.output is not self.tok_embd:
            out["output"] = self.output
        return out | {f"blk.{i}.{k}": f for i, b in zip(self.layers, self.blocks) for k, f in b.forms().items()}

    def weight_bytes(self) -> int:
        """Resident bytes of the weights: every form plus the f32 norms."""
        norms = sum(b.nbytes for b in self.buffers() if b is not self.rot)
        return sum(f.nbytes for f in self.forms().values()) + norms

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: Cache, pos: int, last_only: bool = False,
                from_row: int = 0) -> torch.Tensor:
        """tokens (B, T) at positions pos..pos+T-1 -> logits (B, T or 1, vocab) f32; from_row: of rows from_row..T-1
        only (B, T - from_row, vocab)."""
        return self.head(self.run_blocks(self.tok_embd.rows(tokens), cache, pos), last_only, from_row)

    def run_blocks(self, h: torch.Tensor, cache: Cache, pos: int) -> torch.Tensor:
        """The residual stream h (B, T, n_embd) f32 at positions pos..pos+T-1 through this model's blocks."""
        rot = self.rot[pos : pos + h.shape[1]]
        for block in self.blocks:
            h = block.forward(h, cache, pos, rot)  # (not nn.Module's __call__: no hooks here, a few us a layer less)
        return h

    def head(self, h: torch.Tensor, last_only: bool = False, from_row: int = 0) -> torch.Tensor:
        """The last block's h (B, T, n_embd) -> logits (B, T or 1 or T - from_row, vocab) f32."""
        if last_only:
            h = h[:, -1:]
        elif from_row:
            h = h[:, from_row:]
        h = rms_norm(h, self.output_norm, self.c.rms_eps)
        return self.output.matmul(h)

    @torch.inference_mode()
    def forward_slots(self, ids: list[list[int]], cache, positions: list[int]) -> torch.Tensor:
        """One step of several independent sequences (llama-server's one batch per step): ids[i], tokens appended
        to the i-th sequence at positions[i].., a prompt chunk or one decode token -> logits (len(ids), vocab) f32
        of each one's last token. cache takes the (1, N) batch of every segment and hands each to its own
        sequence's cache (kvcli.serve.slots.Slots). All but attention runs once over every token (the weights are
        read once a step)."""
        lengths = [len(t) for t in ids]
        tokens = torch.tensor([[t for seg in ids for t in seg]], dtype=torch.long, device=self.rot.device)  # (1, N)
        return self.slots_head(self.run_slot_blocks(self.tok_embd.rows(tokens), cache, positions, lengths), lengths)

    def run_slot_blocks(self, h: torch.Tensor, cache, positions: list[int], lengths: list[int]) -> torch.Tensor:
        """forward_slots' blocks: h (1, N, n_embd) f32 of every segment's tokens through this model's blocks; RoPE
        takes each token's own position (rows of self.rot)."""
        where = torch.tensor([p + j for p, n in zip(positions, lengths) for j in range(n)], device=self.rot.device)
        rot = self.rot[where]  # (N, D/2)
        for block in self.blocks:
            h = block(h, cache, 0, rot)
        return h

    def slots_head(self, h: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """forward_slots' head: the last block's h (1, N, n_embd) -> logits (len(lengths), vocab) f32 of each
        segment's last token."""
        h = h[:, torch.tensor(lengths, device=h.device).cumsum(0) - 1]  # (1, n, n_embd)
        h = rms_norm(h, self.output_norm, self.c.rms_eps)
        return self.output.matmul(h)[0]


def dtype_from_name(name: str) -> torch.dtype:
    return {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[name]

