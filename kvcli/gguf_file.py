"""GGUF file -> ModelConfig + dequantized weights.

The header, metadata and tensor table are read by a bounded scan here, every count and length
checked against the bytes left in the file before anything is allocated (gguf-py's GGUFReader
trusts them: a huge array length makes it loop for hours and allocate ~100 bytes per element).
Tensors come back as gguf-py's own ReaderTensor over a read-only memory map, and are
dequantized with gguf.quants; tests check the scan against GGUFReader on good files.

Tensor names and shapes follow llama.cpp's llama layout. GGUF lists a tensor's shape in
ggml order (ne0 = columns first); torch wants (rows, cols), so shapes are reversed here.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import struct
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcli.config import ModelConfig
from kvcli.errors import KvcliError
from kvcli.memory import libc
from kvcli.packed_strings import PackedStrings

# Limits of the format as llama.cpp's gguf.cpp applies them (GGML_MAX_DIMS, GGML_MAX_NAME).
MAX_DIMS = 4
MAX_NAME_BYTES = 63
# GGUF's limit on a key; a bound on any one string value (chat templates are tens of KB).
MAX_KEY_BYTES = 65535
MAX_STRING_BYTES = 1 << 20
# All metadata arrays together: over 5x a 262k-token vocabulary's tokens + scores + types, and a
# bound on the Python objects a file can make kvcli build (~40 bytes per element at worst: ~160 MiB).
MAX_ARRAY_ELEMENTS = 1 << 22
# Smallest encodings: a key/value (key length, type, one byte) and a tensor info (name length,
# n_dims, one dim, type, offset); counts above size // these cannot be in the file.
MIN_KV_BYTES = 8 + 4 + 1
MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8

# GGUF value type -> little-endian numpy dtype (gguf.GGUFValueType numbering; 8 = string, 9 = array).
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
            12: "<f8"}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_U64 = struct.Struct("<Q")
# ggml types gguf-py's reader exposes as plain numpy arrays; the rest are raw bytes, (rows, bytes per row).
_PLAIN = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "<i1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}


@dataclass
class GGUFModel:
    path: str
    metadata: dict[str, Any]
    config: ModelConfig
    tensors: dict[str, Any]  # name -> gguf.ReaderTensor (memory-mapped, not yet dequantized)
    mapping: mmap.mmap | None = None  # the file's read-only memory map, which the tensors view

    def drop_pages(self) -> None:
        """Let the OS take back the map's pages read so far (they count in the process's RSS until then):
        once the weights are resident in their own form, the file's bytes are only read again on demand."""
        if self.mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            self.mapping.madvise(mmap.MADV_DONTNEED)

    def weight_types(self) -> dict[str, int]:
        """Count of tensors per ggml type name, e.g. {'Q4_1': 210, 'F32': 61}."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        return counts

    def weight_bytes(self) -> int:
        return sum(int(t.n_bytes) for t in self.tensors.values())

    def identity(self) -> dict:
        """What names this model in a state file (kvcli/cache/state.py): its architecture, and a SHA-256 of the
        file's header, metadata and tensor table with 64 pages of its tensor data spread evenly over them (read from
        the map: a saved cache is refused on any other file without reading the whole of this one)."""
        data = np.frombuffer(self.mapping, np.uint8) if self.mapping is not None else None
        digest = hashlib.sha256()
        if data is not None:
            start = min(int(t.data_offset) for t in self.tensors.values())
            digest.update(data[:start])
            for i in range(64):
                at = start + (len(data) - start - 4096) * i // 63
                digest.update(data[at : at + 4096])
            self.drop_pages()
        return {"architecture": self.config.arch, "layers": self.config.n_layers, "sha256": digest.hexdigest()}


def drop_view_pages(view: np.ndarray) -> None:
    """drop_pages for the whole pages inside a contiguous view of the map only (a tensor's rows once read)."""
    import ctypes

    if not hasattr(mmap, "MADV_DONTNEED"):
        return
    start, end = view.ctypes.data, view.ctypes.data + view.nbytes
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), mmap.MADV_DONTNEED)


