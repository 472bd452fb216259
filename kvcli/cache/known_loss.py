"""What a cache choice is known, from measurement, to cost a model family: `kvcli run` and `kvcli serve` warn where
it is more than 1% perplexity, before the first token (issue 41: a user who follows `-ctk q4` on a Qwen2.5 file
should be told, not find out).

Each row is a measured figure (benchmarks/README.md, "Keys less their turning mean", the commands there:
`kvcli perplexity -f wiki.test.raw -c 512 --chunks 20 --sweep ...`, PPL change against the f16 cache). A family is
the architecture, and whether the cache stores keys less their turning mean and scaled for the queries
(kvcli/cache/key_scale.py); rows are found by the choice's K and V types, window and key treatment exactly. A choice
without a row gets no warning (nothing known).
"""

from __future__ import annotations

from typing import NamedTuple

WARN_ABOVE = 1.0  # percent perplexity


class Loss(NamedTuple):
    family: str  # "llama" (SmolLM2-135M), "qwen2" (Qwen2.5-Coder-0.5B)
    type_k: str
    type_v: str
    window: int
    keys_less_bias: bool
    ppl_pct: float  # PPL change against the f16 cache, percent
    kld: float  # mean KLD against the f16 cache
    model: str  # where it was measured
    keys_scaled: bool = False  # keys scaled for the queries (--key-scales)


_SMOL, _QWEN = "SmolLM2-135M-Instruct Q4_1", "Qwen2.5-Coder-0.5B-Instruct Q4_K_M"
KNOWN: tuple[Loss, ...] = (
    Loss("llama", "q4_0", "q4_0", 0, False, 16.9, 0.141, _SMOL),
    Loss("llama", "q4_0", "q4_0", 16, False, 4.4, 0.032, _SMOL),
    Loss("llama", "q4_hadamard", "q4_hadamard", 16, True, 0.43, 0.0032, _SMOL),
    Loss("llama", "tq4", "tq4", 64, True, 0.40, 0.0026, _SMOL),
    Loss("llama", "tq3", "tq3", 128, True, 1.29, 0.0101, _SMOL),
    Loss("llama", "tq3", "tq2", 128, True, 2.31, 0.0185, _SMOL),
    Loss("llama", "tq2", "tq2", 128, True, 6.86, 0.0548, _SMOL),
    Loss("qwen2", "q8_0", "q8_0", 0, False, 3.4, 0.0149, _QWEN),
    Loss("qwen2", "q4_0", "q4_0", 0, False, 191.0, 1.253, _QWEN),
    Loss("qwen2", "q8_0", "q8_0", 0, True, -0.10, 0.00019, _QWEN),
    Loss("qwen2", "q4_hadamard", "q4_hadamard", 16, True, -0.31, 0.0052, _QWEN),
    Loss("qwen2", "tq4", "tq4", 64, True, -0.02, 0.0049, _QWEN),
    Loss("qwen2", "tq3", "tq3", 128, True, 0.32, 0.0174, _QWEN),
    Loss("qwen2", "tq3", "tq2", 128, True, 0.14, 0.0301, _QWEN),
    Loss("qwen2", "tq2", "tq2", 128, True, 5.98, 0.1022, _QWEN),
    # keys less their mean and scaled for the queries (--key-scales auto: the rotated types on this file)
    Loss("qwen2", "q4_hadamard", "q4_hadamard", 16, True, -0.43, 0.0032, _QWEN, True),
    Loss("qwen2", "tq4", "tq4", 64, True, -0.41, 0.0027, _QWEN, True),
    Loss("qwen2", "tq3", "tq3", 128, True, 0.68, 0.0107, _QWEN, True),
    Loss("qwen2", "tq3", "tq2", 128, True, 0.24, 0.0222, _QWEN, True),
    Loss("qwen2", "tq2", "tq2", 128, True, 2.79, 0.0769, _QWEN, True),
    # SmolLM2's rotated types with keys as they come (--key-bias off; the default before their mean was taken off)
    Loss("llama", "q4_hadamard", "q4_hadamard", 16, False, 0.4, 0.0033, _SMOL),
    Loss("llama", "tq4", "tq4", 64, False, 0.4, 0.0026, _SMOL),
    Loss("llama", "tq3", "tq3", 128, False, 1.2, 0.0102, _SMOL),
    Loss("llama", "tq3", "tq2", 128, False, 2.2, 0.0189, _SMOL),
    Loss("llama", "tq2", "tq2", 128, False, 6.9, 0.0576, _SMOL),
    # keys as they come (--key-bias off), at the windows these types had before (10 chunks: issue 41)
    Loss("qwen2", "q4_hadamard", "q4_hadamard", 16, False, 12.4, 0.134, _QWEN),
    Loss("qwen2", "tq4", "tq4", 16, False, 8.2, 0.0946, _QWEN),
    Loss("qwen2", "tq3", "tq3", 64, False, 78.0, 0.654, _QWEN),
    Loss("qwen2", "tq3", "tq2", 64, False, 72.0, 0.616, _QWEN),
)


def known_loss(config, spec, keys_less_bias: bool, keys_scaled: bool = False) -> Loss | None:
    """The measured row for this model's family and cache choice (a resolved kv CacheSpec), or None."""
    if spec.mode != "kv":
        return None
    family = config.arch
    for row in KNOWN:
        if (row.family, row.type_k, row.type_v, row.window, row.keys_less_bias, row.keys_scaled) == (
                family, spec.type_k, spec.type_v, spec.window, keys_less_bias, keys_scaled):
            return row
    return None


def loss_warning(config, spec, keys_less_bias: bool, keys_scaled: bool = False) -> str | None:
    """One line where the choice is known to lose more than WARN_ABOVE percent perplexity on this family."""
    row = known_loss(config, spec, keys_less_bias, keys_scaled)
    if row is None or row.ppl_pct <= WARN_ABOVE:
        return None
    fix = ("; --key-bias on stores keys less their mean" if config.qkv_bias and not keys_less_bias
           and spec.type_k not in ("f16", "f32", "bf16") else "")
    return (f"warning: -ctk {spec.type_k} -ctv {spec.type_v} (window {spec.window}"
            f"{', keys less their mean' if keys_less_bias else ''}{', scaled' if keys_scaled else ''}) "
            f"measured +{row.ppl_pct:g}% "
            f"perplexity (mean KLD {row.kld:g}) against f16 on {row.model}, a {row.family} model like this one{fix}")
