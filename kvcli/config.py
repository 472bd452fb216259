"""ModelConfig: the decoder's hyper-parameters, read from the `{arch}.*` keys of a GGUF file."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from kvcli.errors import KvcliError

# Each architecture kvcli runs is Llama's decoder with these switches (llama.cpp's llm_build_qwen2/qwen3):
# rope_neox: RoPE rotates dims (i, i + D/2) (LLAMA_ROPE_TYPE_NEOX; no Q/K row permutation in the file);
# qkv_bias: attn_{q,k,v}.bias added to the projections; qk_norm: RMSNorm of each Q and K head before RoPE.
ARCH_TRAITS = {
    "llama": dict(rope_neox=False, qkv_bias=False, qk_norm=False),
    "qwen2": dict(rope_neox=True, qkv_bias=True, qk_norm=False),
    "qwen3": dict(rope_neox=True, qkv_bias=False, qk_norm=True),
}
SUPPORTED_ARCHITECTURES = tuple(ARCH_TRAITS)
ROPE_SCALINGS = ("none", "linear", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    n_embd: int
    n_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_base: float
    rope_scaling: str = "none"  # none | linear (positions divided by rope_scale_factor) | yarn
    rope_scale_factor: float = 1.0
    rope_neox: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    # YaRN (arXiv 2309.00071) as ggml's rope_yarn: frequencies ramp from extrapolated (dims rotating more than
    # beta_fast times in the original context) to interpolated (fewer than beta_slow); cos/sin times mscale.
    yarn_orig_ctx: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_ext_factor: float = 1.0
    yarn_mscale: float = 1.0

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def n_groups(self) -> int:
        """Query heads per KV head (GQA group size; 1 for MHA)."""
        return self.n_heads // self.n_kv_heads

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], vocab_size: int) -> "ModelConfig":
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise KvcliError(f"unsupported architecture {arch!r} (kvcli runs: {', '.join(SUPPORTED_ARCHITECTURES)})")

        def key(name: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{name}", default)
            if value is None:
                raise KvcliError(f"GGUF metadata lacks {arch}.{name}")
            return value

        n_embd = int(key("embedding_length"))
        n_heads = int(key("attention.head_count"))
        n_kv_heads = int(key("attention.head_count_kv", n_heads))
        if n_heads <= 0 or n_kv_heads <= 0 or n_heads % n_kv_heads:
            raise KvcliError(f"bad head counts: {n_heads} query heads, {n_kv_heads} KV heads")
        head_dim = int(key("attention.key_length", n_embd // n_heads))
        rope_dim = int(key("rope.dimension_count", head_dim))
        if rope_dim != head_dim:
            raise KvcliError(f"partial RoPE ({rope_dim} of {head_dim} dims) is not supported")
        scaling = str(meta.get(f"{arch}.rope.scaling.type", "none"))
        factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
        if scaling not in ROPE_SCALINGS:
            raise KvcliError(f"rope scaling {scaling!r} is not supported (kvcli supports {', '.join(ROPE_SCALINGS)})")
        if factor == 0.0:  # llama.cpp reads a 0 factor as none
            factor = 1.0
        context_length = int(key("context_length", 4096))
        yarn = {}
        if scaling == "yarn" and factor != 1.0:
            # llama.cpp's defaults (llama-hparams.h, llama-context.cpp): original context = the trained one;
            # beta fast 32, slow 1, ext factor 1; mscale (1 + 0.1 ln factor) times rope.scaling.attn_factor.
            # llama.cpp reads none of the yarn_* keys; convert writes them only where config.json sets
            # them, with Hugging Face's meaning (yarn_attn_factor replaces 1 + 0.1 ln factor).
            mscale = float(meta.get(f"{arch}.rope.scaling.yarn_attn_factor", 1.0 + 0.1 * math.log(factor)))
            yarn = dict(yarn_orig_ctx=int(meta.get(f"{arch}.rope.scaling.original_context_length", context_length)),
                        yarn_beta_fast=float(meta.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
                        yarn_beta_slow=float(meta.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
                        yarn_ext_factor=float(meta.get(f"{arch}.rope.scaling.yarn_ext_factor", 1.0)),
                        yarn_mscale=mscale * float(meta.get(f"{arch}.rope.scaling.attn_factor", 1.0)))
        return cls(
            arch=arch,
            n_layers=int(key("block_count")),
            n_embd=n_embd,
            n_ff=int(key("feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            vocab_size=int(meta.get(f"{arch}.vocab_size", vocab_size)),
            context_length=context_length,
            rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_base=float(key("rope.freq_base", 10000.0)),
            rope_scaling=scaling if factor != 1.0 else "none",
            rope_scale_factor=factor if scaling != "none" else 1.0,
            **ARCH_TRAITS[arch],
            **yarn,
        )