class _Scan:
    """A cursor over the mapped file that never reads past its end (any overrun -> KvcliError)."""

    def __init__(self, data: np.ndarray, path: str):
        self.data, self.path, self.size, self.pos = data, path, len(data), 0
        self.array_elements = 0

    def fail(self, why: str) -> KvcliError:
        return KvcliError(f"corrupt GGUF file {self.path}: {why}")

    def take(self, n: int, what: str) -> int:
        if n > self.size - self.pos:
            raise KvcliError(f"truncated GGUF file {self.path}: {what} at byte {self.pos} needs {n} bytes, "
                             f"{self.size - self.pos} left")
        start, self.pos = self.pos, self.pos + n
        return start

    def scalar(self, dtype: str, what: str) -> Any:
        dt = np.dtype(dtype)
        return np.frombuffer(self.data, dt, 1, self.take(dt.itemsize, what)).tolist()[0]

    def string(self, what: str, max_bytes: int = MAX_STRING_BYTES) -> str:
        n = self.scalar("<u8", f"length of {what}")
        if n > max_bytes:
            raise self.fail(f"{what} is {n} bytes long (at most {max_bytes})")
        start = self.take(n, what)
        try:
            return self.data[start:start + n].tobytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{what} is not valid UTF-8 (byte {start + e.start})") from None

    def strings(self, n: int, key: str) -> PackedStrings:
        """n strings of array `key`, as `string` reads each (its checks and messages), in one loop over the lengths,
        kept packed (kvcli/packed_strings.py: a vocabulary's 150k tokens and merges as str objects held ~25 MiB)."""
        buf = getattr(self.data.base, "obj", None)  # the file's mmap, sliced as bytes (numpy's view: per element)
        if not isinstance(buf, mmap.mmap):
            buf = memoryview(self.data)
        u64, size, pos, starts, lengths = _U64.unpack_from, self.size, self.pos, [], []
        for i in range(n):
            if pos + 8 > size:
                self.pos = pos
                self.take(8, f"length of element {i} of {key}")
            length = u64(buf, pos)[0]
            if length > MAX_STRING_BYTES:
                raise self.fail(f"element {i} of {key} is {length} bytes long (at most {MAX_STRING_BYTES})")
            if length > size - pos - 8:
                self.pos = pos + 8
                self.take(length, f"element {i} of {key}")
            starts.append(pos + 8)
            lengths.append(length)
            pos += 8 + length
        self.pos = pos
        packed = PackedStrings.joined([buf[a : a + z] for a, z in zip(starts, lengths)])
        bad = packed.invalid()
        if bad is not None:
            raise self.fail(f"element {bad[0]} of {key} is not valid UTF-8 (byte {starts[bad[0]] + bad[1]})")
        return packed

    def value(self, vtype: int, key: str) -> Any:
        """The value of metadata `key` (already shortened for messages) of GGUF type vtype."""
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], f"value of {key}")
        if vtype == _STRING:
            return self.string(f"value of {key}")
        if vtype != _ARRAY:
            raise self.fail(f"metadata key {key} has unknown value type {vtype}")
        itype = self.scalar("<u4", f"array type of {key}")
        n = self.scalar("<u8", f"array length of {key}")
        if itype == _ARRAY:
            raise self.fail(f"metadata key {key} is an array of arrays (GGUF allows none)")
        if itype not in _SCALARS and itype != _STRING:
            raise self.fail(f"metadata key {key} is an array of unknown type {itype}")
        least = np.dtype(_SCALARS[itype]).itemsize if itype in _SCALARS else 8  # a string: its 8-byte length
        if n > (self.size - self.pos) // least:
            raise KvcliError(f"truncated GGUF file {self.path}: array {key} claims {n} elements, more than "
                             f"the {self.size - self.pos} bytes left can hold")
        self.array_elements += n
        if self.array_elements > MAX_ARRAY_ELEMENTS:
            raise self.fail(f"metadata arrays hold over {MAX_ARRAY_ELEMENTS} elements (at {key})")
        if itype == _STRING:
            return self.strings(n, key)
        dt = np.dtype(_SCALARS[itype])
        return np.frombuffer(self.data, dt, n, self.take(n * dt.itemsize, f"array {key}")).tolist()


