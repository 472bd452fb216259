"""GGUF file -> ModelConfig + dequantized weights, through gguf-py (no hand-written parsing).

Tensor names and shapes follow llama.cpp's llama layout. gguf-py lists a tensor's shape in
ggml order (ne0 = columns first); torch wants (rows, cols), so shapes are reversed here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcli.config import ModelConfig
from kvcli.errors import KvcliError

# Errors gguf-py and numpy raise on malformed input; anything else is a bug and should show.
_READ_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, EOFError, UnicodeDecodeError, OSError)


@dataclass
class GGUFModel:
    path: str
    metadata: dict[str, Any]
    config: ModelConfig
    tensors: dict[str, Any]  # name -> gguf.ReaderTensor (memory-mapped, not yet dequantized)

    def weight_types(self) -> dict[str, int]:
        """Count of tensors per ggml type name, e.g. {'Q4_1': 210, 'F32': 61}."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        return counts

    def weight_bytes(self) -> int:
        return sum(int(t.n_bytes) for t in self.tensors.values())


def _field_value(field: Any) -> Any:
    value = field.contents()
    return value


def open_gguf(path: str | os.PathLike) -> GGUFModel:
    """Read and validate header, metadata and tensor table; weights stay memory-mapped."""
    import gguf

    path = os.fspath(path)
    if not os.path.exists(path):
        raise KvcliError(f"model file not found: {path}")
    if os.path.isdir(path):
        raise KvcliError(f"model path is a directory, not a GGUF file: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise KvcliError(f"not a GGUF file (bad magic {magic!r}): {path}")
    try:
        reader = gguf.GGUFReader(path, "r")
        metadata = {name: _field_value(field) for name, field in reader.fields.items()}
        tensors = {t.name: t for t in reader.tensors}
    except _READ_ERRORS as e:
        raise KvcliError(f"corrupt or truncated GGUF file {path}: {e}") from None
    file_size = os.path.getsize(path)
    for t in tensors.values():
        if t.data_offset + int(t.n_bytes) > file_size:
            raise KvcliError(f"truncated GGUF file {path}: tensor {t.name} ends past the end of the file")
    vocab = metadata.get("tokenizer.ggml.tokens")
    emb = tensors.get("token_embd.weight")
    vocab_size = len(vocab) if vocab is not None else (int(emb.shape[-1]) if emb is not None else 0)
    config = ModelConfig.from_metadata(metadata, vocab_size)
    model = GGUFModel(path, metadata, config, tensors)
    _check_tensors(model)
    return model


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the llama decoder needs, in torch (rows, cols) order."""
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (c.vocab_size, c.n_embd),
        "output_norm.weight": (c.n_embd,),
    }
    q_dim, kv_dim = c.n_heads * c.head_dim, c.kv_dim
    for i in range(c.n_layers):
        b = f"blk.{i}."
        shapes |= {
            b + "attn_norm.weight": (c.n_embd,),
            b + "attn_q.weight": (q_dim, c.n_embd),
            b + "attn_k.weight": (kv_dim, c.n_embd),
            b + "attn_v.weight": (kv_dim, c.n_embd),
            b + "attn_output.weight": (c.n_embd, q_dim),
            b + "ffn_norm.weight": (c.n_embd,),
            b + "ffn_gate.weight": (c.n_ff, c.n_embd),
            b + "ffn_up.weight": (c.n_ff, c.n_embd),
            b + "ffn_down.weight": (c.n_embd, c.n_ff),
        }
    return shapes


# Optional tensors: untied output head, llama3-style per-frequency RoPE factors.
def optional_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {"output.weight": (c.vocab_size, c.n_embd), "rope_freqs.weight": (c.head_dim // 2,)}


def _torch_shape(t: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(list(t.shape)))


def _check_tensors(model: GGUFModel) -> None:
    import gguf

    c = model.config
    wanted = expected_shapes(c)
    for name, shape in wanted.items():
        if name not in model.tensors:
            raise KvcliError(f"GGUF file lacks tensor {name} (needed by a {c.n_layers}-layer {c.arch} model)")
    for name, shape in (wanted | optional_shapes(c)).items():
        t = model.tensors.get(name)
        if t is None:
            continue
        got = _torch_shape(t)
        if got != shape:
            raise KvcliError(f"tensor {name} has shape {list(got)}, expected {list(shape)}")
        if t.tensor_type not in _dequantizable_types(gguf):
            raise KvcliError(f"tensor {name} has unsupported type {t.tensor_type.name}")


def _dequantizable_types(gguf: Any) -> set:
    plain = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
    return plain | set(gguf.quants._type_traits)


def read_tensor(model: GGUFModel, name: str) -> np.ndarray:
    """One tensor dequantized to float32, in torch (rows, cols) order."""
    import gguf

    t = model.tensors[name]
    try:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise KvcliError(f"tensor {name} has unsupported type {t.tensor_type.name}") from None
    return np.array(values, dtype=np.float32).reshape(_torch_shape(t))  # a copy: the file stays read-only
