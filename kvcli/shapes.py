"""Published Llama-family configurations, for speed and memory runs with random weights.

A synthetic model is never used for fidelity: every output that comes from one says so.
"""

from __future__ import annotations


import torch

from kvcli.config import ModelConfig
from kvcli.errors import KvcliError

_COMMON = dict(arch="llama", rms_eps=1e-5)
SHAPES: dict[str, dict] = {
    # Llama 2 (Touvron et al., 2023): MHA
    "llama2-7b": dict(n_layers=32, n_embd=4096, n_ff=11008, n_heads=32, n_kv_heads=32, head_dim=128,
                      vocab_size=32000, context_length=4096, rope_base=10000.0),
    "llama2-13b": dict(n_layers=40, n_embd=5120, n_ff=13824, n_heads=40, n_kv_heads=40, head_dim=128,
                       vocab_size=32000, context_length=4096, rope_base=10000.0),
    # Llama 3 8B and Mistral 7B: GQA with 8 KV heads
    "llama3-8b": dict(n_layers=32, n_embd=4096, n_ff=14336, n_heads=32, n_kv_heads=8, head_dim=128,
                      vocab_size=128256, context_length=8192, rope_base=500000.0),
    "mistral-7b": dict(n_layers=32, n_embd=4096, n_ff=14336, n_heads=32, n_kv_heads=8, head_dim=128,
                       vocab_size=32000, context_length=32768, rope_base=10000.0),
    # SmolLM2-135M's own shape, random weights: a quick check of the synthetic path
    "smollm2-135m": dict(n_layers=30, n_embd=576, n_ff=1536, n_heads=9, n_kv_heads=3, head_dim=64,
                         vocab_size=49152, context_length=8192, rope_base=100000.0),
}


def shape_config(name: str) -> ModelConfig:
    if name not in SHAPES:
        raise KvcliError(f"unknown --shape {name!r}; choose one of: {', '.join(SHAPES)}")
    return ModelConfig(**_COMMON, **SHAPES[name])


def random_weights(c: ModelConfig, dtype: torch.dtype, device: str, seed: int = 0):
    """Yield (GGUF tensor name, tensor) with N(0, 0.02) matrices and unit norms, made on `device`
    one at a time (a 7B model is never built twice in host memory)."""
    from kvcli.gguf_file import expected_shapes

    g = torch.Generator(device=device).manual_seed(seed)
    for name, shape in expected_shapes(c).items():
        if len(shape) == 1:
            yield name, torch.ones(shape, device=device)
        else:
            yield name, torch.randn(shape, generator=g, device=device, dtype=dtype) * 0.02


# The ggml type a synthetic model's matrices stand for: --weights native keeps them as 4-bit codes in
# the device's form for Q4_0 (the common 4-bit case), so a --shape run measures packed weights.
SYNTHETIC_TYPE = "Q4_0"


def synthetic_types(c: ModelConfig) -> dict[str, str]:
    """GGUF tensor name -> the ggml type it stands for in a synthetic model (matrices Q4_0, norms F32)."""
    from kvcli.gguf_file import expected_shapes

    return {name: SYNTHETIC_TYPE if len(shape) > 1 else "F32" for name, shape in expected_shapes(c).items()}


def random_forms(c: ModelConfig, weights: str, dtype: str, device: str, seed: int = 0):
    """Yield (GGUF tensor name, resident form, or a unit norm) of a synthetic model, made on `device`
    one at a time: under --weights native each matrix as random 4-bit codes in the device's form for
    SYNTHETIC_TYPE (kvcli.weights.random_int4, or random_q4_0 where the CPU keeps the file's blocks: no quantizing,
    a random model's values do not matter),
    else random_weights' matrices, dense at the chosen dtype."""
    from kvcli.gguf_file import expected_shapes
    from kvcli.model import dtype_from_name
    from kvcli.weights import Dense, random_int4, random_q4_0, resident_form

    form = resident_form(SYNTHETIC_TYPE, weights, dtype, device)  # each matrix: random_q4_0 keeps x8 to whole tiles
    if form not in ("int4", "int4_cuda", "q4_0", "q4_0x8"):  # dense: f16 / f32 weights, or no packed form here
        for name, w in random_weights(c, dtype_from_name(form), device, seed):
            yield name, Dense(w) if w.dim() > 1 else w
        return
    g = torch.Generator(device=device).manual_seed(seed)
    for name, shape in expected_shapes(c).items():
        if len(shape) == 1:
            yield name, torch.ones(shape, device=device)
        else:
            q4_0 = form if shape[0] % 8 == 0 else "q4_0"
            yield name, random_q4_0(*shape, g, q4_0) if form.startswith("q4_0") else random_int4(form, *shape, g, dtype)


def weight_bytes(c: ModelConfig, dtype: str, untied_output: bool = False, weights: str = "native",
                 types: dict[str, str] | None = None, device: str = "cpu") -> int:
    """The decoder's weights in memory as Llama holds them: each matrix in its resident form
    (kvcli.weights.resident_form of its GGUF type; types: name -> ggml type name, synthetic_types for
    a synthetic model, None for F32 matrices), norms f32."""
    return sum(resident_weight_bytes(c, dtype, untied_output, weights, types, device).values())


def resident_weight_bytes(c: ModelConfig, dtype: str, untied_output: bool = False, weights: str = "native",
                          types: dict[str, str] | None = None, device: str = "cpu") -> dict[str, int]:
    """GGUF tensor name -> its resident bytes (see weight_bytes)."""
    from kvcli.gguf_file import expected_shapes
    from kvcli.weights import resident_bytes, resident_form

    shapes = expected_shapes(c) | ({"output.weight": (c.vocab_size, c.n_embd)} if untied_output else {})
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            out[name] = 4 * shape[0]
        else:
            ggml = types.get(name, "F32") if types else "F32"
            out[name] = resident_bytes(resident_form(ggml, weights, dtype, device, shape[0]), *shape)
    return out