def _scan(data: np.ndarray, path: str) -> tuple[dict[str, Any], list[Any]]:
    """Header, metadata and tensor table -> (metadata, [gguf.ReaderTensor]); every field bounded.

    Layout (GGUF v2/v3, little-endian): magic, u32 version, u64 n_tensors, u64 n_kv, n_kv x
    (string key, u32 type, value), n_tensors x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml
    type, u64 offset), padding to `general.alignment`, tensor data (offsets relative to its start)."""
    import gguf

    s = _Scan(data, path)
    s.take(4, "magic")
    version = s.scalar("<u4", "version")
    if version and version & 0xFFFF == 0:
        raise KvcliError(f"{path} is a big-endian GGUF file; kvcli reads little-endian files")
    if version not in (2, 3):
        raise s.fail(f"unsupported GGUF version {version} (kvcli reads versions 2 and 3)")
    n_tensors = s.scalar("<u8", "tensor count")
    n_kv = s.scalar("<u8", "metadata count")
    if n_kv > (s.size - s.pos) // MIN_KV_BYTES:
        raise s.fail(f"header claims {n_kv} metadata entries, more than the file's {s.size} bytes can hold")
    if n_tensors > (s.size - s.pos) // MIN_TENSOR_INFO_BYTES:
        raise s.fail(f"header claims {n_tensors} tensors, more than the file's {s.size} bytes can hold")

    metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
    for i in range(n_kv):
        key = s.string(f"metadata key {i}", MAX_KEY_BYTES)
        shown = _short(key)  # file contents in a message: one short line, whatever they hold
        if key in metadata:
            raise s.fail(f"metadata key {shown} appears twice")
        vtype = s.scalar("<u4", f"value type of {shown}")
        if key == "general.alignment" and vtype != _UINT32:
            raise s.fail(f"general.alignment has value type {vtype}, not uint32")
        metadata[key] = s.value(vtype, shown)
    alignment = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    if alignment <= 0 or alignment & (alignment - 1):
        raise s.fail(f"general.alignment {alignment} is not a power of two")

    infos = []
    for i in range(n_tensors):
        name = s.string(f"name of tensor {i}", MAX_NAME_BYTES)
        shown = _short(name)
        n_dims = s.scalar("<u4", f"n_dims of {shown}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise s.fail(f"tensor {shown} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
        dims = np.frombuffer(data, "<u8", n_dims, s.take(8 * n_dims, f"dims of {shown}")).copy()
        raw_type = s.scalar("<u4", f"type of {shown}")
        offset = s.scalar("<u8", f"data offset of {shown}")
        infos.append((name, dims, raw_type, offset))
    data_start = s.pos + (-s.pos % alignment)

    tensors, seen = [], set()
    for name, dims, raw_type, offset in infos:
        if name in seen:
            raise s.fail(f"tensor {_short(name)} appears twice")
        seen.add(name)
        tensors.append(_tensor(s, name, dims, raw_type, offset, data_start, alignment))
    return metadata, tensors


def _tensor(s: _Scan, name: str, dims: np.ndarray, raw_type: int, offset: int, data_start: int, alignment: int):
    import gguf

    shown = _short(name)
    try:
        ggml_type = gguf.GGMLQuantizationType(raw_type)
        block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    except (ValueError, KeyError):
        raise s.fail(f"tensor {shown} has unknown ggml type {raw_type}") from None
    ne = [int(d) for d in dims]  # Python ints: the product cannot overflow
    if min(ne) < 1:
        raise s.fail(f"tensor {shown} has shape {ne}: every dimension must be at least 1")
    if ne[0] % block:
        raise s.fail(f"tensor {shown}: row length {ne[0]} is not a multiple of the {ggml_type.name} block ({block})")
    n_elements = math.prod(ne)
    n_bytes = n_elements // block * type_size
    if offset % alignment:
        raise s.fail(f"tensor {shown}: data offset {offset} is not a multiple of the alignment {alignment}")
    if data_start + offset + n_bytes > s.size:
        raise KvcliError(f"truncated GGUF file {s.path}: tensor {shown} ({ggml_type.name}, shape {ne}, {n_bytes} "
                         f"bytes at offset {offset}) ends past the end of the file ({s.size} bytes)")
    start = data_start + offset
    np_dims = tuple(reversed(ne))
    if ggml_type.name in _PLAIN:
        view = np.frombuffer(s.data, _PLAIN[ggml_type.name], n_elements, start).reshape(np_dims)
    else:
        view = s.data[start:start + n_bytes].reshape(gguf.quants.quant_shape_to_byte_shape(np_dims, ggml_type))
    return gguf.ReaderTensor(name=name, tensor_type=ggml_type, shape=dims, n_elements=n_elements, n_bytes=n_bytes,
                             data_offset=start, data=view, field=None)


def open_gguf(path: str | os.PathLike) -> GGUFModel:
    """Read and validate header, metadata and tensor table; weights stay memory-mapped."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise KvcliError(f"model file not found: {path}")
    if os.path.isdir(path):
        raise KvcliError(f"model path is a directory, not a GGUF file: {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise KvcliError(f"not a GGUF file (bad magic {magic!r}): {path}")
        with open(path, "rb") as f:  # the mapping outlives the descriptor
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        data = np.frombuffer(mapping, dtype=np.uint8)
    except (OSError, ValueError) as e:  # ValueError: an empty file cannot be mapped
        raise KvcliError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    metadata, tensor_list = _scan(data, path)
    tensors = {t.name: t for t in tensor_list}
    config = _config(metadata, tensors, path)
    model = GGUFModel(path, metadata, config, tensors, mapping)
    _check_tensors(model)
    return model


# Keys ModelConfig reads, by the kind of value they must hold (a string where a count belongs
# would otherwise surface as a ValueError deep inside int()).
_INT_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
             "attention.head_count_kv", "attention.key_length", "rope.dimension_count", "vocab_size",
             "context_length", "rope.scaling.original_context_length")
_FLOAT_KEYS = ("attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.scaling.factor", "rope.scaling.attn_factor",
               "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
               "rope.scaling.yarn_ext_factor")


def _config(metadata: dict[str, Any], tensors: dict[str, Any], path: str) -> ModelConfig:
    arch = metadata.get("general.architecture")
    for key in ("general.architecture", f"{arch}.rope.scaling.type"):  # both are quoted in errors
        if len(str(metadata.get(key, ""))) > 64:
            raise KvcliError(f"GGUF metadata {_short(key)} is {_short(metadata[key])}, not a short name")
    if isinstance(arch, str):
        for key in _INT_KEYS:
            v = metadata.get(f"{arch}.{key}")
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise KvcliError(f"GGUF metadata {arch}.{key} must be a positive integer, got {_short(v)}")
        for key in _FLOAT_KEYS:
            v = metadata.get(f"{arch}.{key}")
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v < 0):
                raise KvcliError(f"GGUF metadata {arch}.{key} must be a finite number >= 0, got {_short(v)}")
        n_layers = metadata.get(f"{arch}.block_count")
        if isinstance(n_layers, int) and n_layers > len(tensors):  # before anything loops over the layers
            raise KvcliError(f"GGUF metadata {arch}.block_count is {n_layers}, but the file has only "
                             f"{len(tensors)} tensors")
    vocab = metadata.get("tokenizer.ggml.tokens")
    if vocab is not None and not isinstance(vocab, PackedStrings):
        raise KvcliError("GGUF metadata tokenizer.ggml.tokens must be an array of strings")
    emb = tensors.get("token_embd.weight")
    vocab_size = len(vocab) if vocab is not None else (int(emb.shape[-1]) if emb is not None else 0)
    try:
        config = ModelConfig.from_metadata(metadata, vocab_size)
    except (ValueError, TypeError, OverflowError, ZeroDivisionError) as e:
        raise KvcliError(f"bad GGUF metadata in {path}: {e}") from None
    if config.head_dim % 2:
        raise KvcliError(f"GGUF metadata gives head dimension {config.head_dim}, which is odd; RoPE needs pairs")
    return config


def _short(value: Any) -> str:
    """Text from the file, fit for a one-line message: as is when short and printable, else repr'd and cut."""
    if isinstance(value, str) and value.isprintable() and len(value) <= 64:
        return value
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder needs, in torch (rows, cols) order (qwen2's biases, qwen3's head norms included)."""
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
        if c.qkv_bias:
            shapes |= {b + "attn_q.bias": (q_dim,), b + "attn_k.bias": (kv_dim,), b + "attn_v.bias": (kv_dim,)}
        if c.qk_norm:
            shapes |= {b + "attn_q_norm.weight": (c.head_dim,), b + "attn_k_norm.weight": (c.head_dim,)}
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
    return dequantize(model.tensors[name])


def dequantize(t: Any, start: int = 0, end: int | None = None) -> np.ndarray:
    """A gguf.ReaderTensor dequantized to float32, in torch (rows, cols) order; rows start..end-1 only
    if given (a large matrix is converted a slab at a time, never as one f32 copy)."""
    import gguf

    shape = _torch_shape(t)
    rows = t.data.reshape(int(np.prod(shape[:-1])), -1)[start:end]  # (n, elements or bytes per row): a view
    try:
        out = gguf.quants.dequantize(rows, t.tensor_type)
    except NotImplementedError:
        raise KvcliError(f"tensor {t.name} has unsupported type {t.tensor_type.name}") from None
    out = np.asarray(out, dtype=np.float32)
    if out.base is not None or not out.flags.writeable:  # a view of the read-only file: copy it
        out = out.copy()
    out = out.reshape(len(rows), shape[-1]) if end is not None or start else out.reshape(shape)
    finite = np.isfinite(out)
    if not finite.all():  # a NaN scale in one block would otherwise poison every logit, silently
        first = start * shape[-1] + int(np.argmin(finite.ravel()))
        raise KvcliError(f"tensor {t.name} holds {out.size - int(finite.sum())} NaN/Inf values (the first at flat "
                         f"index {first}); the model file is corrupt")
    return out
