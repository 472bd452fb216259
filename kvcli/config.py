"""ModelConfig: the decoder's hyper-parameters, read from the `{arch}.*` keys of a GGUF file."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from kvcli.errors import KvcliError

SUPPORTED_ARCHITECTURES = ("llama",)


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
    rope_scaling: str = "none"  # none | linear (positions divided by rope_scale_factor)
    rope_scale_factor: float = 1.0

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
        if scaling not in ("none", "linear") and factor != 1.0:
            raise KvcliError(f"rope scaling {scaling!r} is not supported (kvcli supports none, linear)")
        return cls(
            arch=arch,
            n_layers=int(key("block_count")),
            n_embd=n_embd,
            n_ff=int(key("feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            vocab_size=int(meta.get(f"{arch}.vocab_size", vocab_size)),
            context_length=int(key("context_length", 4096)),
            rms_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_base=float(key("rope.freq_base", 10000.0)),
            rope_scaling="linear" if scaling == "linear" and factor != 1.0 else "none",
            rope_scale_factor=factor if scaling == "linear" else 1.0,
        )
